"""`tfe-estimator attack`: try, from outside and from an owner, what the transport must stop.

Against a cluster started with ``tfe-estimator launch --isolate [--tls]
--network-file NET.json`` (the file names every namespace, address and port),
this joins the cluster's private bridge with a namespace of its own (an
outsider who knows every address and port) and tries, against every task:

- ``tcp``: a TCP connection to TensorFlow's port, on the task's bridge
  address and on its IPv6 link-local address (TensorFlow listens on ``[::]``);
- ``grpc``: plaintext gRPC (HTTP/2) to TensorFlow's port (both addresses) and
  to the TLS port: success is the server's HTTP/2 SETTINGS frame coming back;
- ``readfile``: a TensorFlow session on the task (``grpc://address:port``, both
  addresses) running ``ReadFile`` of `--read-file` there: the attack that reads
  an owner's data;
- ``no-cert`` / ``foreign-ca``: TLS to the TLS port without a client
  certificate, and with a certificate for a real task's identity issued by
  another CA: success is getting gRPC's answer through the tunnel.

Then, from inside each data owner's namespace with that owner's own
certificate: ``owner-to-owner`` TLS to every other owner (refused unless the
cluster mode's peer table, `tfe_estimator.cluster.peers`, lets owners call
each other, as in-graph's does), beside ``owner-to-server`` (must be
accepted: the check that the probe itself works).

Prints one line per attempt and exits 1 if any attack got through (or a
check that must succeed did not), 0 otherwise. Needs root.

Against a service-mode cluster (``launch --cluster-mode service
--network-file NET.json``, no root needed) it runs `tools.attack_service`
instead: an owner with a valid certificate against the aggregation servers,
outsiders without one, and every owner's TF_CONFIG port on both loopbacks.
With ``--isolate`` too (root), those run from a namespace of its own on the
bridge, and every TCP port of every task is tried on its bridge address and
its IPv6 link-local address (`tools.portscan`), from there and again from the
first server's namespace.

Example::

    $ tfe-estimator launch --isolate --tls --network-file /tmp/net.json -- python train.py &
    $ tfe-estimator attack --network /tmp/net.json --read-file /data/owner.csv
    [attack] outside -> chief-0 tcp 10.213.0.2:7000: refused (timed out)
    ...
"""
import argparse
import json
import os
import socket
import ssl
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from typing import Dict, List, Optional, Sequence

from tfe_estimator.cluster.peers import allowed_callers
from tools import checkout_on_pythonpath
from tools.portscan import target, task_hosts

__all__ = ["main", "parse_args", "ATTACKS"]

#: Every kind of attempt, and whether it must fail (True) or succeed (the probe's own check).
ATTACKS = {"tcp": True, "grpc": True, "readfile": True, "no-cert": True, "foreign-ca": True,
           "owner-to-owner": True, "owner-to-server": False}
_HTTP2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + bytes([0, 0, 0, 4, 0, 0, 0, 0, 0])  # + empty SETTINGS
_TIMEOUT = 3.0


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="tfe-estimator attack", description=__doc__.split("\n\n")[0])
    parser.add_argument("--network", required=True, help="the --network-file written by `launch --isolate`")
    parser.add_argument("--read-file", default="/etc/hostname",
                        help="the file the readfile attack asks each owner's task to read (default /etc/hostname)")
    parser.add_argument("--as", dest="attacker", default=None,
                        help="service mode: the owner whose certificate attacks (default the chief, chief:0)")
    parser.add_argument("--probe", default=None, help=argparse.SUPPRESS)  # "outside" or an owner: run here
    return parser.parse_args(argv)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Runs every attempt; returns 1 if one went the wrong way."""
    args = parse_args(argv)
    checkout_on_pythonpath()  # the probes run `-m tools.attack` inside the namespaces
    with open(args.network, encoding="utf-8") as f:
        network = json.load(f)
    if network.get("mode") == "service":
        if args.probe:  # inside a namespace of an isolated service cluster
            print(json.dumps(_probe_service(network, args.probe, args.attacker)))
            return 0
        return _report_service(network, args)
    if args.probe:
        results = _probe_outside(network, args.read_file) if args.probe == "outside" else \
            _probe_owner(network, args.probe)
        print(json.dumps(results))
        return 0
    results = _run_probes(network, args)
    wrong = 0
    jobs = {task["name"]: task["job"] for task in network["tasks"]}
    for result in results:
        must_fail = ATTACKS[result["attack"]]
        if result["attack"] == "owner-to-owner":  # what the mode's peer table says
            must_fail = jobs[result["from"]] not in allowed_callers(network["mode"], jobs[result["to"]])
        ok = result["succeeded"] != must_fail
        wrong += not ok
        verdict = ("refused" if must_fail else "accepted (as it must)") if ok else \
            ("GOT THROUGH" if must_fail else "REFUSED, but must be accepted")
        print(f"[attack] {result['from']} -> {result['to']} {result['attack']} {result['target']}: "
              f"{verdict} ({result['detail']})", flush=True)
    print(f"[attack] {len(results)} attempts, {wrong} went the wrong way", flush=True)
    return 1 if wrong else 0


def _report_service(network: Dict, args) -> int:
    """Service mode: `tools.attack_service`'s attempts, one line each; 1 if one went the wrong way.

    With ``launch --isolate`` they run from a namespace of their own on the bridge, and the owners are scanned
    once more from the first server's namespace (a server must not reach an owner at all)."""
    from tools.attack_service import service_attacks  # pylint: disable=import-outside-toplevel

    if network.get("isolation"):
        here = [sys.executable, "-m", "tools.attack", "--network", args.network, "--probe"]
        if args.attacker:
            here = here[:-1] + ["--as", args.attacker, "--probe"]
        results = _in_observer(network["isolation"], [*here, "outside"])
        server = next(t for t in network["isolation"]["tasks"] if t["job"] == "tfe")
        results += _run_json(["ip", "netns", "exec", server["namespace"], *here, f"tfe:{server['index']}"])
    else:
        results = service_attacks(network, args.attacker)
    wrong = 0
    for result in results:
        wrong += not result["ok"]
        if result["control"]:
            verdict = "accepted (as it must)" if result["ok"] else "REFUSED, but must be accepted"
        else:
            verdict = "refused" if result["ok"] else "GOT THROUGH"
        prefix = "control " if result["control"] else ""
        print(f"[attack] {prefix}{result['from']} -> {result['to']} {result['attack']} {result['target']}: "
              f"{verdict} ({result['detail']})", flush=True)
    print(f"[attack] {len(results)} attempts, {wrong} went the wrong way", flush=True)
    return 1 if wrong else 0


