"""A data owner's client of the two aggregation servers.

Each owner masks its vector on its own device (``ops.mask_share`` -> ``share``,
``seed``), then `OwnerClient.contribute` sends the key to server0 and the
masked share to server1 at once and returns ``(blind_key, w)``; the owner
reveals locally with ``ops.reveal_sum(w, None, ..., key=blind_key)``. Server1's
answer carries the blind key sealed for this owner by server0
(`sealed_blind`): the call returns on it, without waiting for server0's
answer (which leaves server0 only once server1's release came back to it).

`get_client` keeps one client per string key in this process, so a
``tf.numpy_function`` in an owner's graph can find its client by name.

Example::

    tls = TlsFiles.from_dir("/certs", "worker", 0)
    client = OwnerClient(("tfe0.example:7000", "tfe1.example:7001"), tls)
    blind_key, w = client.contribute("grads", step, 64, n, seed, share)
    rows = client.handshake(step, np.array([1, 2, 3]), model=7)
    client.close()
"""
import contextlib
import logging
import os
import threading
import time
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import grpc
import numpy as np

from tfe_estimator.service import frames, ring, sealed_blind, wire
from tfe_estimator.service import tls as tls_lib
from tfe_estimator.service import native_link
from tfe_estimator.service.data_link import DataLink, LinkError, PlaneLink
from tfe_estimator.service.thread_pool import ThreadPool
from tfe_estimator.service.tls import TlsFiles, server_name, server_name_option

__all__ = ["OwnerClient", "ServiceError", "CLIENT_OPTIONS", "REPLY_MARGIN_BYTES", "EARLY_KEY_ENV",
           "EARLY_KEY_MIN_RTT_MS", "get_client", "live_clients", "release_client", "reply_into"]

#: Channel options of an owner: no size limit (1e7 parameters are 80 MB), reconnect within ~1 s once a server is
#: up (gRPC's default backoff grows to 120 s), no keep-alive pings (the servers do not expect any).
CLIENT_OPTIONS = (("grpc.max_send_message_length", -1), ("grpc.max_receive_message_length", -1),
                  ("grpc.initial_reconnect_backoff_ms", 100), ("grpc.min_reconnect_backoff_ms", 100),
                  ("grpc.max_reconnect_backoff_ms", 1000))

#: Bytes of server1's answer beyond its ring words, for a `reply_into` buffer: its step, the payload's field header
#: and server0's blind key sealed for each owner (`sealed_blind`: 46 bytes per owner, so ~1,400 owners fit).
REPLY_MARGIN_BYTES = 1 << 16

#: `OwnerClient`'s ``early_key`` from the environment: ``auto`` (default), ``on`` or ``off``.
EARLY_KEY_ENV = "TFE_ESTIMATOR_EARLY_KEY"
#: With ``early_key="auto"``, keys go to server0 before their shares when its round trip is at least this long: a
#: step then saves up to half of the servers' round trip; nearer, nothing is hidden (the cost of the key's own call
#: and, on one machine, of the servers' work competing with the owners' compute remain: ~7% of the 2-core loopback
#: step at 1e6, docs/benchmarks.md).
EARLY_KEY_MIN_RTT_MS = 2.0

_LOG = logging.getLogger("tfe_estimator")
#: Per thread, the buffer `reply_into` lends to this thread's `OwnerClient.contribute` calls.
_LENT = threading.local()


@contextlib.contextmanager
def reply_into(buffer: Optional[bytearray]):
    """Inside, this thread's `OwnerClient.contribute` reads server1's answer on the data plane into `buffer`
    (one the caller reuses from step to step: no fresh multi-megabyte buffer to page in per reply); the ``w``
    it returns is then a view of `buffer`, valid until the buffer is lent again. An answer larger than the
    buffer gets a new one. The caller must not reuse a buffer whose call raised (a put may still be writing).

    Example::

        buffer = bytearray(8 * words + REPLY_MARGIN_BYTES)
        with reply_into(buffer):
            blind_key, w = client.contribute("sum_0", step, 64, n, key, share)
    """
    previous, _LENT.buffer = getattr(_LENT, "buffer", None), buffer
    try:
        yield
    finally:
        _LENT.buffer = previous
#: A call still waiting after this long checks that its server answers at all; then every `_NOTICE_SECS`.
_FIRST_CHECK_SECS, _NOTICE_SECS = 3.0, 10.0
#: Codes after which an owner puts the same contribution again (within its patience): the step was aborted
#: for everyone (another owner was missing), or the server was unreachable or restarted.
_RETRY = (grpc.StatusCode.ABORTED, grpc.StatusCode.UNAVAILABLE)


