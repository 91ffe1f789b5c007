"""`tfe-estimator attack` against service mode: an owner with a valid certificate, outsiders, the owners' ports.

The first test runs the tool (`python -m tools.attack`) against a loopback
service cluster in training (`launch --cluster-mode service --network-file`)
and asserts that every attack was refused. The mutations run the tool against
in-process aggregation servers with a planted leak (identity read from the
call's metadata; the membership check skipped) and assert that it exits 1
naming the attack that got through.
"""
import io
import json
import os
import re
import subprocess
import sys
import threading
import time
import urllib.request

import portpicker
import pytest

from service_helpers import cert_dirs, make_service, owner_names, small_owner_data  # noqa: F401
from launch_log import report
from tfe_estimator.service import TlsFiles, server as server_module
from tfe_estimator.service.health import check_health
from tools import CHECKOUT, attack

SCRIPT = os.path.join(os.path.dirname(__file__), "scripts", "service_owner.py")
#: Every kind of line the tool prints for service mode (besides the control and the summary).
SERVICE_ATTACKS = {"put-as-other-owner", "get-other-result", "tf-runtime", "forward-as-owner", "handshake-on-server1",
                   "non-owner-cert", "no-cert", "foreign-ca", "plaintext", "owner-port"}


def _attack_lines(out):
    return [line for line in out.splitlines() if line.startswith("[attack] ") and " -> " in line
            and not line.startswith("[attack] control ")]


def _released(port):
    """A server's ``tfe_aggregation_steps_released_total`` at http://127.0.0.1:port/metrics."""
    page = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    return float(re.search(r"^tfe_aggregation_steps_released_total (\S+)$", page, re.M).group(1))


def _run_tool(network_file, timeout=120):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(CHECKOUT), os.environ.get("PYTHONPATH", "")]))
    return subprocess.run([sys.executable, "-m", "tools.attack", "--network", network_file], capture_output=True,
                          text=True, timeout=timeout, cwd=str(CHECKOUT), env=env, check=False)


@pytest.mark.multiprocess
@pytest.mark.slow
def test_every_service_attack_is_refused_on_a_cluster_in_training(tmp_path):
    from tfe_estimator.cluster.launcher import Launcher  # pylint: disable=import-outside-toplevel

    workdir, network_file = str(tmp_path), str(tmp_path / "net.json")
    small_owner_data(workdir)
    out = io.StringIO()
    launcher = Launcher([sys.executable, SCRIPT, "30", "0.1", "--step-seconds", "0.5"], workers=1,
                        task_cwd=os.path.join(workdir, "{job}-{index}"), out=out, cluster_mode="service",
                        network_file=network_file, down_timeout=60, final_eval_timeout=60)
    result = {}
    runner = threading.Thread(target=lambda: result.setdefault("status", launcher.run()))
    runner.start()
    try:
        deadline = time.monotonic() + 60
        progress = [os.path.join(workdir, owner, "progress") for owner in ("chief-0", "worker-0")]
        while not all(os.path.exists(p) for p in progress) and time.monotonic() < deadline and runner.is_alive():
            time.sleep(0.2)
        assert all(os.path.exists(p) for p in progress), report(out.getvalue())
        with open(network_file, encoding="utf-8") as f:
            network = json.load(f)
        assert network["mode"] == "service" and len(network["jobs"]["tfe"]) == 2
        assert os.path.isfile(os.path.join(network["cert_dir"], "chief-0.crt"))
        tool = _run_tool(network_file)
        before = [int(open(p).read() or 0) for p in progress]
        time.sleep(1.5)
        after = [int(open(p).read() or 0) for p in progress]
        # An operator's view meanwhile: each server SERVING to an owner's certificate, its metrics (from the
        # network file's metrics_ports) counting at least the steps trained so far as released.
        owner_tls = TlsFiles.from_dir(network["cert_dirs"]["chief:0"], "chief", 0)
        health = [check_health(address, owner_tls, k) for k, address in enumerate(network["jobs"]["tfe"])]
        released = {name: _released(port) for name, port in network["metrics_ports"].items()}
    finally:
        launcher.stop()
        runner.join(timeout=60)
    assert health == ["SERVING", "SERVING"]
    assert set(released) == {"tfe:0", "tfe:1"} and all(n >= max(after) for n in released.values()), \
        (released, after)
    assert tool.returncode == 0, tool.stdout + tool.stderr
    lines = _attack_lines(tool.stdout)
    assert lines and all(": refused (" in line for line in lines), tool.stdout
    assert {line.split()[4] for line in lines} == SERVICE_ATTACKS, tool.stdout
    assert tool.stdout.count("[attack] control ") == 2 and "accepted (as it must)" in tool.stdout
    assert sum(" owner-port " in line for line in lines) == 4  # chief and worker, on 127.0.0.1 and ::1
    assert all("Connection refused" in line for line in lines if " owner-port " in line), tool.stdout
    assert "; the first put still waits for worker:0" in tool.stdout
    assert all(a > b for a, b in zip(after, before)), (before, after)  # training went on undisturbed


