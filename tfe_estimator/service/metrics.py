"""Prometheus metrics of one aggregation server (`tfe-estimator server --metrics-port PORT`).

Served at ``http://HOST:PORT/metrics`` by prometheus_client, from a registry of
the server's own (several servers in one process, as in the tests, never mix).
Plain HTTP without authentication: it holds counts and sizes only, no key, no
share, no channel or model name, no owner's name, and must be reachable by the
site's monitoring only (``docs/operations.md``).

====================================================  =====================================================
``tfe_aggregation_steps_released_total``              sums released (one per channel and step: a training step
                                                      that sums its gradients and its loss counts 2); replays
                                                      from the window are not releases
``tfe_aggregation_refusals_total{code}``              calls refused, by gRPC status code (either port; a TLS
                                                      handshake that fails is no call and is not counted)
``tfe_aggregation_received_bytes_total``              payload bytes of Contribute and ForwardBlinded received
``tfe_aggregation_sent_bytes_total``                  payload bytes of answers sent, and server0's forwards
``tfe_aggregation_step_latency_seconds``              histogram: from an owner's put arriving to its answer
``tfe_aggregation_memory_budget_used_bytes``          bytes reserved in the memory budget now
``tfe_aggregation_memory_budget_bytes``               the budget (``--memory-budget-bytes``)
``tfe_aggregation_owners_connected``                  configured owners that called within the last 60 s
``tfe_aggregation_owners``                            configured owners
``tfe_aggregation_server_role``                       0 (server0) or 1 (server1)
====================================================  =====================================================

`AggregationServer` wraps its boundary methods with `observe_admitted`,
`observe_contribute`, `observe_forwarded`, `observe_forward_sent` and
`observe_refused`, which cover both of its ports, and calls `released` when a
step is answered.

Example::

    metrics = ServerMetrics(1, budget, ["chief:0", "worker:0"])
    port = metrics.serve("localhost:0")      # http://localhost:<port>/metrics
    ...
    metrics.close()
"""
import functools
import threading
import time
from typing import Dict, Optional, Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.exposition import start_http_server

from tfe_estimator.service.budget import MemoryBudget

__all__ = ["ServerMetrics", "CONNECTED_SECS", "PREFIX"]

PREFIX = "tfe_aggregation_"
#: An owner counts as connected for this long after its last call.
CONNECTED_SECS = 60.0
#: Step latency buckets (seconds): a small model's step takes milliseconds, a large one's seconds.
_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)


def _nbytes(data) -> int:
    """The bytes of a payload or an answer (bytes, a buffer, or a protobuf message)."""
    if data is None:
        return 0
    return data.ByteSize() if hasattr(data, "ByteSize") else memoryview(data).nbytes


