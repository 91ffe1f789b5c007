# ruff: noqa: F811  # the fixtures imported from service_helpers are parameters of the tests
"""The owner's data-plane link in C (`service/native_link.py`, BoringSSL) against Python's (`DataLink`), in process.

Servers are real: `AggregationServer` data planes on loopback, or (for the faults) a Python `ssl` server
with the cluster's certificates speaking `frames` by hand (`_FrameServer`). Every behaviour test runs both
links (``kind``); each pinning property sits beside its mutation (a build of tls_link.cc with the check
compiled out, `native_build.MUTATIONS`: the property's own check must then fail):
- answers: a step where one owner puts on the Python link and the other on the C link gives both the same,
  exact sum, at 0, 1e3 and 1e6 elements, with the reply read into a buffer reused across steps;
- pinning: a server of another CA, a server whose certificate names another server (tfe-0 where tfe-1 is
  pinned), a TLS 1.1-only peer and a plaintext peer are each refused in the handshake: LinkError
  UNAVAILABLE, sent=False, naming host:port;
- faults: a server closing inside its answer gives LinkError(sent=True) and that connection is not reused; a
  stale idle connection is dropped; a silent server gives DEADLINE_EXCEEDED; `abort` ends a waiting call;
  no file descriptor is left behind.
"""
import os
import socket
import ssl
import threading

import grpc
import numpy as np
import pytest

from service_helpers import WAIT_SECS, Service, cert_dirs, in_threads, make_service, owner_names  # noqa: F401
from tfe_estimator.service import TlsFiles, frames, native_build, ring, wire
from tfe_estimator.service.client import REPLY_MARGIN_BYTES, reply_into
from tfe_estimator.service.data_link import DataLink, LinkError
from tfe_estimator.service import native_link
from tfe_estimator.service.native_link import NativeLink, link_choice, resolve_link
from tfe_estimator.service.tls import server_name

KINDS = ("python", "c")
MESSAGES = wire.messages()


def _detects(check, *args):
    """The planted leak makes `check` fail."""
    with pytest.raises((AssertionError, pytest.fail.Exception)):
        check(*args)


def _link(kind, port, tls, server, hostname, library=None, timeout=5.0):
    if kind == "python":
        return DataLink("localhost", port, tls.ssl_client_context(server), hostname, connect_timeout_secs=timeout)
    return NativeLink("localhost", port, tls, server, hostname, connect_timeout_secs=timeout, library=library)


def _data_ports(service):
    server1, server0 = service.servers
    return server0._data_plane.port, server1._data_plane.port  # pylint: disable=protected-access


def _masked(x, ring_bits=64):
    key = np.frombuffer(os.urandom(16), np.int32)
    share = x.copy()
    ring.sub_into(share.view(np.uint64), ring.keystream_words(key, x.size), ring_bits)
    return share, key


def _revealed(result, ring_bits=64):
    blind, w = result
    return ring.add_into(np.array(w).view(np.uint64), ring.keystream_words(blind, w.size), ring_bits)


def _head(n=4, channel="c"):
    return MESSAGES["ContributeRequest"](channel=channel, step=0, ring_bits=64, num_elements=n).SerializeToString()


def _fds():
    return len(os.listdir("/proc/self/fd"))


def test_the_link_is_chosen_by_argument_or_environment(monkeypatch):
    monkeypatch.delenv("TFE_ESTIMATOR_DATA_LINK", raising=False)
    assert link_choice() == "auto"
    monkeypatch.setenv("TFE_ESTIMATOR_DATA_LINK", "C")
    assert link_choice() == "c" and link_choice("python") == "python"
    with pytest.raises(ValueError, match=r"TFE_ESTIMATOR_DATA_LINK='rust'.*\('auto', 'python', 'c'\)"):
        monkeypatch.setenv("TFE_ESTIMATOR_DATA_LINK", "rust")
        link_choice()


def test_auto_takes_the_c_link_where_it_builds_else_pythons_and_says_why(monkeypatch, caplog):
    # Where TensorFlow ships BoringSSL and a compiler is there (this machine), an owner's client takes the C link
    # by default; where it cannot be built, Python's (the same pinning), said once in the log; asked for by name,
    # the C link's absence is an error naming the Python link.
    native_link._auto.cache_clear()  # pylint: disable=protected-access
    assert resolve_link("auto") == "c" and resolve_link("python") == "python"

    def unavailable(*args):
        raise native_build.NativeLinkUnavailable("no C++ compiler 'g++' for the C data-plane link: install g++")

    monkeypatch.setattr(native_build, "load", unavailable)
    native_link._auto.cache_clear()  # pylint: disable=protected-access
    try:
        with caplog.at_level("INFO", logger="tfe_estimator"):
            assert resolve_link("auto") == "python"
        assert "data-plane link is Python's ssl: the C link is not available here (no C++ compiler" in caplog.text
        with pytest.raises(native_build.NativeLinkUnavailable, match="no C\\+\\+ compiler"):
            resolve_link("c")
    finally:
        native_link._auto.cache_clear()  # pylint: disable=protected-access


