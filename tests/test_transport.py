"""Mutual TLS between tasks: certificates (`cluster.certs`) and the stunnel sidecar (`cluster.sidecar`).

The handshake tests run a real stunnel (Debian's ``stunnel4``, installed by
``scripts/system-deps.sh``) on loopback in front of a TCP echo server, and
connect with Python's ``ssl`` (OpenSSL) as the peer. Each refusal stands beside
its accepted twin: the same connection with the right certificate gets its echo.
"""
import datetime
import os
import shutil
import socket
import ssl
import subprocess
import threading
import time

import portpicker
import pytest
from cryptography import x509
from cryptography.x509.oid import NameOID

from tfe_estimator.cluster import certs, peers
from tfe_estimator.cluster.sidecar import stunnel_config
from tfe_estimator.cluster.spec import cluster_tasks

CLUSTER = "testnet"
TASKS = cluster_tasks(1, evaluator=True)  # chief 0, worker 0, evaluator 0, tfe 0-2
STUNNEL = shutil.which("stunnel4") or shutil.which("stunnel")


# ---------------------------------------------------------------- certificates

def test_a_task_certificate_carries_its_identity(tmp_path):
    paths = certs.make_cluster_certs(str(tmp_path), TASKS, CLUSTER, organisations={("worker", 0): "bank-b"})
    cert = x509.load_pem_x509_certificate(open(paths[("worker", 0)][0], "rb").read())
    assert cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value == "worker-0"
    assert cert.subject.get_attributes_for_oid(NameOID.ORGANIZATION_NAME)[0].value == "bank-b"
    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert san.get_values_for_type(x509.DNSName) == ["worker-0.testnet"]
    assert san.get_values_for_type(x509.UniformResourceIdentifier) == ["tfe://testnet/bank-b/worker/0"]
    assert oct(os.stat(paths[("worker", 0)][1]).st_mode & 0o777) == "0o600"
    assert oct(os.stat(tmp_path / certs.CA_KEY).st_mode & 0o777) == "0o600"


def test_an_organisation_keeps_its_key_and_sends_only_a_csr():
    ca_cert, ca_key = certs.make_ca(CLUSTER)
    key_pem, csr_pem = certs.make_key_and_csr("tfe", 1, "compute-co", CLUSTER)
    cert = x509.load_pem_x509_certificate(certs.sign_csr(csr_pem, ca_cert, ca_key, CLUSTER))
    assert b"PRIVATE KEY" not in csr_pem and b"PRIVATE KEY" in key_pem
    assert cert.issuer == x509.load_pem_x509_certificate(ca_cert).subject
    # A CSR for another cluster, or with a forged identity, is refused by the CA.
    with pytest.raises(ValueError, match="not task tfe-1 of cluster 'other'"):
        certs.sign_csr(csr_pem, ca_cert, ca_key, "other")


@pytest.mark.parametrize("call, message", [
    (lambda: certs.task_name("Worker", 0), "job='Worker' must be a DNS label"),
    (lambda: certs.task_name("worker", -1), "task index -1"),
    (lambda: certs.make_ca("bad_name"), "cluster='bad_name' must be a DNS label"),
    (lambda: certs.make_ca("ok", validity_days=0), "validity_days=0"),
])
def test_bad_input_is_refused_with_the_value(call, message):
    with pytest.raises(ValueError, match=message):
        call()


# ---------------------------------------------------------------- the rendered configuration

def _ports():
    return ({t: 7000 + i for i, t in enumerate(TASKS)},
            {t: f"{certs.task_dns_name(*t, CLUSTER)}:8443" for t in TASKS})


@pytest.mark.parametrize("mode", peers.CLUSTER_MODES)
def test_each_sidecar_accepts_and_calls_exactly_the_peer_table(mode):
    tf_ports, tls = _ports()
    for task in TASKS:
        text = stunnel_config(task, TASKS, mode, "/certs", CLUSTER, tf_ports, tls)
        sections = text.split("\n[")
        inbound = next((s for s in sections if s.startswith("in]")), "")
        allowed_in = {line.split("= ")[1] for line in inbound.splitlines() if line.startswith("checkHost")}
        want_in = {certs.task_dns_name(*t, CLUSTER) for t in TASKS
                   if t != task and t[0] in peers.allowed_callers(mode, task[0])}
        assert allowed_in == want_in, (task, text)
        assert ("requireCert = yes" in inbound) == bool(want_in)
        outbound = {s.split("]")[0][len("out-"):] for s in sections if s.startswith("out-")}
        assert outbound == {certs.task_name(*t) for t in TASKS
                            if t != task and t[0] in peers.allowed_callees(mode, task[0])}, (task, text)
        if want_in or outbound:  # (the evaluator neither accepts nor calls: no section at all)
            assert "sslVersionMin = TLSv1.3" in text and "verifyChain = yes" in text
    # The evaluator calls nobody: no task accepts it.
    chief = stunnel_config(("chief", 0), TASKS, mode, "/certs", CLUSTER, tf_ports, tls)
    assert "checkHost = evaluator-0.testnet" not in chief.split("[out-")[0]


# ---------------------------------------------------------------- real handshakes through stunnel

needs_stunnel = pytest.mark.skipif(STUNNEL is None, reason="stunnel is not installed (Debian package stunnel4; "
                                                           "scripts/system-deps.sh installs it as root)")


