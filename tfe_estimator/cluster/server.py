"""`run_server`: this task's TFE party, from TF_CONFIG.

In service mode (across organisations) a ``tfe`` task 0 or 1 is an
aggregation server (`tfe_estimator.service.AggregationServer`): a small
grpcio service with mutual TLS that imports no TensorFlow; its certificate
comes from ``TFE_ESTIMATOR_TLS_DIR``.

In the TensorFlow-runtime mode (in-graph) a ``tfe`` task
holds one party of the secure sum. It is a plain
`tf.distribute.Server` of the cluster, started after tf-encrypted's op
library is loaded: the chief places share-adding ops on it, and without the
library remote execution fails with "Op type not registered
'SecureSeededRandomUniform'".

Example::

    $ TF_CONFIG='{"cluster": {...}, "task": {"type": "tfe", "index": 0}}' \
      TFE_ESTIMATOR_CLUSTER_MODE=service TFE_ESTIMATOR_TLS_DIR=/etc/tfe/certs tfe-estimator server --data-port 2223

``--data-port`` (service mode) opens the server's data plane
(`tfe_estimator.service.data_plane`) on that port of the service port's bind
host: the owners and server0 ask each server for it (the ``DataPlane`` call)
and send their large calls there, on gRPC when a server has none.
``--metrics-port`` (service mode) serves its Prometheus metrics
(`tfe_estimator.service.metrics`) at ``http://<bind host>:PORT/metrics``.
"""
import logging
import os
import signal
import threading
from typing import Mapping, Optional, Tuple

from tfe_estimator.cluster.peers import SERVICE, cluster_mode
from tfe_estimator.cluster.spec import STATE_DIR_ENV, TFE_JOB, TLS_DIR_ENV, TfeCluster
from tfe_estimator.secure.protocols import load_backend
from tfe_estimator.validation import is_int

__all__ = ["run_server", "start_server", "server_command", "check_data_port", "check_metrics_port",
           "SERVER_SUBCOMMAND"]

log = logging.getLogger("tfe_estimator")

#: The `tfe-estimator` subcommand that runs a ``tfe`` task.
SERVER_SUBCOMMAND = "server"


def server_command(python: Optional[str] = None) -> Tuple[str, ...]:
    """The command line that runs a ``tfe`` task: the one definition.

    Args:
      python: None for the installed console script (a container image, a
        cluster node); an interpreter path to run this installation's module
        with it (the loopback launcher uses ``sys.executable``).

    Example::

        >>> server_command()
        ('tfe-estimator', 'server')
        >>> server_command("/usr/bin/python3")
        ('/usr/bin/python3', '-m', 'tfe_estimator.tools.cli', 'server')
    """
    if python is None:
        return ("tfe-estimator", SERVER_SUBCOMMAND)
    return (python, "-m", "tfe_estimator.tools.cli", SERVER_SUBCOMMAND)


def _check_tfe_task(cluster: TfeCluster) -> None:
    if cluster.task_type != TFE_JOB:
        raise ValueError(
            f"`tfe-estimator server` runs the '{TFE_JOB}' tasks, but TF_CONFIG says this task "
            f"is {cluster.task_type}:{cluster.task_index}. Chief, worker and evaluator tasks "
            "run the training script."
        )


def start_server(cluster: TfeCluster):
    """Starts the `tf.distribute.Server` of a ``tfe`` task and returns it."""
    _check_tfe_task(cluster)
    load_backend()  # registers tf-encrypted's ops before the server starts
    import tensorflow as tf  # pylint: disable=import-outside-toplevel

    return tf.distribute.Server(
        cluster.cluster_spec(without=("evaluator",)),
        job_name=TFE_JOB,
        task_index=cluster.task_index,
        protocol="grpc",
        start=True,
    )


def _bind_address(address: str) -> str:
    """Where an aggregation server listens: its loopback address as given, else its port on every interface."""
    host, port = address.rsplit(":", 1)
    if host in ("localhost", "::1", "[::1]") or host.startswith("127."):
        return address
    return f"[::]:{port}"


def check_data_port(data_port, service_address: str) -> int:
    """`data_port` (``tfe-estimator server --data-port``) checked against the service port it sits beside.

    Returns it as an int: 0 for any free port, else 1..65535 and not the service port of `service_address`.

    Example::

        >>> check_data_port(2223, "tfe-0.example.org:2222")
        2223
    """
    service_port = int(service_address.rsplit(":", 1)[1])
    if not is_int(data_port, minimum=0, maximum=65535):
        raise ValueError(f"--data-port {data_port!r} is not a TCP port: pass 1..65535 (or 0 for any free port), "
                         f"e.g. --data-port {service_port + 1 if service_port < 65535 else service_port - 1}.")
    if data_port == service_port:
        raise ValueError(f"--data-port {data_port} is this server's service port (TF_CONFIG says "
                         f"{service_address}): the data plane needs a port of its own, e.g. --data-port "
                         f"{service_port + 1 if service_port < 65535 else service_port - 1}.")
    return int(data_port)


def check_metrics_port(metrics_port, service_address: str, data_port: Optional[int] = None) -> int:
    """`metrics_port` (``tfe-estimator server --metrics-port``) checked against the server's other ports.

    Example::

        >>> check_metrics_port(9090, "tfe-0.example.org:2222", 2223)
        9090
    """
    if not is_int(metrics_port, minimum=0, maximum=65535):
        raise ValueError(f"--metrics-port {metrics_port!r} is not a TCP port: pass 1..65535 (or 0 for any free "
                         "port), e.g. --metrics-port 9090.")
    service_port = int(service_address.rsplit(":", 1)[1])
    for port, what in ((service_port, f"this server's service port (TF_CONFIG says {service_address})"),
                       (data_port, "its --data-port")):
        if metrics_port and metrics_port == port:
            raise ValueError(f"--metrics-port {metrics_port} is {what}: the metrics endpoint (plain HTTP) needs a "
                             "port of its own, e.g. --metrics-port 9090.")
    return int(metrics_port)


