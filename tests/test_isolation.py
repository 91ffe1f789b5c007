"""`tfe-estimator launch --isolate --tls` against the attacks it must stop, and the training it must not change.

In-graph mode, the TensorFlow-runtime mode (one organisation): every task
runs in its own network namespace on a private bridge that the test creates
(in a hub namespace of its own: nothing is routed anywhere else). Needs root,
iproute2, iptables and stunnel4 (CI runs as root; ``scripts/system-deps.sh``
installs them); elsewhere these tests skip naming what is missing. Each
security check has its mutation beside it: without ``--tls`` the same attacks
get through, and a firewall left open on IPv6 lets them through TensorFlow's
port on the IPv6 link-local address. One launch serves the training with TLS
and the attacks on it, one more the training and the attacks without TLS (the
module's fixtures `tls_run` and `plain_run`). (Service mode's isolation is
tests/test_service_isolation.py.)
"""
import io
import json
import os
import re
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from tfe_estimator.cluster import isolation
from tfe_estimator.cluster.isolation import IsolatedCluster
from tfe_estimator.cluster.launcher import Launcher
from test_launch import _owner_data, _true_weights, _weights

MISSING = IsolatedCluster.missing(tls=True)
pytestmark = [pytest.mark.multiprocess, pytest.mark.slow,
              pytest.mark.skipif(MISSING is not None, reason=f"--isolate --tls needs {MISSING}")]

SCRIPTS = os.path.join(os.path.dirname(__file__), "scripts")
SERVING_OWNER = os.path.join(SCRIPTS, "serving_owner.py")
CAPTURE = os.path.join(SCRIPTS, "capture.py")
TRAIN_THEN_SERVE = os.path.join(SCRIPTS, "train_then_serve.py")
#: What plaintext gRPC between TensorFlow tasks shows on the wire: HTTP/2's client preface,
#: and device names inside RunGraph/RecvTensor requests.
PLAINTEXT_MARKERS = (b"PRI * HTTP/2.0", b"/job:tfe/replica:0/task:")
#: An owner's file the ReadFile attack asks for.
SECRET = "patient,diagnosis\n1,positive\n"


@pytest.fixture(autouse=True)
def nothing_left_behind():
    yield
    namespaces = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert f"tfe-{os.getpid()}-" not in namespaces, namespaces
    assert "tfe-attack-" not in namespaces, namespaces
    stunnels = subprocess.run(["pgrep", "-af", "tfe-estimator-isolate-"], capture_output=True, text=True).stdout
    assert not stunnels.strip(), stunnels


class _Background:
    """A `Launcher` running in a thread, with its network file."""

    def __init__(self, workdir, command, tls, **kwargs):
        self.network_file = os.path.join(workdir, "network.json")
        self.out = io.StringIO()
        kwargs.setdefault("cluster_mode", "in-graph")  # namespaces and sidecars isolate the TensorFlow runtime
        self.launcher = Launcher(command, task_cwd=os.path.join(workdir, "{job}-{index}"), out=self.out,
                                 isolate=True, tls=tls, network_file=self.network_file, down_timeout=120, **kwargs)
        self.status = None
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self):
        self.status = self.launcher.run()

    def network(self, timeout=60):
        deadline = time.monotonic() + timeout
        while not os.path.exists(self.network_file):
            assert self.thread.is_alive() and time.monotonic() < deadline, self.out.getvalue()[-3000:]
            time.sleep(0.1)
        time.sleep(0.2)  # the file is complete once the launcher has closed it
        with open(self.network_file) as f:
            return json.load(f)

    def wait_serving(self, network, timeout=90):
        deadline = time.monotonic() + timeout
        for task in network["tasks"]:
            probe = ["ip", "netns", "exec", task["namespace"], "bash", "-c",
                     f"exec 3<>/dev/tcp/127.0.0.1/{task['tf_port']}"]
            while subprocess.run(probe, capture_output=True, check=False).returncode != 0:
                assert time.monotonic() < deadline, f"{task['name']} not serving: {self.out.getvalue()[-3000:]}"
                time.sleep(0.3)

    def join(self, timeout=180):
        self.thread.join(timeout)
        assert not self.thread.is_alive(), self.out.getvalue()[-3000:]
        return self.status