def test_an_unknown_mutation_is_refused():
    with pytest.raises(ValueError, match="are not mutations"):
        native_build.build(("NO_TLS",))


# ------------------------------------------------------------ answers --

@pytest.mark.parametrize("n", [0, 1000, 1_000_000])
def test_a_step_on_both_links_gives_the_same_exact_answer(make_service, n):
    """Owner A on one link and owner B on the other, swapped each step; replies read into reused buffers."""
    service = make_service(owner_names(2), data_plane=True)
    clients = [service.client("chief", 0, data_link="python"), service.client("worker", 0, data_link="c")]
    assert type(clients[1]._links[1].get(WAIT_SECS)) is NativeLink  # pylint: disable=protected-access
    assert type(clients[0]._links[1].get(WAIT_SECS)) is DataLink  # pylint: disable=protected-access
    buffers = [bytearray(8 * n + REPLY_MARGIN_BYTES) for _ in clients]
    rng = np.random.default_rng(n)
    for step in range(3):
        xs = [rng.integers(-2**62, 2**62, n, dtype=np.int64) for _ in clients]
        masked = [_masked(x) for x in xs]

        def put(k, step=step, masked=masked):
            client = clients[k if step % 2 == 0 else 1 - k]
            with reply_into(buffers[k]):
                blind, w = client.contribute("grads", step, 64, n, masked[k][1], masked[k][0])
                return blind.copy(), np.array(w)

        results = in_threads([lambda k=k: put(k) for k in range(2)])
        assert all(isinstance(r, tuple) for r in results), results
        expected = ring.add_into(xs[0].copy().view(np.uint64), xs[1], 64)
        np.testing.assert_array_equal(results[0][0], results[1][0])
        assert results[0][1].tobytes() == results[1][1].tobytes()  # bit-identical answers on both links
        np.testing.assert_array_equal(_revealed(results[0]), expected)
    for client in clients:
        assert client._links[1].link is not None  # every put stayed on the data plane  # pylint: disable=W0212


@pytest.mark.parametrize("into", [False, True])
def test_a_refusal_reads_the_same_on_both_links(make_service, cert_dirs, into):
    """A refusal's text (ring 48) is the same message on both links, read into `into` or a new buffer."""
    service = make_service(owner_names(2), data_plane=True)
    tls = TlsFiles.from_dir(cert_dirs[0], "chief", 0)
    head = MESSAGES["ContributeRequest"](channel="c", step=0, ring_bits=48, num_elements=4).SerializeToString()
    answers = []
    for kind in KINDS:
        link = _link(kind, _data_ports(service)[1], tls, 1, server_name(tls, 1))
        try:
            code, replayed, message = link.call("Contribute", head, b"", np.zeros(4, np.int64), WAIT_SECS,
                                                into=bytearray(4096) if into else None)
            answers.append((code, replayed, bytes(message)))
        finally:
            link.close()
    assert answers[0] == answers[1] and answers[0][0] == grpc.StatusCode.INVALID_ARGUMENT, answers


# ------------------------------------------------------------ pinning --

def _refused_in_handshake(link, port, *expected):
    try:
        with pytest.raises(LinkError) as raised:
            link.call("Contribute", _head(), b"", np.zeros(4, np.int64), WAIT_SECS)
    finally:
        link.close()
    error = raised.value
    assert error.code == grpc.StatusCode.UNAVAILABLE and error.sent is False, (error.code, error.sent, error.details)
    assert f"localhost:{port}" in error.details and "TLS" in error.details, error.details
    assert any(e.lower() in error.details.lower() for e in expected), error.details


def check_a_server_of_another_ca_is_refused(dirs, kind, library=None):
    foreign = Service(dirs[1], owner_names(2), data_plane=True)  # the same names, issued by another CA
    try:
        tls = TlsFiles.from_dir(dirs[0], "chief", 0)
        port = _data_ports(foreign)[1]
        _refused_in_handshake(_link(kind, port, tls, 1, server_name(tls, 1), library), port,
                              "certificate verify failed", "unable to get local issuer")
    finally:
        foreign.close()


