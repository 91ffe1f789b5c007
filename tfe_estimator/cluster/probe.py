"""`tfe-estimator health` and `tfe-estimator status`: is an aggregation server up, as a party of its federation.

Both ask the standard gRPC health service on a server's service port
(`tfe_estimator.service.health`) with mutual TLS, as the caller's own identity:
the servers answer only parties of their federation.

``health`` runs in a server task's environment (TF_CONFIG naming its ``tfe``
task, ``TFE_ESTIMATOR_TLS_DIR`` its certificate), calls its own server on this
host at its port from TF_CONFIG (a Kubernetes Service routes only to ready
pods: a readiness probe through it could never pass), prints one line and
exits 0 when SERVING, 1 otherwise; Kubernetes exec probes run exactly
``["tfe-estimator", "health"]``.

``status`` asks both servers of a federation, as an owner or an operator, and
prints one row per server: its health and, from the service's ``Status`` call
(any party may ask; names and step numbers, no values), the newest step
released per model (a channel's name is its model id, then its sum's name); it
exits 0 when both are SERVING, 1 otherwise.

Example::

    $ TF_CONFIG='{"cluster": {...}, "task": {"type": "tfe", "index": 0}}' \\
      TFE_ESTIMATOR_TLS_DIR=/etc/tfe/certs tfe-estimator health
    tfe:0 at localhost:7000: SERVING
    $ tfe-estimator status --federation federation.json --tls-dir hospital-a/chief-0
    server  address             health   released
    tfe:0   tfe0.example:7000   SERVING  model 5f0c...: step 41
    tfe:1   tfe1.example:7000   SERVING  model 5f0c...: step 41
"""
import glob
import os
from typing import List, Mapping, Optional, Sequence, TextIO, Tuple

import grpc

from tfe_estimator.cluster.spec import TFE_JOB, TLS_DIR_ENV, TfeCluster
from tfe_estimator.identity import certs
from tfe_estimator.identity.federation import FEDERATION_FILE

__all__ = ["run_health", "run_status", "HEALTH_SUBCOMMAND", "STATUS_SUBCOMMAND"]

HEALTH_SUBCOMMAND, STATUS_SUBCOMMAND = "health", "status"
_LOOPBACK = ("localhost", "::1", "[::1]")


def _ask(address: str, tls, server: int, timeout: float) -> Tuple[bool, str]:
    """``(serving, what to print)`` for server `server` at `address`."""
    from tfe_estimator.service.health import SERVING, check_health  # pylint: disable=import-outside-toplevel

    try:
        status = check_health(address, tls, server, timeout=timeout)
    except grpc.RpcError as e:
        details = " ".join((e.details() or "").split())[:200]
        return False, f"unreachable or refused ({e.code().name}: {details})"
    return status == SERVING, status


def _released(address: str, tls, server: int, timeout: float) -> str:
    """The newest released step per model on server `server` (its ``Status`` call), as one cell."""
    from tfe_estimator.service import wire  # pylint: disable=import-outside-toplevel
    from tfe_estimator.service.tls import server_name_option  # pylint: disable=import-outside-toplevel

    classes = wire.messages()
    try:
        with grpc.secure_channel(address, tls.channel_credentials(server),
                                 options=[server_name_option(tls, server)]) as channel:
            reply = channel.unary_unary(wire.method_path("Status"), request_serializer=wire.serialize,
                                        response_deserializer=classes["StatusReply"].FromString)(
                classes["StatusRequest"](), timeout=timeout)
    except grpc.RpcError as e:
        return f"unknown ({e.code().name})"
    latest = {}
    for channel_name, step in zip(reply.channels, reply.steps):
        model = channel_name.split("/", 1)[0]  # `<model id>/<sum>` (owner.service_strategy.channel_name)
        latest[model] = max(step, latest.get(model, step))
    return ", ".join(f"model {model}: step {step}" for model, step in sorted(latest.items())) or "none yet"


def _own_target(address: str) -> str:
    """This host's port of a server task's TF_CONFIG address (its loopback address as given)."""
    host, port = address.rsplit(":", 1)
    if host in _LOOPBACK or host.startswith("127."):
        return address
    return f"localhost:{port}"