class ServerMetrics:
    """The metrics of one aggregation server, in a registry of its own, and their HTTP endpoint.

    Args:
      role: 0 (server0) or 1 (server1).
      budget: the server's `MemoryBudget` (read when scraped).
      owners: the configured owners (only they count as connected).
    """

    def __init__(self, role: int, budget: MemoryBudget, owners: Sequence[str]):
        self.registry = CollectorRegistry(auto_describe=True)
        self._owners = frozenset(owners)
        self._seen: Dict[str, float] = {}
        self._lock = threading.Lock()
        self._http = None
        kw = dict(registry=self.registry)
        self.released_steps = Counter(PREFIX + "steps_released", "Sums released (one per channel and step); "
                                      "replays from the window are not counted.", **kw)
        self.refusals = Counter(PREFIX + "refusals", "Calls refused, by gRPC status code.", ["code"], **kw)
        self.received_bytes = Counter(PREFIX + "received_bytes", "Payload bytes of Contribute and ForwardBlinded "
                                      "calls received.", **kw)
        self.sent_bytes = Counter(PREFIX + "sent_bytes", "Payload bytes of answers sent and of server0's "
                                  "forwards to server1.", **kw)
        self.step_latency = Histogram(PREFIX + "step_latency_seconds", "Seconds from an owner's put arriving to "
                                      "its answer.", buckets=_BUCKETS, **kw)
        Gauge(PREFIX + "memory_budget_used_bytes", "Bytes reserved in the server's memory budget.",
              **kw).set_function(lambda: budget.total)
        Gauge(PREFIX + "memory_budget_bytes", "The server's memory budget (--memory-budget-bytes).",
              **kw).set(budget.server_bytes)
        Gauge(PREFIX + "owners_connected", f"Configured owners that called within the last {CONNECTED_SECS:g} s.",
              **kw).set_function(self.owners_connected)
        Gauge(PREFIX + "owners", "Configured owners.", **kw).set(len(self._owners))
        Gauge(PREFIX + "server_role", "0: server0 (keys), 1: server1 (masked shares).", **kw).set(role)

    # ---------------------------------------------------------------- HTTP --

    def serve(self, address: str) -> int:
        """Serves ``/metrics`` at `address` (``host:port``, ``[::]:port``; port 0: any free one); returns the port."""
        host, _, port = address.rpartition(":")
        try:
            self._http, _ = start_http_server(int(port), addr=host.strip("[]") or "::", registry=self.registry)
        except OSError as e:
            raise RuntimeError(f"the metrics endpoint cannot listen on {address} ({e}): the port is taken or the "
                               "address is not local. Pick another --metrics-port.") from None
        return self._http.server_address[1]

    @property
    def port(self) -> Optional[int]:
        """The port ``/metrics`` is served on (None: not serving)."""
        return self._http.server_address[1] if self._http is not None else None

    def close(self) -> None:
        """Stops serving ``/metrics``."""
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()
            self._http = None

    # ------------------------------------------------------------- counts --

    def seen(self, identity: str) -> None:
        """`identity` called now (counted as connected if it is a configured owner)."""
        if identity in self._owners:
            with self._lock:
                self._seen[identity] = time.monotonic()

    def owners_connected(self) -> int:
        """Configured owners that called within the last `CONNECTED_SECS`."""
        since = time.monotonic() - CONNECTED_SECS
        with self._lock:
            return sum(1 for when in self._seen.values() if when >= since)

    def released(self) -> None:
        """A step of a channel was released (its answer is built)."""
        self.released_steps.inc()

    def observe_contribute(self, contribute):
        """`contribute(identity, request, context, reply)` counting the caller, its bytes and its latency."""
        @functools.wraps(contribute)
        def observed(identity, request, context, reply):
            started = time.monotonic()
            self.received_bytes.inc(_nbytes(request.payload))
            answer = contribute(identity, request, context, reply)
            self.step_latency.observe(time.monotonic() - started)
            self.sent_bytes.inc(_nbytes(answer))
            return answer

        return observed

    def observe_admitted(self, admit):
        """`admit(method, identity)` (the server's check of a proved caller) noting an admitted caller as seen."""
        @functools.wraps(admit)
        def observed(method, identity):
            admit(method, identity)
            self.seen(identity)

        return observed

    def observe_forwarded(self, forwarded):
        """`forwarded(identity, request, context, reply)` (server1) counting server0's bytes."""
        @functools.wraps(forwarded)
        def observed(identity, request, context, reply):
            self.received_bytes.inc(_nbytes(request.payload))
            return forwarded(identity, request, context, reply)

        return observed

    def observe_forward_sent(self, send):
        """`send(channel, released, ...)` (server0's forward to server1) counting the bytes it sent."""
        @functools.wraps(send)
        def observed(channel, released, *args):
            send(channel, released, *args)
            self.sent_bytes.inc(_nbytes(released.acc))

        return observed

    def observe_refused(self, refused):
        """`refused(refusal) -> grpc.StatusCode` counting each refusal by its code."""
        @functools.wraps(refused)
        def observed(refusal):
            code = refused(refusal)
            self.refusals.labels(code=code.name).inc()
            return code

        return observed
