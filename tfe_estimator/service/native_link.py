"""The owner's data-plane link in C: `DataLink`'s calls with BoringSSL doing the TLS, no Python on the data path.

`NativeLink` behaves like `data_link.DataLink` (the same `call`, `abort`,
`retire`, `close`, `LinkError` and frames): the payload is written by
``SSL_write`` straight from the caller's array, the reply's message read by
``SSL_read`` straight into ``into``, every wait a ``poll`` on a non-blocking
socket, and the GIL released for the whole call (ctypes). TLS is BoringSSL as
TensorFlow ships it (`native_build`, `native/tls_link.cc`), pinned like
`TlsFiles.ssl_client_context(server)`: that server's operator's CA only, its
name, the owner's certificate; TLS 1.2 with forward-secret AEAD suites, or 1.3.

Which link an owner uses: `OwnerClient(data_link=...)`, else the environment
variable ``TFE_ESTIMATOR_DATA_LINK``: ``auto`` (the default: the C link where it
builds, else Python's, said once in the log), ``c`` or ``python``
(`link_choice`, `resolve_link`). Asking for ``c`` where TensorFlow lacks the
BoringSSL headers or symbols (or there is no C++ compiler) raises
`native_build.NativeLinkUnavailable`. Both links pin the server alike; the C
link costs an owner less CPU (docs/benchmarks.md).

Example::

    link = NativeLink("tfe1.example", 7002, tls, 1, server_name(tls, 1))
    code, replayed, message = link.call("Contribute", head, meta, share, timeout=600, into=buffer)
    link.close()
"""
import ctypes
import functools
import logging
import os
import threading
from typing import Any, Callable, List, Optional, Tuple

import grpc
import numpy as np

from tfe_estimator.service import frames, native_build
from tfe_estimator.service.data_link import DataLink, LinkError, LinkPool
from tfe_estimator.service.tls import TlsFiles

__all__ = ["NativeLink", "LINK_ENV", "LINKS", "link_choice", "resolve_link", "make_link_factory"]

#: The environment variable that picks the owners' data-plane link when `OwnerClient` is not told.
LINK_ENV = "TFE_ESTIMATOR_DATA_LINK"
LINKS = ("auto", "python", "c")
_OK, _LARGER, _FAILED, _TIMEOUT, _ENDED = 0, 1, -1, -2, -3
_CODES = {code.value[0]: code for code in grpc.StatusCode}
_ERR = 512
_LOG = logging.getLogger("tfe_estimator")


def link_choice(choice: Optional[str] = None) -> str:
    """`choice`, else ``$TFE_ESTIMATOR_DATA_LINK``, else ``"auto"``; ValueError naming the value otherwise."""
    source = "data_link" if choice is not None else LINK_ENV
    value = (choice if choice is not None else os.environ.get(LINK_ENV, "auto")).strip().lower() or "auto"
    if value not in LINKS:
        raise ValueError(f"{source}={value!r} is not a data-plane link; pick one of {LINKS} (auto: the C link where "
                         "it builds, else Python's; python: Python's ssl; c: BoringSSL from C, native_link).")
    return value


def resolve_link(choice: str) -> str:
    """The link a `link_choice` value gives here: ``"c"`` or ``"python"``. ``"c"`` builds the C link (or raises
    `native_build.NativeLinkUnavailable` naming why); ``"auto"`` takes it where it builds, else Python's, and says
    why once in the log.

    Example::

        kind = resolve_link(link_choice())     # "c" on a TensorFlow that ships BoringSSL, with a C++ compiler
    """
    if choice == "auto":
        return _auto()
    if choice == "c":
        native_build.load()  # fails now, with its reason, rather than at the first put
    return choice


@functools.lru_cache(maxsize=None)
def _auto() -> str:
    try:
        native_build.load()
    except (native_build.NativeLinkUnavailable, OSError) as e:
        _LOG.info("tfe_estimator: the owner's data-plane link is Python's ssl: the C link is not available here "
                  "(%s). Both pin the servers alike; the C link costs less CPU.", str(e).splitlines()[0])
        return "python"
    return "c"


def make_link_factory(kind: str, tls: TlsFiles, server: int, hostname: str) -> Callable[[str, int], Any]:
    """``(host, port) -> link`` of `kind` (``"c"`` or ``"python"``: `resolve_link`'s) pinned to server `server`,
    its TLS context made for each link (renewed files are taken)."""
    if kind == "c":
        return lambda host, port: NativeLink(host, port, tls, server, hostname)
    if kind != "python":
        raise ValueError(f"kind={kind!r} is not a data-plane link here; resolve it first (resolve_link).")
    return lambda host, port: DataLink(host, port, tls.ssl_client_context(server), hostname)


def _address(buffer, writable: bool) -> Tuple[int, int, Any]:
    """``(address, bytes, keep-alive)`` of a contiguous buffer (numpy reads read-only ones without a copy)."""
    array = np.frombuffer(buffer, np.uint8) if not isinstance(buffer, np.ndarray) else buffer.reshape(-1).view(np.uint8)
    if writable and not array.flags.writeable:
        raise ValueError("into must be a writable buffer (e.g. a bytearray the caller reuses).")
    return (array.ctypes.data if array.nbytes else 0), array.nbytes, array


