"""The aggregation service's data plane (`service/data_plane.py`) against users and attackers, in process.

Servers and clients run in this process on loopback. An attacker here holds a
valid certificate of its own (an owner, or a non-owner task of the cluster) or
none, and speaks the data plane's frames by hand (`_Raw`, `frames`); each
property sits beside its mutation (the check disabled with monkeypatch: the
property's own check must then fail):
- sums: exact at rings 32, 64 and 128 with 2 and 3 owners over several steps, on the data plane (the servers
  count its calls); a replayed step is answered from the window and flagged; reused buffers change no answer;
- identity: TLS refuses no certificate, a foreign CA's certificate and plaintext (no reply frame at all), and
  past a broken TLS the federation check still refuses a foreign CA's certificate; a valid non-owner
  certificate may not Contribute, an owner may not ForwardBlinded, an owner's put lands as the owner its
  certificate names whatever the frame says;
- limits: a payload of the wrong size, above --max-elements or above the owner's memory budget is refused
  before a byte of it is read; --max-waiting-puts counts data-plane calls; one caller's connections are capped
  while another owner is served; a stalled TLS handshake is closed on time and blocks nobody; garbage after
  the handshake gets a refusal or a close, and the server goes on;
- lifecycle: a closed service leaves no data-plane thread and nothing listening on its data port.
Regressions of bugs found here (each fixed in e1eac16 or 6509134): a malformed head answered, a refusal before a
large payload read by its caller, a forward that timed out never sent again, a stopped server ending the
handshakes in progress, outsiders holding every handshake slot not stopping the owners.
"""
import datetime
import json
import os
import select
import shutil
import socket
import ssl
import threading
import time
import types

import grpc
import numpy as np
import portpicker
import pytest

from service_helpers import (CLUSTER, WAIT_SECS, Service, cert_dirs, credentials_of, in_threads,  # noqa: F401
                             make_service, owner_names, raw_call)
from federation_helpers import CLUSTER as FEDERATION_CLUSTER, make_federation
from tfe_estimator.cluster import certs
from tfe_estimator.identity import federation as federation_lib
from tfe_estimator.service import TlsFiles, budget as budget_module, data_plane, frames, ring, wire
from tfe_estimator.service import server as server_module
from tfe_estimator.service import tls as tls_module
from tfe_estimator.service.data_link import DataLink, LinkError
from tfe_estimator.service.native_link import make_link_factory
from tfe_estimator.service.tls import server_name, server_name_option

MESSAGES = wire.messages()
QUICK = 1.0  # how long a refusal may take (it is answered at once; a read payload would wait for bytes never sent)


def _detects(check, *args):
    """The planted leak makes `check` fail."""
    with pytest.raises((AssertionError, pytest.fail.Exception)):
        check(*args)


def _ports(service):
    """``(server0's data port, server1's)``."""
    server1, server0 = service.servers
    return server0._data_plane.port, server1._data_plane.port  # pylint: disable=protected-access


def _plane(service, server):
    return service.servers[1 - server]._data_plane  # pylint: disable=protected-access


# ------------------------------------------------------------ frames by hand --

def _hostname(server):
    return certs.task_dns_name("tfe", server, CLUSTER)


def _context(dirs, job, index, server):
    """A valid task's own client context (its certificate, pinned to tfe-<server>)."""
    return TlsFiles.from_dir(dirs[0], job, index).ssl_client_context(server)


def _our_ca(dirs):
    with open(os.path.join(dirs[0], certs.CA_CERT), "rb") as f:
        return f.read().decode("ascii")


def _no_certificate_context(dirs):
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.load_verify_locations(cadata=_our_ca(dirs))
    return context


def _foreign_context(dirs, job="chief", index=0):
    """`job-index`'s name from a foreign CA, trusting our CA (so only the server's check can stop it)."""
    context = _no_certificate_context(dirs)
    foreign = TlsFiles.from_dir(dirs[1], job, index)
    context.load_cert_chain(foreign.cert, foreign.key)
    return context


def _frame(method, channel="c", step=0, ring_bits=64, n=4, server=1, meta=(), payload=None, payload_len=None):
    """A request frame's bytes: header, head, meta, then `payload` (default: a right-sized one of zeros).
    `payload_len` (default: the payload's size) is what the header claims."""
    if payload is None:
        payload = bytes(ring.KEY_BYTES) if server == 0 and method == "Contribute" else \
            bytes(8 * ring.ring_words(n, ring_bits))
    request = MESSAGES[wire.method(method).request](channel=channel, step=step, ring_bits=ring_bits,
                                                    num_elements=n)
    head, meta = request.SerializeToString(), frames.encode_meta(meta)
    claimed = len(payload) if payload_len is None else payload_len
    return frames.request_header(method, len(head), len(meta), claimed) + head + meta + payload


class _Raw:
    """One connection to a data plane; `reply` is ``(code, replayed, text)``, ``"closed"`` (TLS refused it, or the
    server closed it without a reply) or ``"timeout"`` (no answer within the wait)."""

    def __init__(self, port, context=None, server=1, timeout=QUICK):
        self.sock = socket.create_connection(("localhost", port), timeout=timeout)
        self.handshake = None
        if context is not None:
            try:
                self.sock = context.wrap_socket(self.sock, server_hostname=_hostname(server))
            except (OSError, ssl.SSLError) as e:
                self.handshake = e  # refused during the handshake (TLS 1.2, or the server's alert came first)

    def send(self, data):
        try:
            self.sock.sendall(data)
        except (OSError, ssl.SSLError):
            pass  # the server closed it already: `reply` tells

    def reply(self, timeout=QUICK):
        if self.handshake is not None:
            return "closed"
        self.sock.settimeout(timeout)
        try:
            header = frames.read_exact(self.sock, frames.REPLY.size)
            if header is None:
                return "closed"
            code, replayed, length = frames.parse_reply(header)
            text = frames.read_exact(self.sock, length) if length else b""
        except socket.timeout:
            return "timeout"
        except (OSError, ssl.SSLError, ConnectionError):
            return "closed"
        return code, replayed, bytes(text or b"")

    def close(self):
        self.sock.close()


def _call(port, context, data, server=1, timeout=QUICK):
    """One frame on a fresh connection; its reply (`_Raw.reply`)."""
    raw = _Raw(port, context, server)
    try:
        raw.send(data)
        return raw.reply(timeout)
    finally:
        raw.close()


def _refused(reply, code):
    assert isinstance(reply, tuple), f"no reply frame: {reply}"
    assert reply[0] == code, (reply[0], reply[2][:500])
    return reply[2].decode("utf-8")


# ------------------------------------------------------------ sums --

@pytest.fixture
def plane_calls(monkeypatch):
    """Every call the servers' data planes served: ``(role, identity, method)``."""
    calls, real = [], server_module.AggregationServer._data_call  # pylint: disable=protected-access

    def counted(self, identity, name, *args):
        calls.append((self._role, identity, name))  # pylint: disable=protected-access
        return real(self, identity, name, *args)

    monkeypatch.setattr(server_module.AggregationServer, "_data_call", counted)
    return calls


def _masked(x, ring_bits):
    """``(share, key)`` of ring words `x` (NumPy: share = x - AES(key) in the ring)."""
    key = np.frombuffer(os.urandom(16), np.int32)
    share = x.copy()
    ring.sub_into(share.view(np.uint64), ring.keystream_words(key, x.size), ring_bits)
    return share, key


def _revealed(result, ring_bits):
    blind, w = result
    total = w.copy().view(np.uint64)
    return ring.add_into(total, ring.keystream_words(blind, w.size), ring_bits)


