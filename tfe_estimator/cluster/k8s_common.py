"""What the two Kubernetes renderers share: labels, ports, defaults and the argument checks.

`tfe_estimator.cluster.kubernetes` (plain manifests, `tfe-estimator k8s`) and
`tfe_estimator.cluster.tfjob` (one Kubeflow TFJob) both import this module and
neither imports the other. It imports no TensorFlow.

Example::

    from tfe_estimator.cluster import k8s_common

    k8s_common.check_arguments("demo", "example.com/train:1", 2, ["python", "train.py"], "default",
                               k8s_common.DEFAULT_PORT, {"data": (None, "/data"), "model": (None, "/model")})
    k8s_common.labels("demo", "chief", 0)[k8s_common.JOB_LABEL]  # 'chief'
"""
import re
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

from tfe_estimator.cluster.server import server_command
from tfe_estimator.cluster.spec import NUM_TFE_TASKS, cluster_tasks
from tfe_estimator.validation import check_int

__all__ = [
    "CLUSTER_LABEL",
    "JOB_LABEL",
    "INDEX_LABEL",
    "DEFAULT_PORT",
    "TLS_PORT",
    "DEFAULT_SIDECAR_IMAGE",
    "DEFAULT_TLS_SECRET",
    "TLS_DIR",
    "DEFAULT_COMMAND",
    "SERVER_COMMAND",
    "NUM_TFE_TASKS",
    "DEFAULT_RESOURCES",
    "DEFAULT_RUN_AS_USER",
    "RENDERED_KINDS",
    "container_security_context",
    "pod_security_context",
    "parse_quantities",
    "teardown_command",
    "check_arguments",
    "check_image",
    "check_active_deadline_seconds",
    "check_tls",
    "check_tls_secret",
    "SERVICE_TFE_TASKS",
    "tasks",
    "labels",
    "selector",
]

#: Label on every object and pod of one cluster; the NetworkPolicies select on it.
CLUSTER_LABEL = "tfe-estimator/cluster"
#: Label naming a pod's TF_CONFIG job (chief, worker, evaluator, tfe).
JOB_LABEL = "tfe-estimator/job"
#: Label naming a pod's task index within its job.
INDEX_LABEL = "tfe-estimator/task-index"

DEFAULT_PORT = 2222
#: With --tls: where each pod's sidecar accepts mutual TLS (the only port a Service exposes).
TLS_PORT = 8443
#: With --tls: the sidecar container's image (Debian's stunnel4; deploy/sidecar/Dockerfile builds it).
DEFAULT_SIDECAR_IMAGE = "tfe-estimator-tls-sidecar:1"
#: With --tls: the Secret per task holding ca.crt and the task's <job>-<index>.crt/.key (`tfe-estimator certs`).
DEFAULT_TLS_SECRET = "{name}-{job}-{index}-tls"
#: With --tls: where the sidecar finds its config and certificates.
TLS_DIR = "/etc/tfe-tls"
DEFAULT_COMMAND: Tuple[str, ...] = ("python", "train.py")
#: Service mode: the aggregation service's two servers, tfe:0 and tfe:1 (as `launcher.SERVICE_TFE_TASKS`).
SERVICE_TFE_TASKS = 2
#: What a ``tfe`` pod runs: a TensorFlow server configured by TF_CONFIG (the one server command).
SERVER_COMMAND: Tuple[str, ...] = server_command()

#: Requests and limits of every TensorFlow container (owners and tfe servers); `--requests`/`--limits` change them.
#: No CPU limit: throttling a party stalls every owner's step.
DEFAULT_RESOURCES: Dict[str, Dict[str, str]] = {"requests": {"cpu": "1", "memory": "2Gi"}, "limits": {"memory": "4Gi"}}
#: The user every pod runs as (the training image, deploy/Dockerfile, creates it); never root.
DEFAULT_RUN_AS_USER = 1000
#: Every kind `render_manifests` emits (`render_tfjob`: a TFJob and NetworkPolicies): what `teardown_command` deletes.
RENDERED_KINDS: Tuple[str, ...] = ("jobs.batch", "deployments.apps", "services", "configmaps",
                                   "networkpolicies.networking.k8s.io")
_TFJOB_KIND = "tfjobs.kubeflow.org"

_DNS_1123_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_DNS_1035_LABEL = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
_DNS_1123_SUBDOMAIN = re.compile(r"^[a-z0-9]([-.a-z0-9]*[a-z0-9])?$")
_MAX_LABEL = 63