def check_a_server_named_otherwise_is_refused(service, dirs, kind, library=None):
    tls = TlsFiles.from_dir(dirs[0], "chief", 0)
    port = _data_ports(service)[0]  # server0's: it presents tfe-0's certificate, tfe-1 is pinned
    _refused_in_handshake(_link(kind, port, tls, 1, server_name(tls, 1), library), port,
                          "hostname mismatch", "certificate verify failed")


@pytest.mark.parametrize("kind", KINDS)
def test_a_server_of_another_ca_is_refused(cert_dirs, kind):
    check_a_server_of_another_ca_is_refused(cert_dirs, kind)


@pytest.mark.parametrize("kind", KINDS)
def test_a_server_named_otherwise_is_refused(make_service, cert_dirs, kind):
    check_a_server_named_otherwise_is_refused(make_service(owner_names(2), data_plane=True), cert_dirs, kind)


def test_mutation_the_c_link_without_its_ca_check_is_detected(cert_dirs):
    library = native_build.load(("TFE_LINK_MUTATION_NO_CA_CHECK",))
    _detects(check_a_server_of_another_ca_is_refused, cert_dirs, "c", library)


def test_mutation_the_c_link_without_its_name_check_is_detected(make_service, cert_dirs):
    library = native_build.load(("TFE_LINK_MUTATION_NO_NAME_CHECK",))
    service = make_service(owner_names(2), data_plane=True)
    _detects(check_a_server_named_otherwise_is_refused, service, cert_dirs, "c", library)


class _FrameServer:
    """A loopback server: each accepted connection (TLS with `context`, or plaintext if None) is served by
    ``serve(conn, index)`` on a thread of its own. `accepted` counts connections; `close` ends them all."""

    def __init__(self, context, serve):
        self._context, self._serve = context, serve
        self._listener = socket.create_server(("localhost", 0))
        self.port = self._listener.getsockname()[1]
        self.accepted, self.stop = 0, threading.Event()
        self._conns, self._threads = [], []
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    def _accept(self):
        while True:
            try:
                raw, _ = self._listener.accept()
            except OSError:
                return
            self.accepted += 1
            thread = threading.Thread(target=self._one, args=(raw, self.accepted - 1), daemon=True)
            self._threads.append(thread)
            thread.start()

    def _one(self, raw, index):
        conn = raw
        self._conns.append(raw)
        try:
            raw.settimeout(WAIT_SECS)
            if self._context is not None:
                conn = self._context.wrap_socket(raw, server_side=True)
                self._conns.append(conn)
            self._serve(conn, index)
        except (OSError, ssl.SSLError, ValueError):
            pass
        finally:
            conn.close()

    def close(self):
        self.stop.set()
        try:
            self._listener.shutdown(socket.SHUT_RDWR)  # wakes the accepting thread (close alone does not)
        except OSError:
            pass
        self._listener.close()
        self._thread.join(WAIT_SECS)
        for conn in self._conns:
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        for thread in self._threads:
            thread.join(WAIT_SECS)


def _read_request(conn):
    header = frames.read_exact(conn, frames.REQUEST.size)
    if header is None:
        return False
    _, head, meta, payload = frames.parse_request(header)
    frames.read_exact(conn, head + meta + payload)
    return True


def _server_context(dirs, **versions):
    context = TlsFiles.from_dir(dirs[0], "tfe", 1).ssl_server_context()
    for name, value in versions.items():
        setattr(context, name, value)
    return context


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("peer", ["tls1.1", "plaintext"])
def test_a_tls11_or_plaintext_peer_is_refused(cert_dirs, kind, peer):
    if peer == "tls1.1":
        try:
            context = _server_context(cert_dirs, minimum_version=ssl.TLSVersion.TLSv1,
                                      maximum_version=ssl.TLSVersion.TLSv1_1)
        except (ValueError, ssl.SSLError) as e:
            pytest.skip(f"this OpenSSL cannot offer TLS 1.1 only: {e}")
        context.set_ciphers("ALL:@SECLEVEL=0")
        server = _FrameServer(context, lambda conn, index: _read_request(conn))
    else:
        server = _FrameServer(None, lambda conn, index: conn.sendall(b"HTTP/1.1 400 Bad Request\r\n\r\n") or
                              server.stop.wait(WAIT_SECS))
    tls = TlsFiles.from_dir(cert_dirs[0], "chief", 0)
    try:
        _refused_in_handshake(_link(kind, server.port, tls, 1, server_name(tls, 1)), server.port,
                              "version", "wrong", "protocol", "record", "packet", "alert", "eof", "closed")
    finally:
        server.close()