@pytest.mark.parametrize("num_owners", [2, 3])
@pytest.mark.parametrize("ring_bits", [32, 64, 128])
def test_sums_on_the_data_plane_are_exact_over_steps_and_a_replay_is_answered_from_the_window(
        make_service, plane_calls, ring_bits, num_owners):
    service = make_service(owner_names(num_owners), data_plane=True)
    clients = service.clients_of(num_owners)
    rng = np.random.default_rng(ring_bits + num_owners)
    n, steps = 37, 4
    words = ring.ring_words(n, ring_bits)
    first = {}
    for step in range(steps):
        xs = [rng.integers(-2**62, 2**62, words, dtype=np.int64) for _ in clients]
        masked = [_masked(x, ring_bits) for x in xs]
        results = in_threads([lambda c=c, m=m, s=step: c.contribute("grads", s, ring_bits, n, m[1], m[0])
                              for c, m in zip(clients, masked)])
        assert all(isinstance(r, tuple) for r in results), results
        expected = xs[0].copy().view(np.uint64)
        for x in xs[1:]:
            ring.add_into(expected, x, ring_bits)
        for result in results:
            np.testing.assert_array_equal(_revealed(result, ring_bits), expected)
            np.testing.assert_array_equal(result[1], results[0][1])  # one answer for every owner
        first[step] = [(b.copy(), w.copy()) for b, w in results]
    # Every put went on the data plane: each owner's link to both servers, its Contribute on each, server0's
    # forward on server1's data plane.
    assert all(c._links[0].link is not None and c._links[1].link is not None for c in clients)  # pylint: disable=W0212
    for role in (0, 1):
        for owner in owner_names(num_owners):
            assert plane_calls.count((role, owner, "Contribute")) == steps, plane_calls
    assert plane_calls.count((1, "tfe:0", "ForwardBlinded")) == steps, plane_calls
    # The chief, restored from an earlier checkpoint, puts step 1 again with other values: the stored answer
    # (after three later steps whose buffers reused the same memory), flagged as a replay on both servers.
    share, key = _masked(np.zeros(words, np.int64), ring_bits)
    again = clients[0].contribute("grads", 1, ring_bits, n, key, share)
    np.testing.assert_array_equal(again[0], first[1][0][0])
    np.testing.assert_array_equal(again[1], first[1][0][1])
    assert clients[0].answers["grads"] == [steps, 1]
    assert [c.answers["grads"] for c in clients[1:]] == [[steps, 0]] * (num_owners - 1)
    server1, server0 = service.servers
    assert server1._pool.held > 0 and server0._pool.held > 0  # buffers kept for reuse  # pylint: disable=W0212


@pytest.mark.parametrize("ring_bits,n", [(32, 4), (64, 2), (128, 1)])
def test_a_share_the_size_of_a_key_is_summed_exactly(make_service, plane_calls, ring_bits, n):
    """Two ring words: server0 reads the 16-byte key into a pooled buffer of the sum's size (reused after)."""
    service = make_service(owner_names(2), data_plane=True)
    clients = service.clients_of(2)
    rng = np.random.default_rng(n)
    for step in range(3):
        xs = [rng.integers(-2**62, 2**62, 2, dtype=np.int64) for _ in clients]
        masked = [_masked(x, ring_bits) for x in xs]
        results = in_threads([lambda c=c, m=m, s=step: c.contribute("k", s, ring_bits, n, m[1], m[0])
                              for c, m in zip(clients, masked)])
        expected = ring.add_into(xs[0].copy().view(np.uint64), xs[1], ring_bits)
        for result in results:
            np.testing.assert_array_equal(_revealed(result, ring_bits), expected)
    assert len(plane_calls) == 3 * (2 + 2 + 1), plane_calls


# ------------------------------------------------------------ identity and TLS --

def _probe(server=1):
    """A call any accepted connection is answered at once (INVALID_ARGUMENT: ring 48), payload included."""
    return _frame("Contribute", ring_bits=48, n=4, server=server, payload=bytes(32))


def check_tls_refuses_callers_without_a_certificate_of_ours(make_service, dirs):
    """No certificate, a foreign CA's certificate, plaintext: the connection is closed, no reply frame."""
    service = make_service(owner_names(2), data_plane=True)
    for server, port in enumerate(_ports(service)):
        for what, context in (("no certificate", _no_certificate_context(dirs)),
                              ("a foreign CA", _foreign_context(dirs))):
            reply = _call(port, context, _probe(server), server)
            assert reply == "closed", f"{what} on server{server}'s data plane: {reply}"
        raw = _Raw(port, None)  # plaintext: a request frame without TLS
        raw.send(_probe(server))
        try:
            got = raw.sock.recv(1 << 16)
        except OSError:
            got = b""
        raw.close()
        assert not got.startswith(b"TFR1"), f"plaintext on server{server}'s data plane was answered: {got!r}"
        # The same frame from an owner's own certificate is answered: the service is up.
        assert _refused(_call(port, _context(dirs, "chief", 0, server), _probe(server), server),
                        grpc.StatusCode.INVALID_ARGUMENT)


def test_tls_refuses_callers_without_a_certificate_of_ours(make_service, cert_dirs):
    check_tls_refuses_callers_without_a_certificate_of_ours(make_service, cert_dirs)


def _server_context_that(monkeypatch, change):
    real = TlsFiles.ssl_server_context

    def changed(self):
        context = real(self)
        change(context)
        return context

    monkeypatch.setattr(TlsFiles, "ssl_server_context", changed)


def test_mutation_a_data_plane_without_client_certificates_is_detected(make_service, cert_dirs, monkeypatch):
    _server_context_that(monkeypatch, lambda context: setattr(context, "verify_mode", ssl.CERT_OPTIONAL))
    _detects(check_tls_refuses_callers_without_a_certificate_of_ours, make_service, cert_dirs)


def test_mutation_a_data_plane_trusting_a_foreign_ca_is_detected(make_service, cert_dirs, monkeypatch):
    _trusting_the_foreign_ca(monkeypatch, cert_dirs)
    _detects(check_tls_refuses_callers_without_a_certificate_of_ours, make_service, cert_dirs)


def _trusting_the_foreign_ca(monkeypatch, dirs):
    """TLS broken: the data plane's context also trusts the foreign CA (only the federation check is left)."""
    with open(os.path.join(dirs[1], certs.CA_CERT), "rb") as f:
        foreign_ca = f.read().decode("ascii")
    _server_context_that(monkeypatch, lambda context: context.load_verify_locations(cadata=foreign_ca))


def check_tls12_takes_only_forward_secret_aead_suites(make_service, dirs):
    """An owner's own certificate offering TLS 1.2 with AES-CBC only is refused in the handshake (the gRPC port
    takes AES-GCM only); the same owner offering AES-GCM is answered."""
    service = make_service(owner_names(2), data_plane=True)
    for server, port in enumerate(_ports(service)):
        for suites, answered in (("ECDHE-ECDSA-AES128-SHA256:ECDHE-ECDSA-AES256-SHA384:ECDHE-ECDSA-AES128-SHA", False),
                                 ("ECDHE-ECDSA-AES128-GCM-SHA256", True)):
            context = _context(dirs, "chief", 0, server)
            context.maximum_version = ssl.TLSVersion.TLSv1_2
            context.set_ciphers(suites)
            reply = _call(port, context, _probe(server), server)
            if answered:
                _refused(reply, grpc.StatusCode.INVALID_ARGUMENT)  # past TLS: the probe's own refusal
            else:
                assert reply == "closed", f"TLS 1.2 with {suites} on server{server}'s data plane: {reply}"


def test_tls12_takes_only_forward_secret_aead_suites(make_service, cert_dirs):
    check_tls12_takes_only_forward_secret_aead_suites(make_service, cert_dirs)


def test_mutation_a_data_plane_taking_cbc_suites_is_detected(make_service, cert_dirs, monkeypatch):
    _server_context_that(monkeypatch, lambda context: context.set_ciphers("DEFAULT"))
    _detects(check_tls12_takes_only_forward_secret_aead_suites, make_service, cert_dirs)


def check_a_foreign_certificate_past_tls_is_refused_by_the_federation_check(make_service, dirs, monkeypatch):
    """Defence in depth: were TLS to let a foreign CA's chief-0 through, `tls.ssl_peer` still refuses it
    (UNAUTHENTICATED: not issued by the CA of chief:0's organisation), before any call is read."""
    _trusting_the_foreign_ca(monkeypatch, dirs)
    service = make_service(owner_names(2), data_plane=True)
    for server, port in enumerate(_ports(service)):
        text = _refused(_call(port, _foreign_context(dirs), _probe(server), server), grpc.StatusCode.UNAUTHENTICATED)
        assert "the certificate of chief:0 was issued by 'CN=tfe-estimator CA evil'" in text, text


def test_a_foreign_certificate_past_tls_is_refused_by_the_federation_check(make_service, cert_dirs, monkeypatch):
    check_a_foreign_certificate_past_tls_is_refused_by_the_federation_check(make_service, cert_dirs, monkeypatch)


def test_mutation_the_federation_check_skipped_on_the_data_plane_is_detected(make_service, cert_dirs, monkeypatch):
    monkeypatch.setattr(tls_module.SslPeer, "problem", lambda self, now=None: None)
    _detects(check_a_foreign_certificate_past_tls_is_refused_by_the_federation_check, make_service, cert_dirs,
             monkeypatch)