_CAUSES = (("Connection refused", "connection refused"), ("DNS resolution failed", "its host name does not resolve"),
           ("No route to host", "no route to host"), ("Connection timed out", "connection timed out"))
_CONNECTION_CAUSES = tuple(said for _, said in _CAUSES)
#: How gRPC's refusal of a message above the receiver's limit begins (the receiver read none of it).
_TOO_LARGE = "Received message larger than max"


def _reason(details: str) -> str:
    """gRPC's connection error, shortened to its cause."""
    text = details or ""
    for needle, said in _CAUSES:
        if needle in text:
            return said
    return text.splitlines()[0][:300] if text else "no answer"


class ServiceError(RuntimeError):
    """A call to an aggregation server failed.

    Attributes:
      code: the `grpc.StatusCode`.
      details: the server's message, verbatim.
      method: the method called; address: the server's address.
    """

    def __init__(self, method: str, address: str, code: grpc.StatusCode, details: str):
        super().__init__(f"{method} on aggregation server {address} failed with {code.name}: {details}")
        self.method, self.address, self.code, self.details = method, address, code, details


class _CallError(grpc.RpcError):
    """A failed call's status, read like gRPC's own error (``code()``, ``details()``)."""

    def __init__(self, code: grpc.StatusCode, details: str):
        super().__init__(details)
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


class _Put:
    """One Contribute to one server, on a thread of the client's pool (`thread_pool`), read like a gRPC future
    (``done``, ``result``, ``cancel``, ``add_done_callback``, ``trailing_metadata``): on the server's data plane if
    it has one (`OwnerClient._plane`), else on gRPC."""

    def __init__(self, client: "OwnerClient", server: int, fields: dict, meta, payload, timeout: float,
                 into: Optional[bytearray] = None):
        self._client, self._server, self._fields, self._meta = client, server, fields, meta
        self._payload, self._timeout, self._into = payload, timeout, into
        self._done = threading.Event()
        self._lock = threading.Lock()
        self._callbacks: list = []
        self._started: list = []
        self._grpc = None
        self._cancelled = False
        self._reply = self._error = None
        self._trailing: tuple = ()
        client._put_threads.run(self._run)  # pylint: disable=protected-access

    def _run(self) -> None:
        try:
            link = self._client._plane(self._server, self._timeout)  # pylint: disable=protected-access
            unreachable = None if link is None else self._on_plane(link)
            if link is None or unreachable is not None:
                self._on_grpc(unreachable)
        except grpc.RpcError as e:
            self._error = e
        except Exception as e:  # pylint: disable=broad-except  # reported by result(), never lost in a thread
            self._error = _CallError(grpc.StatusCode.INTERNAL, f"{type(e).__name__}: {e}")
        finally:
            with self._lock:
                self._done.set()
                callbacks, self._callbacks = self._callbacks, []
            for callback in callbacks:
                callback(self)

    def _on_plane(self, link: DataLink) -> Optional[str]:
        """The put on the data plane; None if done, else why it cannot be reached (the server saw nothing: put on
        gRPC if the message is small enough for its gRPC port)."""
        head = self._client._messages["ContributeRequest"](**self._fields).SerializeToString()
        try:
            code, replayed, message = link.call("Contribute", head, frames.encode_meta(self._meta), self._payload,
                                                self._timeout, self._started, into=self._into)
        except LinkError as e:
            self._client._links[self._server].failed(link, e)  # pylint: disable=protected-access
            if self._cancelled:
                raise _CallError(grpc.StatusCode.CANCELLED, e.details) from None
            if not e.sent:  # connecting or its TLS handshake failed: the same mutual TLS on the gRPC port
                return e.details
            raise _CallError(e.code, e.details) from None
        if code != grpc.StatusCode.OK:
            raise _CallError(code, bytes(message).decode("utf-8", "replace"))
        self._reply = wire.decode("ContributeReply", message)
        self._trailing = ((ring.REPLAYED_METADATA, "1"),) if replayed else ()
        return None

    def _on_grpc(self, unreachable: Optional[str]) -> None:
        """The put on gRPC (`unreachable`: why the server's data plane could not be reached, if it has one)."""
        server = f"aggregation server{self._server}"
        size = wire.encoded_size("ContributeRequest", memoryview(self._payload).nbytes, **self._fields)
        refusal = self._client._links[self._server].grpc_refusal(  # pylint: disable=protected-access
            f"this owner's share for step {self._fields['step']} of {self._fields['channel']!r}", size, server)
        if refusal is not None:  # its gRPC port would refuse the message unread (the owner retries UNAVAILABLE)
            raise _CallError(grpc.StatusCode.UNAVAILABLE, refusal)
        if unreachable is not None:
            _LOG.warning("service mode: %s's data plane cannot be reached (%s); putting on its gRPC port", server,
                         unreachable)
        # The share's bytes are copied once, from the array into the message's wire bytes.
        message = wire.encode("ContributeRequest", self._payload, **self._fields)
        with self._lock:
            if self._cancelled:
                raise _CallError(grpc.StatusCode.CANCELLED, "cancelled")
            self._grpc = self._client._stubs[self._server]["Contribute"].future(  # pylint: disable=protected-access
                message, timeout=self._timeout, wait_for_ready=self._client._wait,  # pylint: disable=protected-access
                metadata=self._meta)
        try:
            self._reply = self._grpc.result()
        except grpc.RpcError as e:
            if e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and _TOO_LARGE in (e.details() or ""):
                raise _CallError(e.code(), (
                    f"{server} read none of this {size}-byte Contribute: its gRPC port refused it ({e.details()}). "
                    "A server with a data port reads shares there only (OwnerClient(data_plane=True), the default); "
                    "one without takes them on gRPC up to its --owner-memory-budget-bytes.")) from None
            raise
        self._trailing = tuple(self._grpc.trailing_metadata() or ())

    def done(self) -> bool:
        return self._done.is_set()

    def result(self):
        self._done.wait()
        if self._error is not None:
            raise self._error
        return self._reply

    def cancelled(self) -> bool:
        """False: a put cancelled ends with an error, ``CANCELLED`` (`exception`), unlike a `grpc.Future`."""
        return False

    def exception(self) -> Optional[grpc.RpcError]:
        """The call's error (None: it answered), once it is done (like `grpc.Future.exception`)."""
        self._done.wait()
        return self._error

    def trailing_metadata(self):
        return self._trailing

    def add_done_callback(self, callback) -> None:
        with self._lock:
            if not self._done.is_set():
                self._callbacks.append(callback)
                return
        callback(self)

    def cancel(self) -> bool:
        with self._lock:
            self._cancelled = True
            call = self._grpc
        if call is not None:
            call.cancel()
        DataLink.abort(self._started)
        return True