def _data_address(bind_address: str, data_port: Optional[int]) -> Optional[str]:
    """Where the data plane (or the metrics endpoint) listens: the service port's bind host at `data_port`
    (None: none)."""
    if data_port is None:
        return None
    return f"{bind_address.rsplit(':', 1)[0]}:{data_port}"


def _serve_aggregation(cluster: TfeCluster, environ: Optional[Mapping[str, str]], stop: threading.Event,
                       limits: Mapping[str, float], data_port: Optional[int] = None,
                       metrics_port: Optional[int] = None) -> int:
    """Service mode: this ``tfe`` task is aggregation server 0 or 1 (`tfe_estimator.service`), no TensorFlow."""
    from tfe_estimator.service import AggregationServer, TlsFiles  # pylint: disable=import-outside-toplevel

    environ = os.environ if environ is None else environ
    servers = cluster.jobs[TFE_JOB]
    if len(servers) != 2 or cluster.task_index > 1:
        raise ValueError(
            f"the aggregation service has 2 servers ('{TFE_JOB}' tasks 0 and 1), but TF_CONFIG lists "
            f"{len(servers)}: {list(servers)}. Note that these values come from the TF_CONFIG environment variable.")
    tls_dir = environ.get(TLS_DIR_ENV)
    if not tls_dir:
        raise ValueError(f"`tfe-estimator server` in service mode needs its certificate: set {TLS_DIR_ENV} to a "
                         f"directory with ca.crt and {TFE_JOB}-{cluster.task_index}.crt/.key (`tfe-estimator certs`).")
    owners = [f"{job}:{index}" for job, index in cluster.data_owners()]
    bind = _bind_address(servers[cluster.task_index])
    if data_port is not None:
        data_port = check_data_port(data_port, servers[cluster.task_index])
    if metrics_port is not None:
        metrics_port = check_metrics_port(metrics_port, servers[cluster.task_index], data_port)
    server = AggregationServer(
        role=cluster.task_index, address=bind, owners=owners,
        tls=TlsFiles.from_dir(tls_dir, TFE_JOB, cluster.task_index),
        peer_address=servers[1] if cluster.task_index == 0 else None,
        data_address=_data_address(bind, data_port), state_dir=environ.get(STATE_DIR_ENV) or None,
        metrics_address=_data_address(bind, metrics_port), **limits)
    server.start()  # it logs the one start line (`AggregationServer.start`): role, owners, port
    _stop_on_signals(stop)
    try:
        while not stop.wait(0.5):
            pass
    finally:
        server.stop(1.0)
    log.info("aggregation server %d stopping", cluster.task_index)
    return 0


def _stop_on_signals(stop: threading.Event) -> None:
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda signum, frame: stop.set())


def run_server(environ: Optional[Mapping[str, str]] = None, stop: Optional[threading.Event] = None,
               limits: Optional[Mapping[str, float]] = None, data_port: Optional[int] = None,
               metrics_port: Optional[int] = None) -> int:
    """Serves this ``tfe`` task until SIGTERM or SIGINT (or `stop` is set).

    Args:
      limits: service mode only: `AggregationServer`'s ``step_timeout_secs``, ``max_elements`` and
        ``max_channels`` (``tfe-estimator server --step-timeout-secs ... --max-elements ... --max-channels ...``).
      data_port: service mode only: the data plane's port (``--data-port``; 0: any free port; None: no data
        plane, the owners use gRPC for every call).
      metrics_port: service mode only: the port of its Prometheus metrics on the service port's bind host
        (``--metrics-port``; 0: any free port; None: none).

    Returns:
      0, the exit status.

    Raises:
      ValueError: without a TF_CONFIG cluster, or when this task is not a ``tfe`` task.
    """
    cluster = TfeCluster.from_environment(environ)
    if cluster is None:
        raise ValueError(
            "`tfe-estimator server` needs TF_CONFIG with a cluster and this task, e.g. "
            '{"cluster": {"chief": [...], "tfe": ["s0:2222", "s1:2222", "s2:2222"]}, '
            '"task": {"type": "tfe", "index": 0}}.'
        )
    _check_tfe_task(cluster)
    stop = stop or threading.Event()
    limits = dict(limits or {})
    mode = cluster_mode(environ=environ)
    if mode == SERVICE:
        return _serve_aggregation(cluster, environ, stop, limits, data_port, metrics_port)
    if limits or data_port is not None or metrics_port is not None:
        flags = ", ".join("--" + name.replace("_", "-") for name in sorted(limits) +
                          (["data_port"] if data_port is not None else []) +
                          (["metrics_port"] if metrics_port is not None else []))
        raise ValueError(f"{flags} configure the aggregation service; this task runs in "
                         f"{mode} mode, where the servers are TensorFlow servers. Drop {flags}.")
    server = start_server(cluster)
    _stop_on_signals(stop)
    address = cluster.jobs[TFE_JOB][cluster.task_index]
    log.info(
        "TFE party %d of %d serving /job:%s/task:%d at %s (target %s); holds only "
        "ring elements; stop with SIGTERM or Ctrl-C",
        cluster.task_index, len(cluster.jobs[TFE_JOB]), TFE_JOB, cluster.task_index, address, server.target,
    )
    while not stop.wait(0.5):
        pass
    log.info("TFE party %d stopping", cluster.task_index)
    return 0