# Organisations each with its own CA (the deployment page's flow): a CA of the federation signs only its own
# organisation's parties.

@pytest.fixture(scope="module")
def federation(tmp_path_factory):
    """``(root, server1)``: the federation's parties' directories and a server1 with a data plane."""
    root = tmp_path_factory.mktemp("federation")
    make_federation(root, {"tfe:0": ("localhost", portpicker.pick_unused_port()),
                           "tfe:1": ("localhost", portpicker.pick_unused_port())})
    tls = TlsFiles.from_dir(str(root / "operator-y" / "tfe-1"), "tfe", 1)
    server1 = server_module.AggregationServer(1, "localhost:0", ["chief:0", "worker:0"], tls, step_timeout_secs=5.0,
                                              data_address="localhost:0")
    server1.start()
    yield root, server1
    server1.stop(0)


def _federation_context(root, org, identity_dir, ca_org=None):
    """`identity_dir`'s client context pinned to operator-y's tfe-1; with `ca_org`, worker:0's name signed by
    that organisation's CA (a minting insider: its CA is one the federation trusts)."""
    job, index = identity_dir.split("-")
    own = TlsFiles.from_dir(str(root / org / identity_dir), job, int(index))
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.load_verify_locations(cadata=own.trust().server_ca_pem(1).decode("ascii"))
    if ca_org is None:
        context.load_cert_chain(own.cert, own.key)
        return context
    ca = root / ca_org / "ca"
    key, csr = certs.make_key_and_csr("worker", 0, ca_org, FEDERATION_CLUSTER)
    cert = certs.sign_csr(csr, (ca / "ca.crt").read_bytes(), (ca / "ca.key").read_bytes(), FEDERATION_CLUSTER)
    forged = root / f"forged-by-{ca_org}"
    forged.mkdir(exist_ok=True)
    (forged / "worker-0.crt").write_bytes(cert)
    (forged / "worker-0.key").write_bytes(key)
    context.load_cert_chain(str(forged / "worker-0.crt"), str(forged / "worker-0.key"))
    return context


def check_a_party_minted_by_another_organisation_is_refused(root, server1):
    port = server1._data_plane.port  # pylint: disable=protected-access
    name = certs.task_dns_name("tfe", 1, FEDERATION_CLUSTER)
    for ca_org in ("hospital-a", "operator-x"):
        raw = _Raw(port, None)
        raw.sock = _federation_context(root, "hospital-b", "worker-0", ca_org).wrap_socket(raw.sock,
                                                                                         server_hostname=name)
        raw.send(_probe())
        text = _refused(raw.reply(), grpc.StatusCode.UNAUTHENTICATED)
        raw.close()
        assert "not by the CA of worker:0's organisation 'Hospital B'" in text, (ca_org, text)
    # The honest worker:0 is served (ring 48 is refused by the handler's checks).
    raw = _Raw(port, None)
    raw.sock = _federation_context(root, "hospital-b", "worker-0").wrap_socket(raw.sock, server_hostname=name)
    raw.send(_probe())
    assert "Contribute of worker:0" in _refused(raw.reply(), grpc.StatusCode.INVALID_ARGUMENT)
    raw.close()


def test_a_party_minted_by_another_organisation_is_refused(federation):
    check_a_party_minted_by_another_organisation_is_refused(*federation)


def test_mutation_no_per_organisation_check_on_the_data_plane_is_detected(federation, monkeypatch):
    monkeypatch.setattr(federation_lib.Federation, "check_peer", lambda self, identity, leaf, now=None: None)
    _detects(check_a_party_minted_by_another_organisation_is_refused, *federation)


class _PlainConnection:
    """A raw socket read like a finished TLS connection (the leak below serves it as the chief)."""

    def __init__(self, raw):
        self._raw = raw

    def do_handshake(self):
        pass

    def pending(self):
        return 0

    def __getattr__(self, name):
        return getattr(self._raw, name)


class _TlsOrPlaintext:
    """The leak: a data plane that serves plaintext too (a stream not starting with a TLS record)."""

    def __init__(self, context):
        self._context = context

    def wrap_socket(self, raw, server_side, **kwargs):
        select.select([raw], [], [], QUICK)  # its first byte
        if raw.recv(1, socket.MSG_PEEK) == b"\x16":  # a TLS handshake record
            return self._context.wrap_socket(raw, server_side=server_side, **kwargs)
        return _PlainConnection(raw)


def test_mutation_a_data_plane_serving_plaintext_too_is_detected(make_service, cert_dirs, monkeypatch):
    real_context, real_peer = data_plane.DataPlane._ssl_context, data_plane.ssl_peer  # pylint: disable=W0212
    monkeypatch.setattr(data_plane.DataPlane, "_ssl_context", lambda self: _TlsOrPlaintext(real_context(self)))
    monkeypatch.setattr(data_plane, "ssl_peer", lambda tls, conn: _Fixed(tls, "chief:0", None)
                        if isinstance(conn, _PlainConnection) else real_peer(tls, conn))
    _detects(check_tls_refuses_callers_without_a_certificate_of_ours, make_service, cert_dirs)


def check_valid_non_owners_may_not_contribute_and_owners_may_not_forward(make_service, dirs):
    service = make_service(owner_names(2), step_timeout_secs=1.0, data_plane=True)
    for server, port in reversed(list(enumerate(_ports(service)))):  # server1 first: the forward's target
        for job, index in (("tfe", 2), ("evaluator", 0), ("tfe", 0)):
            text = _refused(_call(port, _context(dirs, job, index, server), _frame("Contribute", server=server),
                                  server), grpc.StatusCode.PERMISSION_DENIED)
            assert f"{job}:{index} may not call Contribute on aggregation server{server}" in text, text
        for job, index in (("chief", 0), ("worker", 0), ("tfe", 2)):
            text = _refused(_call(port, _context(dirs, job, index, server), _frame("ForwardBlinded"), server),
                            grpc.StatusCode.PERMISSION_DENIED)
            assert f"{job}:{index} may not call ForwardBlinded on aggregation server{server}" in text, text
    # server0 serves no ForwardBlinded, even to itself.
    _refused(_call(_ports(service)[0], _context(dirs, "tfe", 0, 0), _frame("ForwardBlinded"), 0),
             grpc.StatusCode.UNIMPLEMENTED)


def test_valid_non_owners_may_not_contribute_and_owners_may_not_forward(make_service, cert_dirs):
    check_valid_non_owners_may_not_contribute_and_owners_may_not_forward(make_service, cert_dirs)


def test_mutation_admission_skipped_on_the_data_plane_is_detected(make_service, cert_dirs, monkeypatch):
    monkeypatch.setattr(server_module.AggregationServer, "_admit", lambda self, method, identity: None)
    _detects(check_valid_non_owners_may_not_contribute_and_owners_may_not_forward, make_service, cert_dirs)


def test_mutation_owners_allowed_to_forward_on_the_data_plane_is_detected(make_service, cert_dirs, monkeypatch):
    real = server_module.AggregationServer._callers  # pylint: disable=protected-access
    monkeypatch.setattr(server_module.AggregationServer, "_callers", lambda self, method: list(self._owners) + [
        "tfe:0"] if method.name == "ForwardBlinded" else real(self, method))  # pylint: disable=protected-access
    _detects(check_valid_non_owners_may_not_contribute_and_owners_may_not_forward, make_service, cert_dirs)


def test_mutation_identity_fixed_to_an_owner_on_the_data_plane_is_detected(make_service, cert_dirs, monkeypatch):
    monkeypatch.setattr(data_plane, "ssl_peer", lambda tls, conn: _Fixed(tls, "chief:0", None))
    _detects(check_valid_non_owners_may_not_contribute_and_owners_may_not_forward, make_service, cert_dirs)


class _Fixed(tls_module.SslPeer):
    """The leak: the caller is chief:0, whatever its certificate says."""

    def problem(self, now=None):
        return None


def check_an_owner_puts_only_as_itself(make_service, dirs):
    """chief:0 puts twice on server0's data plane, the second time claiming worker:0 in every way a frame could
    (its metadata, the channel's name): ALREADY_EXISTS, and worker:0's slot still waits (the first put is
    aborted naming it)."""
    service = make_service(owner_names(2), step_timeout_secs=1.0, data_plane=True)
    port = _ports(service)[0]
    chief = _context(dirs, "chief", 0, 0)
    claim = (("x-tfe-owner", "worker:0"), ("identity", "worker:0"))
    first = lambda: _call(port, chief, _frame("Contribute", channel="worker:0", server=0), 0, 5.0)  # noqa: E731
    second = lambda: (time.sleep(0.3), _call(port, chief, _frame("Contribute", channel="worker:0", server=0,  # noqa
                                                                  meta=claim), 0, 5.0))[1]
    results = in_threads([first, second])
    text = _refused(results[1], grpc.StatusCode.ALREADY_EXISTS)
    assert "chief:0 already contributed to step 0" in text, text
    text = _refused(results[0], grpc.StatusCode.ABORTED)  # the step completed without worker:0? no: aborted
    assert "missing worker:0 (no contribution yet)" in text, text