def check_arguments(
    name: str,
    image: str,
    workers: int,
    command: Sequence[str],
    namespace: str,
    port: int,
    claims: Mapping[str, Tuple[Optional[str], str]],
) -> None:
    """Raises ValueError naming the bad argument and the fix."""
    if not isinstance(name, str) or not _DNS_1035_LABEL.match(name):
        raise ValueError(
            f"name={name!r} is not a valid cluster name: it must be a DNS-1123 label that "
            "starts with a letter (lowercase letters, digits and '-', starting with a letter "
            "and ending with a letter or digit), because it prefixes every Service name."
        )
    check_int(workers, f"workers={workers!r} must be an integer >= 0 (the data owners besides the chief).", minimum=0)
    longest = max((f"{name}-{job}-{index}" for job, index in tasks(workers, evaluator=True)), key=len)
    if len(longest) > _MAX_LABEL:
        raise ValueError(
            f"name={name!r} is too long: the Service name {longest!r} has {len(longest)} "
            f"characters, more than Kubernetes allows ({_MAX_LABEL}). Use a shorter name."
        )
    if not isinstance(namespace, str) or len(namespace) > _MAX_LABEL or not _DNS_1123_LABEL.match(namespace):
        raise ValueError(
            f"namespace={namespace!r} is not a valid Kubernetes namespace: it must be a DNS-1123 "
            "label (lowercase letters, digits and '-', at most 63 characters)."
        )
    check_image(image, "image")
    if (
        not isinstance(command, (list, tuple))
        or not command
        or not all(isinstance(a, str) and a for a in command)
    ):
        raise ValueError(
            f"command={command!r} must be a non-empty list of non-empty strings, "
            "e.g. ['python', 'train.py'] (a list, not one shell string)."
        )
    check_int(port, f"port={port!r} must be an integer TCP port in 1..65535.", minimum=1, maximum=65535)
    for volume, (claim, mount_path) in claims.items():
        if claim is not None:
            try:
                example = claim.format(job="chief", index=0, name=name)
            except (AttributeError, KeyError, IndexError, ValueError) as e:
                raise ValueError(
                    f"{volume}_claim={claim!r} must be a PersistentVolumeClaim name, optionally with "
                    f"the placeholders {{name}}, {{job}} and {{index}} (got {e!r})."
                ) from None
            if len(example) > 253 or not _DNS_1123_SUBDOMAIN.match(example):
                raise ValueError(
                    f"{volume}_claim={claim!r} gives {example!r}, which is not a valid "
                    "PersistentVolumeClaim name (a DNS-1123 subdomain: lowercase letters, digits, '-' and '.')."
                )
        if not isinstance(mount_path, str) or not mount_path.startswith("/"):
            raise ValueError(f"{volume}_mount_path={mount_path!r} must be an absolute path such as '/{volume}'.")
    (data_path, model_path) = (claims["data"][1], claims["model"][1])
    if data_path.rstrip("/") == model_path.rstrip("/"):
        raise ValueError(f"data_mount_path and model_mount_path are both {data_path!r}: use two paths.")


def check_image(image: str, source: str) -> None:
    """Raises ValueError unless `image` (from `source`, e.g. ``"server_image"``) is a container image reference."""
    if not isinstance(image, str) or not image.strip() or any(c.isspace() for c in image):
        raise ValueError(
            f"{source}={image!r} must be a non-empty container image reference without spaces, "
            "e.g. 'registry.example.com/tfe-train:1.0'; the image needs tfe_estimator installed."
        )


def check_active_deadline_seconds(active_deadline_seconds: Optional[int]) -> None:
    """Raises ValueError unless `active_deadline_seconds` is None or an integer >= 1."""
    if active_deadline_seconds is not None:
        check_int(active_deadline_seconds,
                  f"active_deadline_seconds={active_deadline_seconds!r} must be an integer >= 1 (seconds).", minimum=1)


