"""A caller's link to one aggregation server's data plane: idle TLS connections kept for the next call.

`DataLink.call` sends one request frame (`frames`) on an idle connection (or a
new one) and reads its reply: the payload is written from the caller's array
as it is (no copy before TLS encrypts it) and the reply's message is read
with ``recv_into`` into one buffer. The server is pinned like on gRPC: its
operator's CA only and its name (`TlsFiles.ssl_client_context`,
``server_hostname``). A connection that failed is closed, never reused; an
idle connection the server closed (a restart) is dropped before it is used.

Example::

    link = DataLink("tfe1.example", 7002, tls.ssl_client_context(1), server_name(tls, 1))
    code, replayed, message = link.call("Contribute", head, meta, share_bytes, timeout=600)
    link.close()
"""
import select
import socket
import ssl
import threading
import time
from typing import Any, Callable, List, Optional, Tuple

import grpc

from tfe_estimator.service import frames, wire

__all__ = ["DataLink", "LinkError", "LinkPool", "PlaneLink", "RETRY_SECS"]

#: After a server's data port could not be reached, how long its caller stays on gRPC before trying it again.
RETRY_SECS = 10.0


class LinkError(ConnectionError):
    """The call did not get an answer: the connection failed (refused, closed, timed out).

    ``sent``: whether any of the request may have reached the server (False: connecting or the TLS
    handshake failed, so the server saw nothing of this call and it may go another way, e.g. gRPC)."""

    def __init__(self, code: grpc.StatusCode, details: str, sent: bool = False):
        super().__init__(details)
        self.code, self.details, self.sent = code, details, sent


def _stale(conn: ssl.SSLSocket) -> bool:
    """An idle connection with something to read: the server closed it (an idle one is sent nothing)."""
    try:
        if conn.pending():
            return True
        poller = select.poll()  # not select: any fd number (a server with many connections has fds past 1024)
        poller.register(conn, select.POLLIN | select.POLLPRI)
        return bool(poller.poll(0))
    except (OSError, ValueError):
        return True


class LinkPool:
    """The connections of one link to one server's data plane, whatever makes them (thread-safe: each call holds
    one): idle ones reused unless stale, a failed one closed, never reused. `DataLink` (Python's `ssl`) and
    `native_link.NativeLink` (BoringSSL from C) make and use the connections; this keeps them.

    A subclass sets ``host``, ``port`` and calls ``LinkPool.__init__``; it defines ``_connect()`` (a new
    connection, or LinkError) and ``_stale(conn)``; a connection has ``close()`` and ``shutdown(how)``.

    Example::

        conn = self._take()
        ok = False
        try:
            ...  # the call on conn; ok = True if it may carry the next one
        finally:
            self._settle(conn, ok)
    """

    def __init__(self):
        self._lock = threading.Lock()
        self._idle: List[Any] = []
        self._busy: set = set()
        self._closed = False

    def _connect(self) -> Any:
        raise NotImplementedError

    def _stale(self, conn) -> bool:
        raise NotImplementedError

    def _take(self):
        """An idle connection that is not stale, else a new one; LinkError if the link is closed."""
        with self._lock:
            if self._closed:
                raise LinkError(grpc.StatusCode.CANCELLED, "the link is closed")
            while self._idle:
                conn = self._idle.pop()
                if not self._stale(conn):
                    self._busy.add(conn)
                    return conn
                conn.close()
        conn = self._connect()
        with self._lock:
            self._busy.add(conn)
        return conn

    def _settle(self, conn, ok: bool) -> None:
        """Ends a call on `conn`: kept idle if `ok` (answered OK) and the link is open, else closed (a refused
        call's connection too: the server closes it)."""
        with self._lock:
            self._busy.discard(conn)
            if ok and not self._closed:
                self._idle.append(conn)
                conn = None
        if conn is not None:
            conn.close()

    @staticmethod
    def abort(started: List) -> None:
        """Ends the call that put its connection in `started` (its `call` raises LinkError)."""
        for conn in started:
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def retire(self) -> None:
        """Takes no new call and closes the idle connections; calls still running finish on theirs (one call's
        failed connection says nothing of the others')."""
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for conn in idle:
            conn.close()

    def close(self) -> None:
        """Closes every connection; calls still running end with LinkError."""
        self.retire()
        with self._lock:
            busy = list(self._busy)
        self.abort(busy)