def test_an_owner_puts_only_as_itself(make_service, cert_dirs):
    check_an_owner_puts_only_as_itself(make_service, cert_dirs)


def test_mutation_identity_from_the_frame_is_detected(make_service, cert_dirs, monkeypatch):
    real = server_module.AggregationServer._data_call  # pylint: disable=protected-access

    def from_frame(self, identity, name, request, metadata, *args):
        return real(self, dict(metadata).get("x-tfe-owner", identity), name, request, metadata, *args)

    monkeypatch.setattr(server_module.AggregationServer, "_data_call", from_frame)
    _detects(check_an_owner_puts_only_as_itself, make_service, cert_dirs)


# ------------------------------------------------------------ limits --

def _changed(make_service, change):
    """`make_service` whose services get `change(service)` once started (a check disabled on a live server)."""
    def make(*args, **kwargs):
        service = make_service(*args, **kwargs)
        change(service)
        return service
    return make


def _header_only(raw, frame, payload_bytes):
    """Sends `frame` without its last `payload_bytes` (the payload a refused call must never wait for)."""
    raw.send(frame[:len(frame) - payload_bytes])


def check_a_payload_of_the_wrong_size_is_refused_unread(make_service, dirs):
    service = make_service(owner_names(2), data_plane=True)
    for server, port in enumerate(_ports(service)):
        right = ring.KEY_BYTES if server == 0 else 32
        raw = _Raw(port, _context(dirs, "chief", 0, server), server)
        _header_only(raw, _frame("Contribute", n=4, server=server, payload=bytes(right + 8)), right + 8)
        text = _refused(raw.reply(), grpc.StatusCode.INVALID_ARGUMENT)
        assert f"payload has {right + 8} bytes, expected {right}" in text, text
        if server == 1:
            assert raw.reply(timeout=3.0) == "closed"  # the stream is out of step: closed (after a drain)
        raw.close()


def test_a_payload_of_the_wrong_size_is_refused_unread(make_service, cert_dirs):
    check_a_payload_of_the_wrong_size_is_refused_unread(make_service, cert_dirs)


def test_mutation_payload_size_unchecked_is_detected(make_service, cert_dirs, monkeypatch):
    real = server_module.AggregationServer._check_request  # pylint: disable=protected-access

    def size_unchecked(self, request, nbytes, what):
        words = ring.ring_words(request.num_elements, request.ring_bits)
        right = ring.KEY_BYTES if what.startswith("Contribute") and self._role == 0 else 8 * words  # noqa
        return real(self, request, right, what)

    monkeypatch.setattr(server_module.AggregationServer, "_check_request", size_unchecked)
    _detects(check_a_payload_of_the_wrong_size_is_refused_unread, make_service, cert_dirs)


def check_a_put_above_max_elements_is_refused_unread(make_service, dirs):
    service = make_service(owner_names(2), data_plane=True, max_elements=1000)
    port = _ports(service)[1]
    raw = _Raw(port, _context(dirs, "chief", 0, 1))
    _header_only(raw, _frame("Contribute", n=1001), 8 * 1001)
    text = _refused(raw.reply(), grpc.StatusCode.RESOURCE_EXHAUSTED)
    assert "num_elements=1001 is above this server's max_elements=1000 (--max-elements)" in text, text
    raw.close()


def test_a_put_above_max_elements_is_refused_unread(make_service, cert_dirs):
    check_a_put_above_max_elements_is_refused_unread(make_service, cert_dirs)


def test_mutation_max_elements_unchecked_is_detected(make_service, cert_dirs):
    def unlimited(service):
        for server in service.servers:
            server._max_elements = 2**27  # pylint: disable=protected-access

    _detects(check_a_put_above_max_elements_is_refused_unread, _changed(make_service, unlimited), cert_dirs)


def check_the_owner_budget_refuses_a_put_before_reading_it(make_service, dirs):
    service = make_service(owner_names(2), data_plane=True, owner_memory_budget_bytes=1 << 20)
    n = 1 << 18  # 2 MiB of ring words at ring 64
    raw = _Raw(_ports(service)[1], _context(dirs, "chief", 0, 1))
    _header_only(raw, _frame("Contribute", n=n), 8 * n)
    text = _refused(raw.reply(), grpc.StatusCode.RESOURCE_EXHAUSTED)
    assert "per-owner memory budget" in text and "--owner-memory-budget-bytes=1048576" in text, text
    raw.close()


def test_the_owner_budget_refuses_a_put_before_reading_it(make_service, cert_dirs):
    check_the_owner_budget_refuses_a_put_before_reading_it(make_service, cert_dirs)


def test_mutation_without_the_budget_a_put_is_read_is_detected(make_service, cert_dirs, monkeypatch):
    monkeypatch.setattr(budget_module.MemoryBudget, "reserve", lambda self, owner, nbytes, what, reclaim=True: None)
    _detects(check_the_owner_budget_refuses_a_put_before_reading_it, make_service, cert_dirs)


def _wait_until(condition, secs=5.0):
    deadline = time.monotonic() + secs
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.02)
    return condition()


def check_max_waiting_puts_counts_data_plane_calls(make_service, dirs):
    """chief:0 keeps 8 puts waiting on server1's data plane (the default --max-waiting-puts); its 9th is refused."""
    service = make_service(owner_names(2), step_timeout_secs=5.0, data_plane=True)
    server1 = service.servers[0]
    port, context = _ports(service)[1], _context(dirs, "chief", 0, 1)
    waiting = [_Raw(port, context) for _ in range(8)]
    try:
        for k, raw in enumerate(waiting):
            raw.send(_frame("Contribute", channel=f"wait-{k}"))
        assert _wait_until(lambda: server1._waiting.get("chief:0") == 8)  # pylint: disable=protected-access
        text = _refused(_call(port, context, _frame("Contribute", channel="ninth")), grpc.StatusCode.RESOURCE_EXHAUSTED)
        assert "chief:0 already has 8 calls waiting on aggregation server1 (--max-waiting-puts=8)" in text, text
    finally:
        for raw in waiting:
            raw.close()


def test_max_waiting_puts_counts_data_plane_calls(make_service, cert_dirs):
    check_max_waiting_puts_counts_data_plane_calls(make_service, cert_dirs)


def test_mutation_unbounded_waiting_calls_on_the_data_plane_is_detected(make_service, cert_dirs):
    def unbounded(service):
        for server in service.servers:
            server._max_waiting = 1000  # pylint: disable=protected-access

    _detects(check_max_waiting_puts_counts_data_plane_calls, _changed(make_service, unbounded), cert_dirs)


def check_one_callers_connections_are_capped_and_another_owner_is_served(make_service, dirs):
    service = make_service(owner_names(2), data_plane=True)
    plane, port = _plane(service, 1), _ports(service)[1]
    chief = _context(dirs, "chief", 0, 1)
    held = [_Raw(port, chief) for _ in range(9)]  # max_waiting_puts + 1, idle
    try:
        assert _wait_until(lambda: plane._callers.get("chief:0") == 9)  # pylint: disable=protected-access
        extra = _Raw(port, chief)
        text = _refused(extra.reply(), grpc.StatusCode.RESOURCE_EXHAUSTED)  # told at once, then closed
        extra.close()
        assert "chief:0 already holds 9 data-plane connections to aggregation server1" in text, text
        # worker:0 is served meanwhile (its call reaches the handler: ring 48 is refused by the checks).
        text = _refused(_call(port, _context(dirs, "worker", 0, 1), _probe()), grpc.StatusCode.INVALID_ARGUMENT)
        assert "Contribute of worker:0" in text, text
    finally:
        for raw in held:
            raw.close()
    assert _wait_until(lambda: not plane._callers.get("chief:0"))  # closed connections are counted out  # noqa


def test_one_callers_connections_are_capped_and_another_owner_is_served(make_service, cert_dirs):
    check_one_callers_connections_are_capped_and_another_owner_is_served(make_service, cert_dirs)


