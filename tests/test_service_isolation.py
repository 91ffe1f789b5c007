"""Service mode with every task on a host of its own (`launch --isolate`): what an outsider on the bridge reaches.

A 2-owner service cluster trains with every task in its own network namespace
on a private bridge. `tfe-estimator attack` (`python -m tools.attack`) then
joins the bridge with a namespace of its own and, besides every attack of
`tools.attack_service` (an owner's valid certificate against the servers,
outsiders without one), tries every TCP port of every task on its IPv4 address
and on its IPv6 link-local address (which the kernel gives every interface,
whatever the subnet says: the way around an IPv4-only firewall the issue
found). Nothing may answer on an owner, only the service port on a server,
and from the first server's own namespace no owner port answers either. The
mutation plants an IPv6-only listener in an owner's namespace: the tool must
name it. Needs root and iproute2 (CI has both); skipped otherwise, naming what
is missing.
"""
import io
import json
import os
import subprocess
import sys
import threading
import time

import pytest

from service_helpers import small_owner_data
from tfe_estimator.cluster.isolation import IsolatedCluster
from tools import CHECKOUT

SCRIPT = os.path.join(os.path.dirname(__file__), "scripts", "service_owner.py")
OWNERS = ("chief-0", "worker-0")
_MISSING = IsolatedCluster.missing(tls=False)

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow,
              pytest.mark.skipif(_MISSING is not None, reason=f"launch --isolate needs {_MISSING}")]


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
        assert all(os.path.exists(p) for p in progress), out.getvalue()[-5000:]
        assert "each task in its own network namespace" in out.getvalue()
        yield launcher, network_file, workdir
    finally:
        launcher.stop()
        runner.join(timeout=120)
    assert not runner.is_alive()
    assert not [t.name for t in launcher.tasks if t.process is not None and t.process.poll() is None]
    assert f"tfe-{run_id}-" not in _namespaces()  # every namespace (and its links) removed


def test_an_outsider_on_the_bridge_reaches_no_owner_port_on_ipv4_or_ipv6_and_the_servers_only_with_mtls(cluster):
    _, network_file, workdir = cluster
    with open(network_file, encoding="utf-8") as f:
        network = json.load(f)
    tasks = {t["name"]: t for t in network["isolation"]["tasks"]}
    assert set(tasks) == {"chief-0", "worker-0", "tfe-0", "tfe-1"}
    assert all(t["ipv6_link_local"].startswith("fe80:") for t in tasks.values()), tasks  # IPv6 is there to try
    before = _progress(workdir)
    tool = _run_tool(network_file)
    after = _progress(workdir)
    assert tool.returncode == 0, tool.stdout + tool.stderr
    lines = _attack_lines(tool.stdout)
    assert lines and all(": refused (" in line for line in lines), tool.stdout
    kinds = {line.split()[4] for line in lines}
    assert {"put-as-other-owner", "non-owner-cert", "no-cert", "foreign-ca", "plaintext", "owner-port",
            "server-ports"} <= kinds, tool.stdout
    scans = [line for line in lines if " owner-port " in line]
    # Each owner, on its bridge address and its link-local address, from outside and from server0's namespace.
    for origin in ("outside", "tfe:0"):
        for owner in ("chief:0", "worker:0"):
            name = owner.replace(":", "-")
            for host in (tasks[name]["address"], f"[{tasks[name]['ipv6_link_local']}%eth0]"):
                assert [line for line in scans if line.startswith(f"[attack] {origin} -> {owner} owner-port {host}")
                        ], (origin, owner, host, tool.stdout)
    assert all("65535 ports tried: 0 open [], 65535 refused" in line for line in scans), scans
    servers = [line for line in lines if " server-ports " in line]
    assert len(servers) == 4 and all(", 65534 refused" in line for line in servers), servers
    assert any("tfe:1 no-cert [fe80:" in line for line in lines), tool.stdout  # mTLS only, on IPv6 too
    assert tool.stdout.count("[attack] control ") == 4 and "accepted (as it must)" in tool.stdout
    assert all(a > b for a, b in zip(after, before)), (before, after)  # training went on undisturbed


def test_mutation_an_owner_listening_on_ipv6_only_is_found_from_outside_and_from_the_server(cluster):
    """The leak the issue found: a port an IPv4-only view misses. Planted in worker-0's namespace."""
    _, network_file, _ = cluster
    with open(network_file, encoding="utf-8") as f:
        worker = next(t for t in json.load(f)["isolation"]["tasks"] if t["name"] == "worker-0")
    code = ("import socket, time; s = socket.socket(socket.AF_INET6); "
            "s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1); s.bind(('::', 7777)); s.listen(); "
            "print('listening', flush=True); time.sleep(300)")
    listener = subprocess.Popen(["ip", "netns", "exec", worker["namespace"], sys.executable, "-c", code],
                                stdout=subprocess.PIPE, text=True)
    try:
        assert listener.stdout.readline().strip() == "listening"
        tool = _run_tool(network_file)
    finally:
        listener.kill()
        listener.wait(timeout=30)
    assert tool.returncode == 1, tool.stdout + tool.stderr
    through = [line for line in _attack_lines(tool.stdout) if "GOT THROUGH" in line]
    host = f"[{worker['ipv6_link_local']}%eth0]"
    assert sorted(line.split(" -> ")[0] for line in through) == ["[attack] outside", "[attack] tfe:0"], through
    assert all(f"worker:0 owner-port {host}" in line and "1 open [7777]" in line for line in through), through