def _write_secret(workdir):
    secret = os.path.join(workdir, "owner-secret.csv")
    with open(secret, "w") as f:
        f.write(SECRET)
    return secret


def _run_attack(cluster, secret):
    """`tfe-estimator attack` against a running cluster: its result."""
    return subprocess.run([sys.executable, "-m", "tfe_estimator.tools.cli", "attack", "--network",
                           cluster.network_file, "--read-file", secret],
                          capture_output=True, text=True, timeout=300, check=False)


def _stop(cluster, workdir, others):
    """Stops a cluster of tasks that serve until ./stop exists, the chief first (in-graph, a worker that ends
    while the chief runs is a failure)."""
    open(os.path.join(workdir, "chief-0", "stop"), "w").close()
    chief = next(t for t in cluster.launcher.tasks if t.job == "chief")
    deadline = time.monotonic() + 60
    while chief.process is not None and chief.process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    for task in others:
        open(os.path.join(workdir, task, "stop"), "w").close()


def _attack(workdir, tls):
    """Launches serving stand-ins for every task, runs `tfe-estimator attack`, stops the cluster."""
    secret = _write_secret(workdir)
    cluster = _Background(workdir, [sys.executable, SERVING_OWNER], tls, workers=1, evaluator=True)
    try:
        network = cluster.network()
        cluster.wait_serving(network)
        attack = _run_attack(cluster, secret)
    finally:
        _stop(cluster, workdir, ("worker-0", "evaluator-0"))
    assert cluster.join() == 0, cluster.out.getvalue()[-3000:]
    return attack


def _train_capture_and_attack(workdir, tls, steps=60):
    """A 2-owner in-graph training run (the demo's cluster script) with every frame on the chief's link captured,
    then `tfe-estimator attack` against the same cluster, every task still serving: (weights, wire, attack).

    The owners run tests/scripts/train_then_serve.py (the demo's task, then serving until ./stop); the evaluator
    only serves. The capture stops when the chief has trained, before the attack sends anything.
    """
    _owner_data(workdir)
    secret = _write_secret(workdir)
    command = [sys.executable, TRAIN_THEN_SERVE, "--mode", "secure", "--model-dir", os.path.join(workdir, "model"),
               "--steps", str(steps), "--learning-rate", "0.1"]
    cluster = _Background(workdir, command, tls, workers=1, evaluator=True)
    try:
        network = cluster.network()
        frames, stop = os.path.join(workdir, "frames.bin"), os.path.join(workdir, "stop-capture")
        chief_link = next(t["hub_port"] for t in network["tasks"] if t["name"] == "chief-0")
        capture = subprocess.Popen(["ip", "netns", "exec", network["hub"], sys.executable, CAPTURE, chief_link,
                                    frames, stop], stdout=subprocess.PIPE, text=True)
        try:
            assert capture.stdout.readline().strip() == "capturing"
            trained = os.path.join(workdir, "chief-0", "trained")
            while not os.path.exists(trained):
                assert cluster.thread.is_alive(), cluster.out.getvalue()[-5000:]
                time.sleep(0.2)
        finally:
            open(stop, "w").close()
            capture.wait(timeout=30)
        with open(trained, encoding="utf-8") as f:
            assert f.read() == "0", cluster.out.getvalue()[-5000:]  # the chief's training returned 0
        cluster.wait_serving(network)  # every task (the chief too, its training done) still serves
        attack = _run_attack(cluster, secret)
    finally:
        _stop(cluster, workdir, ("evaluator-0",))  # the worker serves the chief's sessions: the launcher ends it
    assert cluster.join() == 0, cluster.out.getvalue()[-5000:]
    with open(frames, "rb") as f:
        wire = f.read()
    return _weights(os.path.join(workdir, "model")), wire, attack


@pytest.fixture(scope="module")
def tls_run(tmp_path_factory):
    """Training through `launch --isolate --tls`, then the attacks on that cluster: (weights, wire, attack)."""
    return _train_capture_and_attack(str(tmp_path_factory.mktemp("tls")), tls=True)