def test_mutation_uncapped_connections_are_detected(make_service, cert_dirs):
    def uncapped(service):
        _plane(service, 1)._max_connections = 10**6  # pylint: disable=protected-access

    _detects(check_one_callers_connections_are_capped_and_another_owner_is_served, _changed(make_service, uncapped),
             cert_dirs)


HANDSHAKE_SECS = 1.0


def check_a_stalled_handshake_is_closed_on_time_and_blocks_nobody(make_service, dirs):
    service = make_service(owner_names(2), data_plane=True)
    plane, port = _plane(service, 1), _ports(service)[1]
    plane._handshake_timeout = HANDSHAKE_SECS  # pylint: disable=protected-access
    stalled = _Raw(port, None)
    stalled.send(b"\x16\x03\x01")  # the start of a TLS record, then nothing
    start = time.monotonic()
    time.sleep(0.1)
    # An owner is served while the stalled connection waits.
    text = _refused(_call(port, _context(dirs, "chief", 0, 1), _probe()), grpc.StatusCode.INVALID_ARGUMENT)
    assert "Contribute of chief:0" in text
    assert time.monotonic() - start < HANDSHAKE_SECS - 0.4, "the owner waited for the stalled handshake"
    stalled.sock.settimeout(HANDSHAKE_SECS + 1.0)
    try:
        got = stalled.sock.recv(1 << 16)
    except socket.timeout:
        got = None
    except OSError:
        got = b""
    took = time.monotonic() - start
    stalled.close()
    assert got == b"" and took < HANDSHAKE_SECS + 0.9, f"the stalled connection got {got!r} after {took:.1f} s"


def test_a_stalled_handshake_is_closed_on_time_and_blocks_nobody(make_service, cert_dirs):
    check_a_stalled_handshake_is_closed_on_time_and_blocks_nobody(make_service, cert_dirs)


def test_mutation_no_handshake_timeout_is_detected(make_service, cert_dirs, monkeypatch):
    monkeypatch.setattr(data_plane.DataPlane, "_handshake_timeout", property(
        lambda self: 1e6, lambda self, value: None), raising=False)  # whatever it is set to
    _detects(check_a_stalled_handshake_is_closed_on_time_and_blocks_nobody, make_service, cert_dirs)


def check_a_frame_that_stops_coming_is_closed_after_the_frame_timeout(make_service, dirs):
    """chief:0 starts a request and sends no more: its connection is closed after --step-timeout-secs (the
    data plane's frame timeout) and counted out; its other calls go on."""
    service = make_service(owner_names(2), step_timeout_secs=1.0, data_plane=True)
    plane, port, chief = _plane(service, 1), _ports(service)[1], _context(dirs, "chief", 0, 1)
    stalled = _Raw(port, chief)
    stalled.send(_frame("Contribute")[:frames.REQUEST.size + 3])  # the header and 3 bytes of its head
    start = time.monotonic()
    assert _refused(_call(port, chief, _probe()), grpc.StatusCode.INVALID_ARGUMENT)  # served meanwhile
    reply = stalled.reply(timeout=2.0)
    took = time.monotonic() - start
    stalled.close()
    assert reply == "closed" and took < 1.8, f"the stalled frame got {reply} after {took:.1f} s"
    assert _wait_until(lambda: not plane._callers.get("chief:0"), 1.0)  # pylint: disable=protected-access


def test_a_frame_that_stops_coming_is_closed_after_the_frame_timeout(make_service, cert_dirs):
    check_a_frame_that_stops_coming_is_closed_after_the_frame_timeout(make_service, cert_dirs)


def test_mutation_no_frame_timeout_is_detected(make_service, cert_dirs, monkeypatch):
    monkeypatch.setattr(data_plane.DataPlane, "_frame_timeout", property(
        lambda self: None, lambda self, value: None), raising=False)
    _detects(check_a_frame_that_stops_coming_is_closed_after_the_frame_timeout, make_service, cert_dirs)


class _InlineThread(threading.Thread):
    """Part of the leak below: each connection's thread run in the accept loop itself."""

    def start(self):
        if self.name == "tfe-data":
            self.run()
        else:
            super().start()


class _BlockingHandshakes:
    """The other part: the TLS handshake done at once, blocking, by whoever wraps the socket."""

    def __init__(self, context):
        self._context = context

    def wrap_socket(self, raw, server_side, **kwargs):
        del kwargs
        raw.setblocking(True)
        raw.settimeout(HANDSHAKE_SECS)
        conn = self._context.wrap_socket(raw, server_side=server_side)
        return conn


def test_mutation_handshakes_blocking_the_accept_loop_are_detected(make_service, cert_dirs, monkeypatch):
    monkeypatch.setattr(data_plane, "threading", types.SimpleNamespace(
        Thread=_InlineThread, Lock=threading.Lock, Event=threading.Event))
    real_context = data_plane.DataPlane._ssl_context  # pylint: disable=protected-access
    monkeypatch.setattr(data_plane.DataPlane, "_ssl_context", lambda self: _BlockingHandshakes(real_context(self)))
    _detects(check_a_stalled_handshake_is_closed_on_time_and_blocks_nobody, make_service, cert_dirs)


def test_outsiders_holding_every_handshake_slot_do_not_stop_the_owners(make_service):
    service = make_service(owner_names(2), data_plane=True)
    held = [socket.create_connection(("127.0.0.1", port)) for port in _ports(service)
            for _ in range(_plane(service, 0)._max_handshakes)]  # pylint: disable=protected-access
    try:
        time.sleep(0.3)  # the servers accepted them
        clients = [service.client(job, 0, retry_secs=3.0) for job in ("chief", "worker")]
        x = np.arange(8, dtype=np.int64)
        results = in_threads([lambda c=c: c.contribute("c", 0, 64, 8, *reversed(_masked(x, 64))) for c in clients])
        assert all(isinstance(r, tuple) for r in results), results
    finally:
        for sock in held:
            sock.close()


def check_only_owners_and_server0_learn_the_data_port(make_service, dirs):
    """The gRPC ``DataPlane`` call: owners and tfe:0 get the port; any other certificate PERMISSION_DENIED."""
    service = make_service(owner_names(2), data_plane=True)
    for server, address in enumerate(service.addresses):
        for job, index in (("chief", 0), ("tfe", 0)):
            reply = raw_call(address, server, "DataPlane", MESSAGES["DataPlaneRequest"](),
                             credentials_of(dirs[0], job, index), timeout=5)
            assert reply.port == _ports(service)[server]
        for job, index in (("tfe", 2), ("evaluator", 0)):
            with pytest.raises(grpc.RpcError) as e:
                raw_call(address, server, "DataPlane", MESSAGES["DataPlaneRequest"](),
                         credentials_of(dirs[0], job, index), timeout=5)
            assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED, e.value.details()
            assert f"{job}:{index} may not call DataPlane" in e.value.details()


def test_only_owners_and_server0_learn_the_data_port(make_service, cert_dirs):
    check_only_owners_and_server0_learn_the_data_port(make_service, cert_dirs)


def test_mutation_anyone_learning_the_data_port_is_detected(make_service, cert_dirs, monkeypatch):
    real = server_module.AggregationServer._callers  # pylint: disable=protected-access
    monkeypatch.setattr(server_module.AggregationServer, "_callers", lambda self, method: real(self, method) + [
        "tfe:2", "evaluator:0"] if method.name == "DataPlane" else real(self, method))
    _detects(check_only_owners_and_server0_learn_the_data_port, make_service, cert_dirs)


def _a_step_completes(service):
    """Both owners' clients complete a step on the data planes (the servers still serve)."""
    clients = [service.client(job, index) for job, index in (("chief", 0), ("worker", 0))]
    x = np.arange(8, dtype=np.int64)
    results = in_threads([lambda c=c: c.contribute("after", 0, 64, 8, *reversed(_masked(x, 64))) for c in clients])
    assert all(isinstance(r, tuple) for r in results), results
    np.testing.assert_array_equal(_revealed(results[0], 64).view(np.int64), 2 * x)
    assert all(c._links[1].link is not None for c in clients)  # pylint: disable=protected-access


