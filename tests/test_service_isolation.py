"""Service mode with every task on a host of its own (`launch --isolate`): what an outsider on the bridge reaches.

A 2-owner service cluster trains with every task in its own network namespace
on a private bridge. `tfe-estimator attack` (`python -m tools.attack`) then
joins the bridge with a namespace of its own and, besides every attack of
`tools.attack_service` (an owner's valid certificate against the servers,
outsiders without one), tries every TCP port of every task on its IPv4 address
and on its IPv6 link-local address (which the kernel gives every interface,
whatever the subnet says: the way around an IPv4-only firewall the issue
found). Nothing may answer on an owner, only the service port and the data
port on a server (both mutual TLS: the tool's TLS attacks cover both), and
from the first server's own namespace no owner port answers either. The
mutation plants an IPv6-only listener in an owner's namespace: the tool must
name it, and nothing else (one run of the tool, with the listener planted,
serves both tests: the fixture `attacked`). Needs root and iproute2 (CI has both); skipped otherwise, naming what
is missing.

The data-plane attacks themselves (`tools.attack_service`: frames through TLS
without a certificate, with a foreign CA's, in the clear, as a non-owner and
a forward as an owner) are also checked here against in-process servers, fast
and without root, with a mutation that lets the data plane's TLS take callers
without a certificate.
"""
import io
import json
import os
import ssl
import subprocess
import sys
import threading
import time

import portpicker
import pytest

from service_helpers import CLUSTER, OWNER_TASKS, Service, owner_names, small_owner_data
from launch_log import report
from tfe_estimator.cluster import certs
from tfe_estimator.cluster.isolation import IsolatedCluster
from tfe_estimator.service import tls as tls_module
from tools import CHECKOUT, attack
from tools.portscan import target

SCRIPT = os.path.join(os.path.dirname(__file__), "scripts", "service_owner.py")
OWNERS = ("chief-0", "worker-0")
_MISSING = IsolatedCluster.missing(tls=False)

#: The isolated cluster's tests (the in-process data-plane tests below run everywhere).
_ISOLATED = (pytest.mark.multiprocess, pytest.mark.slow,
             pytest.mark.skipif(_MISSING is not None, reason=f"launch --isolate needs {_MISSING}"))
#: The data-plane attack kinds (`tools.attack_service._data_plane_probes`).
DATA_PLANE_ATTACKS = ("forward-as-owner", "non-owner-cert", "no-cert", "foreign-ca", "plaintext")


def isolated(test):
    for mark in _ISOLATED:
        test = mark(test)
    return test


def _attack_lines(out):
    return [line for line in out.splitlines() if line.startswith("[attack] ") and " -> " in line
            and not line.startswith("[attack] control ")]


def _run_tool(network_file):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(CHECKOUT), os.environ.get("PYTHONPATH", "")]))
    return subprocess.run([sys.executable, "-m", "tools.attack", "--network", network_file], capture_output=True,
                          text=True, timeout=600, cwd=str(CHECKOUT), env=env, check=False)


def _progress(workdir):
    values = []
    for owner in OWNERS:
        with open(os.path.join(workdir, owner, "progress"), encoding="utf-8") as f:
            values.append(int(f.read() or 0))
    return values


def _namespaces():
    return subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """A 2-owner service cluster in training, each task in its own namespace: (launcher, network file, workdir)."""
    from tfe_estimator.cluster.launcher import Launcher  # pylint: disable=import-outside-toplevel

    workdir = str(tmp_path_factory.mktemp("isolated-service"))
    network_file = os.path.join(workdir, "net.json")
    small_owner_data(workdir, OWNERS)
    out = io.StringIO()
    launcher = Launcher([sys.executable, SCRIPT, "2000", "0.1", "--step-seconds", "0.2"], workers=1,
                        task_cwd=os.path.join(workdir, "{job}-{index}"), out=out, cluster_mode="service",
                        isolate=True, network_file=network_file, down_timeout=120, final_eval_timeout=60)
    run_id = launcher.isolation.network.run_id
    result = {}
    runner = threading.Thread(target=lambda: result.setdefault("status", launcher.run()))
    runner.start()
    try:
        deadline = time.monotonic() + 120
        progress = [os.path.join(workdir, owner, "progress") for owner in OWNERS]
        while not all(os.path.exists(p) for p in progress) and time.monotonic() < deadline and runner.is_alive():
            time.sleep(0.2)
        assert all(os.path.exists(p) for p in progress), report(out.getvalue())
        assert "each task in its own network namespace" in out.getvalue()
        yield launcher, network_file, workdir
    finally:
        launcher.stop()
        runner.join(timeout=120)
    assert not runner.is_alive()
    assert not [t.name for t in launcher.tasks if t.process is not None and t.process.poll() is None]
    assert f"tfe-{run_id}-" not in _namespaces()  # every namespace (and its links) removed