class DataLink(LinkPool):
    """Connections to one server's data plane with Python's `ssl` (thread-safe: each call holds one connection).

    Args:
      host, port: the server's data plane.
      context: this caller's client context (`TlsFiles.ssl_client_context`).
      server_hostname: the name the server's certificate must carry.
      connect_timeout_secs: how long connecting and the TLS handshake may take.
    """

    def __init__(self, host: str, port: int, context: ssl.SSLContext, server_hostname: str,
                 connect_timeout_secs: float = 10.0):
        super().__init__()
        self.host, self.port = host.strip("[]"), int(port)
        self._context, self._hostname = context, server_hostname
        self._connect_timeout = float(connect_timeout_secs)

    def _stale(self, conn) -> bool:
        return _stale(conn)

    def _connect(self) -> ssl.SSLSocket:
        try:
            raw = socket.create_connection((self.host, self.port), timeout=self._connect_timeout)
        except OSError as e:
            raise LinkError(grpc.StatusCode.UNAVAILABLE, f"cannot connect to the data plane at "
                                                         f"{self.host}:{self.port}: {e}") from None
        try:
            raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            return self._context.wrap_socket(raw, server_hostname=self._hostname)
        except (OSError, ssl.SSLError, ssl.CertificateError) as e:
            raw.close()
            raise LinkError(grpc.StatusCode.UNAVAILABLE, f"TLS with the data plane at {self.host}:{self.port} "
                                                         f"failed: {e}") from None

    def call(self, method: str, head: bytes, meta: bytes, payload, timeout: float,
             started: Optional[List] = None, into: Optional[bytearray] = None) -> Tuple[grpc.StatusCode, bool, Any]:
        """One call: ``(code, replayed, message)`` (the reply message's wire bytes on OK, else the refusal's
        text); LinkError if there is no answer. `started`, if given, gets the connection while the call
        waits (so that `abort` can end it). `into`: a buffer the caller reuses across calls; a reply that fits
        is read into it (``message`` is then a memoryview of its start: no fresh buffer to page in), a larger
        one into a new bytearray."""
        view = memoryview(payload).cast("B") if not isinstance(payload, memoryview) or payload.format != "B" \
            else payload
        deadline = time.monotonic() + timeout
        conn = self._take()
        if started is not None:
            started.append(conn)
        ok = False
        try:
            conn.settimeout(max(0.001, deadline - time.monotonic()))
            conn.sendall(frames.request_header(method, len(head), len(meta), view.nbytes) + head + meta)
            if view.nbytes:
                conn.sendall(view)
            conn.settimeout(max(0.001, deadline - time.monotonic()))
            header = frames.read_exact(conn, frames.REPLY.size)
            if header is None:
                raise ConnectionError("the server closed the connection without an answer")
            code, replayed, length = frames.parse_reply(header)
            message = memoryview(into)[:length] if into is not None and len(into) >= length else bytearray(length)
            if length and not frames.read_into(conn, memoryview(message)):
                raise ConnectionError("the server closed the connection inside its answer")
            ok = code == grpc.StatusCode.OK
            return code, replayed, message
        except socket.timeout:
            raise LinkError(grpc.StatusCode.DEADLINE_EXCEEDED,
                            f"no answer from the data plane at {self.host}:{self.port} within {timeout:g} s",
                            sent=True) from None
        except (OSError, ssl.SSLError, frames.FrameError) as e:
            raise LinkError(grpc.StatusCode.UNAVAILABLE, f"the data plane at {self.host}:{self.port} failed: "
                                                         f"{e}", sent=True) from None
        finally:
            self._settle(conn, ok)