def test_garbage_after_the_handshake_is_refused_or_closed_and_the_server_goes_on(make_service, cert_dirs):
    service = make_service(owner_names(2), data_plane=True)
    plane, port, chief = _plane(service, 1), _ports(service)[1], _context(cert_dirs, "chief", 0, 1)
    head = MESSAGES["ContributeRequest"](channel="c", step=0, ring_bits=64, num_elements=4).SerializeToString()
    garbage = {
        "an HTTP request": b"GET / HTTP/1.1\r\nHost: tfe-1\r\n\r\n",
        "a gRPC preface": b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n",
        "an unknown kind": frames.REQUEST.pack(b"TFD1", 9, len(head), 0, 32) + head + bytes(32),
        "a head above MAX_HEAD": frames.REQUEST.pack(b"TFD1", 1, frames.MAX_HEAD + 1, 0, 32),
        "metadata without '='": frames.request_header("Contribute", len(head), 4, 32) + head + b"junk" + bytes(32),
        "a short stream": frames.request_header("Contribute", len(head), 0, 32) + head + bytes(5),
    }
    for what, data in garbage.items():
        raw = _Raw(port, chief)
        raw.send(data)
        reply = raw.reply() if what != "a short stream" else "closed"  # the caller ends it mid-payload
        raw.close()
        assert reply == "closed" or reply[0] == grpc.StatusCode.INVALID_ARGUMENT, f"{what}: {reply}"
    assert _wait_until(lambda: not plane._callers.get("chief:0"))  # every connection counted out  # noqa
    _a_step_completes(service)


def test_a_malformed_head_is_refused_invalid_argument_and_the_server_goes_on(make_service, cert_dirs):
    # ContributeRequest's bytes that protobuf cannot parse: data_plane.py means to answer INVALID_ARGUMENT
    # ("protobuf's DecodeError is one" of ValueError), like gRPC's own parse error.
    service = make_service(owner_names(2), data_plane=True)
    head = b"\xff\xff\xff"
    data = frames.request_header("Contribute", len(head), 0, 32) + head + bytes(32)
    reply = _call(_ports(service)[1], _context(cert_dirs, "chief", 0, 1), data)
    _a_step_completes(service)
    _refused(reply, grpc.StatusCode.INVALID_ARGUMENT)



def check_a_refusal_before_a_large_payload_reaches_its_caller(make_service, dirs):
    """The owner budget refuses a 32 MiB share before reading it, while the caller still sends it: the caller
    reads the refusal (the server drains before it closes: a close with unread bytes resets the connection and
    destroys the answer)."""
    service = make_service(owner_names(2), data_plane=True, owner_memory_budget_bytes=1 << 20)
    tls = TlsFiles.from_dir(dirs[0], "chief", 0)
    link = DataLink("localhost", _ports(service)[1], tls.ssl_client_context(1), server_name(tls, 1))
    n = 1 << 22  # 32 MiB: more than the sockets' buffers take while the server reads nothing
    head = MESSAGES["ContributeRequest"](channel="c", step=0, ring_bits=64, num_elements=n).SerializeToString()
    try:
        code, _, message = link.call("Contribute", head, b"", np.zeros(n, np.int64), timeout=WAIT_SECS)
    except LinkError as e:
        code, message = e.code, e.details.encode("utf-8")
    finally:
        link.close()
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED, (code, bytes(message)[:300])
    assert b"--owner-memory-budget-bytes=1048576" in message


def test_a_refusal_before_a_large_payload_reaches_its_caller(make_service, cert_dirs):
    check_a_refusal_before_a_large_payload_reaches_its_caller(make_service, cert_dirs)


def test_mutation_closing_without_draining_is_detected(make_service, cert_dirs, monkeypatch):
    monkeypatch.setattr(data_plane, "_drain", lambda conn, *args, **kwargs: None)
    _detects(check_a_refusal_before_a_large_payload_reaches_its_caller, make_service, cert_dirs)


@pytest.mark.parametrize("plane", [False, True])
def test_a_forward_that_times_out_is_sent_once(make_service, cert_dirs, monkeypatch, plane):
    """Both keys reach server0, no share reaches server1: server1's step times out. Server0 forwarded once, and
    the owners read why (as on gRPC), not a duplicate of server0's part."""
    forwards, real = [], server_module.AggregationServer._forwarded  # pylint: disable=protected-access

    def counted(self, identity, request, context, reply):
        forwards.append(identity)
        return real(self, identity, request, context, reply)

    monkeypatch.setattr(server_module.AggregationServer, "_forwarded", counted)
    service = make_service(owner_names(2), step_timeout_secs=1.0, data_plane=plane)
    key_only = wire.encode("ContributeRequest", np.zeros(4, "<i4"), channel="c", step=0, ring_bits=64,
                           num_elements=8)
    stubs = [c._stubs[0]["Contribute"] for c in service.clients_of(2)]  # pylint: disable=protected-access
    results = in_threads([lambda s=s: s(key_only, timeout=10) for s in stubs])
    assert all(isinstance(r, grpc.RpcError) for r in results), results
    for r in results:
        assert "could not forward its blinded part" in r.details() and "already contributed" not in r.details(), \
            r.details()
    assert forwards == ["tfe:0"], forwards


# ------------------------------------------------------------ lifecycle --

def _data_threads():
    return {t for t in threading.enumerate() if t.name.startswith("tfe-data")}


def _listening(ports):
    out = []
    for port in ports:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1.0).close()
            out.append(port)
        except OSError:
            pass
    return out


def check_a_closed_service_leaves_no_data_plane_behind(dirs, held=()):
    """A service closed after a step: no data-plane thread, nothing listening on a data port. `held`: a caller
    also holds connections it does not close ("idle": authenticated, between calls; "handshake": in its TLS
    handshake)."""
    before = _data_threads()
    service = Service(dirs[0], owner_names(2), data_plane=True)
    ports = _ports(service)
    left = []
    try:
        _a_step_completes(service)  # the owners' idle links and server0's link to server1 hold connections
        if "idle" in held:
            left.append(_Raw(ports[1], _context(dirs, "chief", 0, 1)))
        if "handshake" in held:
            left.append(_Raw(ports[0], None))
        # two accept loops, the owners' four connections, server0's to server1 (and the idle one's)
        assert _wait_until(lambda: len(_data_threads() - before) >= 2 + 4 + 1 + ("idle" in held)), \
            _data_threads() - before
    finally:
        service.close()
    try:
        assert _wait_until(lambda: not (_data_threads() - before) and not _listening(ports), 1.5), \
            (sorted(t.name for t in _data_threads() - before), _listening(ports))
        for raw in left:  # the server closed them
            raw.sock.settimeout(1.0)
            try:
                assert raw.sock.recv(1 << 16) == b"", "a connection the server sent bytes after it stopped"
            except socket.timeout:
                raise AssertionError("a connection still open after the service closed") from None
            except OSError:
                pass
    finally:
        for raw in left:
            raw.close()


def test_a_closed_service_leaves_no_data_plane_behind(cert_dirs):
    check_a_closed_service_leaves_no_data_plane_behind(cert_dirs)


def test_mutation_a_data_plane_left_running_is_detected(cert_dirs, monkeypatch):
    planes, real = [], data_plane.DataPlane.stop
    monkeypatch.setattr(data_plane.DataPlane, "stop", lambda self: planes.append(self))
    try:
        _detects(check_a_closed_service_leaves_no_data_plane_behind, cert_dirs)
    finally:
        for plane in planes:
            real(plane)


def test_a_closed_service_ends_an_idle_connection_a_caller_keeps_open(cert_dirs):
    check_a_closed_service_leaves_no_data_plane_behind(cert_dirs, held=("idle",))


def test_a_closed_service_ends_a_connection_in_its_handshake(cert_dirs):
    check_a_closed_service_leaves_no_data_plane_behind(cert_dirs, held=("handshake",))


# ------------------------------------------------------------ renewal --

def check_a_renewed_server_certificate_is_presented_to_new_connections(dirs, tmp_path):
    """The operator renews server1's key and certificate in place while it runs: a new data-plane connection gets
    the new certificate (as the gRPC port does, test_federation), and the renewed server still answers owners."""
    import shutil  # pylint: disable=import-outside-toplevel

    from cryptography.x509.oid import NameOID  # pylint: disable=import-outside-toplevel

    own = tmp_path / "tfe-1"
    shutil.copytree(dirs[0], own)
    tls = TlsFiles.from_dir(str(own), "tfe", 1)
    server = server_module.AggregationServer(1, "localhost:0", owner_names(2), tls, step_timeout_secs=WAIT_SECS,
                                             data_address="localhost:0")
    server.start()
    port = server._data_plane.port  # pylint: disable=protected-access

    def presented():
        raw = _Raw(port, _context(dirs, "chief", 0, 1), 1)
        try:
            return certs.load_certificate(ssl.DER_cert_to_PEM_cert(raw.sock.getpeercert(True)).encode(), "server1")
        finally:
            raw.close()

    try:
        before = presented()
        organisation = before.subject.get_attributes_for_oid(NameOID.ORGANIZATION_NAME)[0].value
        key, csr = certs.make_key_and_csr("tfe", 1, organisation, CLUSTER)
        with open(own / certs.CA_CERT, "rb") as ca_cert, open(own / "ca.key", "rb") as ca_key:
            new_cert = certs.sign_csr(csr, ca_cert.read(), ca_key.read(), CLUSTER)
        with open(tls.key, "wb") as f:
            f.write(key)
        with open(tls.cert, "wb") as f:
            f.write(new_cert)
        after = presented()
        assert after.serial_number != before.serial_number, "the data plane still presents the old certificate"
        assert after.serial_number == certs.load_certificate(new_cert, "new").serial_number
        assert _refused(_call(port, _context(dirs, "chief", 0, 1), _probe(1), 1), grpc.StatusCode.INVALID_ARGUMENT)
    finally:
        server.stop(0)