# ------------------------------------------------------------ faults --

def _answer_ok(conn, index, calls=2):
    """Answers `calls` requests OK with a fixed message, then closes (a restart of the server)."""
    for _ in range(calls):
        if not _read_request(conn):
            return
        message = bytes(range(256)) * 4
        conn.sendall(frames.reply_header(grpc.StatusCode.OK, len(message), replayed=index == 1) + message)


@pytest.mark.parametrize("kind", KINDS)
def test_a_stale_idle_connection_is_dropped_and_one_broken_mid_answer_never_reused(cert_dirs, kind):
    tls = TlsFiles.from_dir(cert_dirs[0], "chief", 0)

    def serve(conn, index):
        if index == 2:  # the third connection: closes inside its answer
            _read_request(conn)
            conn.sendall(frames.reply_header(grpc.StatusCode.OK, 1000) + bytes(10))
            return
        _answer_ok(conn, index, calls=1)

    before = _fds()
    server = _FrameServer(_server_context(cert_dirs), serve)
    link = _link(kind, server.port, tls, 1, server_name(tls, 1))
    try:
        into = bytearray(2048)
        code, replayed, message = link.call("Contribute", _head(), b"", np.arange(4, dtype=np.int64), WAIT_SECS,
                                            into=into)
        assert (code, replayed, bytes(message)) == (grpc.StatusCode.OK, False, bytes(range(256)) * 4)
        threads = server._threads  # pylint: disable=protected-access
        assert _wait(lambda: not threads[0].is_alive())  # the server closed the idle connection
        code, replayed, message = link.call("Contribute", _head(), b"", b"x" * 32, WAIT_SECS)  # a new connection
        assert (code, replayed, bytes(message)) == (grpc.StatusCode.OK, True, bytes(range(256)) * 4)
        assert server.accepted == 2 and _wait(lambda: not threads[1].is_alive())  # closed again
        with pytest.raises(LinkError) as raised:
            link.call("Contribute", _head(), b"", b"x" * 32, WAIT_SECS, into=into)
        assert raised.value.sent is True and raised.value.code == grpc.StatusCode.UNAVAILABLE, raised.value.details
        assert f"localhost:{server.port}" in raised.value.details, raised.value.details
        code, _, _ = link.call("Contribute", _head(), b"", b"x" * 32, WAIT_SECS)
        assert code == grpc.StatusCode.OK and server.accepted == 4  # on a new connection: the broken one is gone
    finally:
        link.close()
        server.close()
    assert _fds() == before


def _wait(condition):
    done = threading.Event()
    for _ in range(int(WAIT_SECS * 20)):
        if condition():
            return True
        done.wait(0.05)
    return False


@pytest.mark.parametrize("kind", KINDS)
def test_a_silent_server_times_out_and_abort_ends_a_waiting_call(cert_dirs, kind):
    tls = TlsFiles.from_dir(cert_dirs[0], "chief", 0)
    before = _fds()
    server = _FrameServer(_server_context(cert_dirs), lambda conn, index: _read_request(conn) and
                          server.stop.wait(WAIT_SECS))
    link = _link(kind, server.port, tls, 1, server_name(tls, 1))
    try:
        with pytest.raises(LinkError) as raised:
            link.call("Contribute", _head(), b"", np.zeros(1000, np.int64), 0.3)
        assert raised.value.code == grpc.StatusCode.DEADLINE_EXCEEDED and raised.value.sent is True
        assert f"localhost:{server.port}" in raised.value.details
        started = []
        result = []
        thread = threading.Thread(target=lambda: result.append(in_threads([lambda: link.call(
            "Contribute", _head(), b"", b"", WAIT_SECS, started=started)])[0]))
        thread.start()
        assert _wait(lambda: started and server.accepted == 2)
        link.abort(started)
        thread.join(WAIT_SECS)
        assert not thread.is_alive() and isinstance(result[0], LinkError) and result[0].sent, result
    finally:
        link.close()
        server.close()
    assert _fds() == before


def test_a_tensorflow_without_boringssl_headers_names_the_python_link(tmp_path, monkeypatch):
    """A stack whose TensorFlow ships no BoringSSL headers runs on the Python link; asking for C says why."""
    monkeypatch.setattr(native_build, "_tensorflow", lambda: (tmp_path, "2.9.1"))
    with pytest.raises(native_build.NativeLinkUnavailable, match=r"ships no BoringSSL headers.*"
                                                                 r"TFE_ESTIMATOR_DATA_LINK=python"):
        native_build.build()