def _in_process_network(tmp_path, service, certs_dir):
    """A network file for in-process servers; the owners' TF_CONFIG ports are free ports nothing listens on."""
    ports = [portpicker.pick_unused_port() for _ in range(2)]
    network = {"mode": "service", "cluster": "t", "cert_dir": certs_dir,
               "jobs": {"chief": [f"127.0.0.1:{ports[0]}"], "worker": [f"127.0.0.1:{ports[1]}"],
                        "tfe": list(service.addresses)}}
    path = str(tmp_path / "net.json")
    with open(path, "w", encoding="utf-8") as f:
        json.dump(network, f)
    return path


def test_the_tool_passes_against_honest_in_process_servers(make_service, cert_dirs, tmp_path, capsys):
    """The baseline of the mutations: the same servers without a planted leak."""
    service = make_service(owner_names(2))
    assert attack.main(["--network", _in_process_network(tmp_path, service, cert_dirs[0])]) == 0
    out = capsys.readouterr().out
    assert {line.split()[4] for line in _attack_lines(out)} == SERVICE_ATTACKS, out


def _identity_from_metadata(context):
    """The leak: a caller may name itself in the call's metadata."""
    for key, value in context.invocation_metadata():
        if key == "tfe-identity":
            return value
    return _REAL_PEER_IDENTITY(context)


_REAL_PEER_IDENTITY = server_module.peer_identity


class _Everyone(tuple):
    def __contains__(self, item):
        return True


def test_mutation_identity_from_the_request_lets_put_as_other_owner_through(make_service, cert_dirs, tmp_path,
                                                                              capsys, monkeypatch):
    monkeypatch.setattr(server_module, "peer_identity", _identity_from_metadata)
    service = make_service(owner_names(2))
    assert attack.main(["--network", _in_process_network(tmp_path, service, cert_dirs[0])]) == 1
    through = [line for line in _attack_lines(capsys.readouterr().out) if "GOT THROUGH" in line]
    assert through and {line.split()[4] for line in through} == {"put-as-other-owner"}, through
    # Server0 releases the forged step; its answer waits for server1's release (ForwardBlinded waits for it).
    assert any("-> tfe:0 put-as-other-owner" in line and ("accepted and its step released" in line or
                                                           "was taken (it waited for the step)" in line)
               for line in through), through


def test_mutation_membership_skipped_lets_forward_and_non_owner_through(make_service, cert_dirs, tmp_path, capsys,
                                                                        monkeypatch):
    monkeypatch.setattr(server_module.AggregationServer, "_callers", lambda self, method: _Everyone())
    service = make_service(owner_names(2))
    assert attack.main(["--network", _in_process_network(tmp_path, service, cert_dirs[0])]) == 1
    through = [line for line in _attack_lines(capsys.readouterr().out) if "GOT THROUGH" in line]
    kinds = {line.split()[4] for line in through}
    assert kinds == {"forward-as-owner", "non-owner-cert"}, through
    # The forged forward is taken: answered, or waiting for the step's shares (ForwardBlinded waits for the release).
    assert any("chief:0 -> tfe:1 forward-as-owner" in line and ("answered OK" in line or "DEADLINE_EXCEEDED" in line)
               for line in through), through


def test_mutation_an_owner_port_left_open_is_caught(make_service, cert_dirs, tmp_path, capsys):
    """An owner that listens on its TF_CONFIG port (as a TensorFlow server would), on IPv6 only."""
    service = make_service(owner_names(2))
    path = _in_process_network(tmp_path, service, cert_dirs[0])
    import socket  # pylint: disable=import-outside-toplevel

    listener = socket.socket(socket.AF_INET6)
    listener.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
    with open(path, encoding="utf-8") as f:
        port = int(json.load(f)["jobs"]["worker"][0].rsplit(":", 1)[1])
    listener.bind(("::1", port))
    listener.listen()
    try:
        assert attack.main(["--network", path]) == 1
    finally:
        listener.close()
    through = [line for line in _attack_lines(capsys.readouterr().out) if "GOT THROUGH" in line]
    assert len(through) == 1 and f"-> worker:0 owner-port [::1]:{port}" in through[0], through


def test_the_service_attacks_import_no_tensorflow():  # grpcio and cryptography only: runs from a small image
    code = "import sys, tools.attack, tools.attack_service; assert 'tensorflow' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=str(CHECKOUT), timeout=60)
