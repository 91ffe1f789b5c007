"""One aggregation server (server0 = tfe:0, server1 = tfe:1) of the cross-organisation secure sum.

The protocol per (channel, step) with N owners (`aggregation.proto` has the API):

    owner r:   share_r, key_r = mask_share(x_r)       (its own device; share_r = enc(x_r) - AES(key_r))
    server0:   Contribute(key_r) from each owner; acc0 = sum of AES(key_r), expanded as each key arrives;
               when all N put: b = acc0 - AES(blind), blind fresh (`secrets`); ForwardBlinded(b) to server1;
               answers each owner's call with `blind`
    server1:   Contribute(share_r) from each owner + server0's b: w = sum of share_r + b = enc(sum) - AES(blind);
               answers each owner's call with w
    owner r:   sum = reveal_sum(w, key=blind)        (its own device)

Server0 holds only fresh random keys and their sum, server1 only masked
vectors, and server0's part blinded under a key it never sees.

Rules, per channel (mirroring the step accumulators of the TF-runtime version,
``step_accumulator_ops.cc``; every refusal names the channel, owners and steps):
the first put fixes ``ring_bits``/``num_elements``; one contribution per owner
and step (ALREADY_EXISTS); a stale step, at or below the last released step
unless that owner rewound to it (FAILED_PRECONDITION); owners out of step
(FAILED_PRECONDITION); a put waits at most ``step_timeout_secs``
(DEADLINE_EXCEEDED naming each missing owner and its last step). A caller is
who its certificate says (`tls.peer_identity`), never what a request says;
methods refuse callers the table in `wire.METHODS` does not list
(PERMISSION_DENIED) and methods this role does not serve (UNIMPLEMENTED).

Example::

    tls = TlsFiles.from_dir("/certs", "tfe", 1)
    server1 = AggregationServer(1, "[::]:7001", ["chief:0", "worker:0"], tls)
    server1.start()
    server0 = AggregationServer(0, "[::]:7000", ["chief:0", "worker:0"], TlsFiles.from_dir("/certs", "tfe", 0),
                                peer_address="tfe1.example:7001")
    server0.start()
    server0.wait()
"""
import concurrent.futures
import logging
import secrets
import threading
import time
from typing import Dict, List, Optional, Sequence

import grpc
import numpy as np

from tfe_estimator.service import ring, wire
from tfe_estimator.service.tls import TlsFiles, peer_identity, server_name_option

__all__ = ["AggregationServer", "SERVER_OPTIONS"]

_LOG = logging.getLogger("tfe_estimator")

#: gRPC server options: no second server on the same port, no message size limit (1e7 parameters are 80 MB).
SERVER_OPTIONS = (("grpc.so_reuseport", 0), ("grpc.max_send_message_length", -1),
                  ("grpc.max_receive_message_length", -1))
_FORWARDER = "tfe:0"
_POLL_SECS = 0.25  # how often a waiting put checks that its call is still alive
_RESTART = (" Rewind every owner to the same checkpoint step (the owners' handshake does) or restart the "
            "cluster's tasks from one checkpoint.")


class _Abort(Exception):
    """A refusal: the gRPC status code and its message."""

    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code, self.message = code, message


class _Result:
    """A released step's answer, kept until every owner took it."""

    def __init__(self, step: int, owners: int):
        self.step, self.pending = step, set(range(owners))
        self.payload = None  # bytes (server0's blind key) or the uint64 ring words (server1's w), read-only
        self.error: Optional[_Abort] = None

    @property
    def done(self) -> bool:
        return self.payload is not None or self.error is not None


class _Open:
    """The step being summed: its ring accumulator and who put what (to subtract it again on a rewind)."""

    def __init__(self, step: int, words: int):
        self.step, self.acc = step, np.zeros(words, np.uint64)
        self.parts: Dict[int, bytes] = {}  # participant -> its payload (a key or ring words), for a rewind


class _Channel:
    def __init__(self, name: str, participants: int):
        self.name = name
        self.cond = threading.Condition()
        self.settings = None  # (ring_bits, num_elements), fixed by the first put
        self.open: Optional[_Open] = None
        self.released: Optional[int] = None
        self.rewound: List[Optional[int]] = [None] * participants  # since the last release
        self.last_step: List[Optional[int]] = [None] * participants
        self.results: Dict[int, _Result] = {}