class _Echo(threading.Thread):
    """A loopback TCP server that echoes one message per connection (stands for TensorFlow's port)."""

    def __init__(self):
        super().__init__(daemon=True)
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(8)
        self.port = self.sock.getsockname()[1]

    def run(self):
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with conn:
                conn.settimeout(5)
                try:
                    conn.sendall(conn.recv(1024))
                except OSError:
                    pass


@pytest.fixture
def sidecar(tmp_path):
    """`start(task, mode)`: the task's stunnel [in] in front of an echo server; returns its TLS port."""
    procs, echoes = [], []
    certs.make_cluster_certs(str(tmp_path / "certs"), TASKS, CLUSTER)

    def start(task, mode):
        echo = _Echo()
        echo.start()
        echoes.append(echo)
        tls_port = portpicker.pick_unused_port()
        tf_ports = {t: echo.port if t == task else 7000 + i for i, t in enumerate(TASKS)}
        tls = {t: f"127.0.0.1:{tls_port if t == task else 9}" for t in TASKS}
        text = stunnel_config(task, TASKS, mode, str(tmp_path / "certs"), CLUSTER, tf_ports, tls)
        # Only the inbound side here: the outbound sections would bind the other tasks' TF ports.
        conf = tmp_path / f"{certs.task_name(*task)}.conf"
        conf.write_text(text.split("\n[out-")[0] + "\n")
        proc = subprocess.Popen([STUNNEL, str(conf)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        procs.append(proc)
        deadline = time.time() + 10
        while time.time() < deadline:
            with socket.socket() as probe:
                if probe.connect_ex(("127.0.0.1", tls_port)) == 0:
                    return tls_port
            assert proc.poll() is None, proc.stdout.read().decode()[-2000:]
            time.sleep(0.05)
        raise AssertionError("stunnel did not listen within 10 s")

    yield start
    for proc in procs:
        proc.terminate()
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=5)
    for echo in echoes:
        echo.sock.close()
    assert all(p.poll() is not None for p in procs)


def _client_context(cert_dir, task, ca_dir=None):
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.minimum_version = ssl.TLSVersion.TLSv1_3
    context.load_verify_locations(os.path.join(ca_dir or cert_dir, certs.CA_CERT))
    stem = os.path.join(cert_dir, certs.task_name(*task))
    context.load_cert_chain(stem + ".crt", stem + ".key")
    return context


def _echo_through(port, context, server_task):
    """True if a TLS connection as `context` gets its message echoed by the task behind the sidecar."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=5) as raw:
            with context.wrap_socket(raw, server_hostname=certs.task_dns_name(*server_task, CLUSTER)) as tls:
                tls.sendall(b"ping")
                return tls.recv(16) == b"ping"
    except (ssl.SSLError, OSError):
        return False


@needs_stunnel
@pytest.mark.multiprocess
def test_a_server_accepts_an_owner_and_refuses_the_other_cases(sidecar, tmp_path):
    server = ("tfe", 0)
    port = sidecar(server, peers.IN_GRAPH)
    good = str(tmp_path / "certs")
    # Accepted: an owner (chief 0) with a certificate of this cluster's CA.
    assert _echo_through(port, _client_context(good, ("chief", 0)), server)
    # Refused: a certificate from another CA (the client still trusts our CA, so only its own cert differs).
    certs.make_cluster_certs(str(tmp_path / "foreign"), TASKS, CLUSTER)
    assert not _echo_through(port, _client_context(str(tmp_path / "foreign"), ("chief", 0), ca_dir=good), server)
    # Refused: an expired certificate from the right CA.
    ca_cert = open(os.path.join(good, certs.CA_CERT), "rb").read()
    ca_key = open(os.path.join(good, certs.CA_KEY), "rb").read()
    key, csr = certs.make_key_and_csr("chief", 0, "chief-0", CLUSTER)
    old = datetime.datetime.now(datetime.timezone.utc) - datetime.timedelta(days=40)
    expired = tmp_path / "expired"
    expired.mkdir()
    (expired / "chief-0.crt").write_bytes(certs.sign_csr(csr, ca_cert, ca_key, CLUSTER, 30, not_before=old))
    (expired / "chief-0.key").write_bytes(key)
    assert not _echo_through(port, _client_context(str(expired), ("chief", 0), ca_dir=good), server)
    # Refused: plaintext to the TLS port.
    with socket.create_connection(("127.0.0.1", port), timeout=5) as raw:
        raw.sendall(b"ping\n")
        raw.settimeout(5)
        try:
            assert raw.recv(16) != b"ping\n"
        except OSError:
            pass


@needs_stunnel
@pytest.mark.multiprocess
def test_an_owner_refuses_the_evaluator_but_accepts_a_server(sidecar, tmp_path):
    owner = ("worker", 0)
    port = sidecar(owner, peers.IN_GRAPH)
    good = str(tmp_path / "certs")
    assert _echo_through(port, _client_context(good, ("tfe", 1)), owner)           # a server: allowed
    assert not _echo_through(port, _client_context(good, ("evaluator", 0)), owner)  # the evaluator: refused


@needs_stunnel
@pytest.mark.multiprocess
def test_in_graph_mode_lets_the_chief_reach_an_owner(sidecar, tmp_path):
    """The chief's certificate gets through to a worker: in-graph the chief runs ops on every task."""
    owner = ("worker", 0)
    port = sidecar(owner, peers.IN_GRAPH)
    assert _echo_through(port, _client_context(str(tmp_path / "certs"), ("chief", 0)), owner)