class PlaneLink:
    """A caller's `DataLink` to one server's data plane, found by asking the server (its ``DataPlane`` call)
    and kept (thread-safe). The owners' client and server0 (forwarding to server1) each hold one per server.

    Asked for once; asked again at once after a call that reached the server failed (it may have restarted
    on another port), but only `RETRY_SECS` after its port could not be reached (a firewall: the caller stays
    on gRPC meanwhile instead of a connection attempt per call). Only calls up to `wire.CONTROL_MESSAGE_BYTES`
    go on gRPC instead (`grpc_refusal`): a server with a data plane reads no larger message on its gRPC port.

    Args:
      ask: ``ask(timeout) -> port`` (0: the server has no data plane); raises ``grpc.RpcError``.
      host: the server's host (its gRPC address's).
      make_link: ``(host, port) -> link`` pinned to the server (`native_link.make_link_factory`: a `DataLink`
        or the C link), called for each port the server announces (renewed certificates are taken then).

    Example::

        plane = PlaneLink(ask, "tfe1.example", make_link_factory("python", tls, 1, server_name(tls, 1)))
        link = plane.get(timeout=5.0)        # None: use gRPC
    """

    def __init__(self, ask: Callable[[float], int], host: str, make_link: Callable[[str, int], Any]):
        self._ask, self._host, self._factory = ask, host, make_link
        self._lock = threading.Lock()
        self._asked_now = threading.Condition(self._lock)
        self._asking = False
        self.link: Optional[LinkPool] = None
        self._asked: Optional[float] = None  # when the server was last asked for its port
        self._port, self._cause = 0, ""  # the port it announced last (0: none); why it could not be reached

    def get(self, timeout: float) -> Optional[LinkPool]:
        """The link, asking the server for its port if due; None: use gRPC. A failed ask raises
        ``grpc.RpcError`` and is asked again at the next call. Callers that come while the server is being
        asked wait for that answer (within `timeout`), so concurrent first calls all take the data plane."""
        with self._lock:
            if self._asking:
                self._asked_now.wait_for(lambda: not self._asking, timeout=timeout)
                return self.link
            if self.link is not None or (self._asked is not None and time.monotonic() - self._asked < RETRY_SECS):
                return self.link
            self._asked, self._asking = time.monotonic(), True
        link = None
        try:
            port = self._port = self._ask(timeout)
            if port:
                link = self._factory(self._host, port)
        except grpc.RpcError:
            with self._lock:
                self._asked = None
            raise
        finally:
            with self._lock:
                self._asking = False
                if link is not None and self.link is None:
                    self.link, link = link, None
                self._asked_now.notify_all()
        if link is not None:
            link.close()
        return self.link

    def failed(self, link: LinkPool, error: LinkError) -> None:
        """Forgets `link` after `error` (its calls still running finish on their connections)."""
        with self._lock:
            if self.link is link:
                self.link = None
                self._asked = None if error.sent else time.monotonic()
            self._cause = error.details
        link.retire()

    def grpc_refusal(self, what: str, nbytes: int, server: str) -> Optional[str]:
        """None if a message of `nbytes` may go on the server's gRPC port now that its data plane is not used;
        else why not, naming the fix (a server that announced a data plane reads no message larger than
        `wire.CONTROL_MESSAGE_BYTES` on gRPC), and the server is asked for its port again at the next call (a
        restarted server may have another). `what`: the call's content; `server`: e.g. "aggregation server1"."""
        with self._lock:
            port, cause = self._port, self._cause or "not tried"
            if not port or nbytes <= wire.CONTROL_MESSAGE_BYTES:
                return None
            self._asked = None
        return (f"{server}'s data plane (port {port}) cannot be reached ({cause}), and {what} ({nbytes} bytes) "
                f"travels only there: its gRPC port reads messages up to {wire.CONTROL_MESSAGE_BYTES} bytes, so that "
                "one owner's calls cannot make it read more than its memory budget before it knows who sent them. "
                "Open the data port like the service port, or restart the server without --data-port.")

    def close(self) -> None:
        """Closes the link; calls still running end with LinkError."""
        with self._lock:
            link, self.link = self.link, None
        if link is not None:
            link.close()
