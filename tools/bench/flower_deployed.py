"""Flower's SecAgg+ on its own deployment runtime (SuperLink, SuperNodes, TLS) beside our service.

For each vector size, in one run on one machine, on loopback:

- Flower (its own virtualenv, ``.venv-flower``, built by ``make bench-flower``): a certificate
  authority and a server certificate for ``127.0.0.1``/``localhost`` are made for the run in a
  temporary directory; ``flower-superlink`` starts with them (``--ssl-ca-certfile``,
  ``--ssl-certfile``, ``--ssl-keyfile``: HTTPS for its Fleet, Control and Runtime APIs, as Flower
  documents TLS), ``clients`` ``flower-supernode`` processes connect with ``--root-certificates``,
  and ``flwr run`` submits `tools.bench.flower_deployed_app` (a Flower app directory written for the
  run) through a SuperLink connection in a private ``FLWR_HOME``. Each SuperNode and the SuperLink
  run their ClientApps and the ServerApp through Flower's SuperExec (isolation ``subprocess``, the
  default); runtime dependency installation is off. The ServerApp runs ``rounds`` SecAgg+ rounds
  (``SecAggPlusWorkflow`` + ``secaggplus_mod``, each client summing one float32 vector) and reports
  each round's wall seconds and the CPU seconds of every Flower process (the trees under the
  SuperLink and the SuperNodes, from ``/proc``).
- ours: `tools.bench.service_alone` at the same size and owner count (two server processes, mutual
  TLS, the owners' clients, on the data planes): wall ms and CPU ms (servers + owners' transport)
  per secure sum.

Each Flower deployment is bounded by ``timeout`` seconds; every process it started (and all their
descendants) is terminated, then killed, at the end, and the bench checks none is left. Ports come
from `portpicker`; everything binds to 127.0.0.1.

Run (``make bench-flower`` builds ``.venv-flower`` first). With the defaults, 2 clients at 1e4 and
1e5 with 2 rounds each, it takes about 2.5 minutes on 2 cores (a deployment starts in 10-25 s and a
round takes 20-30 s, spent waiting on polls and starting a ClientApp process per message); 1e6
adds about 1.5 minutes::

    PYTHONPATH=. .venv/bin/python -m tools.bench.flower_deployed --elements 10000 100000 --clients 2 --rounds 2
"""
import argparse
import datetime
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from typing import Dict, List, Optional, Sequence

import portpicker

from tools.bench import flower_deployed_app, flower_secagg

__all__ = ["max_error", "make_tls", "deployed_rounds", "measure_ours", "compare", "main"]

FLOWER_VENV = ".venv-flower"
APP_MODULE = "flower_deployed_app"


def max_error(clients: int) -> float:
    """How far SecAgg+'s released mean may be from the plain mean: `clients` quantization steps.

    Flower's client scales its vector by ``num_examples / max_weight`` (1 / 1000) before quantizing
    [-8, 8] into 2**22 levels, so one step is 16 * 1000 / 2**22, about 3.8e-3 of the vector's units.
    """
    step = 2 * flower_secagg.CLIPPING_RANGE * flower_secagg.MAX_WEIGHT / flower_secagg.QUANTIZATION_RANGE
    return clients * step

_PYPROJECT = """[build-system]
requires = ["hatchling"]
build-backend = "hatchling.build"

[project]
name = "tfe-secaggplus-bench"
version = "1.0.0"
description = "SecAgg+ rounds summing one vector per client (tools.bench.flower_deployed)"
license = "Apache-2.0"
dependencies = []

[tool.flwr.app]
publisher = "tfe-estimator"

[tool.flwr.app.components]
serverapp = "{module}:components.serverapp"
clientapp = "{module}:components.clientapp"

[tool.flwr.app.config]
elements = 1000
clients = 2
rounds = 1
pids = ""
out = ""
"""

_FLWR_CONFIG = """[superlink]
default = "bench"

[superlink.bench]
address = "127.0.0.1:{port}"
root-certificates = "{ca}"
"""


