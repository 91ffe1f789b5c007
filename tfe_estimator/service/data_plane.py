"""An aggregation server's data plane: the large calls on mutual TLS beside gRPC, read into reused buffers.

gRPC's Python server copies every received message twice and every sent one
once, and its serializers take only ``bytes``: at 1e6 parameters a third of
server1's time went to copying memory. The data plane (`frames` has its wire
format) serves the same two calls, Contribute and ForwardBlinded, on a port of
its own with Python's `ssl` (OpenSSL): the payload is read with ``recv_into``
straight into a buffer the server reuses across steps and answers are written
from the bytes the replay window keeps. gRPC keeps everything else (Handshake,
Rewind, the ``DataPlane`` call that tells callers this port) and still serves
Contribute for callers that do not use the data plane.

What holds on the gRPC port holds here: mutual TLS only, the caller is who its
certificate says (`tls.ssl_peer`: issued by the CA of its own organisation and
valid now, checked at the connection and again before every call against the
current trust, so a revoked organisation or an expired certificate is refused
on its next call; renewed files are taken for new connections),
every refusal of the gRPC handlers (the method's callers, the step rules, the
memory budget: a payload's bytes are reserved before they are read, the calls
one owner keeps waiting). TLS handshakes run in one thread, non-blocking, so an
unauthenticated connection holds no thread: one that has not finished within
`handshake_timeout_secs` is closed, and past `max_handshakes` in progress the
oldest gives way. An authenticated connection has a thread; one caller keeps at
most `max_connections`, and a frame's bytes must keep coming
(`frame_timeout_secs`).

Example::

    plane = DataPlane(tls, "[::]:0", serve, max_connections=9, name="aggregation server1")
    port = plane.start()
    ...
    plane.stop()

``serve(identity, method, request, meta, payload_len, receive, alive)`` returns
``(answer bytes, replayed)`` or raises `Refused`; it calls ``receive(view)`` to
read the payload into `view` (after its checks: a refused call's payload is
never read, and the connection is closed after the refusal).
"""
import logging
import select
import selectors
import socket
import ssl
import threading
import time
from typing import Callable, Dict, Optional, Set, Tuple

import grpc
from google.protobuf.message import DecodeError

from tfe_estimator.service import frames, wire
from tfe_estimator.service.tls import SslPeer, TlsFiles, ssl_peer

__all__ = ["DataPlane", "Refused"]

_LOG = logging.getLogger("tfe_estimator")


class Refused(Exception):
    """A call the server refuses: its gRPC status code and message (the same as on the gRPC port)."""

    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code, self.message = code, message


def _split(address: str) -> Tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host.strip("[]") or "::", int(port)