def check_tls(name: str, tasks, port: int, sidecar_image: str, tls_secret: str) -> None:
    """Raises ValueError naming a bad TLS argument and the fix."""
    if port + len(tasks) - 1 > 65535 or TLS_PORT in range(port, port + len(tasks)):
        raise ValueError(f"port={port} with --tls: task k's TensorFlow port is port + k (up to "
                         f"{port + len(tasks) - 1}), which must stay below 65536 and clear of the TLS port "
                         f"{TLS_PORT}. Use e.g. --port {DEFAULT_PORT}.")
    if not isinstance(sidecar_image, str) or not sidecar_image.strip() or any(c.isspace() for c in sidecar_image):
        raise ValueError(f"sidecar_image={sidecar_image!r} must be a container image reference without spaces "
                         "(build one from deploy/sidecar/Dockerfile).")
    check_tls_secret(name, tasks, tls_secret)


def check_tls_secret(name: str, tasks, tls_secret: str) -> None:
    """Raises ValueError unless `tls_secret` gives a valid Secret name for every task."""
    for job, index in tasks:
        try:
            secret = tls_secret.format(name=name, job=job, index=index)
        except (KeyError, IndexError, AttributeError) as e:
            raise ValueError(f"tls_secret={tls_secret!r}: only the placeholders {{name}}, {{job}} and {{index}} "
                             f"are available ({e!r}).") from None
        if len(secret) > 253 or not _DNS_1123_SUBDOMAIN.match(secret):
            raise ValueError(f"tls_secret={tls_secret!r} gives {secret!r}, not a valid Secret name (lowercase "
                             "letters, digits, '-' and '.').")


def tasks(workers: int, evaluator: bool, num_tfe: int = NUM_TFE_TASKS) -> List[Tuple[str, int]]:
    """`(job, index)` of every task, in TF_CONFIG order (the one layout, `cluster_tasks`)."""
    return cluster_tasks(workers, evaluator, num_tfe)


def labels(name: str, job: Optional[str] = None, index: Optional[int] = None) -> Dict[str, str]:
    """The labels of every object of cluster `name`; with `job` and `index`, of that task's objects."""
    result = {
        "app.kubernetes.io/name": "tfe-estimator",
        "app.kubernetes.io/instance": name,
        CLUSTER_LABEL: name,
    }
    if job is not None:
        result["app.kubernetes.io/component"] = job
        result[JOB_LABEL] = job
        result[INDEX_LABEL] = str(index)
    return result


def selector(name: str, job: str, index: int) -> Dict[str, str]:
    """The labels that pick exactly one task's pod."""
    return {CLUSTER_LABEL: name, JOB_LABEL: job, INDEX_LABEL: str(index)}


def pod_security_context(run_as_user: int = DEFAULT_RUN_AS_USER) -> Dict[str, Any]:
    """The pod's securityContext: a non-root user and the runtime's default seccomp profile."""
    check_int(run_as_user, f"run_as_user={run_as_user!r} must be an integer user id >= 1 (not root).", minimum=1)
    return {"runAsNonRoot": True, "runAsUser": run_as_user, "runAsGroup": run_as_user, "fsGroup": run_as_user,
            "seccompProfile": {"type": "RuntimeDefault"}}


def container_security_context(read_only_root: bool) -> Dict[str, Any]:
    """A container's securityContext: no privilege escalation, no capabilities, optionally a read-only root."""
    return {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": bool(read_only_root),
            "capabilities": {"drop": ["ALL"]}}


def parse_quantities(text: str, flag: str) -> Dict[str, str]:
    """``"cpu=1,memory=2Gi"`` -> ``{"cpu": "1", "memory": "2Gi"}``; ``""`` -> ``{}``."""
    result = {}
    for item in filter(None, (p.strip() for p in text.split(","))):
        key, sep, value = item.partition("=")
        if not sep or key.strip() not in ("cpu", "memory", "ephemeral-storage") or not value.strip():
            raise ValueError(f"{flag} {text!r}: expected resource=quantity pairs separated by commas, e.g. "
                             "'cpu=1,memory=2Gi' (resources: cpu, memory, ephemeral-storage).")
        result[key.strip()] = value.strip()
    return result


def teardown_command(name: str, namespace: str = "default", tfjob: bool = False) -> List[str]:
    """The kubectl command that deletes every object rendered for cluster `name` (TLS ConfigMaps included).

    With `tfjob` also the TFJob (kubectl refuses a kind whose CRD is not installed, so only then).
    """
    kinds = RENDERED_KINDS + ((_TFJOB_KIND,) if tfjob else ())
    return ["kubectl", "-n", namespace, "delete", ",".join(kinds), "-l", f"{CLUSTER_LABEL}={name}",
            "--ignore-not-found"]