#: The port of the IPv6-only listener the mutation plants in worker-0's namespace.
PLANTED = 7777


@pytest.fixture(scope="module")
def attacked(cluster):
    """The tool's one run against `cluster`, with the mutation planted: an IPv6-only listener on port PLANTED in
    worker-0's namespace (the leak the issue found: a port an IPv4-only view misses).

    Returns (tool result, network, worker-0's IPv6 host in brackets, progress before, progress after). One run
    serves both tests: the planted port must be the only thing found, so everything else the tool tried is
    the unplanted cluster's answer.
    """
    _, network_file, workdir = cluster
    with open(network_file, encoding="utf-8") as f:
        network = json.load(f)
    worker = next(t for t in network["isolation"]["tasks"] if t["name"] == "worker-0")
    code = ("import socket, time; s = socket.socket(socket.AF_INET6); "
            f"s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1); s.bind(('::', {PLANTED})); s.listen(); "
            "print('listening', flush=True); time.sleep(300)")
    listener = subprocess.Popen(["ip", "netns", "exec", worker["namespace"], sys.executable, "-c", code],
                                stdout=subprocess.PIPE, text=True)
    try:
        assert listener.stdout.readline().strip() == "listening"
        before = _progress(workdir)
        tool = _run_tool(network_file)
        after = _progress(workdir)
    finally:
        listener.kill()
        listener.wait(timeout=30)
    return tool, network, f"[{worker['ipv6_link_local']}%eth0]", before, after


@isolated
def test_an_outsider_on_the_bridge_reaches_no_owner_port_on_ipv4_or_ipv6_and_the_servers_only_with_mtls(attacked):
    """Everything the tool tried is refused but the planted listener (`attacked`): on worker-0's link-local
    address the scans find it and nothing else; the tool's verdict counts only those two scans as wrong."""
    tool, network, planted_host, before, after = attacked
    tasks = {t["name"]: t for t in network["isolation"]["tasks"]}
    assert set(tasks) == {"chief-0", "worker-0", "tfe-0", "tfe-1"}
    assert all(t["ipv6_link_local"].startswith("fe80:") for t in tasks.values()), tasks  # IPv6 is there to try
    assert tool.returncode == 1, tool.stdout + tool.stderr  # 1: the planted port (the mutation's test)
    lines = _attack_lines(tool.stdout)
    planted = [line for line in lines if f"-> worker:0 owner-port {planted_host}" in line]
    assert len(planted) == 2 and all(f"65535 ports tried: 1 open [{PLANTED}], 65534 refused" in line
                                     for line in planted), planted  # it, and nothing else on worker-0's IPv6
    lines = [line for line in lines if line not in planted]
    assert lines and all(": refused (" in line for line in lines), tool.stdout
    assert f"[attack] {len(lines) + 2 + 4} attempts, 2 went the wrong way" in tool.stdout  # 4: the controls
    kinds = {line.split()[4] for line in lines}
    assert {"put-as-other-owner", "non-owner-cert", "no-cert", "foreign-ca", "plaintext", "owner-port",
            "server-ports"} <= kinds, tool.stdout
    scans = [line for line in lines if " owner-port " in line]
    # Each owner, on its bridge address and its link-local address, from outside and from server0's namespace.
    for origin in ("outside", "tfe:0"):
        for owner in ("chief:0", "worker:0"):
            name = owner.replace(":", "-")
            for host in (tasks[name]["address"], f"[{tasks[name]['ipv6_link_local']}%eth0]"):
                assert [line for line in scans + planted
                        if line.startswith(f"[attack] {origin} -> {owner} owner-port {host}")
                        ], (origin, owner, host, tool.stdout)
    assert all("65535 ports tried: 0 open [], 65535 refused" in line for line in scans), scans
    servers = [line for line in lines if " server-ports " in line]
    data_ports = {int(name.split(":")[1]): port for name, port in network["data_ports"].items()}
    for k in (0, 1):  # two open ports each, the service port and the data port, on IPv4 and IPv6
        ports = sorted([tasks[f"tfe-{k}"]["tf_port"], data_ports[k]])
        assert len([line for line in servers if f"-> tfe:{k} server-ports " in line and f"2 open {ports}, 65533 "
                    "refused" in line]) == 2, (k, ports, servers)
    assert len(servers) == 4, servers
    assert any("tfe:1 no-cert [fe80:" in line for line in lines), tool.stdout  # mTLS only, on IPv6 too
    for k in (0, 1):  # ... on the data port too: every TLS attack, on both addresses
        task = tasks[f"tfe-{k}"]
        for host in (task["address"], f"{task['ipv6_link_local']}%eth0"):
            for kind in DATA_PLANE_ATTACKS:
                assert [line for line in lines if f"-> tfe:{k} {kind} {target(host, data_ports[k])}: refused (data "
                        "plane: " in line], (k, kind, host, tool.stdout)
    assert tool.stdout.count("[attack] control ") == 4 and "accepted (as it must)" in tool.stdout
    assert all(a > b for a, b in zip(after, before)), (before, after)  # training went on undisturbed