class DataPlane:
    """A TLS listener whose connections each read frames and answer them in turn (a thread per connection).

    Args:
      tls: the server's `TlsFiles`.
      address: where to listen, ``host:port`` (port 0: any free port, see `start`).
      serve: the call handler (module docstring).
      max_connections: connections one caller may hold at once (each holds a thread).
      max_handshakes: connections still in their TLS handshake at once (unauthenticated callers; past it the
        oldest is dropped). Handshakes hold no thread: one thread runs them all, non-blocking.
      handshake_timeout_secs: how long a connection may take to finish its TLS handshake.
      frame_timeout_secs: how long a frame's next bytes may take once it started.
      name: what log lines call the server.
    """

    def __init__(self, tls: TlsFiles, address: str, serve: Callable, max_connections: int = 9,
                 max_handshakes: int = 256, handshake_timeout_secs: float = 10.0, frame_timeout_secs: float = 60.0,
                 name: str = "aggregation server"):
        self._tls, self._address, self._serve = tls, address, serve
        self._max_connections, self._max_handshakes = int(max_connections), int(max_handshakes)
        self._handshake_timeout, self._frame_timeout = float(handshake_timeout_secs), float(frame_timeout_secs)
        self._name = name
        self._lock = threading.Lock()
        self._context: Optional[ssl.SSLContext] = None
        self._stamp = None
        self._callers: Dict[str, int] = {}
        self._sockets: Set[ssl.SSLSocket] = set()  # authenticated connections (`stop` shuts them down)
        self._listener: Optional[socket.socket] = None
        self._acceptor: Optional[threading.Thread] = None
        self._stopped = threading.Event()
        self.port = 0

    def start(self) -> int:
        """Binds and starts accepting; returns the bound port."""
        host, port = _split(self._address)
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        listener = socket.socket(family, socket.SOCK_STREAM)
        try:
            # a restarted server takes its port back while the old connections sit in TIME_WAIT (as gRPC does;
            # never SO_REUSEPORT: a second server on the same port is refused)
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6 and host in ("::", ""):
                listener.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)  # both families, as gRPC's [::]
            listener.bind((host, port))
            listener.listen(128)
        except OSError as e:
            listener.close()
            raise RuntimeError(f"{self._name} cannot listen on {self._address} for its data plane ({e}): the port "
                               "is taken or the address is not local. Pick a free port (0 picks one).") from None
        listener.setblocking(False)
        self._listener = listener
        self.port = listener.getsockname()[1]
        self._acceptor = threading.Thread(target=self._accept, name="tfe-data-accept", daemon=True)
        self._acceptor.start()
        return self.port

    def stop(self) -> None:
        """Stops accepting and closes every connection (their calls end; handshakes in progress too)."""
        self._stopped.set()
        if self._listener is not None:
            try:
                self._listener.shutdown(socket.SHUT_RDWR)  # wakes the acceptor's select at once
            except OSError:
                pass
        if self._acceptor is not None:
            self._acceptor.join(timeout=5.0)  # it drops the handshakes in progress and closes its selector
        if self._listener is not None:
            self._listener.close()
        with self._lock:
            sockets = list(self._sockets)
        for sock in sockets:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def _ssl_context(self) -> ssl.SSLContext:
        """This server's context, made again when one of its TLS files changed (renewal without a restart)."""
        stamp = self._tls.stamp()
        with self._lock:
            if self._context is None or stamp != self._stamp:
                try:
                    self._context, self._stamp = self._tls.ssl_server_context(), stamp
                except (OSError, ValueError, ssl.SSLError) as e:
                    if self._context is None:
                        raise
                    _LOG.warning("%s: TLS files changed but cannot be read yet (%s); keeping the old ones",
                                 self._name, e)
            return self._context

    def _accept(self) -> None:
        """Accepts connections and runs their TLS handshakes, all in this one thread (non-blocking sockets):
        an unauthenticated connection holds no thread. At most `max_handshakes` are in progress; past that
        the oldest is dropped (a peer that keeps connections open in their handshake cannot lock owners out),
        and each is dropped after `handshake_timeout_secs`. A finished handshake gets a thread of its own."""
        selector = selectors.DefaultSelector()
        selector.register(self._listener, selectors.EVENT_READ, None)
        pending: Dict[ssl.SSLSocket, float] = {}  # connection -> its handshake's deadline (insertion = age)

        def drop(conn: ssl.SSLSocket) -> None:
            pending.pop(conn, None)
            try:
                selector.unregister(conn)
            except (KeyError, ValueError):
                pass
            conn.close()

        try:
            while not self._stopped.is_set():
                now = time.monotonic()
                for conn in [c for c, deadline in pending.items() if deadline <= now]:
                    drop(conn)
                wait = min([0.5] + [max(0.0, d - now) for d in pending.values()])
                for key, _ in selector.select(wait):
                    if key.data is None:
                        self._accept_one(selector, pending, drop)
                    else:
                        self._handshake_step(key.data, selector, pending, drop)
        finally:
            for conn in list(pending):
                drop(conn)
            selector.close()

    def _accept_one(self, selector, pending, drop) -> None:
        try:
            raw, _ = self._listener.accept()
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            if not self._stopped.is_set():
                time.sleep(0.05)  # e.g. out of file descriptors: let connections end
            return
        try:
            raw.setblocking(False)
            raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn = self._ssl_context().wrap_socket(raw, server_side=True, do_handshake_on_connect=False)
        except (OSError, ssl.SSLError, ValueError):
            raw.close()
            return
        while len(pending) >= self._max_handshakes:
            drop(next(iter(pending)))  # the oldest unfinished handshake gives way
        pending[conn] = time.monotonic() + self._handshake_timeout
        selector.register(conn, selectors.EVENT_READ, conn)

    def _handshake_step(self, conn: ssl.SSLSocket, selector, pending, drop) -> None:
        try:
            conn.do_handshake()
        except ssl.SSLWantReadError:
            selector.modify(conn, selectors.EVENT_READ, conn)
            return
        except ssl.SSLWantWriteError:
            selector.modify(conn, selectors.EVENT_WRITE, conn)
            return
        except (OSError, ssl.SSLError, ValueError):
            drop(conn)  # not a TLS client of ours (no certificate, another CA, plaintext): TLS refused it
            return
        pending.pop(conn, None)
        selector.unregister(conn)
        conn.setblocking(True)
        with self._lock:
            if self._stopped.is_set():
                conn.close()
                return
            self._sockets.add(conn)
        threading.Thread(target=self._connection, args=(conn,), name="tfe-data", daemon=True).start()

    def _connection(self, conn: ssl.SSLSocket) -> None:
        identity, counted = None, False
        try:
            peer = ssl_peer(self._tls, conn)
            identity, problem = peer.identity, peer.problem()
            if problem is None:
                with self._lock:
                    held = self._callers.get(identity, 0)
                    if held < self._max_connections:
                        self._callers[identity] = held + 1
                        counted = True
                if not counted:
                    problem = (f"{identity} already holds {held} data-plane connections to {self._name}, its limit "
                               "(each holds a thread): a second process runs as this owner, or it misbehaves.")
                    code = grpc.StatusCode.RESOURCE_EXHAUSTED
            else:
                code = grpc.StatusCode.UNAUTHENTICATED
            if problem is not None:
                _LOG.warning("%s: data plane: %s: %s", self._name, code.name, problem)
                self._reply(conn, code, problem.encode("utf-8"))
                _drain(conn)
                return
            self._calls(conn, peer)
        except (OSError, ssl.SSLError, ValueError, ConnectionError) as e:  # FrameError is a ValueError
            if not self._stopped.is_set():
                _LOG.debug("%s: data plane connection of %s closed: %s", self._name, identity, e)
        finally:
            with self._lock:
                if counted:
                    self._callers[identity] -= 1
                self._sockets.discard(conn)
            conn.close()

    def _reply(self, conn, code: grpc.StatusCode, message, replayed: bool = False) -> None:
        conn.settimeout(self._frame_timeout)
        conn.sendall(frames.reply_header(code, len(message), replayed))
        if len(message):
            conn.sendall(message)

    def _calls(self, conn: ssl.SSLSocket, peer: SslPeer) -> None:
        """Serves `peer`'s calls on `conn` one after another until it closes. Its certificate is checked again
        before each call (`SslPeer.problem`: the current trust, its validity): one no longer trusted or expired
        is refused UNAUTHENTICATED and the connection closed, as gRPC refuses it on its next call."""
        classes, identity = wire.messages(), peer.identity
        while not self._stopped.is_set():
            conn.settimeout(None)  # an idle connection waits for its next call (closed on stop)
            header = frames.read_exact(conn, frames.REQUEST.size)
            if header is None:
                return
            conn.settimeout(self._frame_timeout)
            method, head_len, meta_len, payload_len = frames.parse_request(header)
            head, meta = frames.read_exact(conn, head_len), frames.read_exact(conn, meta_len)
            if head is None or meta is None:
                raise ConnectionError("the stream ended inside a request")
            problem = peer.problem()
            if problem is not None:
                message = (f"{method} refused on {self._name} (identity is checked on every call): {problem} Ask "
                           f"{identity}'s organisation for a certificate signed by its CA (`tfe-estimator certs "
                           "sign`), or correct the federation file.")
                _LOG.warning("%s: data plane: UNAUTHENTICATED: %s", self._name, message)
                self._reply(conn, grpc.StatusCode.UNAUTHENTICATED, message.encode("utf-8"))
                _drain(conn)
                return
            received = []

            def receive(view: memoryview, conn=conn, received=received, payload_len=payload_len) -> None:
                if view.nbytes != payload_len:
                    raise Refused(grpc.StatusCode.INTERNAL, f"the payload is {payload_len} bytes, not {view.nbytes}")
                if payload_len and not frames.read_into(conn, view):
                    raise ConnectionError("the stream ended before the payload")
                received.append(True)

            try:
                try:
                    request = classes[wire.method(method).request].FromString(head)
                    metadata = frames.decode_meta(meta)
                except (DecodeError, frames.FrameError) as e:
                    raise Refused(grpc.StatusCode.INVALID_ARGUMENT, f"{method}: the request's fields or metadata do "
                                                                    f"not parse ({e}); use OwnerClient.") from None
                answer, replayed = self._serve(identity, method, request, metadata, payload_len, receive,
                                               lambda conn=conn: _alive(conn))
                code = grpc.StatusCode.OK
            except Refused as e:
                code, answer, replayed = e.code, e.message.encode("utf-8"), False
            self._reply(conn, code, answer, replayed)
            if payload_len and not received:
                _drain(conn)  # the payload of a refused call was never read: the stream is out of step, close it
                return


def _drain(conn: ssl.SSLSocket, secs: float = 1.0, limit: int = 1 << 27) -> None:
    """Reads what the caller still sends (for at most `secs`, `limit` bytes) before the connection closes, so
    that closing with unread bytes (a TCP reset) does not destroy the refusal just sent."""
    deadline, got = time.monotonic() + secs, 0
    try:
        while got < limit and time.monotonic() < deadline:
            conn.settimeout(max(0.01, deadline - time.monotonic()))
            chunk = conn.recv(1 << 16)
            if not chunk:
                return
            got += len(chunk)
    except (OSError, ssl.SSLError):
        return


def _alive(conn: ssl.SSLSocket) -> bool:
    """True while the caller waits for its answer: nothing to read (a caller sends nothing while it waits; a
    readable socket means it closed, or broke the protocol)."""
    try:
        return not conn.pending() and not _readable(conn)
    except (OSError, ValueError):
        return False


def _readable(sock) -> bool:
    """Whether `sock` has something to read (or its end closed) now; poll, not select (any fd number)."""
    poller = select.poll()
    poller.register(sock, select.POLLIN | select.POLLPRI)
    return bool(poller.poll(0))