def run_health(target: Optional[str] = None, environ: Optional[Mapping[str, str]] = None,
               timeout: float = 5.0, out: Optional[TextIO] = None) -> int:
    """`tfe-estimator health`: asks this server task's own server whether it is SERVING.

    Args:
      target: ``host:port`` to call instead of this host's port from TF_CONFIG.
      timeout: seconds to wait for the answer.

    Returns:
      0 when SERVING, else 1.

    Raises:
      ValueError: no TF_CONFIG, not a ``tfe`` task, or no ``TFE_ESTIMATOR_TLS_DIR``.
    """
    from tfe_estimator.service import TlsFiles  # pylint: disable=import-outside-toplevel

    environ = os.environ if environ is None else environ
    cluster = TfeCluster.from_environment(environ)
    if cluster is None or cluster.task_type != TFE_JOB or cluster.task_index > 1:
        task = "no TF_CONFIG" if cluster is None else f"TF_CONFIG says {cluster.task_type}:{cluster.task_index}"
        raise ValueError(f"`tfe-estimator health` runs in an aggregation server's environment (TF_CONFIG naming task "
                         f"{TFE_JOB}:0 or {TFE_JOB}:1), but {task}. An owner or an operator elsewhere uses "
                         "`tfe-estimator status --federation FILE --tls-dir DIR`.")
    tls_dir = environ.get(TLS_DIR_ENV)
    if not tls_dir:
        raise ValueError(f"`tfe-estimator health` calls its server with mutual TLS as {TFE_JOB}:{cluster.task_index}: "
                         f"set {TLS_DIR_ENV} to the directory with its certificate (as for `tfe-estimator server`).")
    tls = TlsFiles.from_dir(tls_dir, TFE_JOB, cluster.task_index)
    address = target or _own_target(cluster.jobs[TFE_JOB][cluster.task_index])
    serving, what = _ask(address, tls, cluster.task_index, timeout)
    print(f"{TFE_JOB}:{cluster.task_index} at {address}: {what}", file=out, flush=True)
    return 0 if serving else 1


def _own_identity(tls_dir: str, identity: Optional[str]) -> Tuple[str, int]:
    """``(job, index)`` of the caller: `identity` (``job:index``), else the one certificate in `tls_dir`."""
    if identity is not None:
        job, _, index = identity.partition(":")
        if not job or not index.isdigit():
            raise ValueError(f"--identity {identity!r} is not job:index, e.g. --identity chief:0.")
        return job, int(index)
    names = sorted(os.path.basename(p)[:-4] for p in glob.glob(os.path.join(tls_dir, "*.crt"))
                   if os.path.basename(p) != certs.CA_CERT and os.path.isfile(p[:-4] + ".key"))
    parsed = [certs.identity_of_common_name(name) for name in names]
    parsed = [p for p in parsed if p is not None]
    if len(parsed) != 1:
        raise ValueError(f"{tls_dir} holds {len(parsed)} task certificates with their keys ({names}); name the one "
                         "to call as with --identity job:index.")
    job, index = parsed[0].split(":")
    return job, int(index)


def _server_addresses(trust, environ: Mapping[str, str], source: str) -> List[str]:
    addresses = [trust.server_address(k) for k in (0, 1)]
    if all(addresses):
        return addresses
    cluster = TfeCluster.from_environment(environ)
    if cluster is not None and len(cluster.jobs.get(TFE_JOB, ())) == 2:
        return list(cluster.jobs[TFE_JOB])
    raise ValueError(f"{source} names no address for the aggregation servers and TF_CONFIG lists none: pass the "
                     "federation file made with `tfe-estimator certs federation --server tfe:0=HOST:PORT ...`.")


def run_status(federation: Optional[str] = None, tls_dir: Optional[str] = None, identity: Optional[str] = None,
               environ: Optional[Mapping[str, str]] = None, timeout: float = 5.0,
               out: Optional[TextIO] = None) -> int:
    """`tfe-estimator status`: asks both aggregation servers of a federation for their health.

    Args:
      federation: the federation file (default: the one in `tls_dir`); its servers' addresses are called
        (TF_CONFIG's ``tfe`` addresses when it has none).
      tls_dir: the caller's certificate directory (default: ``TFE_ESTIMATOR_TLS_DIR``).
      identity: ``job:index`` of the caller's certificate there (default: the only one).

    Returns:
      0 when both servers are SERVING, else 1.
    """
    from tfe_estimator.service import TlsFiles  # pylint: disable=import-outside-toplevel

    environ = os.environ if environ is None else environ
    tls_dir = tls_dir or environ.get(TLS_DIR_ENV)
    if not tls_dir:
        raise ValueError(f"`tfe-estimator status` calls the servers with mutual TLS as you: pass --tls-dir with your "
                         f"certificate and key (or set {TLS_DIR_ENV}).")
    job, index = _own_identity(tls_dir, identity)
    tls = TlsFiles.from_dir(tls_dir, job, index)
    if federation is not None:
        if not os.path.isfile(federation):
            raise ValueError(f"--federation {federation} does not exist: pass the {FEDERATION_FILE} of your "
                             "federation (`tfe-estimator certs federation`).")
        tls = TlsFiles(federation, tls.cert, tls.key)
    addresses = _server_addresses(tls.trust(), environ, federation or tls.ca)
    rows = [("server", "address", "health", "released")]
    serving = []
    for k, address in enumerate(addresses):
        ok, what = _ask(address, tls, k, timeout)
        serving.append(ok)
        rows.append((f"{TFE_JOB}:{k}", address, what, _released(address, tls, k, timeout) if ok else "-"))
    print(_table(rows), file=out, flush=True)
    return 0 if all(serving) else 1


def _table(rows: Sequence[Tuple[str, ...]]) -> str:
    """Columns padded to their widest cell (the last one as it is)."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]) - 1)]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths)) + "  " + row[-1] for row in rows)