def make_tls(directory: str) -> Dict[str, str]:
    """A CA and a server certificate for 127.0.0.1 and localhost in `directory`; their paths.

    >>> paths = make_tls(tempfile.mkdtemp())  # doctest: +SKIP
    >>> sorted(paths)  # doctest: +SKIP
    ['ca', 'cert', 'key']
    """
    import ipaddress  # pylint: disable=import-outside-toplevel

    from cryptography import x509  # pylint: disable=import-outside-toplevel
    from cryptography.hazmat.primitives import hashes, serialization  # pylint: disable=import-outside-toplevel
    from cryptography.hazmat.primitives.asymmetric import ec  # pylint: disable=import-outside-toplevel
    from cryptography.x509.oid import NameOID  # pylint: disable=import-outside-toplevel

    now = datetime.datetime.now(datetime.timezone.utc)

    def build(subject, issuer, public_key, signer, ca: bool, sans=None):
        builder = (x509.CertificateBuilder().subject_name(subject).issuer_name(issuer).public_key(public_key)
                   .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
                   .not_valid_after(now + datetime.timedelta(days=1))
                   .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
        if sans:
            builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
        return builder.sign(signer, hashes.SHA256())

    ca_key, key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "flower-bench-ca")])
    ca = build(ca_name, ca_name, ca_key.public_key(), ca_key, True)
    cert = build(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")]), ca_name, key.public_key(),
                 ca_key, False, [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))])
    paths = {name: os.path.join(directory, f) for name, f in (("ca", "ca.crt"), ("cert", "server.pem"),
                                                             ("key", "server.key"))}
    for name, data in (("ca", ca.public_bytes(serialization.Encoding.PEM)),
                       ("cert", cert.public_bytes(serialization.Encoding.PEM)),
                       ("key", key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                                 serialization.NoEncryption()))):
        with open(paths[name], "wb") as sink:
            sink.write(data)
    return paths