@pytest.fixture(scope="module")
def plain_run(tmp_path_factory):
    """The same with `--isolate` alone (plaintext gRPC on the bridge): the mutation of `tls_run`."""
    return _train_capture_and_attack(str(tmp_path_factory.mktemp("plain")), tls=False)


def test_training_through_tls_matches_and_the_wire_shows_no_plaintext_grpc(tls_run, plain_run):
    (secure, wire, _), (plain, plain_wire, _) = tls_run, plain_run
    np.testing.assert_allclose(secure, plain, atol=1e-6)  # TLS changes the transport, not the training
    np.testing.assert_allclose(secure, _true_weights(), atol=1.0)  # learned from both owners' files
    assert len(wire) > 20_000 and len(plain_wire) > 20_000  # the capture saw the training's traffic
    for marker in PLAINTEXT_MARKERS:
        assert marker not in wire, marker
        assert marker in plain_wire, marker  # mutation: without TLS the capture shows plaintext gRPC


def test_no_attack_gets_through_tls_isolation(tls_run):
    """On the cluster that has just trained through TLS (`tls_run`), every task still serving."""
    attack = tls_run[2]
    assert attack.returncode == 0, attack.stdout + attack.stderr[-3000:]
    lines = attack.stdout.splitlines()
    for kind in ("tcp", "grpc", "readfile", "no-cert", "foreign-ca"):
        assert any(f" {kind} " in line and ": refused" in line for line in lines), (kind, attack.stdout)
    # TensorFlow's port on every task's IPv6 link-local address too (TensorFlow listens on [::]).
    for kind in ("tcp", "grpc", "readfile"):
        ipv6 = [line for line in lines if f" {kind} [fe80:" in line]
        assert ipv6 and all(": refused" in line for line in ipv6), (kind, attack.stdout)
    assert sum("owner-to-server" in line and "accepted (as it must)" in line for line in lines) == 6
    # In-graph the chief's session runs ops on the worker: owners accept each other (the peer table).
    assert sum("owner-to-owner" in line and "accepted (as it must)" in line for line in lines) == 2
    assert "0 went the wrong way" in attack.stdout


def test_without_tls_the_same_attacks_get_through(plain_run):
    """Mutation: isolation alone (plaintext gRPC on the bridge, `plain_run`): the attack script must report it."""
    attack = plain_run[2]
    assert attack.returncode == 1, attack.stdout + attack.stderr[-3000:]
    assert f"readfile 10.213.0.2:7000: GOT THROUGH (read {len(SECRET)} bytes" in attack.stdout, attack.stdout
    assert "tcp 10.213.0.5:7003: GOT THROUGH" in attack.stdout  # a server's TF port
    assert re.search(rf"chief-0 readfile \[fe80:[0-9a-f:]+%eth0\]:7000: GOT THROUGH \(read {len(SECRET)} bytes",
                     attack.stdout), attack.stdout  # and on IPv6: the probe reaches TensorFlow there


def test_a_firewall_left_open_on_ipv6_is_caught(tmp_path, monkeypatch):
    """Mutation: --tls with the IPv4 firewall only (the reviewer's IPv6 way past it): the attack must report it."""
    monkeypatch.setattr(isolation, "FIREWALL_IPV6", "true")  # `true` accepts the rules and installs none
    attack = _attack(str(tmp_path), tls=True)
    assert attack.returncode == 1, attack.stdout + attack.stderr[-3000:]
    assert re.search(rf"chief-0 readfile \[fe80:[0-9a-f:]+%eth0\]:7000: GOT THROUGH \(read {len(SECRET)} bytes",
                     attack.stdout), attack.stdout
    assert re.search(r"tfe-0 tcp \[fe80:[0-9a-f:]+%eth0\]:7003: GOT THROUGH", attack.stdout), attack.stdout
    assert not re.search(r"readfile 10\.213\.0\.\d+:\d+: GOT THROUGH", attack.stdout)  # IPv4 still closed