class OwnerClient:
    """One data owner's connections to server0 and server1, with mutual TLS and pinned server names.

    Args:
      addresses: ``(server0 address, server1 address)``.
      tls: this owner's `TlsFiles` (its certificate is its identity on the servers).
      timeout_secs: deadline of each call (longer than the servers' step timeout).
      wait_for_ready: calls wait for a server that is not up yet (owners may start first).
      data_plane: put contributions on a server's data plane when it has one (`data_plane`: the same
        rules and certificates without gRPC's copies); False: always gRPC (a server with a data plane reads no
        gRPC message above `wire.CONTROL_MESSAGE_BYTES`: larger shares are refused RESOURCE_EXHAUSTED unread).
      data_link: the data plane's client: ``"auto"`` (the C link where it builds, else Python's), ``"c"``
        (BoringSSL from C, `native_link.NativeLink`) or ``"python"`` (Python's ssl, `data_link.DataLink`);
        default: the environment variable ``TFE_ESTIMATOR_DATA_LINK``, else ``"auto"``. ``data_link`` (the
        attribute) is the one taken: ``"c"`` or ``"python"``.
      early_key: whether `put_key` puts a step's key on server0 before its share: ``"auto"`` (when server0 is at
        least `EARLY_KEY_MIN_RTT_MS` away, measured once: near it there is no distance to hide, and on one
        machine the servers' work would only compete with the owners' compute), ``"on"`` or ``"off"``;
        default: the environment variable ``TFE_ESTIMATOR_EARLY_KEY``, else ``"auto"``.

    Example::

        client = OwnerClient(("localhost:7000", "localhost:7001"), TlsFiles.from_dir(d, "chief", 0))
        blind_key, w = client.contribute("grads", 0, 64, x.size, seed, share)
    """

    def __init__(self, addresses: Sequence[str], tls: TlsFiles, timeout_secs: float = 600.0,
                 wait_for_ready: bool = True, retry_secs: Optional[float] = None, data_plane: bool = True,
                 data_link: Optional[str] = None, early_key: Optional[str] = None):
        addresses = tuple(addresses)
        early_key = os.environ.get(EARLY_KEY_ENV, "auto") if early_key is None else early_key
        if early_key not in ("auto", "on", "off"):
            raise ValueError(f"early_key={early_key!r} ({EARLY_KEY_ENV}): use 'auto', 'on' or 'off'.")
        if len(addresses) != 2 or not all(isinstance(a, str) and a for a in addresses):
            raise ValueError(f"addresses={addresses!r} must be (server0 address, server1 address).")
        if not isinstance(tls, TlsFiles):
            raise TypeError(f"tls={tls!r} must be a TlsFiles (mutual TLS is mandatory; there is no plaintext mode).")
        if isinstance(timeout_secs, bool) or not timeout_secs > 0:
            raise ValueError(f"timeout_secs={timeout_secs!r} must be a number > 0.")
        self._addresses, self._timeout, self._wait = addresses, float(timeout_secs), bool(wait_for_ready)
        self._retry = float(timeout_secs if retry_secs is None else retry_secs)
        self._tls = tls
        self._use_plane = bool(data_plane)
        choice = native_link.link_choice(data_link)
        self.data_link = native_link.resolve_link(choice) if self._use_plane else "python"
        #: Serialized bytes of the Contribute messages this client sent and received so far (both servers):
        #: what a contribution costs on the owner's link, before gRPC's framing and TLS records.
        self.bytes_sent = self.bytes_received = self.contributions = 0
        #: Per channel ``[fresh, replayed]``: answers of a release made for this call, and answers from the
        #: servers' replay window (a step released before, e.g. before this owner restarted; nothing was summed
        #: or released for the call). A step released once is answered fresh once per owner.
        self.answers: Dict[str, List[int]] = {}
        # Each server pinned by its operator's CA only and by its name (tls.TlsFiles.channel_credentials).
        self._channels = [grpc.secure_channel(address, tls.channel_credentials(k),
                                              options=list(CLIENT_OPTIONS) + [server_name_option(tls, k)])
                          for k, address in enumerate(addresses)]
        classes = wire.messages()
        self._messages = classes
        self._stubs = [{m.name: channel.unary_unary(wire.method_path(m.name), request_serializer=wire.serialize,
                                                    response_deserializer=wire.decoder(m.reply))
                        for m in wire.METHODS} for channel in self._channels]
        self._links = [PlaneLink(lambda timeout, k=k: self._data_port(k, timeout), address.rpartition(":")[0],
                                 native_link.make_link_factory(self.data_link, tls, k, server_name(tls, k)))
                       for k, address in enumerate(addresses)]
        self._unopened = False  # server1 answered sealed blind keys none of which opened (said once)
        #: `put_key` puts keys: True/False, or None until measured (``early_key="auto"``: `_early_wanted`)
        self._early_on: Optional[bool] = {"on": True, "off": False}.get(early_key)
        self._early_probe_after = 0.0  # server0 did not answer the measurement: not before then again
        #: (channel, step) -> (key bytes, settings, its put on server0): keys put before their shares (`put_key`)
        self._early: Dict[Tuple[str, int], tuple] = {}
        self._early_lock = threading.Lock()
        #: Threads the puts run on, kept from call to call (`thread_pool`).
        self._put_threads = ThreadPool("tfe-put")
        # A method no server serves: its answer (UNIMPLEMENTED) proves the server is there, with no side effect.
        self._probes = [channel.unary_unary(f"/{wire.SERVICE_NAME}/Probe", request_serializer=bytes,
                                            response_deserializer=bytes) for channel in self._channels]

    def unreachable(self, server: int) -> Optional[str]:
        """None if aggregation server `server` answers now; else why not, e.g. ``"connection refused"``, or
        a TLS message naming the expected and the presented identity (a swapped or foreign server)."""
        try:
            self._probes[server](b"", timeout=3.0, wait_for_ready=False)
        except grpc.RpcError as e:
            if e.code() not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                return None  # it answered (UNIMPLEMENTED): reachable, and its certificate is the pinned one
            reason = _reason(e.details() or "")
            if reason in _CONNECTION_CAUSES:
                return reason
            try:  # reached, but refused: TLS (a swapped address, another organisation's server)?
                mismatch = tls_lib.server_mismatch(self._tls, server, self._addresses[server], None)
            except Exception:  # pylint: disable=broad-except  # a diagnosis must never hide the cause
                mismatch = None
            return mismatch or reason
        return None

    def _await(self, method: str, what: str, calls: Dict[int, "grpc.Future"], start: float,
               any_of: Sequence[int] = ()) -> None:
        """Waits until every call in `calls` is done, one of them failed (it may be retried at once), or a call of
        a server in `any_of` is done (its answer is acted on at once); names a server that does not answer within
        seconds and every ~10 s after (WARNING), e.g. ``waiting for aggregation server0 at host:port: connection
        refused (20 s)``. The waiting thread wakes once per call when all goes well (each wake-up costs CPU)."""
        next_check = start + _FIRST_CHECK_SECS
        done = threading.Event()

        def settled(call) -> bool:  # `call` is done: may the waiting thread act?
            return (all(c.done() for c in calls.values()) or call.cancelled() or call.exception() is not None
                    or any(calls.get(k) is call for k in any_of))

        for call in calls.values():
            call.add_done_callback(lambda c: settled(c) and done.set())
        # the loop's own look (at least every second) also ends the wait should a callback not have set `done`
        while not done.is_set() and not any(c.done() and settled(c) for c in calls.values()):
            now = time.monotonic()
            if now >= next_check:
                next_check = now + _NOTICE_SECS
                for server in (k for k, c in calls.items() if not c.done()):
                    why = self.unreachable(server)
                    if why is not None:
                        _LOG.warning("service mode: %s of %s waits for aggregation server%d at %s: %s (%.0f s)",
                                     method, what, server, self._addresses[server], why, now - start)
                    elif now - start >= _NOTICE_SECS:
                        _LOG.info("service mode: %s of %s waits on aggregation server%d for the other owners "
                                  "(%.0f s)", method, what, server, now - start)
            done.wait(timeout=min(1.0, max(0.05, next_check - now)))

    def _plane(self, server: int, timeout: float) -> Optional[DataLink]:
        """The link to server `server`'s data plane (`data_link.PlaneLink`); None: put on gRPC."""
        return self._links[server].get(timeout) if self._use_plane else None

    def _data_port(self, server: int, timeout: float) -> int:
        """Server `server`'s data port (0: none; a server without the ``DataPlane`` call has none)."""
        try:
            return self._stubs[server]["DataPlane"](self._messages["DataPlaneRequest"](), timeout=timeout,
                                                    wait_for_ready=self._wait).port
        except grpc.RpcError as e:
            if e.code() == grpc.StatusCode.UNIMPLEMENTED:
                return 0
            raise

    def _error(self, method: str, server: int, error: grpc.RpcError) -> ServiceError:
        return ServiceError(method, self._addresses[server], error.code(), error.details())

    def _call(self, server: int, method: str, request):
        call = self._stubs[server][method].future(request, timeout=self._timeout, wait_for_ready=self._wait)
        self._await(method, f"owner {self._tls.identity()}", {server: call}, time.monotonic())
        try:
            return call.result()
        except grpc.RpcError as e:
            raise self._error(method, server, e) from None

    def put_key(self, channel: str, step: int, ring_bits: int, num_elements: int, key: np.ndarray) -> None:
        """Puts `key` (the int32[4] seed a mask of this step will use) on server0 now, before its share exists:
        server0 forwards its blinded part once every owner's key is in, while the owners still compute, and the
        `contribute` of the same step and key then puts only the share (its wait for server0's part is gone
        when the compute took longer than one server-to-server leg). Returns at once; a failed put is seen, and
        put again, by that `contribute`.

        Example::

            client.put_key("m/sum_0", step, 64, n, key)      # when the step starts
            blind_key, w = client.contribute("m/sum_0", step, 64, n, key, share)
        """
        key_bytes = np.ascontiguousarray(key, "<i4").tobytes()
        if len(key_bytes) != ring.KEY_BYTES:
            raise ValueError(f"key has {len(key_bytes)} bytes; pass the int32[4] seed of the step's mask.")
        if not self._early_wanted():
            return  # the contribution puts the key with its share
        fields = dict(channel=channel, step=step, ring_bits=ring_bits, num_elements=num_elements)
        self.bytes_sent += wire.encoded_size("ContributeRequest", len(key_bytes), **fields)
        call = _Put(self, 0, fields, None, key_bytes, self._timeout)
        with self._early_lock:
            # A put of this channel not taken by its contribution (its session run failed, or the step went back
            # to a checkpoint's): never taken now, so its call on server0 ends (the step, if nobody released it,
            # is aborted there and put again by whoever contributes to it).
            stale = [self._early.pop(k)[2] for k in list(self._early) if k[0] == channel]
            self._early[(channel, step)] = (key_bytes, (ring_bits, num_elements), call)
        for put in stale:
            put.cancel()

    def _early_wanted(self) -> bool:
        """Whether keys go to server0 before their shares (``early_key``); ``"auto"`` measures server0's round
        trip once (the least of 3 calls of a method no server serves): at least `EARLY_KEY_MIN_RTT_MS`, said in the
        log."""
        if self._early_on is None:
            if time.monotonic() < self._early_probe_after:
                return False
            rtts = []
            for _ in range(3):
                start = time.monotonic()
                try:  # a method no server serves: UNIMPLEMENTED is its answer (the channel may still be connecting)
                    self._probes[0](b"", timeout=3.0, wait_for_ready=True)
                except grpc.RpcError as e:
                    if e.code() != grpc.StatusCode.UNIMPLEMENTED:  # measured again in a minute; the contribution
                        self._early_probe_after = time.monotonic() + 60.0  # says what is wrong
                        return False
                rtts.append(1e3 * (time.monotonic() - start))
            self._early_on = min(rtts) >= EARLY_KEY_MIN_RTT_MS
            _LOG.info("service mode: aggregation server0 at %s is %.1f ms away: keys are put %s (%s=auto)",
                      self._addresses[0], min(rtts), "when the step starts" if self._early_on else "with the shares",
                      EARLY_KEY_ENV)
        return self._early_on

    def _taken_early(self, channel: str, step: int, ring_bits: int, num_elements: int, key_bytes: bytes):
        """The put of `put_key` for this step if it put this very key with these settings and has not failed
        (e.g. refused while server0 still held a put of this channel that was never taken), else None."""
        with self._early_lock:
            early = self._early.pop((channel, step), None)
        if early is None or early[0] != key_bytes or early[1] != (ring_bits, num_elements) or \
                (early[2].done() and early[2].exception() is not None):
            return None
        return early[2]

    def contribute(self, channel: str, step: int, ring_bits: int, num_elements: int, key: np.ndarray,
                   share: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
        """Puts `key` on server0 and `share` on server1 concurrently; waits for every owner of the step.

        Returns on server1's answer when the blind key sealed for this owner in it opens under `key`
        (`sealed_blind`); server0's call then ends on its own. Otherwise (a replay of a step released from another
        key of this owner; a server0 that does not seal) it waits for server0's answer too.

        Args:
          channel: the sum's name (the same in every owner).
          step: the training step.
          ring_bits, num_elements: the encoding's ring and the vector's length.
          key: the int32[4] seed of ``ops.mask_share``.
          share: its int64 masked share (``ring_words(num_elements, ring_bits)`` words, any shape).

        Returns:
          ``(blind_key int32[4], w int64 of share's shape)``: reveal with
          ``ops.reveal_sum(w, None, dtype, ring_bits, fraction_bits, scale, shapes, key=blind_key)``.

        Raises:
          ServiceError: a server refused or timed out (its message verbatim).
        """
        key_bytes = np.ascontiguousarray(key, "<i4").tobytes()
        if len(key_bytes) != ring.KEY_BYTES:
            raise ValueError(f"key has {len(key_bytes)} bytes; pass the int32[4] seed of ops.mask_share.")
        share = np.asarray(share)
        words = ring.ring_words(num_elements, ring_bits)
        if share.dtype != np.int64 or share.size != words:
            raise ValueError(f"share is {share.dtype} with {share.size} elements; ops.mask_share of "
                             f"{num_elements} elements at ring {ring_bits} gives int64 with {words}.")
        metadata = [None, ((ring.KEY_METADATA, ring.key_digest(key_bytes).hex()),)]
        lent = getattr(_LENT, "buffer", None)  # `reply_into`: server1's answer lands in the caller's buffer
        payloads = [key_bytes, np.ascontiguousarray(share.reshape(-1), "<i8")]
        fields = dict(channel=channel, step=step, ring_bits=ring_bits, num_elements=num_elements)
        start = time.monotonic()
        patience = start + max(self._retry, 0.0)
        what = f"step {step} of {channel!r}"

        def put(server):
            self.bytes_sent += wire.encoded_size("ContributeRequest", payloads[server].nbytes
                                                 if isinstance(payloads[server], np.ndarray)
                                                 else len(payloads[server]), **fields)
            timeout = max(1.0, min(self._timeout, patience - time.monotonic()) if self._retry else self._timeout)
            return _Put(self, server, fields, metadata[server], payloads[server], timeout,
                        into=lent if server == 1 else None)

        early = self._taken_early(channel, step, ring_bits, num_elements, key_bytes)
        calls = {0: early if early is not None else put(0), 1: put(1)}
        replies = {}
        recheck = False  # server1 failed before server0 answered: put on server0 again once it answers
        answered = {}  # server0's first answer's call: its replay flag counts (the same key put again is flagged)
        sealed = None  # the blind key, from server1's answer (sealed for this owner by server0): server0's not needed
        first0 = calls[0]  # any other call on server0 is this call's put again (a retry, a recheck)
        while len(replies) < 2 and sealed is None:
            # server1's answer is acted on at once (it carries the blind key sealed for this owner); server0's too
            # while `recheck` (server1 may wait for the part it forwards again)
            self._await("Contribute", what, {k: c for k, c in calls.items() if k not in replies}, start,
                        any_of=(0, 1) if recheck else (1,))
            # server1 first: an answer that carries the blind key ends the call before a failure on server0 is retried
            for server, call in sorted(calls.items(), reverse=True):
                if server in replies or not call.done():
                    continue
                try:
                    replies[server] = call.result()
                    if server == 1:
                        sealed = self._sealed_blind(key_bytes, replies[1], fields, call.trailing_metadata())
                        if sealed is not None:
                            # server0's first call ends on its own (its answer is the same key); one put again is
                            # ended now, so that a restarted server0 holds no contribution of a finished step
                            if calls[0] is not first0 and not calls[0].done():
                                calls[0].cancel()
                            break
                    if server == 0 and recheck:
                        recheck = False
                        del replies[0]
                        answered.setdefault(0, call)
                        calls[0] = put(0)
                except grpc.RpcError as e:
                    if e.code() in _RETRY and time.monotonic() < patience:
                        # The same contribution again (never a fresh one: server0 may have released the step with
                        # this key, and server1 refuses a share of another key for it). Nothing was released with
                        # it, so the servers learn nothing new; a released step answers from its replay window.
                        _LOG.warning("service mode: %s on aggregation server%d at %s: %s: %s; putting the same "
                                     "contribution again (patience %.0f s left)", what, server,
                                     self._addresses[server], e.code().name, e.details(),
                                     patience - time.monotonic())
                        time.sleep(0.2 if e.code() == grpc.StatusCode.ABORTED else 1.0)
                        calls[server] = put(server)
                        if server == 0 and 1 in replies:
                            # Server0 releases the step again (its first release failed): server1's answer must
                            # come from that same release (w and the blind key pair up), so ask server1 again.
                            del replies[1]
                            calls[1] = put(1)
                        elif server == 1:
                            # Server0 answers once server1 released the step: server1 failed since (restarted?) and
                            # may have lost the release. The same key on server0 again (now, or once server0
                            # answers) gets the same answer, and server0 forwards its same part again if server1 no
                            # longer holds the release (nothing is summed or released again).
                            recheck = 0 not in replies
                            if not recheck:
                                del replies[0]
                                answered.setdefault(0, calls[0])
                                calls[0] = put(0)
                        continue
                    for other in calls.values():
                        other.cancel()
                    raise self._error("Contribute", server, e) from None
        for server, reply in replies.items():
            if reply.step != step:
                raise ServiceError("Contribute", self._addresses[server], grpc.StatusCode.INTERNAL,
                                   f"the reply is for step {reply.step}, not for step {step}.")
        # views of the received bytes (wire.decode): no copy; the blind key sealed in server1's answer, if it was
        payloads = [replies[0].payload if sealed is None else sealed, replies[1].payload]
        self.bytes_received += sum(wire.encoded_size("ContributeReply", len(r.payload), step=r.step,
                                                     sealed_blinds=list(r.sealed_blinds)) for r in replies.values())
        self.contributions += 1
        # A step answered from the servers' replay window: server1's flag when its answer carried the blind key
        replayed = all((ring.REPLAYED_METADATA, "1") in tuple(answered.get(server, calls[server]).trailing_metadata()
                                                              or ()) for server in ((1,) if sealed else (0, 1)))
        self.answers.setdefault(channel, [0, 0])[1 if replayed else 0] += 1
        if len(payloads[0]) != ring.KEY_BYTES or len(payloads[1]) != 8 * words:
            raise ServiceError("Contribute", self._addresses[0 if len(payloads[0]) != ring.KEY_BYTES else 1],
                               grpc.StatusCode.INTERNAL,
                               f"the servers answered {len(payloads[0])} and {len(payloads[1])} bytes, not a "
                               f"16-byte blind key and {8 * words} bytes of ring words.")
        blind_key = np.frombuffer(payloads[0], "<i4").copy()
        w = np.frombuffer(payloads[1], "<i8").reshape(share.shape)  # read-only, over the reply's own bytes
        return blind_key, w

    def _sealed_blind(self, key: bytes, reply, fields: dict, trailing) -> Optional[bytes]:
        """The blind key server0 sealed for this owner in server1's answer (`sealed_blind`); None if the answer
        carries none (a server0 that does not seal) or none opens: a replay of a step released from another key
        of this owner (it restored a checkpoint: server0 answers it from its window or log), or altered on the
        way (said once per client). Then server0's own answer is waited for."""
        entries = list(reply.sealed_blinds)
        if not entries:
            return None
        blind = sealed_blind.open_own(key, entries, fields["channel"], fields["ring_bits"], fields["num_elements"],
                                      fields["step"])
        if blind is None and not self._unopened and (ring.REPLAYED_METADATA, "1") not in tuple(trailing or ()):
            self._unopened = True
            _LOG.warning("service mode: aggregation server1 at %s answered step %d of %r with %d sealed blind keys, "
                         "none of which opens under this owner's key: waiting for server0's answer instead (one "
                         "more server-to-server hop per step)", self._addresses[1], fields["step"],
                         fields["channel"], len(entries))
        return blind

    def handshake(self, step: int, descriptor,
                  model: int = 0) -> List[Tuple[int, Optional[np.ndarray], Optional[float]]]:
        """Stores this owner's row for `model` on server0; returns per owner ``(model, row, age_secs)``.

        Each owner's row for `model`, else its latest row for another model (``model`` says which), else
        ``(0, None, ...)``; ``age_secs``: since its last handshake call (None: never). See
        `tfe_estimator.service.handshake_table`.
        """
        return self.handshake_parts(step, descriptor, model)[0]

    def handshake_parts(self, step: int, descriptor, model: int = 0, part: bytes = b""):
        """`handshake` with this owner's check-seed `part` (`tfe_estimator.owner.check_seed`; empty:
        keep the previous one); returns ``(rows, parts)``, parts[o] the seed part of owner o's row."""
        descriptor = [int(v) for v in np.asarray(descriptor).reshape(-1)]
        reply = self._call(0, "Handshake", self._messages["HandshakeRequest"](step=step, descriptor=descriptor,
                                                                              model=int(model), seed_part=part))
        rows, start = [], 0
        for length, which, age in zip(reply.lengths, reply.models, reply.ages_ms):
            row = np.asarray(reply.rows[start:start + length], np.int64) if length else None
            start += length
            rows.append((int(which), row, None if age < 0 else age / 1000.0))
        parts = list(reply.seed_parts) or [b""] * len(rows)
        return rows, parts

    def rewind(self, step: int) -> None:
        """Drops this owner's unreleased contributions on both servers; it contributes from `step` again."""
        for server in (0, 1):
            self._call(server, "Rewind", self._messages["RewindRequest"](step=step))

    def close(self) -> None:
        """Closes both channels and the data-plane links, and ends the idle put threads."""
        self._put_threads.close()
        for channel in self._channels:
            channel.close()
        for plane in self._links:
            plane.close()


_CLIENTS: Dict[str, OwnerClient] = {}
_CLIENTS_LOCK = threading.Lock()


def get_client(key: str, factory: Callable[[], OwnerClient]) -> OwnerClient:
    """This process's client named `key`, made by `factory()` on first use (for ``tf.numpy_function``)."""
    with _CLIENTS_LOCK:
        if key not in _CLIENTS:
            _CLIENTS[key] = factory()
        return _CLIENTS[key]


def live_clients() -> List[OwnerClient]:
    """A snapshot of this process's clients (for byte and call counters, e.g. in the benchmark)."""
    with _CLIENTS_LOCK:
        return list(_CLIENTS.values())


def release_client(key: str) -> None:
    """Closes and forgets the client named `key` (nothing if there is none)."""
    with _CLIENTS_LOCK:
        client = _CLIENTS.pop(key, None)
    if client is not None:
        client.close()