def _run_probes(network: Dict, args) -> List[Dict]:
    """The outsider's probes from a namespace of its own on the bridge, then each owner's."""

    here = [sys.executable, "-m", "tools.attack", "--network", args.network,
            "--read-file", args.read_file, "--probe"]
    results = _in_observer(network, [*here, "outside"])
    if network.get("tls"):
        for task in network["tasks"]:
            if task["job"] in ("chief", "worker"):
                results += _run_json(["ip", "netns", "exec", task["namespace"], *here, task["name"]])
    return results


def _in_observer(isolation: Dict, argv: List[str]) -> List[Dict]:
    """`argv`'s JSON results, run in a namespace of our own on the bridge of `isolation` (removed after)."""
    from tfe_estimator.cluster.netns import join_network, link_local_address  # pylint: disable=import-outside-toplevel

    namespace = f"tfe-attack-{os.getpid()}"
    join_network(isolation["hub"], namespace, isolation["observer_address"], f"a{os.getpid() % 10**6}")
    try:
        link_local_address(namespace)  # IPv6 probes need our own link-local address out of its tentative state
        return _run_json(["ip", "netns", "exec", namespace, *argv])
    finally:
        subprocess.run(["ip", "netns", "del", namespace], capture_output=True, check=False)


def _probe_service(network: Dict, origin: str, attacker: Optional[str]) -> List[Dict]:
    """Inside a namespace: the outsider's and the attacker's attempts (`origin` "outside"), or a server's scans."""
    from tools.attack_service import isolated_scans, service_attacks  # pylint: disable=import-outside-toplevel

    if origin == "outside":
        return service_attacks(network, attacker)
    return isolated_scans(network["isolation"], origin)


def _run_json(argv: List[str]) -> List[Dict]:
    result = subprocess.run(argv, capture_output=True, text=True, timeout=600, check=False)
    lines = [line for line in result.stdout.splitlines() if line.startswith("[")]
    if result.returncode != 0 or not lines:
        raise RuntimeError(f"probe {' '.join(argv)} failed ({result.returncode}): {result.stderr[-3000:]}")
    return json.loads(lines[-1])


# ---------------------------------------------------------------------- probes (run inside a namespace)

def _result(origin, task, attack, target, succeeded, detail):
    return {"from": origin, "to": task["name"], "attack": attack, "target": target, "succeeded": bool(succeeded),
            "detail": detail}


def _probe_outside(network: Dict, read_file: str) -> List[Dict]:
    foreign = _foreign_identity(network)
    with ThreadPoolExecutor(len(network["tasks"])) as pool:  # every task at once: refusals are timeouts
        per_task = list(pool.map(lambda task: _attack_task(task, read_file, foreign), network["tasks"]))
    return [result for results in per_task for result in results]


def _attack_task(task: Dict, read_file: str, foreign) -> List[Dict]:
    """Every outside attempt against one task, in order."""
    results = []
    # TensorFlow listens on [::]: its port on the bridge's IPv4 address and on the IPv6 link-local one.
    hosts = task_hosts(task)
    for host in hosts:
        results.append(_result("outside", task, "tcp", target(host, task["tf_port"]), *_tcp(host, task["tf_port"])))
    targets = [(host, task["tf_port"]) for host in hosts]
    targets += [(task["address"], task["tls_port"])] if task.get("tls_port") else []
    for host, port in targets:
        results.append(_result("outside", task, "grpc", target(host, port), *_grpc_answers(host, port)))
    if task["job"] in ("chief", "worker"):
        for host, port in targets:
            where = target(host, port)
            results.append(_result("outside", task, "readfile", where, *_read_file(task, where, read_file)))
    if task.get("tls_port"):
        where = target(task["address"], task["tls_port"])
        results.append(_result("outside", task, "no-cert", where,
                               *_grpc_answers(task["address"], task["tls_port"], tls=(None, None))))
        results.append(_result("outside", task, "foreign-ca", where,
                               *_grpc_answers(task["address"], task["tls_port"], tls=foreign)))
    return results