class AggregationServer:
    """One of the two aggregation servers: a grpcio server with mutual TLS.

    Args:
      role: 0 (server0, task tfe:0: keys, blinds, forwards) or 1 (server1, task tfe:1: masked shares).
      address: where to listen, e.g. ``"[::]:7000"`` (port 0: any free port, see `start`).
      owners: the data owners' identities in the configured order, e.g. ``["chief:0", "worker:0"]``.
      tls: this server's `TlsFiles` (its certificate must be tfe-<role>).
      peer_address: server1's address (server0 only).
      step_timeout_secs: how long a put waits for the other owners.
      max_workers: handler threads; every waiting put holds one (default 16 + 8 per owner).

    Example::

        server = AggregationServer(1, "[::]:0", ["chief:0", "worker:0"], TlsFiles.from_dir(d, "tfe", 1))
        port = server.start()
        ...
        server.stop(grace=1.0)
    """

    def __init__(self, role: int, address: str, owners: Sequence[str], tls: TlsFiles,
                 peer_address: Optional[str] = None, step_timeout_secs: float = 300.0,
                 max_workers: Optional[int] = None):
        if role not in (0, 1) or isinstance(role, bool):
            raise ValueError(f"role={role!r} must be 0 (server0, tfe:0) or 1 (server1, tfe:1).")
        owners = list(owners)
        if not owners or len(set(owners)) != len(owners) or not all(isinstance(o, str) for o in owners):
            raise ValueError(f"owners={owners!r} must be distinct identities like 'chief:0', 'worker:0' "
                             "(at least one).")
        if _FORWARDER in owners:
            raise ValueError(f"owners={owners!r} includes {_FORWARDER}, the aggregation server0: it cannot be "
                             "an owner.")
        if (role == 0) != (peer_address is not None):
            raise ValueError(f"peer_address={peer_address!r} for role {role}: server0 needs server1's address "
                             "(it forwards its blinded part there); server1 takes none.")
        if not isinstance(tls, TlsFiles):
            raise TypeError(f"tls={tls!r} must be a TlsFiles (mutual TLS is mandatory; there is no plaintext mode).")
        if isinstance(step_timeout_secs, bool) or not step_timeout_secs > 0:
            raise ValueError(f"step_timeout_secs={step_timeout_secs!r} must be a number > 0.")
        self._role, self._address, self._owners, self._tls = role, address, owners, tls
        self._peer_address, self._timeout = peer_address, float(step_timeout_secs)
        self._max_workers = max_workers or 16 + 8 * len(owners)
        self._lock = threading.Lock()  # the channel table and the handshake rows
        self._channels: Dict[str, _Channel] = {}
        self._rows: Dict[int, List[int]] = {}
        self._server = None
        self._peer = None
        self._forward = None
        self._stopped = threading.Event()

    # ------------------------------------------------------------ lifecycle --

    def start(self) -> int:
        """Binds and starts serving; returns the bound port."""
        if self._server is not None:
            raise RuntimeError(f"aggregation server{self._role} at {self._address} is already started.")
        classes = wire.messages()
        handlers = {}
        for m in wire.METHODS:
            handlers[m.name] = grpc.unary_unary_rpc_method_handler(
                self._handler(m), request_deserializer=classes[m.request].FromString,
                response_serializer=wire.serialize)
        server = grpc.server(concurrent.futures.ThreadPoolExecutor(max_workers=self._max_workers,
                                                                   thread_name_prefix=f"tfe-agg{self._role}"),
                             options=list(SERVER_OPTIONS))
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(wire.SERVICE_NAME, handlers),))
        try:
            port = server.add_secure_port(self._address, self._tls.server_credentials())
        except RuntimeError as e:
            port, cause = 0, e
        else:
            cause = None
        if port == 0:
            raise RuntimeError(f"aggregation server{self._role} cannot listen on {self._address} ({cause}): the "
                               "port is taken or the address is not local. Pick a free port (0 picks one).")
        if self._role == 0:
            options = list(SERVER_OPTIONS[1:]) + [server_name_option(self._tls, 1),
                                                  ("grpc.initial_reconnect_backoff_ms", 100),
                                                  ("grpc.min_reconnect_backoff_ms", 100),
                                                  ("grpc.max_reconnect_backoff_ms", 1000)]
            self._peer = grpc.secure_channel(self._peer_address, self._tls.channel_credentials(), options=options)
            self._forward = self._peer.unary_unary(
                wire.method_path("ForwardBlinded"), request_serializer=wire.serialize,
                response_deserializer=classes["ForwardReply"].FromString)
        server.start()
        self._server = server
        _LOG.info("aggregation server%d serves owners %s on port %d", self._role, self._owners, port)
        return port

    def stop(self, grace: Optional[float] = None) -> None:
        """Stops serving (waiting puts end UNAVAILABLE) and closes the link to server1."""
        self._stopped.set()
        with self._lock:
            channels = list(self._channels.values())
        for channel in channels:
            with channel.cond:
                channel.cond.notify_all()
        if self._server is not None:
            self._server.stop(grace).wait()
        if self._peer is not None:
            self._peer.close()

    def wait(self, timeout: Optional[float] = None) -> bool:
        """Blocks until the server stops (or `timeout`); True if it stopped."""
        return self._server.wait_for_termination(timeout) if self._server is not None else True

    # -------------------------------------------------------- authorisation --

    def _callers(self, method: wire.Method) -> Sequence[str]:
        """Who may call `method` (the table in `wire.METHODS`)."""
        return self._owners if method.callers == wire.OWNERS else (_FORWARDER,)

    def _serves(self, method: wire.Method) -> bool:
        return self._role in method.roles

    def _authorize(self, method: wire.Method, context) -> str:
        identity = peer_identity(context)
        if identity is None:
            raise _Abort(grpc.StatusCode.PERMISSION_DENIED,
                         f"{method.name} refused: the caller's certificate names no task (CN <job>-<index>). "
                         "Use a certificate made by tfe_estimator.cluster.certs for this cluster.")
        if identity not in self._callers(method):
            raise _Abort(grpc.StatusCode.PERMISSION_DENIED,
                         f"{identity} may not call {method.name} on aggregation server{self._role}: only "
                         f"{list(self._callers(method))} may. Check the owners configured on the servers "
                         "and the certificate this task uses.")
        if not self._serves(method):
            raise _Abort(grpc.StatusCode.UNIMPLEMENTED,
                         f"{method.name} is served by aggregation server{'/'.join(map(str, method.roles))}, "
                         f"not by server{self._role}: call tfe:{method.roles[0]} instead.")
        return identity

    def _handler(self, method: wire.Method):
        work = {"Contribute": self._contribute, "Handshake": self._handshake, "Rewind": self._rewind,
                "ForwardBlinded": self._forwarded}[method.name]
        reply = wire.messages()[method.reply]

        def handle(request, context):
            try:
                identity = self._authorize(method, context)
                return work(identity, request, context, reply)
            except _Abort as e:
                _LOG.warning("aggregation server%d: %s: %s", self._role, e.code.name, e.message)
                context.abort(e.code, e.message)
            return None  # unreachable: abort raises

        return handle

    # ------------------------------------------------------------- methods --

    def _channel(self, name: str) -> _Channel:
        with self._lock:
            channel = self._channels.get(name)
            if channel is None:
                channel = self._channels[name] = _Channel(name, len(self._owners) + 1)
            return channel

    def _name(self, participant: int) -> str:
        return self._owners[participant] if participant < len(self._owners) else f"{_FORWARDER} (server0's part)"

    def _check_request(self, request, payload: bytes, what: str) -> int:
        """Validates a put's settings and payload size; returns the ring words."""
        if not request.channel:
            raise _Abort(grpc.StatusCode.INVALID_ARGUMENT, f"{what}: empty channel name; name the sum.")
        if request.ring_bits not in ring.RING_BITS or request.num_elements < 0:
            raise _Abort(grpc.StatusCode.INVALID_ARGUMENT,
                         f"{what} to channel {request.channel!r}: ring_bits={request.ring_bits}, num_elements="
                         f"{request.num_elements}; ring_bits must be 32, 64 or 128 and num_elements >= 0.")
        words = ring.ring_words(request.num_elements, request.ring_bits)
        expected = ring.KEY_BYTES if what.startswith("Contribute") and self._role == 0 else 8 * words
        if len(payload) != expected:
            raise _Abort(grpc.StatusCode.INVALID_ARGUMENT,
                         f"{what} to channel {request.channel!r} step {request.step}: payload has "
                         f"{len(payload)} bytes, expected {expected} ("
                         f"{'a 16-byte key' if expected == ring.KEY_BYTES else 'the masked share: ring words'} "
                         f"for {request.num_elements} elements at ring {request.ring_bits}).")
        return words

    def _addend(self, payload: bytes, words: int, is_key: bool) -> np.ndarray:
        return ring.keystream_words(payload, words) if is_key else np.frombuffer(payload, "<u8")

    def _put(self, channel: _Channel, participant: int, request, payload: bytes, words: int, addend: np.ndarray):
        """Adds one contribution under the channel's lock.

        Returns ``(released step, its _Result)`` if it completed the step, else None.
        """
        me, step = self._name(participant), request.step
        settings = (request.ring_bits, request.num_elements)
        if channel.settings is None:
            channel.settings = settings
        elif channel.settings != settings:
            raise _Abort(grpc.StatusCode.FAILED_PRECONDITION,
                         f"Channel {channel.name!r}: {me} puts ring_bits={settings[0]}, num_elements={settings[1]} "
                         f"to step {step}, but the channel was set up with ring_bits={channel.settings[0]}, "
                         f"num_elements={channel.settings[1]} by its first put. Every owner must run the same "
                         "model with the same settings.")
        if participant < len(self._owners):
            rewound = channel.rewound[participant]
        else:  # server0 re-releases a stale step only once every owner rewound to it (its own rule per owner)
            floors = channel.rewound[:len(self._owners)]
            rewound = None if None in floors else max(floors)
        if channel.released is not None and step <= channel.released and (rewound is None or step < rewound):
            raise _Abort(grpc.StatusCode.FAILED_PRECONDITION,
                         f"Channel {channel.name!r}: {me} puts step {step}, but this server already released step "
                         f"{channel.released} (a stale step: a replay, or an owner restored without rewinding)."
                         + _RESTART)
        current = channel.open
        if current is not None and participant in current.parts:
            if current.step == step:
                raise _Abort(grpc.StatusCode.ALREADY_EXISTS,
                             f"Channel {channel.name!r}: {me} already contributed to step {step}; a second "
                             f"contribution is refused (two processes run as {me}? Give every owner its own "
                             "certificate).")
            raise _Abort(grpc.StatusCode.FAILED_PRECONDITION,
                         f"Channel {channel.name!r}: {me} puts step {step} while its contribution to step "
                         f"{current.step} was never released (the owners are out of step)." + _RESTART)
        if current is not None and current.step != step:
            raise _Abort(grpc.StatusCode.FAILED_PRECONDITION,
                         f"Channel {channel.name!r}: {me} puts step {step}, but step {current.step} is open with "
                         f"contributions of {[self._name(p) for p in sorted(current.parts)]} (the owners are "
                         "out of step)." + _RESTART)
        if current is None:
            current = channel.open = _Open(step, words)
        ring.add_into(current.acc, addend, request.ring_bits)
        current.parts[participant] = payload
        channel.last_step[participant] = step
        for result in list(channel.results.values()):  # an answer this owner gave up on
            if result.step != step:
                self._taken(channel, result, participant)
        complete = len(current.parts) == len(self._owners) + (self._role == 1)
        if not complete:
            return None
        channel.open, channel.released = None, step
        channel.rewound = [None] * len(channel.rewound)  # a replay of a released step is stale again
        result = channel.results[step] = _Result(step, len(self._owners))
        return current, result

    @staticmethod
    def _taken(channel: _Channel, result: _Result, participant: int) -> None:
        result.pending.discard(participant)
        if not result.pending and channel.results.get(result.step) is result:
            del channel.results[result.step]

    def _finish(self, channel: _Channel, released, request) -> None:
        """Computes a released step's answer outside the lock (server0 also forwards) and wakes the owners."""
        released, result = released
        payload, error = None, None
        if self._role == 1:
            payload = released.acc  # released: nothing adds to it any more; each answer copies it once
        else:
            blind = secrets.token_bytes(ring.KEY_BYTES)
            ring.sub_into(released.acc, ring.keystream_words(blind, released.acc.size), request.ring_bits)
            forward = wire.encode("ForwardRequest", released.acc, channel=channel.name, step=released.step,
                                  ring_bits=request.ring_bits, num_elements=request.num_elements)
            try:
                self._forward(forward, timeout=self._timeout, wait_for_ready=True)
                payload = blind
            except grpc.RpcError as e:
                error = _Abort(e.code() or grpc.StatusCode.UNKNOWN,
                               f"Channel {channel.name!r} step {released.step}: server0 could not forward its "
                               f"blinded part to server1 at {self._peer_address}: {e.details()}")
        with channel.cond:
            result.payload, result.error = payload, error
            channel.cond.notify_all()

    def _contribute(self, identity: str, request, context, reply):
        what = f"Contribute of {identity}"
        payload = request.payload  # protobuf makes a new bytes object on every access: read it once
        words = self._check_request(request, payload, what)
        owner = self._owners.index(identity)
        addend = self._addend(payload, words, is_key=self._role == 0)  # server0: the key's keystream, right away
        channel = self._channel(request.channel)
        with channel.cond:
            released = self._put(channel, owner, request, payload, words, addend)
        if released is not None:
            self._finish(channel, released, request)
        del reply  # encoded directly: the answer's bytes are copied once, into the reply
        return wire.encode("ContributeReply", self._await(channel, owner, request.step, context), step=request.step)

    def _await(self, channel: _Channel, owner: int, step: int, context):
        deadline = time.monotonic() + self._timeout
        with channel.cond:
            while True:
                result = channel.results.get(step)
                if result is not None and result.done and owner in result.pending:
                    self._taken(channel, result, owner)
                    if result.error is not None:
                        raise result.error
                    return result.payload
                if self._stopped.is_set():
                    raise _Abort(grpc.StatusCode.UNAVAILABLE, f"aggregation server{self._role} is stopping.")
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise _Abort(grpc.StatusCode.DEADLINE_EXCEEDED, self._missing(channel, step))
                if not context.is_active():
                    raise _Abort(grpc.StatusCode.CANCELLED, f"{self._owners[owner]}'s call for step {step} ended.")
                channel.cond.wait(min(_POLL_SECS, remaining))

    def _missing(self, channel: _Channel, step: int) -> str:
        if channel.open is None or channel.open.step != step:
            return (f"Channel {channel.name!r}: step {step} was not answered within {self._timeout:g} s "
                    "(server0's forward to server1 is late, or the caller's contribution was dropped by a rewind).")
        missing = []
        for p in range(len(self._owners) + (self._role == 1)):
            if p not in channel.open.parts:
                last = channel.last_step[p]
                missing.append(f"{self._name(p)} (" + ("no contribution yet" if last is None else
                                                       f"last contributed step {last}") + ")")
        return (f"Channel {channel.name!r}: step {step} is still missing {', '.join(missing)} after "
                f"{self._timeout:g} s (step_timeout_secs). Check that those tasks run and reach this server.")

    def _forwarded(self, identity: str, request, context, reply):
        del identity, context
        payload = request.payload
        words = self._check_request(request, payload, "ForwardBlinded")
        channel = self._channel(request.channel)
        with channel.cond:
            released = self._put(channel, len(self._owners), request, payload, words, np.frombuffer(payload, "<u8"))
        if released is not None:
            self._finish(channel, released, request)
        return reply()

    def _handshake(self, identity: str, request, context, reply):
        del context
        descriptor = list(request.descriptor)
        if not descriptor:
            raise _Abort(grpc.StatusCode.INVALID_ARGUMENT,
                         f"Handshake of {identity} at step {request.step}: empty descriptor; send at least one field.")
        owner = self._owners.index(identity)
        with self._lock:
            for other, row in self._rows.items():
                if other != owner and len(row) != len(descriptor):
                    raise _Abort(grpc.StatusCode.FAILED_PRECONDITION,
                                 f"Handshake of {identity} at step {request.step}: its descriptor has "
                                 f"{len(descriptor)} fields, {self._owners[other]}'s has {len(row)}. Every owner "
                                 "must run the same tfe_estimator version and model.")
            self._rows[owner] = descriptor
            rows = [self._rows.get(o, [-1] * len(descriptor)) for o in range(len(self._owners))]
        _LOG.info("aggregation server0: handshake of %s at step %d", identity, request.step)
        return reply(rows=[v for row in rows for v in row], num_fields=len(descriptor))

    def _rewind(self, identity: str, request, context, reply):
        del context
        owner = self._owners.index(identity)
        with self._lock:
            channels = list(self._channels.values())
        for channel in channels:
            with channel.cond:
                current = channel.open
                if current is not None and owner in current.parts:
                    part = self._addend(current.parts.pop(owner), current.acc.size, is_key=self._role == 0)
                    ring.sub_into(current.acc, part, channel.settings[0])
                    if not any(p < len(self._owners) for p in current.parts):
                        channel.open = None  # nothing of any owner left (a forwarded part goes with it)
                channel.rewound[owner] = request.step
                for result in list(channel.results.values()):
                    self._taken(channel, result, owner)
                channel.cond.notify_all()
        _LOG.info("aggregation server%d: %s rewound to step %d", self._role, identity, request.step)
        return reply()