@isolated
def test_mutation_an_owner_listening_on_ipv6_only_is_found_from_outside_and_from_the_server(attacked):
    """The leak the issue found: a port an IPv4-only view misses. Planted in worker-0's namespace (`attacked`)."""
    tool, _, host, _, _ = attacked
    assert tool.returncode == 1, tool.stdout + tool.stderr
    through = [line for line in _attack_lines(tool.stdout) if "GOT THROUGH" in line]
    assert sorted(line.split(" -> ")[0] for line in through) == ["[attack] outside", "[attack] tfe:0"], through
    assert all(f"worker:0 owner-port {host}" in line and f"1 open [{PLANTED}]" in line for line in through), through


# ------------------------------------------------------------------ the data-plane attacks, in process (fast)

def _data_plane_service(certs_dir):
    """In-process servers with data planes and a network file for them: (service, network file)."""
    certs.make_cluster_certs(certs_dir, OWNER_TASKS[:2] + [("tfe", 0), ("tfe", 1)], cluster=CLUSTER)
    service = Service(certs_dir, owner_names(2), data_plane=True)
    owner_ports = [portpicker.pick_unused_port() for _ in range(2)]  # nothing listens there
    network = {"mode": "service", "cluster": CLUSTER, "cert_dir": certs_dir,
               "jobs": {"chief": [f"127.0.0.1:{owner_ports[0]}"], "worker": [f"127.0.0.1:{owner_ports[1]}"],
                        "tfe": list(service.addresses)}}
    path = os.path.join(certs_dir, "net.json")
    with open(path, "w", encoding="utf-8") as f:
        json.dump(network, f)
    return service, path


def _data_plane_lines(out, service):
    ports = {k: server._data_plane.port for k, server in zip((1, 0), service.servers)}  # pylint: disable=protected-access
    return {k: [line for line in _attack_lines(out) if f"-> tfe:{k} " in line and f":{ports[k]}: " in line]
            for k in (0, 1)}


def test_the_tool_attacks_each_servers_data_plane_and_every_attack_is_refused(tmp_path, capsys):
    service, path = _data_plane_service(str(tmp_path))
    try:
        assert attack.main(["--network", path]) == 0
    finally:
        service.close()
    out = capsys.readouterr().out
    for k, lines in _data_plane_lines(out, service).items():  # the port each server announced, attacked
        assert sorted(line.split()[4] for line in lines) == sorted(DATA_PLANE_ATTACKS), (k, out)
        assert all(": refused (data plane: " in line for line in lines), lines
        forward = next(line for line in lines if " forward-as-owner " in line)  # a valid certificate is answered
        assert "PERMISSION_DENIED: chief:0 may not call ForwardBlinded" in forward, forward


def test_mutation_a_data_plane_that_takes_callers_without_a_certificate_is_caught(tmp_path, capsys, monkeypatch):
    """The leak: the data plane's TLS stops requiring a client certificate (its identity check still refuses
    the call, but an unauthenticated caller got a frame in and an answer out)."""
    real = tls_module.TlsFiles.ssl_server_context

    def no_client_certificate(self):
        context = real(self)
        context.verify_mode = ssl.CERT_NONE
        return context

    monkeypatch.setattr(tls_module.TlsFiles, "ssl_server_context", no_client_certificate)
    service, path = _data_plane_service(str(tmp_path))
    try:
        assert attack.main(["--network", path]) == 1
    finally:
        service.close()
    out = capsys.readouterr().out
    for k, lines in _data_plane_lines(out, service).items():
        through = {line.split()[4] for line in lines if "GOT THROUGH" in line}
        assert {"no-cert", "foreign-ca"} <= through, (k, lines)
        assert "plaintext" not in through, lines
    through = [line for line in _attack_lines(out) if "GOT THROUGH" in line]  # gRPC's port is not this leak
    assert all(" no-cert " in line or " foreign-ca " in line or " forward-as-owner " in line for line in through), \
        through
