"""An aggregation server's pod in service mode: what both Kubernetes renderers add to it.

`tfe_estimator.cluster.manifests` (one namespace) and `tfe_estimator.cluster.k8s_site` (one
organisation's server) render the two servers, ``tfe:0`` and ``tfe:1``, the same way:

- the command: ``tfe-estimator server`` with ``--data-port`` (its data plane) and ``--metrics-port``
  (Prometheus text at ``/metrics``), and a ``metrics`` container port;
- probes that call the server's own gRPC health service (``grpc.health.v1.Health/Check`` on its
  mutual-TLS service port) through ``tfe-estimator health``, run inside the pod with the pod's
  TF_CONFIG and certificate: kubelet's native gRPC probe cannot present a client certificate. A
  startup probe gives the server up to `STARTUP_SECONDS` to serve before liveness counts;
- server0's state directory (``TFE_ESTIMATOR_STATE_DIR``, its release log: docs/operations.md) on an
  ``emptyDir``, so a restarted container answers the steps it released before with the same blind
  key. An emptyDir survives a container restart, not the pod's move to another node, which is what the
  release log promises (the process's death, not the machine's). The log refuses a directory another
  user may write, and an emptyDir's root is world-writable: the state directory is a subdirectory the
  server makes (mode 0700);
- the metrics port's NetworkPolicy rule: closed (no rule) unless the site names its monitoring
  (`metrics_sources`); the federation ports stay as each renderer admits them.

Nothing here imports TensorFlow.

Example::

    from tfe_estimator.cluster import k8s_server

    k8s_server.server_command(data_port=7001, metrics_port=9100)
    # ('tfe-estimator', 'server', '--data-port', '7001', '--metrics-port', '9100')
    spec = {"containers": [{"name": "tfe-server", "env": [], "ports": []}]}
    k8s_server.add_server_parts(spec, index=0, metrics_port=9100)   # probes, metrics port, state volume
    k8s_server.metrics_ingress(9100, k8s_server.metrics_sources("monitoring", {}))
"""
import re
from typing import Any, Dict, List, Mapping, Optional, Tuple

from tfe_estimator.cluster.k8s_common import SERVER_COMMAND
from tfe_estimator.cluster.spec import STATE_DIR_ENV
from tfe_estimator.validation import check_int

__all__ = ["DEFAULT_METRICS_PORT", "HEALTH_COMMAND", "STATE_MOUNT_PATH", "STATE_DIR", "STARTUP_SECONDS",
           "server_command", "probes", "add_server_parts", "check_metrics_port", "metrics_sources",
           "metrics_ingress"]

#: ``tfe-estimator server --metrics-port``'s port in a rendered server pod (``tfe-estimator k8s --metrics-port``).
DEFAULT_METRICS_PORT = 9100
#: Run inside a server's pod: checks its own health service with the pod's TF_CONFIG and certificate (exit 0: SERVING).
HEALTH_COMMAND: Tuple[str, ...] = SERVER_COMMAND[:-1] + ("health",)
#: Where server0's emptyDir is mounted; its state directory (`STATE_DIR`) is made inside it by the server.
STATE_MOUNT_PATH = "/var/lib/tfe-estimator"
#: Server0's ``TFE_ESTIMATOR_STATE_DIR``: the release log's directory.
STATE_DIR = f"{STATE_MOUNT_PATH}/state"
#: How long a server may take to answer SERVING after its container starts, before liveness counts.
STARTUP_SECONDS = 300
_PROBE_PERIOD = 10

_DNS_1123_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_LABEL_NAME = re.compile(r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?"
                         r"[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$")
_LABEL_VALUE = re.compile(r"^([A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?)?$")
#: The label every namespace carries with its own name (Kubernetes >= 1.21).
_NAMESPACE_NAME_LABEL = "kubernetes.io/metadata.name"


def server_command(data_port: Optional[int], metrics_port: Optional[int]) -> Tuple[str, ...]:
    """``tfe-estimator server`` with its data port and metrics port (None: without that flag)."""
    return (SERVER_COMMAND + (("--data-port", str(data_port)) if data_port is not None else ())
            + (("--metrics-port", str(metrics_port)) if metrics_port is not None else ()))


