"""The standard gRPC health service (``grpc.health.v1.Health``) on an aggregation server's port, for its parties.

A load balancer, a Kubernetes probe (`tfe-estimator health`) or an operator's
`tfe-estimator status` asks ``Check`` on the service port itself, with mutual
TLS like every other call: the answer is SERVING while the server runs (for the
whole server, ``""``, and for ``tfe_estimator.aggregation.v1.Aggregation``) and
NOT_SERVING once it stops. Only a caller whose certificate proves a party of the
server's federation gets an answer (the server's own check, on every call,
`AggregationServer`); no or a foreign certificate fails the TLS handshake, a
certificate that the CA of the identity's own organisation did not issue is
refused UNAUTHENTICATED, one naming no task PERMISSION_DENIED (``aggregation.proto``
has the table). SERVING says that this server takes calls, not that its peer
does: a probe restarts only the server that is down.

``Watch`` is UNIMPLEMENTED: a watch would hold one of the handler threads the
server sizes for its owners' waiting puts for as long as it watches; probes poll
``Check``.

Example::

    health = TrustedHealth(refusal)       # refusal(context) -> None, or (grpc.StatusCode, message)
    health.add_to(grpc_server)
    ...
    check_health("tfe0.example:7000", TlsFiles.from_dir("/etc/tfe/certs", "chief", 0), 0)   # "SERVING"
"""
from typing import Callable, Optional, Tuple

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from tfe_estimator.service import wire
from tfe_estimator.service.tls import TlsFiles, server_name_option

__all__ = ["TrustedHealth", "check_health", "HEALTH_SERVICE", "SERVING"]

#: The health service's full name, as callers and the API table write it.
HEALTH_SERVICE = "grpc.health.v1.Health"
#: The status a healthy server answers (``HealthCheckResponse.ServingStatus`` name).
SERVING = "SERVING"

Refusal = Optional[Tuple[grpc.StatusCode, str]]


class TrustedHealth(health.HealthServicer):
    """grpcio-health-checking's servicer that answers only callers `refusal` lets through.

    Args:
      refusal: ``refusal(context)``: None for a caller the federation trusts, else ``(status code, message)``
        (the aggregation server's own check, run on every call).
    """

    def __init__(self, refusal: Callable[[grpc.ServicerContext], Refusal]):
        super().__init__()
        self._refusal = refusal
        self.set(wire.SERVICE_NAME, health_pb2.HealthCheckResponse.SERVING)

    def add_to(self, server: grpc.Server) -> None:
        """Serves this health service on `server` (before it starts)."""
        health_pb2_grpc.add_HealthServicer_to_server(self, server)

    def Check(self, request, context):  # noqa: N802 (gRPC's method name)
        refused = self._refusal(context)
        if refused is not None:
            context.abort(*refused)
        return super().Check(request, context)

    def Watch(self, request, context, send_response_callback=None):  # noqa: N802  # pylint: disable=arguments-differ
        del request, send_response_callback
        refused = self._refusal(context) or (
            grpc.StatusCode.UNIMPLEMENTED,
            f"{HEALTH_SERVICE}/Watch is not served: it would hold a handler thread the aggregation server keeps for "
            "its owners; poll Check (`tfe-estimator health`).")
        context.abort(*refused)

    def stop(self) -> None:
        """Answers NOT_SERVING from now on (the server is stopping)."""
        self.enter_graceful_shutdown()


def check_health(address: str, tls: TlsFiles, server: int, timeout: float = 5.0) -> str:
    """Asks aggregation server `server` (0 or 1) at `address` for its health, as the task of `tls`.

    The server is pinned as an owner pins it (its operator's CA, its name ``tfe-<k>.<cluster>``).

    Returns:
      The status name, e.g. ``"SERVING"``.

    Raises:
      grpc.RpcError: the call failed (unreachable, TLS refused, caller refused).

    Example::

        status = check_health("localhost:7000", TlsFiles.from_dir(d, "tfe", 0), 0)
    """
    with grpc.secure_channel(address, tls.channel_credentials(server),
                             options=[server_name_option(tls, server)]) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=timeout)
    return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