def test_a_renewed_server_certificate_is_presented_to_new_connections(cert_dirs, tmp_path):
    check_a_renewed_server_certificate_is_presented_to_new_connections(cert_dirs, tmp_path)


def test_mutation_a_data_plane_that_never_rereads_its_files_is_detected(cert_dirs, tmp_path, monkeypatch):
    monkeypatch.setattr(TlsFiles, "stamp", lambda self: ())
    _detects(check_a_renewed_server_certificate_is_presented_to_new_connections, cert_dirs, tmp_path)


# ------------------------------------------------------------ finding the data plane --

def test_a_data_port_that_cannot_be_reached_is_tried_again_only_after_a_while(cert_dirs):
    """`PlaneLink` (the owners' client and server0 alike): after a call that reached the server failed it asks
    for the port again at once (a restarted server may have another); after the port could not be reached it
    stays on gRPC for `RETRY_SECS` instead of a connection attempt per call."""
    from tfe_estimator.service import data_link  # pylint: disable=import-outside-toplevel

    asked = []
    tls = TlsFiles.from_dir(cert_dirs[0], "chief", 0)
    plane = data_link.PlaneLink(lambda timeout: asked.append(timeout) or portpicker.pick_unused_port(), "localhost",
                                make_link_factory("python", tls, 1, server_name(tls, 1)))
    link = plane.get(timeout=1.0)
    assert link is not None and len(asked) == 1
    with pytest.raises(LinkError) as refused:  # nothing listens there
        link.call("Contribute", b"", b"", b"", timeout=1.0)
    assert not refused.value.sent
    plane.failed(link, refused.value)
    assert plane.get(timeout=1.0) is None and len(asked) == 1  # gRPC meanwhile, not asked again
    plane._asked -= data_link.RETRY_SECS  # pylint: disable=protected-access  # the while has passed
    again = plane.get(timeout=1.0)
    assert again is not None and again is not link and len(asked) == 2
    plane.failed(again, LinkError(grpc.StatusCode.UNAVAILABLE, "reset after the request", sent=True))
    assert plane.get(timeout=1.0) is not None and len(asked) == 3  # reached it: asked again at once
    plane.close()


def test_calls_that_start_together_wait_for_the_one_asking_for_the_port_and_all_take_the_data_plane(cert_dirs):
    """A step's two sums start their puts at once: the second must not fall back to gRPC because the first is
    still asking the server for its data port (mutation: returning at once gives it None)."""
    from tfe_estimator.service import data_link  # pylint: disable=import-outside-toplevel

    asked, answering = [], threading.Event()

    def ask(timeout):
        asked.append(timeout)
        assert answering.wait(10.0)
        return portpicker.pick_unused_port()

    tls = TlsFiles.from_dir(cert_dirs[0], "chief", 0)
    plane = data_link.PlaneLink(ask, "localhost", make_link_factory("python", tls, 1, server_name(tls, 1)))
    threading.Timer(0.5, answering.set).start()  # the server answers while the second call waits
    links = in_threads([lambda: plane.get(timeout=5.0), lambda: (time.sleep(0.2), plane.get(timeout=5.0))[1]])
    assert links[0] is not None and links[1] is links[0] and len(asked) == 1
    plane.close()


def _sum_of_two(service, n, **client_args):
    """chief:0 and worker:0 put x and 2x of `n` elements (ring 64, NumPy masks); each one's answer or error."""
    clients = [service.client(job, index, **client_args) for job, index in (("chief", 0), ("worker", 0))]

    def put(client, x):
        key = np.frombuffer(os.urandom(16), np.int32)
        share = (x.view(np.uint64) - ring.keystream_words(key, n)).view(np.int64)
        blind, w = client.contribute("s", 0, 64, n, key, share)
        return (w.view(np.uint64) + ring.keystream_words(blind, n)).view(np.int64)

    x = np.arange(n, dtype=np.int64)
    return in_threads([lambda c=c, k=k: put(c, k * x) for k, c in enumerate(clients, 1)])


def test_a_share_above_the_grpc_limit_waits_for_the_data_plane_and_says_so(make_service):
    """A server with a data plane reads at most `wire.CONTROL_MESSAGE_BYTES` per gRPC message (one owner's
    concurrent large calls cannot make it read more than its budget before it knows who sent them,
    test_service_limits): a share larger than that never goes to gRPC when the data port cannot be reached
    (UNAVAILABLE, retried within the owner's patience, naming the fix), a small sum still does, and a client that
    keeps shares off the data plane is told why gRPC refused it unread."""
    small = make_service(owner_names(2))
    _plane(small, 1).stop()
    for result in _sum_of_two(small, 8):  # ring words of 8 elements: gRPC takes them as before
        np.testing.assert_array_equal(result, 3 * np.arange(8))
    large = make_service(owner_names(2))
    _plane(large, 1).stop()
    n = wire.CONTROL_MESSAGE_BYTES // 8 + 1
    for result in _sum_of_two(large, n):
        assert getattr(result, "code", None) == grpc.StatusCode.UNAVAILABLE, result
        assert f"aggregation server1's data plane (port {_ports(large)[1]}) cannot be reached" in result.details
        assert f"its gRPC port reads messages up to {wire.CONTROL_MESSAGE_BYTES} bytes" in result.details
        assert "Open the data port like the service port, or restart the server without --data-port" in \
            result.details
    forward = make_service(owner_names(2))  # server0 alone finds nothing at server1's data port
    dead = portpicker.pick_unused_port()
    forward.servers[1]._peer_plane._ask = lambda timeout: dead  # pylint: disable=protected-access
    for result in _sum_of_two(forward, n):
        assert getattr(result, "code", None) == grpc.StatusCode.UNAVAILABLE, result
        assert "server0 could not forward its blinded part" in result.details
        assert f"aggregation server1's data plane (port {dead}) cannot be reached" in result.details
    unplanned = make_service(owner_names(2))
    for result in _sum_of_two(unplanned, n, data_plane=False):
        assert getattr(result, "code", None) == grpc.StatusCode.RESOURCE_EXHAUSTED, result
        assert "aggregation server1 read none of this" in result.details and "data_plane=True" in result.details


# ------------------------------------------------------------ identity on every call --
# An owner's organisation removed from the servers' federation file, or its certificate expiring, ends its calls
# on connections it already holds: the next call on either port is refused (gRPC and the data plane alike).

def _revocable_server1(root):
    """server1 of a fresh federation under `root` (its own copy of the federation file: the one to edit)."""
    make_federation(root, {"tfe:0": ("localhost", portpicker.pick_unused_port()),
                           "tfe:1": ("localhost", portpicker.pick_unused_port())})
    tls = TlsFiles.from_dir(str(root / "operator-y" / "tfe-1"), "tfe", 1)
    server1 = server_module.AggregationServer(1, "localhost:0", ["chief:0", "worker:0"], tls, step_timeout_secs=5.0,
                                              data_address="localhost:0")
    return server1, server1.start()