def probes() -> Dict[str, Dict[str, Any]]:
    """The server container's startup, readiness and liveness probes: ``tfe-estimator health`` in the pod.

    Startup: every 5 s for up to `STARTUP_SECONDS`; readiness: every 10 s, out of the Service after 3 misses;
    liveness (once started): restarted after 4 misses 30 s apart, so a server busy with a large step is not
    killed for one slow answer.
    """
    check = {"exec": {"command": list(HEALTH_COMMAND)}, "timeoutSeconds": _PROBE_PERIOD}
    return {"startupProbe": dict(check, periodSeconds=5, failureThreshold=STARTUP_SECONDS // 5),
            "readinessProbe": dict(check, periodSeconds=_PROBE_PERIOD, failureThreshold=3),
            "livenessProbe": dict(check, periodSeconds=30, failureThreshold=4)}


def add_server_parts(pod_spec: Dict[str, Any], index: int, metrics_port: Optional[int]) -> None:
    """Adds to server `index`'s pod spec (service mode) its probes, its metrics port and, for server0, its state."""
    container = pod_spec["containers"][0]
    container.update(probes())
    if metrics_port is not None:
        container.setdefault("ports", []).append({"name": "metrics", "containerPort": metrics_port,
                                                  "protocol": "TCP"})
    if index == 0:
        container["env"].append({"name": STATE_DIR_ENV, "value": STATE_DIR})
        container.setdefault("volumeMounts", []).append({"name": "state", "mountPath": STATE_MOUNT_PATH})
        pod_spec["volumes"] = pod_spec.get("volumes", []) + [{"name": "state", "emptyDir": {}}]


def check_metrics_port(metrics_port: Optional[int], taken: Mapping[int, str]) -> None:
    """Refuses a metrics port that is no TCP port or is one of the server's federation ports (`taken`: port ->
    what it is), naming the fix."""
    if metrics_port is None:
        return
    check_int(metrics_port, f"--metrics-port {metrics_port!r} must be a TCP port in 1..65535 (default "
              f"{DEFAULT_METRICS_PORT}).", minimum=1, maximum=65535)
    if metrics_port in taken:
        raise ValueError(f"--metrics-port {metrics_port} is the server's {taken[metrics_port]}: give the metrics "
                         f"their own port (e.g. --metrics-port {DEFAULT_METRICS_PORT}"
                         f"{' + 1' if DEFAULT_METRICS_PORT in taken else ''}).")


def metrics_sources(namespace: Optional[str], pod_labels: Mapping[str, str]) -> List[Dict[str, Any]]:
    """The NetworkPolicy peers admitted to the metrics port: the pods labelled `pod_labels` (any pod if none) in
    the namespace `namespace` (the server's own if None); nobody if both are empty.

    Example::

        >>> metrics_sources("monitoring", {"app.kubernetes.io/name": "prometheus"})[0]["namespaceSelector"]
        {'matchLabels': {'kubernetes.io/metadata.name': 'monitoring'}}
    """
    if namespace is not None and (not isinstance(namespace, str) or len(namespace) > 63
                                  or not _DNS_1123_LABEL.match(namespace)):
        raise ValueError(f"--metrics-namespace {namespace!r} is not a namespace name (a DNS-1123 label: lowercase "
                         "letters, digits and '-', e.g. 'monitoring').")
    for key, value in pod_labels.items():
        if not _LABEL_NAME.match(key) or len(key.rpartition("/")[2]) > 63 or not _LABEL_VALUE.match(value):
            raise ValueError(f"--metrics-pod-label {key}={value}: not a Kubernetes label (KEY=VALUE, e.g. "
                             "app.kubernetes.io/name=prometheus).")
    if namespace is None and not pod_labels:
        return []
    peer: Dict[str, Any] = {"podSelector": {"matchLabels": dict(pod_labels)} if pod_labels else {}}
    if namespace is not None:
        peer["namespaceSelector"] = {"matchLabels": {_NAMESPACE_NAME_LABEL: namespace}}
    return [peer]


def metrics_ingress(metrics_port: Optional[int], sources: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """The ingress rule of the metrics port (a list of at most one): only from `sources`, none without them."""
    if metrics_port is None or not sources:
        return []
    return [{"from": list(sources), "ports": [{"protocol": "TCP", "port": metrics_port}]}]
