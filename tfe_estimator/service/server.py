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

The rules of a channel's steps (a channel is its name and settings; one
unreleased contribution per owner and channel; the replay window of released
steps; aborts; rewinds) live in `steps.StepChannel`, the memory budget in
`budget.MemoryBudget`; this module wires gRPC to them and bounds the calls one
owner may keep waiting (``max_waiting_puts``), so its handler threads always
serve every owner. A caller
is who its certificate says (`tls.peer_identity`), never what a request says;
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
import re
import secrets
import threading
from typing import Dict, Optional, Sequence, Tuple

import grpc
import numpy as np

from tfe_estimator.service import frames, native_link, ring, sealed_blind, wire
from tfe_estimator.service.data_link import DataLink, LinkError, PlaneLink
from tfe_estimator.service.data_plane import DataPlane, Refused
from tfe_estimator.service.handshake_table import HandshakeTable
from tfe_estimator.service.health import HEALTH_SERVICE, TrustedHealth
from tfe_estimator.service.metrics import ServerMetrics
from tfe_estimator.service.budget import BudgetExceeded, MemoryBudget
from tfe_estimator.service.buffers import BufferPool
from tfe_estimator.service.release_log import ReleaseLog
from tfe_estimator.service.ring import DIGESTS_METADATA, KEY_METADATA, REPLAYED_METADATA, key_digest
from tfe_estimator.service.steps import Released, ReplayLimits, StepChannel, StepRefused
from tfe_estimator.service.tls import TlsFiles, check_peer, peer_identity, server_name, server_name_option
from tfe_estimator.validation import is_int

__all__ = ["AggregationServer", "SERVER_OPTIONS"]

_LOG = logging.getLogger("tfe_estimator")

#: gRPC server options: no second server on the same port, no message size limit (1e7 parameters are 80 MB).
SERVER_OPTIONS = (("grpc.so_reuseport", 0), ("grpc.max_send_message_length", -1),
                  ("grpc.max_receive_message_length", -1))
_FORWARDER = "tfe:0"
#: gRPC metadata of server0's ForwardBlinded that only asks server1 whether it released the step from owners' keys
#: of the call's digests (server0 restarted and found the step in its `release_log`); nothing is added.
_CONFIRM_METADATA = "tfe-confirm-released"
#: gRPC metadata of server0's ForwardBlinded: the digest of the key its part is blinded with (`ring.key_digest`),
#: so that server1 takes a step's part again only if it is the one it released (server0 restarted).
_BLIND_METADATA = "tfe-blind-digest"


def _serialize(reply) -> bytes:
    """A reply message's bytes; a reply serialized ahead (a step's answer, shared by its owners) as it is."""
    return reply if isinstance(reply, bytes) else reply.SerializeToString()


def _digests(context, name: str) -> Optional[list]:
    """The key digests a call carries in its metadata `name` (hex, comma-separated), or None."""
    for key, value in context.invocation_metadata() or ():
        if key == name:
            try:
                return [bytes.fromhex(v) for v in value.split(",")]
            except ValueError:
                raise _Abort(grpc.StatusCode.INVALID_ARGUMENT,
                             f"metadata {name}={value[:80]!r} is not hex digests; use OwnerClient.") from None
    return None


class _DataContext:
    """What `_contribute` and `_forwarded` read of a gRPC context, for a data-plane call (`data_plane`)."""

    def __init__(self, metadata, alive):
        self._metadata, self.is_active, self.replayed = metadata, alive, False

    def invocation_metadata(self):
        return self._metadata

    def set_trailing_metadata(self, pairs) -> None:
        self.replayed = (REPLAYED_METADATA, "1") in tuple(pairs)


class _Abort(Exception):
    """A refusal: the gRPC status code and its message."""

    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code, self.message = code, message


class _Forwarded(_Abort):
    """Server1 did not take server0's forward: its status code and message."""