class _OpenConnections:
    """worker:0 (of `own`) holding one gRPC channel and one data-plane connection to server1; `call()` makes one
    call on each: ``(gRPC status code, data-plane reply)`` (a ring-48 put: INVALID_ARGUMENT once the caller is
    authenticated; no payload, so the data plane keeps the connection open after answering it)."""

    def __init__(self, server1, port, own):
        self._options = [server_name_option(own, 1)]
        self._channel = grpc.secure_channel(f"localhost:{port}", own.channel_credentials(1), options=self._options)
        self._stub = self._channel.unary_unary(wire.method_path("Contribute"))
        self.raw = _Raw(server1._data_plane.port, None)  # pylint: disable=protected-access
        self.raw.sock = own.ssl_client_context(1).wrap_socket(self.raw.sock, server_hostname=server_name(own, 1))

    def call(self):
        request = MESSAGES["ContributeRequest"](channel="c", step=0, ring_bits=48, num_elements=4)
        try:
            self._stub(request.SerializeToString(), timeout=5.0)
            code = grpc.StatusCode.OK
        except grpc.RpcError as e:
            code = (e.code(), e.details())
        self.raw.send(_frame("Contribute", ring_bits=48, n=4, payload=b""))
        return code, self.raw.reply()

    def close(self):
        self._channel.close()
        self.raw.close()


def _accepted(calls):
    (code, _), reply = calls.call()
    assert code == grpc.StatusCode.INVALID_ARGUMENT, code
    assert "Contribute of worker:0" in _refused(reply, grpc.StatusCode.INVALID_ARGUMENT)


def _refused_on_both_ports(calls, why):
    (code, details), reply = calls.call()
    assert code == grpc.StatusCode.UNAUTHENTICATED and why in details, (code, details)
    text = _refused(reply, grpc.StatusCode.UNAUTHENTICATED)
    assert why in text and "identity is checked on every call" in text, text
    assert calls.raw.reply(timeout=5.0) == "closed", "the data plane kept the connection of a refused identity open"


def check_an_organisation_removed_from_the_federation_is_refused_on_open_connections(root):
    server1, port = _revocable_server1(root)
    own = TlsFiles.from_dir(str(root / "hospital-b" / "worker-0"), "worker", 0)
    calls = _OpenConnections(server1, port, own)
    try:
        _accepted(calls)
        _accepted(calls)
        # The operator removes Hospital B (worker:0's organisation) from server1's federation file.
        trust = server1._tls.ca  # pylint: disable=protected-access
        data = federation_lib.Federation.load(trust).to_dict()
        del data["organisations"]["hospital-b"], data["parties"]["worker:0"]
        with open(trust + ".new", "w", encoding="utf-8") as f:
            json.dump(data, f)
        os.replace(trust + ".new", trust)
        _refused_on_both_ports(calls, "worker:0 is not a party of federation file")
    finally:
        calls.close()
        server1.stop(0)


def test_an_organisation_removed_from_the_federation_is_refused_on_open_connections(tmp_path):
    check_an_organisation_removed_from_the_federation_is_refused_on_open_connections(tmp_path)


def _checked_once_per_connection(real):
    """The leak: a connection's first answer is kept for good (the check made only when it opened)."""
    def problem(self, now=None):
        if not hasattr(self, "_first"):
            self._first = real(self, now)  # pylint: disable=protected-access
        return self._first  # pylint: disable=protected-access
    return problem


def _checked_once_per_identity(real):
    """The leak on gRPC: the first answer for an identity is kept for good."""
    seen = {}
    return lambda tls, identity, context: seen.setdefault(identity, real(tls, identity, context))


def test_mutation_the_data_plane_checking_identity_only_at_connect_is_detected(tmp_path, monkeypatch):
    monkeypatch.setattr(tls_module.SslPeer, "problem", _checked_once_per_connection(tls_module.SslPeer.problem))
    _detects(check_an_organisation_removed_from_the_federation_is_refused_on_open_connections, tmp_path)


def test_mutation_grpc_checking_identity_once_is_detected(tmp_path, monkeypatch):
    monkeypatch.setattr(server_module, "check_peer", _checked_once_per_identity(server_module.check_peer))
    _detects(check_an_organisation_removed_from_the_federation_is_refused_on_open_connections, tmp_path)


_EXPIRES_IN = 3.0  # seconds: the short-lived certificate's life left when it connects


def check_a_certificate_that_expires_is_refused_on_open_connections(root):
    server1, port = _revocable_server1(root)
    # worker:0 gets a certificate from its own organisation's CA that expires in a few seconds.
    ca, own = root / "hospital-b" / "ca", root / "short-lived"
    own.mkdir()
    key, csr = certs.make_key_and_csr("worker", 0, "hospital-b", FEDERATION_CLUSTER)
    start = datetime.datetime.now(datetime.timezone.utc) - datetime.timedelta(days=1, seconds=-_EXPIRES_IN)
    (own / "worker-0.crt").write_bytes(certs.sign_csr(csr, (ca / "ca.crt").read_bytes(), (ca / "ca.key").read_bytes(),
                                                      FEDERATION_CLUSTER, validity_days=1, not_before=start))
    (own / "worker-0.key").write_bytes(key)
    shutil.copy(root / "hospital-b" / "worker-0" / "federation.json", own)
    calls = _OpenConnections(server1, port, TlsFiles.from_dir(str(own), "worker", 0))
    try:
        _accepted(calls)
        time.sleep(max(0.0, (start + datetime.timedelta(days=1) - datetime.datetime.now(
            datetime.timezone.utc)).total_seconds()) + 1.0)
        _refused_on_both_ports(calls, "the certificate of worker:0 is valid from")
    finally:
        calls.close()
        server1.stop(0)


def test_a_certificate_that_expires_is_refused_on_open_connections(tmp_path):
    check_a_certificate_that_expires_is_refused_on_open_connections(tmp_path)


def test_mutation_the_data_plane_checking_expiry_only_at_connect_is_detected(tmp_path, monkeypatch):
    monkeypatch.setattr(tls_module.SslPeer, "problem", _checked_once_per_connection(tls_module.SslPeer.problem))
    _detects(check_a_certificate_that_expires_is_refused_on_open_connections, tmp_path)


def test_answers_land_in_one_reused_buffer_per_thread_and_sums_stay_exact(make_service, monkeypatch):
    # A revealed contribution's answer is read into this thread's reused buffer (no fresh multi-megabyte buffer
    # per reply); each step's sum is still exact, and a call that raised leaves its buffer behind.
    from tfe_estimator.owner import sum_check  # pylint: disable=import-outside-toplevel

    service = make_service(owner_names(2))
    clients = service.clients_of(2)
    check = sum_check.SumCheck(bytes(range(32)))
    buffers, put_threads = [], []
    from tfe_estimator.service.native_link import NativeLink  # pylint: disable=import-outside-toplevel

    link_class = NativeLink if clients[0].data_link == "c" else DataLink  # TFE_ESTIMATOR_DATA_LINK=c: the C link
    real_call = link_class.call

    def call(self, method, head, meta, payload, timeout, started=None, into=None):
        code, replayed, message = real_call(self, method, head, meta, payload, timeout, started, into=into)
        if method == "Contribute":
            put_threads.append(threading.current_thread())  # kept: a thread object is never reused
        if method == "Contribute" and into is not None:
            buffers.append((threading.current_thread().name, id(into), isinstance(message, memoryview)))
        return code, replayed, message

    monkeypatch.setattr(link_class, "call", call)
    n = 5000

    def owner(o, step):
        values = np.arange(n, dtype=np.int64) * (o + 1) + step
        key = np.frombuffer(os.urandom(16), np.int32).copy()
        share = (values.view(np.uint64) - ring.keystream_words(key, n)).view(np.int64)
        return sum_check.checked_contribute(clients[o].contribute, check, "sum_0", step, 64, n, key, share,
                                            reveal=True)

    results = in_threads([lambda o=o: [owner(o, step) for step in range(3)] for o in range(2)])  # a thread each
    for result in results:
        assert not isinstance(result, Exception), result
        for step, revealed in enumerate(result):
            np.testing.assert_array_equal(revealed, np.arange(n) * 3 + 2 * step)
    assert len(buffers) == 6 and all(viewed for _, _, viewed in buffers), buffers
    assert len({buffer for _, buffer, _ in buffers}) == 2, buffers  # one buffer per owner's thread, reused
    # 12 puts (2 owners, 3 steps, 2 servers) on threads kept from put to put (2 per owner; a put that starts
    # before the previous one's thread is idle again gets another), not on a thread each
    assert len(put_threads) == 12 and len(set(map(id, put_threads))) <= 8, put_threads

    class Refused(Exception):
        pass

    held = sum_check._REPLIES.__dict__.get("buffer")  # pylint: disable=protected-access
    with pytest.raises(Refused):
        sum_check.checked_contribute(lambda *a: (_ for _ in ()).throw(Refused()), None, "sum_0", 9, 64, 1,
                                     np.zeros(4, np.int32), np.zeros(1, np.int64), reveal=True)
    assert sum_check._REPLIES.__dict__.get("buffer") is None and held is None  # main thread: never lent before