def _probe_owner(network: Dict, name: str) -> List[Dict]:
    """From owner `name`'s namespace, with its own certificate: to every other owner and to each server."""
    me = next(t for t in network["tasks"] if t["name"] == name)
    credentials = (os.path.join(me["cert_dir"], f"{name}.crt"), os.path.join(me["cert_dir"], f"{name}.key"))
    ca = os.path.join(me["cert_dir"], "ca.crt")
    results = []
    for task in network["tasks"]:
        if task is me or task["job"] not in ("chief", "worker", "tfe"):
            continue
        attack = "owner-to-server" if task["job"] == "tfe" else "owner-to-owner"
        target = f"{task['address']}:{task['tls_port']}"
        results.append(_result(name, task, attack, target,
                               *_grpc_answers(task["address"], task["tls_port"], tls=credentials, ca=ca)))
    return results


def _tcp(host: str, port: int):
    try:
        with socket.create_connection((host, port), timeout=_TIMEOUT):
            return True, "connected"
    except OSError as e:
        return False, f"no connection: {e.strerror or e}"


def _grpc_answers(host: str, port: int, tls=None, ca: Optional[str] = None):
    """Whether an HTTP/2 server (gRPC) answers our preface with SETTINGS, in the clear or inside TLS.

    `tls`: None for plaintext; ``(cert, key)`` (or ``(None, None)``: no client certificate) for TLS.
    """
    try:
        raw = socket.create_connection((host, port), timeout=_TIMEOUT)
    except OSError as e:
        return False, f"no connection: {e.strerror or e}"
    try:
        conn = raw
        if tls is not None:
            context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
            context.minimum_version = ssl.TLSVersion.TLSv1_3
            context.set_alpn_protocols(["h2"])  # grpcio's own TLS closes connections that do not offer h2
            if ca:
                context.load_verify_locations(ca)
                context.check_hostname = False  # the far end's identity is the sidecar's checkHost's job
            else:
                context.check_hostname, context.verify_mode = False, ssl.CERT_NONE
            if tls[0]:
                context.load_cert_chain(*tls)
            conn = context.wrap_socket(raw)
        conn.sendall(_HTTP2_PREFACE)
        data = b""
        while len(data) < 9:
            chunk = conn.recv(64)
            if not chunk:
                break
            data += chunk
        if len(data) >= 9 and data[3] == 4:
            return True, "the server answered with HTTP/2 SETTINGS"
        return False, f"closed after {len(data)} bytes, no HTTP/2 answer"
    except (OSError, ssl.SSLError) as e:
        return False, f"{type(e).__name__}: {getattr(e, 'reason', None) or e}"
    finally:
        raw.close()


def _read_file(task: Dict, target: str, path: str):
    """A TensorFlow session whose master is `target`, reading `path` on that task."""
    import tensorflow as tf  # pylint: disable=import-outside-toplevel

    # Only the target task's devices (as an attacker would): the master then asks no other task for its devices.
    config = tf.compat.v1.ConfigProto(operation_timeout_in_ms=int(_TIMEOUT * 1000),
                                      device_filters=[f"/job:{task['job']}/task:{task['index']}"])
    graph = tf.Graph()
    with graph.as_default(), tf.device(f"/job:{task['job']}/task:{task['index']}"):
        content = tf.io.read_file(path)
    try:
        with tf.compat.v1.Session(f"grpc://{target}", graph=graph, config=config) as session:
            data = session.run(content)
        return True, f"read {len(data)} bytes of {path}"
    except tf.errors.OpError as e:
        return False, f"{type(e).__name__}: {e.message.splitlines()[0][:120]}"


def _foreign_identity(network: Dict):
    """A key and a certificate for a real task's name, from a CA of our own (not the cluster's)."""
    from tfe_estimator.cluster import certs  # pylint: disable=import-outside-toplevel

    task = network["tasks"][0]
    ca_cert, ca_key = certs.make_ca(network["cluster"])
    key, csr = certs.make_key_and_csr(task["job"], task["index"], "intruder", network["cluster"])
    cert = certs.sign_csr(csr, ca_cert, ca_key, network["cluster"])
    directory = tempfile.mkdtemp(prefix="tfe-attack-")
    paths = (os.path.join(directory, "intruder.crt"), os.path.join(directory, "intruder.key"))
    for path, data in zip(paths, (cert, key)):
        with open(path, "wb") as f:
            f.write(data)
    return paths


if __name__ == "__main__":
    sys.exit(main())