class _Conn:
    """One C connection; `shutdown` from another thread ends the call on it (like a socket's)."""

    def __init__(self, lib, handle: int):
        self._lib, self.handle, self._lock = lib, handle, threading.Lock()

    def shutdown(self, how: int = 2) -> None:  # pylint: disable=unused-argument  # both ways, as DataLink.abort
        with self._lock:
            if self.handle:
                self._lib.tfe_link_shutdown(self.handle)

    def close(self) -> None:
        with self._lock:
            handle, self.handle = self.handle, None
        if handle:
            self._lib.tfe_link_close(handle)

    def __del__(self):  # a connection dropped without close (a link never closed): its fd goes, like a socket's
        self.close()


class NativeLink(LinkPool):
    """Connections to one server's data plane, TLS by BoringSSL from C (thread-safe: each call holds one
    connection). Idle connections are reused, a stale one dropped, a failed one closed.

    Args:
      host, port: the server's data plane.
      tls: this caller's `TlsFiles` (its certificate and key are presented).
      server: the server's index (0 or 1): its operator's CA (``tls.trust().server_ca_pem(server)``) is the only
        one trusted.
      server_hostname: the name the server's certificate must carry (`tls.server_name`).
      connect_timeout_secs: how long connecting and the TLS handshake may take.
      library: the loaded library (tests pass a build with a planted mutation); default `native_build.load()`.
    """

    def __init__(self, host: str, port: int, tls: TlsFiles, server: int, server_hostname: str,
                 connect_timeout_secs: float = 10.0, library: Optional[ctypes.CDLL] = None):
        super().__init__()
        self._lib = library if library is not None else native_build.load()
        self.host, self.port = host.strip("[]"), int(port)
        self._connect_timeout = float(connect_timeout_secs)
        ca = tls.trust().server_ca_pem(server)
        err = ctypes.create_string_buffer(_ERR)
        self._ctx = self._lib.tfe_link_ctx_new(ca, len(ca), tls.cert.encode(), tls.key.encode(),
                                               server_hostname.encode(), err, _ERR)
        if not self._ctx:
            raise ValueError(f"TLS files of {tls.cert} cannot pin server{server} ({server_hostname}): "
                             f"{err.value.decode('utf-8', 'replace')}. Make them with `tfe-estimator certs`.")

    def _stale(self, conn: _Conn) -> bool:
        return bool(self._lib.tfe_link_stale(conn.handle))

    def _connect(self) -> _Conn:
        err, stage = ctypes.create_string_buffer(_ERR), ctypes.c_int(0)
        handle = self._lib.tfe_link_connect(self._ctx, self.host.encode(), self.port, self._connect_timeout,
                                            ctypes.byref(stage), err, _ERR)
        if not handle:
            why = err.value.decode("utf-8", "replace")
            what = (f"cannot connect to the data plane at {self.host}:{self.port}: " if stage.value == 1 else
                    f"TLS with the data plane at {self.host}:{self.port} failed: ")
            raise LinkError(grpc.StatusCode.UNAVAILABLE, what + why)
        return _Conn(self._lib, handle)

    def call(self, method: str, head: bytes, meta: bytes, payload, timeout: float,
             started: Optional[List] = None, into: Optional[bytearray] = None) -> Tuple[grpc.StatusCode, bool, Any]:
        """One call, as `DataLink.call`: ``(code, replayed, message)``; LinkError if there is no answer."""
        payload_at, payload_len, payload_keep = _address(payload, writable=False)
        into_at, into_len, into_keep = _address(into, writable=True) if into is not None else (0, 0, None)
        prefix = frames.request_header(method, len(head), len(meta), payload_len) + bytes(head) + bytes(meta)
        conn = self._take()
        if started is not None:
            started.append(conn)
        ok = False
        err, code, flags, length = (ctypes.create_string_buffer(_ERR), ctypes.c_int(0), ctypes.c_int(0),
                                    ctypes.c_uint64(0))
        try:
            status = self._lib.tfe_link_call(conn.handle, prefix, len(prefix), payload_at, payload_len, into_at,
                                             into_len, max(0.001, float(timeout)), ctypes.byref(code),
                                             ctypes.byref(flags), ctypes.byref(length), err, _ERR)
            message: Any = None
            if status == _LARGER:
                message = bytearray(length.value)
                at, _, keep = _address(message, writable=True)
                status = self._lib.tfe_link_read(conn.handle, at, length.value, max(0.001, float(timeout)), err, _ERR)
                del keep
            elif status == _OK:
                message = memoryview(into)[:length.value] if into is not None else bytearray(0)
            if status == _TIMEOUT:
                raise LinkError(grpc.StatusCode.DEADLINE_EXCEEDED, f"no answer from the data plane at "
                                f"{self.host}:{self.port} within {timeout:g} s", sent=True)
            if status != _OK:
                raise LinkError(grpc.StatusCode.UNAVAILABLE, f"the data plane at {self.host}:{self.port} failed: "
                                f"{err.value.decode('utf-8', 'replace')}", sent=True)
            if code.value not in _CODES:
                raise LinkError(grpc.StatusCode.UNAVAILABLE, f"the data plane at {self.host}:{self.port} failed: "
                                f"its answer has code {code.value}: not a data-plane reply.", sent=True)
            ok = _CODES[code.value] == grpc.StatusCode.OK
            return _CODES[code.value], bool(flags.value & frames.REPLAYED), message
        finally:
            del payload_keep, into_keep
            self._settle(conn, ok)

    def __del__(self):
        ctx, self._ctx = getattr(self, "_ctx", None), None
        if ctx:
            self._lib.tfe_link_ctx_free(ctx)