def _descendants(roots: Sequence[int]) -> List[int]:
    """`roots` that are alive and all their live descendants (from /proc's parent links)."""
    parents: Dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat", encoding="ascii") as stat:
                    parents[int(entry)] = int(stat.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                pass
    found, todo = [], [p for p in roots if p in parents]
    while todo:
        pid = todo.pop()
        if pid not in found:
            found.append(pid)
            todo.extend(child for child, parent in parents.items() if parent == pid)
    return found


def _listening(port: int) -> bool:
    """Whether something accepts TCP connections on 127.0.0.1:`port`."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1.0):
            return True
    except OSError:
        return False


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _stop(started: List[subprocess.Popen], seen: set) -> List[int]:
    """Terminates, then kills, the processes the bench started and every descendant seen; the pids left alive."""
    tree = set(_descendants([p.pid for p in started])) | seen
    for sig, grace in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 5.0)):
        for pid in list(tree):
            if _alive(pid):
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline:
            for process in started:
                process.poll()
            if not any(_alive(pid) for pid in tree):
                break
            time.sleep(0.1)
        tree |= set(_descendants([p.pid for p in started]))
    for process in started:
        try:
            process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass
    return [pid for pid in tree if _alive(pid)]


def deployed_rounds(elements: int, clients: int, rounds: int, venv: str = FLOWER_VENV,
                    timeout: float = 600.0) -> Dict:
    """SecAgg+ `rounds` over `clients` SuperNodes on Flower's deployment runtime; per round wall and CPU seconds.

    Returns ``{"flwr", "elements", "clients", "rounds": [{"wall_s", "cpu_s", "max_error"}, ...],
    "setup_s", "pids": [every Flower process seen], "left_alive": []}``; raises RuntimeError (with the
    processes' log tails) if the rounds do not finish within `timeout` seconds, if the released mean is
    off, or if a process survives the end.
    """
    bin_dir = os.path.abspath(os.path.join(venv, "bin"))
    if not os.path.exists(os.path.join(bin_dir, "flower-superlink")):
        raise FileNotFoundError(f"{bin_dir}/flower-superlink does not exist: run `make bench-flower` (it builds "
                                "Flower's virtualenv from tools/bench/requirements-flower.txt), or pass --flower-venv.")
    work = tempfile.mkdtemp(prefix="tfe-flower-deployed-")
    started: List[subprocess.Popen] = []
    seen: set = set()
    logs: List[str] = []
    try:
        tls = make_tls(work)
        home, app = os.path.join(work, "flwr-home"), os.path.join(work, "app")
        os.makedirs(home)
        os.makedirs(app)
        port = portpicker.pick_unused_port()
        with open(os.path.join(home, "config.toml"), "w", encoding="utf-8") as sink:
            sink.write(_FLWR_CONFIG.format(port=port, ca=tls["ca"]))
        with open(os.path.join(app, "pyproject.toml"), "w", encoding="utf-8") as sink:
            sink.write(_PYPROJECT.format(module=APP_MODULE))
        shutil.copy(flower_deployed_app.__file__, os.path.join(app, APP_MODULE + ".py"))
        out = os.path.join(work, "rounds.jsonl")
        env = dict(os.environ, PATH=bin_dir + os.pathsep + os.environ.get("PATH", ""), FLWR_HOME=home,
                   VIRTUAL_ENV=os.path.dirname(bin_dir), FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION="1",
                   FLWR_TELEMETRY_ENABLED="0")
        env.pop("PYTHONPATH", None)

        def start(name: str, command: List[str]) -> subprocess.Popen:
            log_path = os.path.join(work, name + ".log")
            logs.append(log_path)
            with open(log_path, "wb") as log:
                process = subprocess.Popen(command, cwd=work, env=env, stdout=log,  # pylint: disable=R1732
                                           stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
            started.append(process)
            return process

        begin = time.monotonic()
        start("superlink", [os.path.join(bin_dir, "flower-superlink"), "--ssl-ca-certfile", tls["ca"],
                            "--ssl-certfile", tls["cert"], "--ssl-keyfile", tls["key"], "--host", "127.0.0.1",
                            "--port", str(port), "--disable-runtime-dependency-installation"])
        for i in range(clients):
            start(f"supernode{i}", [os.path.join(bin_dir, "flower-supernode"), "--root-certificates", tls["ca"],
                                    "--superlink", f"127.0.0.1:{port}", "--host", "127.0.0.1",
                                    "--port", str(portpicker.pick_unused_port()),
                                    "--node-config", f"partition-id={i}"])
        roots = ",".join(str(p.pid) for p in started)
        run_config = f"elements={elements} clients={clients} rounds={rounds} pids='{roots}' out='{out}'"
        submitted = False
        rows: List[Dict] = []
        while len(rows) < rounds:
            if time.monotonic() - begin > timeout:
                raise RuntimeError(f"Flower's deployment did not finish {rounds} SecAgg+ round(s) of {elements} "
                                   f"elements over {clients} SuperNodes in {timeout:.0f} s (--timeout); "
                                   f"logs:\n{_tails(logs)}\n--- the run's log\n{_run_log(bin_dir, env, work)}")
            for process in started[:clients + 1]:
                if process.poll() is not None:
                    raise RuntimeError(f"{process.args[0]} exited with {process.returncode}; logs:\n{_tails(logs)}")
            if not submitted:
                if not _listening(port):
                    time.sleep(0.2)
                    continue
                flwr = start("flwr-run", [os.path.join(bin_dir, "flwr"), "run", app, "bench", "--run-config",
                                          run_config])
                try:
                    code = flwr.wait(timeout=max(1.0, timeout - (time.monotonic() - begin)))
                except subprocess.TimeoutExpired:
                    continue  # the deadline check above reports it
                if code != 0:
                    raise RuntimeError(f"`flwr run` exited with {code}; logs:\n{_tails(logs)}")
                submitted = True
            seen |= set(_descendants([p.pid for p in started]))
            if os.path.exists(out):
                with open(out, encoding="utf-8") as source:
                    rows = [json.loads(line) for line in source if line.strip()]
            time.sleep(0.5)
        setup_s = time.monotonic() - begin - sum(r["wall_s"] for r in rows)
        worst = max(r["max_error"] for r in rows)
        if worst > max_error(clients):
            raise RuntimeError(f"Flower's released mean is off the clients' plain mean by {worst} (more than "
                               f"{max_error(clients)}); logs:\n{_tails(logs)}")
    finally:
        left = _stop(started, seen)
        tails = _tails(logs)
        shutil.rmtree(work, ignore_errors=True)
    if left:
        raise RuntimeError(f"Flower processes {left} survived SIGTERM and SIGKILL; logs:\n{tails}")
    version = subprocess.run([os.path.join(bin_dir, "python"), "-c", "import flwr; print(flwr.__version__)"],
                             capture_output=True, text=True, timeout=60, check=True).stdout.strip()
    return {"flwr": version, "elements": elements, "clients": clients, "rounds": rows, "setup_s": setup_s,
            "pids": sorted(seen | {p.pid for p in started}), "left_alive": left}


def _run_log(bin_dir: str, env: Dict[str, str], work: str) -> str:
    """The ServerApp's log of the submitted run (``flwr log RUN_ID bench --show``), for error messages."""
    try:
        with open(os.path.join(work, "flwr-run.log"), encoding="utf-8", errors="replace") as source:
            run_id = source.read().split("Successfully started run ")[1].split()[0]
        shown = subprocess.run([os.path.join(bin_dir, "flwr"), "log", run_id, "bench", "--show"], cwd=work,
                               env=env, capture_output=True, text=True, timeout=30, check=False)
    except (OSError, IndexError, subprocess.TimeoutExpired) as err:
        return f"(not available: {err})"
    return "\n".join((shown.stdout + shown.stderr).splitlines()[-40:])


def _tails(logs: Sequence[str], lines: int = 15) -> str:
    parts = []
    for path in logs:
        try:
            with open(path, encoding="utf-8", errors="replace") as source:
                tail = source.read().splitlines()[-lines:]
        except OSError:
            continue
        parts.append(f"--- {os.path.basename(path)}\n" + "\n".join(tail))
    return "\n".join(parts)


def measure_ours(elements: int, owners: int, steps: int, certs_dir: str) -> Dict:
    """Our service at the same size and owner count: wall and CPU ms per secure sum (`service_alone`)."""
    from tools.bench import service_alone  # pylint: disable=import-outside-toplevel

    ours = service_alone.measure(elements, steps, owners, certs_dir, data_plane=True)
    return {"wall_ms": ours["ms_per_step"], "cpu_ms": sum(ours["server_cpu_ms"]) + ours["owners_cpu_ms"],
            "server_cpu_ms": ours["server_cpu_ms"], "owners_cpu_ms": ours["owners_cpu_ms"]}


def compare(elements: Sequence[int], clients: int, rounds: int, steps: int, venv: str = FLOWER_VENV,
            timeout: float = 600.0) -> List[Dict]:
    """Per size: Flower's deployed SecAgg+ rounds and our service's secure sum, measured one after the other."""
    from tfe_estimator.cluster import certs  # pylint: disable=import-outside-toplevel

    rows = []
    with tempfile.TemporaryDirectory(prefix="tfe-flower-deployed-ours-") as certs_dir:
        tasks: List = [("chief", 0)] + [("worker", i) for i in range(clients - 1)] + [("tfe", 0), ("tfe", 1)]
        certs.make_cluster_certs(certs_dir, tasks, cluster="bench")
        for size in elements:
            flower = deployed_rounds(size, clients, rounds, venv, timeout)
            ours = measure_ours(size, clients, steps, certs_dir)
            rows.append({"elements": size, "clients": clients, "flower": flower, "ours": ours})
    return rows


def format_row(row: Dict) -> str:
    """One printed line per size."""
    flower, ours = row["flower"], row["ours"]
    walls = ", ".join(f"{r['wall_s']:.1f}" for r in flower["rounds"])
    cpus = ", ".join(f"{r['cpu_s']:.2f}" for r in flower["rounds"])
    wall = sum(r["wall_s"] for r in flower["rounds"]) / len(flower["rounds"])
    cpu = sum(r["cpu_s"] for r in flower["rounds"]) / len(flower["rounds"])
    link = sum(r["cpu_s_by_root"][0] for r in flower["rounds"]) / len(flower["rounds"])
    return (f"[flower-deployed] {row['elements']:,} elements, {row['clients']} clients: Flower {flower['flwr']} "
            f"SecAgg+ deployed (SuperLink + SuperNodes, TLS, loopback) per round wall s [{walls}] CPU s of all its "
            f"processes [{cpus}] (SuperLink's tree {link:.2f} s, SuperNodes' {cpu - link:.2f} s per round; start-up "
            f"{flower['setup_s']:.1f} s, {len(flower['pids'])} Flower processes seen); ours per secure sum wall "
            f"{ours['wall_ms']:.2f} ms, CPU {ours['cpu_ms']:.1f} ms (servers {ours['server_cpu_ms'][0]:.1f} + "
            f"{ours['server_cpu_ms'][1]:.1f}, owners' clients {ours['owners_cpu_ms']:.1f}); Flower/ours wall "
            f"{1e3 * wall / ours['wall_ms']:,.0f}x, CPU {1e3 * cpu / ours['cpu_ms']:,.0f}x")


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.bench.flower_deployed",
                                     description=__doc__.split("\n", maxsplit=1)[0])
    parser.add_argument("--elements", type=int, nargs="+", default=[10_000, 100_000], help="vector sizes")
    parser.add_argument("--clients", type=int, default=2, help="SuperNodes, and our owners (default 2)")
    parser.add_argument("--rounds", type=int, default=2, help="Flower's SecAgg+ rounds per size (default 2)")
    parser.add_argument("--steps", type=int, default=20, help="our timed secure sums per size (default 20)")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per Flower deployment (default 600)")
    parser.add_argument("--flower-venv", default=FLOWER_VENV, help="Flower's virtualenv (default .venv-flower)")
    parser.add_argument("--json", action="store_true", help="print one JSON line per size instead")
    args = parser.parse_args(argv)
    for row in compare(args.elements, args.clients, args.rounds, args.steps, args.flower_venv, args.timeout):
        print(json.dumps(row) if args.json else format_row(row), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