class AggregationServer:
    """One of the two aggregation servers: a grpcio server with mutual TLS.

    Args:
      role: 0 (server0, task tfe:0: keys, blinds, forwards) or 1 (server1, task tfe:1: masked shares).
      address: where to listen, e.g. ``"[::]:7000"`` (port 0: any free port, see `start`).
      owners: the data owners' identities in the configured order, e.g. ``["chief:0", "worker:0"]``.
      tls: this server's `TlsFiles` (its certificate must be tfe-<role>).
      peer_address: server1's address (server0 only).
      step_timeout_secs: how long an open step waits for its participants before it is aborted for everyone.
      max_workers: handler threads; every waiting put holds one (default: `max_waiting_puts` per owner + 16,
        so every owner always finds a thread however many calls another one makes).
      max_elements: the largest sum a channel may have (default 2**27); a channel is its name AND its
        settings, so a put of another size lands on another channel and fixes nothing.
      max_channels: how many channels (sums) the server keeps (default 4096; a model has a few); one owner
        may hold at most its share (``max_channels / owners``) of channels no step was released on yet.
      memory_budget_bytes, owner_memory_budget_bytes: what the server may hold for everyone, and for one
        owner's puts (`budget.MemoryBudget`: ring words x 8, server0's key expansion included; default
        4 GiB and 768 MiB): beyond them a put is refused RESOURCE_EXHAUSTED naming the flag.
      max_waiting_puts: how many calls of one owner may wait at once on this server (default 8, at least 2:
        an owner keeps its step's two sums in flight).
      replay_window_steps, replay_window_bytes: how many released steps per channel keep their answer for
        owners that restored an earlier checkpoint (default 64), and how many bytes of answers in all
        (default 1 GiB).
      data_address: where its data plane listens, e.g. ``"[::]:7002"`` (port 0: any free port; None: no data
        plane). Contribute and ForwardBlinded are served there too, with the same rules and certificates,
        without gRPC's copies (`data_plane`); callers learn its port from the ``DataPlane`` call. A server0
        with one forwards to server1's data plane when server1 has one.
      state_dir: server0: where it records the blind key of each step it releases before forwarding it
        (`release_log`), so that after a restart it answers the steps server1 released with the same key
        (None: nothing is kept; a server0 killed between server1's release and its own answers leaves the
        owners unable to finish that step). Server1 keeps nothing there.
      metrics_address: where to serve its Prometheus metrics (`metrics`), e.g. ``"[::]:9090"`` (plain HTTP
        ``/metrics``; port 0: any free port; None: none).

    Every server also serves the standard gRPC health service on its port (`health`), to any party of its
    federation.

    Example::

        server = AggregationServer(1, "[::]:0", ["chief:0", "worker:0"], TlsFiles.from_dir(d, "tfe", 1))
        port = server.start()
        ...
        server.stop(grace=1.0)
    """

    def __init__(self, role: int, address: str, owners: Sequence[str], tls: TlsFiles,
                 peer_address: Optional[str] = None, step_timeout_secs: float = 300.0,
                 max_workers: Optional[int] = None, max_elements: int = 2**27, max_channels: int = 4096,
                 memory_budget_bytes: int = 4 << 30, owner_memory_budget_bytes: int = 768 << 20,
                 max_waiting_puts: int = 8, replay_window_steps: int = 64, replay_window_bytes: int = 1 << 30,
                 data_address: Optional[str] = None, state_dir: Optional[str] = None,
                 metrics_address: Optional[str] = None):
        if role not in (0, 1) or isinstance(role, bool):
            raise ValueError(f"role={role!r} must be 0 (server0, tfe:0) or 1 (server1, tfe:1).")
        owners = list(owners)
        if not owners or len(set(owners)) != len(owners) or \
                not all(isinstance(o, str) and re.match(r"^[a-z0-9-]+:\d+$", o) for o in owners):
            raise ValueError(f"owners={owners!r} must be distinct task identities 'job:index' like 'chief:0', "
                             "'worker:0' (at least one), as the owners' certificates name them (CN job-index).")
        if _FORWARDER in owners:
            raise ValueError(f"owners={owners!r} includes {_FORWARDER}, the aggregation server0, which cannot be "
                             "an owner: list the data owners only.")
        if (role == 0) != (peer_address is not None):
            raise ValueError(f"peer_address={peer_address!r} for role {role}: server0 needs server1's address "
                             "(it forwards its blinded part there); server1 takes none.")
        if not isinstance(tls, TlsFiles):
            raise TypeError(f"tls={tls!r} must be a TlsFiles (mutual TLS is mandatory; there is no plaintext mode).")
        if isinstance(step_timeout_secs, bool) or not step_timeout_secs > 0:
            raise ValueError(f"step_timeout_secs={step_timeout_secs!r} must be a number > 0.")
        self._role, self._address, self._owners, self._tls = role, address, owners, tls
        self._peer_address, self._timeout = peer_address, float(step_timeout_secs)
        for name, value in (("max_elements", max_elements), ("max_channels", max_channels),
                            ("memory_budget_bytes", memory_budget_bytes),
                            ("owner_memory_budget_bytes", owner_memory_budget_bytes),
                            ("max_waiting_puts", max_waiting_puts), ("replay_window_steps", replay_window_steps),
                            ("replay_window_bytes", replay_window_bytes)):
            if not is_int(value, minimum=1):
                raise ValueError(f"{name}={value!r} must be an integer >= 1.")
        if max_waiting_puts < 2:
            raise ValueError(f"max_waiting_puts={max_waiting_puts} must be at least 2: an owner keeps up to 2 sums in "
                             "flight (its step's gradients and loss travel together); use the default 8.")
        self._max_workers = max_workers or 16 + max_waiting_puts * (len(owners) + 1)  # the owners and server0
        self._max_elements, self._max_channels = max_elements, max_channels
        self._max_waiting = max_waiting_puts
        self._waiting: Dict[str, int] = {}  # owner -> its calls waiting on this server (under self._lock)
        self._budget = MemoryBudget(memory_budget_bytes, owner_memory_budget_bytes, f"aggregation server{role}")
        # Accumulators and key expansions reused across steps (counted in the budget, dropped when it is short).
        self._pool = BufferPool(self._budget, per_size=len(owners) + 2)
        self._budget.reclaim = self._pool.reclaim
        self._ahead = None  # server0: prepares each channel's next blinded accumulator (masks ahead of data)
        self._replay = ReplayLimits(replay_window_steps, replay_window_bytes)
        # gRPC reads a whole message before any handler knows its sender: only a server1 without a data plane
        # takes shares (and server0's part) there; everyone else's gRPC port reads control messages only.
        self._receive_limit = min(owner_memory_budget_bytes + (1 << 20), 2**31 - 1) \
            if role == 1 and data_address is None else wire.CONTROL_MESSAGE_BYTES
        self._lock = threading.Lock()  # the channel table and the waiting calls
        self._channels: Dict[Tuple[str, int, int], StepChannel] = {}
        self._created_by: Dict[Tuple[str, int, int], str] = {}  # channels with no release yet -> their creator
        self._handshakes = HandshakeTable(owners)  # server0: the owners' handshake rows, per model
        self._server = None
        self._peer = None
        self._forward = None
        self._stopped = threading.Event()
        self._data_address, self._data_plane = data_address, None
        self._peer_plane: Optional[PlaneLink] = None  # server0: its link to server1's data plane
        # server0: its releases' blind keys on disk; the steps read back at start that server1 has not confirmed
        self._releases = ReleaseLog(state_dir, owners, peer_address, replay_window_steps) \
            if role == 0 and state_dir is not None else None
        self._unconfirmed = set(self._releases.recorded()) if self._releases is not None else set()
        self._reforwarding: set = set()  # server0: (channel key, step) whose part it is forwarding again (`_reforward`)
        if self._unconfirmed:
            _LOG.info("aggregation server0: %d released steps recorded in %s (answered again once server1 "
                      "confirms them)", len(self._unconfirmed), self._releases.path)
        self._health: Optional[TrustedHealth] = None
        self._metrics_address, self._metrics = metrics_address, None
        if metrics_address is not None:  # counted at the methods both ports call (`metrics`)
            self._metrics = metrics = ServerMetrics(role, self._budget, owners)
            self._admit = metrics.observe_admitted(self._admit)
            self._contribute = metrics.observe_contribute(self._contribute)
            self._forwarded = metrics.observe_forwarded(self._forwarded)
            self._send_forward = metrics.observe_forward_sent(self._send_forward)
            self._refused = metrics.observe_refused(self._refused)

    # ------------------------------------------------------------ lifecycle --

    def start(self) -> int:
        """Binds and starts serving; returns the bound port."""
        if self._server is not None:
            raise RuntimeError(f"aggregation server{self._role} at {self._address} is already started.")
        classes = wire.messages()
        handlers = {}
        for m in wire.METHODS:
            handlers[m.name] = grpc.unary_unary_rpc_method_handler(
                self._handler(m), request_deserializer=wire.decoder(m.request),
                response_serializer=_serialize)
        server = grpc.server(concurrent.futures.ThreadPoolExecutor(max_workers=self._max_workers,
                                                                   thread_name_prefix=f"tfe-agg{self._role}"),
                             options=list(SERVER_OPTIONS[:-1]) + [
                                 # a larger message is refused before it is read (`wire.CONTROL_MESSAGE_BYTES`)
                                 ("grpc.max_receive_message_length", self._receive_limit)])
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(wire.SERVICE_NAME, handlers),))
        self._health = TrustedHealth(self._health_refusal)
        self._health.add_to(server)
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
            self._ahead = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="tfe-agg0-ahead")
            options = list(SERVER_OPTIONS[1:]) + [server_name_option(self._tls, 1),
                                                  ("grpc.initial_reconnect_backoff_ms", 100),
                                                  ("grpc.min_reconnect_backoff_ms", 100),
                                                  ("grpc.max_reconnect_backoff_ms", 1000)]
            self._peer = grpc.secure_channel(self._peer_address, self._tls.channel_credentials(1), options=options)
            self._forward = self._peer.unary_unary(
                wire.method_path("ForwardBlinded"), request_serializer=wire.serialize,
                response_deserializer=classes["ForwardReply"].FromString)
            ask = self._peer.unary_unary(wire.method_path("DataPlane"), request_serializer=wire.serialize,
                                         response_deserializer=classes["DataPlaneReply"].FromString)
            self._peer_plane = PlaneLink(
                lambda timeout: ask(classes["DataPlaneRequest"](), timeout=timeout, wait_for_ready=True).port,
                self._peer_address.rpartition(":")[0],
                native_link.make_link_factory("python", self._tls, 1, server_name(self._tls, 1)))
        if self._data_address is not None:
            self._data_plane = DataPlane(self._tls, self._data_address, self._data_call,
                                         max_connections=self._max_waiting + 1,
                                         frame_timeout_secs=self._timeout, name=f"aggregation server{self._role}")
            try:
                self._data_plane.start()
            except RuntimeError:
                server.stop(None)
                raise
        if self._metrics is not None:
            try:
                self._metrics.serve(self._metrics_address)
            except RuntimeError:
                server.stop(None)
                if self._data_plane is not None:
                    self._data_plane.stop()
                raise
        server.start()
        self._server = server
        if self._data_plane is not None:
            _LOG.info("aggregation server%d: data plane on port %d", self._role, self._data_plane.port)
        elif self._role == 1:
            _LOG.warning("aggregation server1 has no data port: the owners' shares come on its gRPC port, which reads "
                         "each message whole (up to %d bytes) before the server knows who sent it, so one owner's "
                         "concurrent calls can make it hold more than its memory budget. Start it with --data-port "
                         "(its gRPC port then reads messages up to %d bytes).", self._receive_limit,
                         wire.CONTROL_MESSAGE_BYTES)
        if self._metrics is not None:
            _LOG.info("aggregation server%d: Prometheus metrics at http://%s:%d/metrics", self._role,
                      self._metrics_address.rpartition(":")[0], self._metrics.port)
        _LOG.info("aggregation server%d serves owners %s on port %d", self._role, self._owners, port)
        return port

    def stop(self, grace: Optional[float] = None) -> None:
        """Stops serving (waiting puts end UNAVAILABLE) and closes the link to server1."""
        self._stopped.set()
        if self._health is not None:
            self._health.stop()
        with self._lock:
            channels = list(self._channels.values())
        for channel in channels:
            channel.wake()
        if self._data_plane is not None:
            self._data_plane.stop()
        if self._server is not None:
            self._server.stop(grace).wait()
        if self._peer is not None:
            self._peer.close()
        if self._peer_plane is not None:
            self._peer_plane.close()
        if self._ahead is not None:
            self._ahead.shutdown(wait=False, cancel_futures=True)
        if self._releases is not None:
            self._releases.close()
        if self._metrics is not None:
            self._metrics.close()
        self._pool.reclaim()

    @property
    def metrics_port(self) -> Optional[int]:
        """The port of its Prometheus metrics (None: it serves none)."""
        return self._metrics.port if self._metrics is not None else None

    def wait(self, timeout: Optional[float] = None) -> bool:
        """Blocks until the server stops (or `timeout`); True if it stopped."""
        return self._server.wait_for_termination(timeout) if self._server is not None else True

    # -------------------------------------------------------- authorisation --

    def _callers(self, method: wire.Method) -> Sequence[str]:
        """Who may call `method` (the table in `wire.METHODS`)."""
        return {wire.OWNERS: self._owners, wire.SERVER0: (_FORWARDER,),
                wire.OWNERS_AND_SERVER0: self._owners + [_FORWARDER]}[method.callers]

    def _serves(self, method: wire.Method) -> bool:
        return self._role in method.roles

    def _authorize(self, method: wire.Method, context) -> str:
        identity = self._trusted(method.name, context)
        self._admit(method, identity)
        return identity

    def _trusted(self, what: str, context) -> str:
        """The caller's identity if its certificate proves it a party of the federation; else `_Abort`."""
        identity = peer_identity(context)
        if identity is None:
            raise _Abort(grpc.StatusCode.PERMISSION_DENIED,
                         f"{what} refused: the caller's certificate names no task (CN <job>-<index>). "
                         "Use a certificate made by `tfe-estimator certs` for this cluster.")
        problem = check_peer(self._tls, identity, context)  # issued by the CA of identity's own organisation
        if problem is not None:
            raise _Abort(grpc.StatusCode.UNAUTHENTICATED,
                         f"{what} refused on aggregation server{self._role}: {problem} Ask "
                         f"{identity}'s organisation for a certificate signed by its CA (`tfe-estimator certs "
                         "sign`), or correct the federation file.")
        return identity

    def _health_refusal(self, context):
        """`health.TrustedHealth`'s check: None for any party of the federation, else its refusal's code and text."""
        try:
            self._trusted(f"{HEALTH_SERVICE} call", context)
        except _Abort as e:
            return self._refused(e), e.message
        return None

    def _admit(self, method: wire.Method, identity: str) -> None:
        """Refuses `identity` (proved by its certificate) a method it may not call or this role does not serve."""
        if method.callers != wire.PARTIES and identity not in self._callers(method):  # PARTIES: `_trusted` only
            raise _Abort(grpc.StatusCode.PERMISSION_DENIED,
                         f"{identity} may not call {method.name} on aggregation server{self._role}: only "
                         f"{list(self._callers(method))} may. Check the owners configured on the servers "
                         "and the certificate this task uses.")
        if not self._serves(method):
            raise _Abort(grpc.StatusCode.UNIMPLEMENTED,
                         f"{method.name} is served by aggregation server{'/'.join(map(str, method.roles))}, "
                         f"not by server{self._role}: call tfe:{method.roles[0]} instead.")

    def _refused(self, refusal) -> grpc.StatusCode:
        """Logs a refusal (`StepRefused` or `_Abort`, on either port); returns its gRPC status code."""
        code = grpc.StatusCode[refusal.code] if isinstance(refusal, StepRefused) else refusal.code
        _LOG.warning("aggregation server%d: %s: %s", self._role, code.name, refusal.message)
        return code

    def _handler(self, method: wire.Method):
        work = {"Contribute": self._contribute, "Handshake": self._handshake, "Rewind": self._rewind,
                "ForwardBlinded": self._forwarded, "DataPlane": self._data_port, "Status": self._status}[method.name]
        reply = wire.messages()[method.reply]

        def handle(request, context):
            try:
                identity = self._authorize(method, context)
                return work(identity, request, context, reply)
            except (StepRefused, _Abort) as e:
                # only its code and text outlive the block: the refusal's traceback holds the call's frames (a
                # key's expansion, a received share) and, kept in this frame, would keep them in a reference
                # cycle until the garbage collector ran, uncounted by the budget
                code, message = self._refused(e), e.message
            context.abort(code, message)
            return None  # unreachable: abort raises

        return handle

    # ------------------------------------------------------------- methods --

    def _channel(self, identity: Optional[str], request) -> Tuple[Tuple[str, int, int], StepChannel]:
        """The channel (name AND settings) a put goes to; made on first use within the limits on channels.
        Counted as in use until `_unhold`: the caller registers its put in it in between."""
        key = (request.channel, int(request.ring_bits), int(request.num_elements))
        with self._lock:
            channel = self._channels.get(key)
            if channel is not None:
                channel.users += 1
                return key, channel
            # nothing open, nothing stored, and no put between finding it here and registering in it (a channel
            # forgotten in that window would keep its put while the others' went to a new one: a stalled step)
            for other in [k for k, c in self._channels.items() if c.users == 0 and c.idle()]:
                self._pool.unstock(self._channels.pop(other))
                self._created_by.pop(other, None)
            if len(self._channels) >= self._max_channels:
                raise _Abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                             f"Service mode: channel {request.channel!r}: aggregation server{self._role} already "
                             f"keeps {len(self._channels)} channels (--max-channels={self._max_channels}); a model's "
                             "sums need a few. Start the servers with a larger --max-channels if the models really "
                             "have more.")
            share = max(1, self._max_channels // len(self._owners))
            mine = sum(1 for k, who in self._created_by.items() if who == identity and
                       not self._channels[k].ever_released)
            if identity is not None and mine >= share:
                raise _Abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                             f"Service mode: channel {request.channel!r}: {identity} already opened {mine} channels "
                             f"on aggregation server{self._role} that no step was released on, its share of "
                             f"--max-channels={self._max_channels} ({share} per owner). Its sums do not match the "
                             "other owners' (another model or settings?), or it misbehaves.")
            forwarder = f"{_FORWARDER} (server0's part)" if self._role == 1 else None
            channel = self._channels[key] = StepChannel(
                request.channel, int(request.ring_bits), int(request.num_elements), self._owners, forwarder,
                self._remove_part, self._replay, self._budget, self._timeout, self._pool)
            if identity is not None:
                self._created_by[key] = identity
            channel.users += 1
            return key, channel

    def _check_request(self, request, nbytes: int, what: str) -> int:
        """Validates a put's settings and its payload's size `nbytes`; returns the ring words."""
        if not request.channel:
            raise _Abort(grpc.StatusCode.INVALID_ARGUMENT, f"{what}: empty channel name; name the sum.")
        if request.ring_bits not in ring.RING_BITS or request.num_elements < 0:
            raise _Abort(grpc.StatusCode.INVALID_ARGUMENT,
                         f"{what} to channel {request.channel!r}: ring_bits={request.ring_bits}, num_elements="
                         f"{request.num_elements}; ring_bits must be 32, 64 or 128 and num_elements >= 0.")
        if request.num_elements > self._max_elements:
            raise _Abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                         f"{what} to channel {request.channel!r}: num_elements={request.num_elements} is above this "
                         f"server's max_elements={self._max_elements} (--max-elements); start the servers with a "
                         "larger --max-elements for a model that large.")
        words = ring.ring_words(request.num_elements, request.ring_bits)
        expected = ring.KEY_BYTES if what.startswith("Contribute") and self._role == 0 else 8 * words
        if nbytes != expected:
            raise _Abort(grpc.StatusCode.INVALID_ARGUMENT,
                         f"{what} to channel {request.channel!r} step {request.step}: payload has "
                         f"{nbytes} bytes, expected {expected} ("
                         f"{'a 16-byte key' if expected == ring.KEY_BYTES else 'the masked share: ring words'} "
                         f"for {request.num_elements} elements at ring {request.ring_bits}).")
        return words

    def _addend(self, payload: bytes, out: Optional[np.ndarray] = None) -> np.ndarray:
        """What an owner's payload adds to the sum: server0 its key's keystream, written into `out` (a buffer
        whose bytes the put reserved), server1 its ring words (a view of the payload)."""
        if self._role == 0 and len(payload) == ring.KEY_BYTES:
            return ring.keystream_into(payload, out)
        return np.frombuffer(payload, "<u8")

    def _remove_part(self, acc: np.ndarray, payload, ring_bits: int) -> None:
        """Subtracts an owner's payload from a sum (a rewind): server0 its key's keystream, drawn a block at a time
        (no expansion of the sum's size, which the budget would not count); server1 its ring words."""
        if self._role == 0 and len(payload) == ring.KEY_BYTES:
            ring.keystream_apply(payload, acc, ring_bits, subtract=True)
        else:
            ring.sub_into(acc, np.frombuffer(payload, "<u8"), ring_bits)

    def _prepare(self, channel: StepChannel) -> None:
        """Server0, in the background after a release: the channel's next accumulator, ``-AES(blind)`` under a
        fresh blind key (`BufferPool.stock`), so the next release only forwards. Masks do not depend on data."""
        if self._stopped.is_set():
            return
        nbytes = 8 * channel.words
        try:  # counted while it is being prepared too; never at the cost of a put (no reclaim)
            self._budget.reserve(None, nbytes, f"the next accumulator of {channel.label}", reclaim=False)
        except BudgetExceeded:
            return
        try:
            acc = self._pool.take(channel.words)
            blind = secrets.token_bytes(ring.KEY_BYTES)
            ring.negate(ring.keystream_into(blind, acc), channel.ring_bits)
        finally:
            self._budget.free(None, nbytes)
        if not self._pool.stock(channel, acc, blind):
            self._pool.give(acc)

    def _finish(self, channel: StepChannel, released: Released) -> None:
        """Computes a released step's answer outside the channel's lock (server0 also forwards); wakes the owners."""
        sealed = ()
        if self._role == 1:
            payload, sealed = released.acc, released.result.sealed or ()
        else:
            keys = [bytes(released.parts[o]) for o in range(len(self._owners))]
            blind = self._blind(channel, released, [key_digest(k) for k in keys])
            try:
                self._send_forward(channel, released, keys, blind)
            except _Forwarded as e:
                channel.finish(released, None, StepRefused(
                    e.code.name, f"Service mode, {channel.label} step {released.step}: server0 could not forward "
                                 f"its blinded part to server1 at {self._peer_address}: {e.message}"))
                return
            # what forwards the same part again if server1 loses the release (`_reforward`): 16 bytes per owner
            released.result.keys = (keys, blind)
            payload = blind
        # The one copy: the answer is bytes of its own, stored in the replay window while the buffer is reused.
        channel.finish(released, wire.encode("ContributeReply", payload, step=released.step, sealed_blinds=sealed))
        if self._metrics is not None:
            self._metrics.released()
        if self._ahead is not None and not self._stopped.is_set():
            try:
                self._ahead.submit(self._prepare, channel)
            except RuntimeError:  # stopping
                pass

    @staticmethod
    def _seal(channel: StepChannel, step: int, keys: Sequence[bytes], blind: bytes) -> Tuple[bytes, ...]:
        """Server0: its blind key sealed for each owner under that owner's key of the step (`sealed_blind`),
        in owner order: server1 puts them in the step's answer, so the owners need not wait for server0's."""
        return tuple(sealed_blind.seal(key, blind, channel.name, channel.ring_bits, channel.num_elements, step)
                     for key in keys)

    def _blind(self, channel: StepChannel, released: Released, summed) -> bytes:
        """Server0: blinds a released step's sum (``acc -= AES(blind)``) and records the blind key before the
        forward (`release_log`); returns the key. A step recorded before a restart and summed again from keys
        of the recorded digests takes the recorded key: its forwarded part is the one server1 may hold."""
        key = (channel.name, channel.ring_bits, channel.num_elements)
        record = self._releases.get(key, released.step) if self._releases is not None else None
        blind = record.blind if record is not None and list(record.digests) == summed else None
        prepared = released.blind  # the accumulator already holds -AES(prepared) (masks ahead of data)
        if blind is not None and prepared is not None:
            self._keystream(released, prepared, ring.add_into)  # the recorded key instead of the prepared one
        if blind is None and prepared is None:  # no prepared accumulator (the channel's first step)
            blind = secrets.token_bytes(ring.KEY_BYTES)
        if blind is None:
            blind = prepared
        else:
            self._keystream(released, blind, ring.sub_into)
        if self._releases is not None:
            try:
                self._releases.write(key, released.step, blind, summed)
            except OSError as e:  # the step is still released; only a restart in its window would lose it
                _LOG.error("aggregation server0: cannot record step %d of %s in %s (%s): a restart of server0 "
                           "before it answers the owners would leave them unable to finish the step",
                           released.step, channel.label, self._releases.path, e)
            with self._lock:
                self._unconfirmed.discard((key, released.step))
        return blind

    @staticmethod
    def _keystream(released: Released, key16: bytes, apply) -> None:
        """``apply(acc, AES(key16))`` on a released step's accumulator (ring.add_into or ring.sub_into), the
        keystream drawn a block at a time (`ring.keystream_apply`: no second vector of the sum's size)."""
        ring.keystream_apply(key16, released.acc, released.ring_bits, subtract=apply is ring.sub_into)

    def _recover(self, channel: StepChannel, step: int) -> None:
        """Server0, before a put: a step recorded before a restart (`release_log`) that server1 confirms it
        released from keys of the recorded digests is answered from the record (a replay, as before the
        restart); otherwise it is summed anew. Each recorded step is asked about once."""
        key = (channel.name, channel.ring_bits, channel.num_elements)
        with self._lock:
            if (key, step) not in self._unconfirmed:
                return
        record = self._releases.get(key, step)
        if record is None:  # left the log's window since
            with self._lock:
                self._unconfirmed.discard((key, step))
            return
        confirmed = self._held_by_server1(channel, step, ",".join(d.hex() for d in record.digests),
                                          key_digest(record.blind).hex())
        if confirmed is None:
            return  # no answer (server1 down?): the put goes on, the next one asks again
        with self._lock:
            if (key, step) not in self._unconfirmed:
                return
            self._unconfirmed.discard((key, step))
        if confirmed and channel.restore(step, wire.encode("ContributeReply", record.blind, step=step),
                                         record.digests):
            _LOG.info("aggregation server0: step %d of %s answered from %s (server1 released it before this "
                      "server restarted)", step, channel.label, self._releases.path)

    def _held_by_server1(self, channel: StepChannel, step: int, digests: str, blind_digest: str) -> Optional[bool]:
        """Server0 asks server1 whether it holds the release of `step` from owners' keys of `digests` (hex,
        comma-separated) and a part blinded with a key of `blind_digest` (`_confirm`): None if it did not answer."""
        request = wire.encode("ForwardRequest", b"", channel=channel.name, step=step, ring_bits=channel.ring_bits,
                              num_elements=channel.num_elements)
        meta = ((DIGESTS_METADATA, digests), (_BLIND_METADATA, blind_digest), (_CONFIRM_METADATA, "1"))
        try:
            self._forward(request, timeout=self._timeout, wait_for_ready=True, metadata=meta)
        except grpc.RpcError as e:
            return False if e.code() == grpc.StatusCode.FAILED_PRECONDITION else None
        return True

    def _reforward(self, identity: str, channel: StepChannel, result, owner: int, payload) -> None:
        """Server0, after answering a put from its window: if the put is the owner's same key of that release (its
        client puts a step on server0 again when server1 failed after server0 had answered), asks server1 whether it
        still holds the release and, if it does not (it restarted before it answered the owners), forwards the same
        part again: the release's own keys and blind key, so server1's answer pairs with the blind key the owners
        got. Nothing is summed or released again here; one such forward per step at a time."""
        if result.keys is None or bytes(payload) != result.keys[0][owner]:
            return  # a step restored from the release log, or another key (an owner restored from a checkpoint)
        keys, blind = result.keys
        task = ((channel.name, channel.ring_bits, channel.num_elements), result.step)
        with self._lock:
            if task in self._reforwarding:
                return
            self._reforwarding.add(task)
        try:
            digests = ",".join(key_digest(k).hex() for k in keys)
            blind_digest = key_digest(blind).hex()
            if self._held_by_server1(channel, result.step, digests, blind_digest) is not False:
                return  # it holds the release (its answer is in its window), or no answer: the next put asks again
            nbytes = 8 * channel.words
            try:
                self._budget.reserve(identity, nbytes, f"server0's part of step {result.step} of {channel.label}, "
                                                       "forwarded again")
            except BudgetExceeded as e:
                _LOG.warning("aggregation server0: %s", e.message)
                return
            acc = self._pool.take(channel.words)
            try:
                ring.negate(ring.keystream_into(blind, acc), channel.ring_bits)  # -AES(blind) + sum of AES(key)
                for key in keys:
                    ring.keystream_apply(key, acc, channel.ring_bits)
                again = Released(result.step, acc, channel.ring_bits, channel.num_elements, result, {})
                try:
                    self._send_forward(channel, again, keys, blind)
                except _Forwarded as e:
                    _LOG.warning("aggregation server0: step %d of %s: server1 did not take the part forwarded "
                                 "again: %s: %s", result.step, channel.label, e.code.name, e.message)
                else:
                    _LOG.info("aggregation server0: step %d of %s forwarded again: server1 no longer held its "
                              "release (it restarted before it answered the owners)", result.step, channel.label)
            finally:
                self._budget.free(identity, nbytes)
                self._pool.give(acc, identity)
        finally:
            with self._lock:
                self._reforwarding.discard(task)

    def _unhold(self, channel: StepChannel) -> None:
        """Ends a `_channel` use (the put is registered in it, or refused)."""
        with self._lock:
            channel.users -= 1

    def _enter(self, identity: str) -> None:
        """Counts one more waiting call of `identity`; refuses past ``max_waiting_puts``."""
        with self._lock:
            waiting = self._waiting.get(identity, 0)
            if waiting >= self._max_waiting:
                raise _Abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                             f"Service mode: {identity} already has {waiting} calls waiting on aggregation "
                             f"server{self._role} (--max-waiting-puts={self._max_waiting}). An owner keeps at most "
                             "2 sums in flight (a step's gradients and loss): a second process runs as this owner, "
                             "or it misbehaves.")
            self._waiting[identity] = waiting + 1

    def _leave(self, identity: str) -> None:
        with self._lock:
            self._waiting[identity] -= 1

    def _contribute(self, identity: str, request, context, reply):
        del reply  # the answer is serialized once per step (see _serialize)
        payload = request.payload
        words = self._check_request(request, len(payload), f"Contribute of {identity}")
        owner = self._owners.index(identity)
        self._enter(identity)
        try:
            _, channel = self._channel(identity, request)
            try:
                if self._unconfirmed:
                    self._recover(channel, request.step)
                expansion = 8 * words if self._role == 0 else 0  # server0 expands the key to ring words
                try:
                    self._budget.reserve(identity, expansion, f"the expansion of its key for {channel.label}")
                except BudgetExceeded as e:
                    raise StepRefused(e.code, e.message) from None
                addend = None
                try:
                    # server0: the key's keystream, outside any lock, into a buffer reused across steps
                    addend = self._addend(payload, self._pool.take(words) if self._role == 0 else None)
                    ticket = channel.put(owner, request.step, payload, addend, _digests(context, KEY_METADATA))
                finally:
                    self._budget.free(identity, expansion)
                    if self._role == 0 and addend is not None:
                        self._pool.give(addend, identity)  # a spare charged to the owner whose put made it
                    del addend
            finally:
                self._unhold(channel)
            if ticket.released is not None:
                self._finish(channel, ticket.released)
            answer = channel.wait(owner, ticket, alive=lambda: context.is_active() and not self._stopped.is_set())
            if self._role == 0 and ticket.replay is not None:
                self._reforward(identity, channel, ticket.replay, owner, payload)
            # the owner counts a replay apart from releases (OwnerClient.answers)
            digest = key_digest(payload) if self._role == 0 else (_digests(context, KEY_METADATA) or [None])[0]
            if ticket.replay is not None and not channel.first_answer(ticket, owner, digest):
                context.set_trailing_metadata(((REPLAYED_METADATA, "1"),))
            return answer
        finally:
            self._leave(identity)

    def _forwarded(self, identity: str, request, context, reply):
        """Server0's part of a step: waits until server1 released the step (or aborted it), so that server0
        keeps an answer only for a step server1 released too."""
        payload = request.payload
        blind = _digests(context, _BLIND_METADATA)
        blind = blind[0] if blind else None
        if any(key == _CONFIRM_METADATA for key, _ in context.invocation_metadata() or ()):
            return self._confirm(request, _digests(context, DIGESTS_METADATA), blind, reply)
        self._check_request(request, len(payload), "ForwardBlinded")
        sealed = list(request.sealed_blinds)
        if sealed and (len(sealed) != len(self._owners) or
                       any(len(entry) != sealed_blind.SEALED_BYTES for entry in sealed)):
            raise _Abort(grpc.StatusCode.INVALID_ARGUMENT,
                         f"ForwardBlinded of step {request.step} of {request.channel!r}: {len(sealed)} sealed blind "
                         f"keys of {sorted({len(e) for e in sealed})} bytes; server0 seals one of "
                         f"{sealed_blind.SEALED_BYTES} bytes per owner ({len(self._owners)}).")
        self._enter(identity)
        try:
            _, channel = self._channel(None, request)
            forwarder = len(self._owners)
            try:
                ticket = channel.put(forwarder, request.step, payload, np.frombuffer(payload, "<u8"),
                                     _digests(context, DIGESTS_METADATA), blind, sealed=tuple(sealed) or None)
            finally:
                self._unhold(channel)
            if ticket.released is not None:
                self._finish(channel, ticket.released)
            channel.wait(forwarder, ticket, alive=lambda: context.is_active() and not self._stopped.is_set())
        finally:
            self._leave(identity)
        return reply()

    def _confirm(self, request, digests, blind, reply):
        """Server1: answers server0's question whether it released a step from owners' keys of `digests` and
        a part blinded with a key of digest `blind` (`_recover`): OK if so, else FAILED_PRECONDITION. Nothing is
        added, opened or released."""
        with self._lock:
            channel = self._channels.get((request.channel, int(request.ring_bits), int(request.num_elements)))
        if request.payload or digests is None or blind is None or channel is None or \
                not channel.released(request.step, digests, blind):
            raise _Abort(grpc.StatusCode.FAILED_PRECONDITION,
                         f"Service mode: channel {request.channel!r} step {request.step}: aggregation server1 holds "
                         "no release of that step from owners' keys and a blind key of those digests (server0 sums it "
                         "anew after its own restart, or forwards its same part again after this server's).")
        return reply()

    def _data_port(self, identity: str, request, context, reply):
        del identity, request, context
        return reply(port=self._data_plane.port if self._data_plane is not None else 0)

    def _status(self, identity: str, request, context, reply):
        """The newest released step of each channel this server keeps: names and step numbers, never values
        (steps released are no secret among the federation's parties; a channel's name is its model id and sum)."""
        del identity, request, context
        with self._lock:
            latest = sorted((c.name, c.last_released) for c in self._channels.values() if c.last_released is not None)
        return reply(channels=[name for name, _ in latest], steps=[step for _, step in latest])

    def _data_call(self, identity: str, name: str, request, metadata, nbytes: int, receive, alive):
        """A Contribute or ForwardBlinded on the data plane (`data_plane.DataPlane`'s handler): the same
        checks as on gRPC, the payload read into a reused buffer once its size and budget are checked."""
        method = wire.method(name)
        try:
            self._admit(method, identity)
            what = f"Contribute of {identity}" if name == "Contribute" else "ForwardBlinded"
            words = self._check_request(request, nbytes, what)
            payer = identity if identity in self._owners else None
            try:  # the bytes are reserved before they are read (gRPC's counterpart: its receive limit)
                self._budget.reserve(payer, nbytes, f"receiving {what} for channel {request.channel!r}")
            except BudgetExceeded as e:
                raise StepRefused(e.code, e.message) from None
            try:
                buffer = self._pool.take(words) if nbytes == 8 * words else bytearray(nbytes)
                receive(memoryview(buffer).cast("B"))
            finally:
                self._budget.free(payer, nbytes)
            context = _DataContext(metadata, alive)
            decoded = wire.Decoded(request, memoryview(buffer).cast("B"))
            if name == "Contribute":
                answer = self._contribute(identity, decoded, context, None)
            else:
                self._forwarded(identity, decoded, context, wire.messages()["ForwardReply"])
                answer = b""
        except (StepRefused, _Abort) as e:
            raise Refused(self._refused(e), e.message) from None
        # Released (its contribution left the step) or answered from the window (never added): reuse the buffer,
        # a spare charged to the caller whose bytes it held.
        self._pool.give(buffer, payer)
        return answer, context.replayed

    def _peer_link(self, size: int) -> Optional[DataLink]:
        """Server0's link to server1's data plane (None: forward on gRPC), waiting for server1 as gRPC would if
        the part (`size` bytes) is too large for its gRPC port."""
        try:
            return self._peer_plane.get(timeout=5.0)
        except grpc.RpcError:
            if size > wire.CONTROL_MESSAGE_BYTES:  # a part only its data plane reads, if it has one
                try:
                    return self._peer_plane.get(timeout=self._timeout)
                except grpc.RpcError:
                    pass
        return None  # server1 unreachable now, or without the call: the gRPC forward waits for it

    def _forward_on_plane(self, link: Optional[DataLink], fields: dict, meta,
                          acc: np.ndarray) -> Tuple[bool, Optional[str]]:
        """The forward on server1's data plane: ``(True, None)`` if server1 took it; ``(False, None)`` without a
        `link`; ``(False, why)`` if the data plane cannot be reached (server1 saw nothing: the part may go another
        way). `_Forwarded` if server1 refused it or may hold it (bytes sent, no answer)."""
        if link is None:
            return False, None
        head = wire.messages()["ForwardRequest"](**fields).SerializeToString()
        try:
            code, _, message = link.call("ForwardBlinded", head, frames.encode_meta(meta), acc, self._timeout)
        except LinkError as e:
            self._peer_plane.failed(link, e)
            if e.sent:  # it may sit in server1's step: forwarding it again would be a second contribution
                raise _Forwarded(e.code, e.details) from None
            return False, e.details
        if code != grpc.StatusCode.OK:
            raise _Forwarded(code, bytes(message).decode("utf-8", "replace"))
        return True, None

    def _send_forward(self, channel: StepChannel, released: Released, keys: Sequence[bytes], blind: bytes) -> None:
        """Forwards a released step's blinded part to server1, with the digests of the owners' `keys` (in owner
        order) and of the `blind` key, and the blind key sealed for each owner (`_seal`): on its data plane if it
        has one, else gRPC."""
        fields = dict(channel=channel.name, step=released.step, ring_bits=released.ring_bits,
                      num_elements=released.num_elements,
                      sealed_blinds=self._seal(channel, released.step, keys, blind))
        meta = ((DIGESTS_METADATA, ",".join(key_digest(k).hex() for k in keys)),
                (_BLIND_METADATA, key_digest(blind).hex()))
        size = wire.encoded_size("ForwardRequest", released.acc.nbytes, **fields)
        for attempt in range(2):
            taken, unreachable = self._forward_on_plane(self._peer_link(size), fields, meta, released.acc)
            if taken:
                return
            refusal = self._peer_plane.grpc_refusal("server0's blinded part", size, "aggregation server1")
            if refusal is None:
                break
            if attempt or unreachable is None:  # server1's gRPC port would refuse it unread
                raise _Forwarded(grpc.StatusCode.UNAVAILABLE, refusal)
            # its data port refused the connection: server1 may have restarted on another one (asked again now)
        if unreachable is not None:
            _LOG.info("aggregation server0: server1's data plane cannot be reached (%s); forwarding on gRPC",
                      unreachable)
        forward = wire.encode("ForwardRequest", released.acc, **fields)
        try:
            self._forward(forward, timeout=self._timeout, wait_for_ready=True, metadata=meta)
        except grpc.RpcError as e:
            raise _Forwarded(e.code() or grpc.StatusCode.UNKNOWN, e.details()) from None

    def _handshake(self, identity: str, request, context, reply):
        """Stores the caller's row (and check-seed part) for its model; answers every owner's (`handshake_table`)."""
        del context
        descriptor = list(request.descriptor)
        if not descriptor:
            raise _Abort(grpc.StatusCode.INVALID_ARGUMENT,
                         f"Handshake of {identity} at step {request.step}: empty descriptor; send at least one field.")
        owner = self._owners.index(identity)
        try:
            changed = self._handshakes.put(owner, request.model, descriptor, request.seed_part)
        except ValueError as e:
            raise _Abort(grpc.StatusCode.INVALID_ARGUMENT, f"Handshake of {identity}: {e}") from None
        rows, models, ages, parts = self._handshakes.view_parts(request.model)
        # A new row at INFO; the owners' polls while they wait for each other at DEBUG.
        _LOG.log(logging.INFO if changed else logging.DEBUG, "aggregation server0: handshake of %s at step %d "
                 "(model %016x)", identity, request.step, request.model)
        return reply(rows=[v for row in rows if row for v in row], lengths=[len(row or ()) for row in rows],
                     models=models, ages_ms=[-1 if age is None else int(age * 1000) for age in ages],
                     seed_parts=parts)

    def _rewind(self, identity: str, request, context, reply):
        del context
        owner = self._owners.index(identity)
        with self._lock:
            channels = list(self._channels.values())
        dropped = sum(channel.rewind(owner) for channel in channels)
        _LOG.info("aggregation server%d: %s rewound to step %d (%d unreleased contributions dropped)", self._role,
                  identity, request.step, dropped)
        return reply()
