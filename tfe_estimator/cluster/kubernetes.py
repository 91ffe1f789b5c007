"""Renders plain Kubernetes manifests for a secure-aggregation cluster.

One cluster is, for ``workers=1`` with an evaluator::

    chief-0, worker-0      data owners: the user's training script, a Job each
    evaluator-0            the user's training script, a Job
    tfe-0, tfe-1, tfe-2    TFE parties: ``tfe-estimator server``, a Deployment each

Every task gets its own headless ``Service`` named ``<name>-<job>-<index>``
and its own ``TF_CONFIG`` whose addresses are those Services' DNS names,
``<name>-<job>-<index>.<namespace>.svc:<port>``. One ``NetworkPolicy``
admits ingress to the cluster's pods only from the cluster's own pods,
because TensorFlow's gRPC runtime has neither TLS nor authentication.

The layout (which tasks exist) is `tfe_estimator.cluster.spec.cluster_tasks`, the
same one the loopback launcher uses, and the ``tfe`` pods run
`tfe_estimator.cluster.server.server_command()`. `to_yaml` writes a multi-document
YAML stream through PyYAML, so the output can go straight to
``kubectl apply -f -``.

Example::

    from tfe_estimator.cluster import kubernetes

    manifests = kubernetes.render_manifests(
        "demo", "registry.example.com/train:1.0", workers=2,
        command=["python", "train.py"])
    print(kubernetes.to_yaml(manifests))

or from a shell::

    tfe-estimator k8s --name demo --image registry.example.com/train:1.0 \\
        --workers 2 -- python train.py | kubectl apply -f -
"""
import argparse
import re
import sys
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

from tfe_estimator.cluster import certs, peers
from tfe_estimator.cluster.model_dir_claim import MODEL_DIR_ENV
from tfe_estimator.cluster.sidecar import stunnel_config
from tfe_estimator.cluster.spec import (LAUNCH_CLUSTER_MODE_ENV, NUM_TFE_TASKS, TFE_JOB, cluster_jobs, cluster_tasks,
                                        tf_config_json)
from tfe_estimator.cluster.server import server_command

__all__ = [
    "CLUSTER_LABEL",
    "JOB_LABEL",
    "INDEX_LABEL",
    "DEFAULT_PORT",
    "TLS_PORT",
    "DEFAULT_SIDECAR_IMAGE",
    "DEFAULT_TLS_SECRET",
    "DEFAULT_COMMAND",
    "SERVER_COMMAND",
    "NUM_TFE_TASKS",
    "render_manifests",
    "to_yaml",
    "main",
]

#: Label on every object and pod of one cluster; the NetworkPolicy selects on it.
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
_TLS_DIR = "/etc/tfe-tls"
DEFAULT_COMMAND: Tuple[str, ...] = ("python", "train.py")
#: What a ``tfe`` pod runs: a TensorFlow server configured by TF_CONFIG (the one server command).
SERVER_COMMAND: Tuple[str, ...] = server_command()
#: The program name `main` reports in its usage and errors.
PROG = "tfe-estimator k8s"

_DNS_1123_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_DNS_1035_LABEL = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
_DNS_1123_SUBDOMAIN = re.compile(r"^[a-z0-9]([-.a-z0-9]*[a-z0-9])?$")
_MAX_LABEL = 63


def _check_arguments(
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
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 0:
        raise ValueError(f"workers={workers!r} must be an integer >= 0 (the data owners besides the chief).")
    longest = max((f"{name}-{job}-{index}" for job, index in _tasks(workers, evaluator=True)), key=len)
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
    if not isinstance(image, str) or not image.strip() or any(c.isspace() for c in image):
        raise ValueError(
            f"image={image!r} must be a non-empty container image reference without spaces, "
            "e.g. 'registry.example.com/train:1.0'; the image needs tfe_estimator installed."
        )
    if (
        not isinstance(command, (list, tuple))
        or not command
        or not all(isinstance(a, str) and a for a in command)
    ):
        raise ValueError(
            f"command={command!r} must be a non-empty list of non-empty strings, "
            "e.g. ['python', 'train.py'] (a list, not one shell string)."
        )
    if isinstance(port, bool) or not isinstance(port, int) or not 1 <= port <= 65535:
        raise ValueError(f"port={port!r} must be an integer TCP port in 1..65535.")
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


def _check_tls(name: str, tasks, port: int, sidecar_image: str, tls_secret: str) -> None:
    """Raises ValueError naming a bad TLS argument and the fix."""
    if port + len(tasks) - 1 > 65535 or TLS_PORT in range(port, port + len(tasks)):
        raise ValueError(f"port={port} with --tls: task k's TensorFlow port is port + k (up to "
                         f"{port + len(tasks) - 1}), which must stay below 65536 and clear of the TLS port "
                         f"{TLS_PORT}. Use e.g. --port {DEFAULT_PORT}.")
    if not isinstance(sidecar_image, str) or not sidecar_image.strip() or any(c.isspace() for c in sidecar_image):
        raise ValueError(f"sidecar_image={sidecar_image!r} must be a container image reference without spaces "
                         "(build one from deploy/sidecar/Dockerfile).")
    for job, index in tasks:
        try:
            secret = tls_secret.format(name=name, job=job, index=index)
        except (KeyError, IndexError, AttributeError) as e:
            raise ValueError(f"tls_secret={tls_secret!r}: only the placeholders {{name}}, {{job}} and {{index}} "
                             f"are available ({e!r}).") from None
        if len(secret) > 253 or not _DNS_1123_SUBDOMAIN.match(secret):
            raise ValueError(f"tls_secret={tls_secret!r} gives {secret!r}, not a valid Secret name (lowercase "
                             "letters, digits, '-' and '.').")


def _tasks(workers: int, evaluator: bool) -> List[Tuple[str, int]]:
    """`(job, index)` of every task, in TF_CONFIG order (the one layout, `cluster_tasks`)."""
    return cluster_tasks(workers, evaluator, NUM_TFE_TASKS)


def _labels(name: str, job: Optional[str] = None, index: Optional[int] = None) -> Dict[str, str]:
    labels = {
        "app.kubernetes.io/name": "tfe-estimator",
        "app.kubernetes.io/instance": name,
        CLUSTER_LABEL: name,
    }
    if job is not None:
        labels["app.kubernetes.io/component"] = job
        labels[JOB_LABEL] = job
        labels[INDEX_LABEL] = str(index)
    return labels


def _selector(name: str, job: str, index: int) -> Dict[str, str]:
    """The labels that pick exactly one task's pod."""
    return {CLUSTER_LABEL: name, JOB_LABEL: job, INDEX_LABEL: str(index)}


def _pod_spec(
    job: str,
    image: str,
    command: Sequence[str],
    tf_config: str,
    port: int,
    restart_policy: str,
    mounts: Sequence[Tuple[str, str, str, bool]] = (),
    mode: str = peers.BETWEEN_GRAPH,
    sidecar: Optional[Dict[str, Any]] = None,
) -> Dict[str, Any]:
    """A pod spec; `mounts` are (volume name, claim name, mount path, read-only); `sidecar` adds the TLS sidecar."""
    container: Dict[str, Any] = {
        "name": "tensorflow" if job != TFE_JOB else "tfe-server",
        "image": image,
        "command": list(command),
        "env": [{"name": "TF_CONFIG", "value": tf_config}, {"name": LAUNCH_CLUSTER_MODE_ENV, "value": mode}],
        "ports": [{"name": "grpc", "containerPort": port, "protocol": "TCP"}],
    }
    spec: Dict[str, Any] = {
        "restartPolicy": restart_policy,
        # Nothing here talks to the Kubernetes API: keep its credentials out of the pod.
        "automountServiceAccountToken": False,
        "enableServiceLinks": False,
        "containers": [container],
    }
    if sidecar is not None:
        # A native sidecar (an init container that keeps running, Kubernetes >= 1.29): it starts before
        # TensorFlow and is stopped once the training container exits, so a Job still completes.
        spec["initContainers"] = [sidecar["container"]]
        spec["volumes"] = list(sidecar["volumes"])
    if mounts:
        container["volumeMounts"] = [
            {"name": volume, "mountPath": path, "readOnly": read_only} for volume, _, path, read_only in mounts
        ]
        spec["volumes"] = spec.get("volumes", []) + [
            {"name": volume, "persistentVolumeClaim": {"claimName": claim, "readOnly": read_only}}
            for volume, claim, _, read_only in mounts
        ]
    return spec


def _sidecar(name: str, task: Tuple[str, int], image: str, secret: str) -> Dict[str, Any]:
    """The TLS sidecar container of `task`'s pod and its volumes (its stunnel config, its Secret)."""
    return {
        "container": {
            "name": "tls-sidecar",
            "image": image,
            "restartPolicy": "Always",
            "command": ["stunnel4", f"{_TLS_DIR}/config/stunnel.conf"],
            "ports": [{"name": "tls", "containerPort": TLS_PORT, "protocol": "TCP"}],
            "securityContext": {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
                                "capabilities": {"drop": ["ALL"]}},
            "volumeMounts": [{"name": "tls-config", "mountPath": f"{_TLS_DIR}/config", "readOnly": True},
                             {"name": "tls-certs", "mountPath": f"{_TLS_DIR}/certs", "readOnly": True}],
        },
        "volumes": [{"name": "tls-config", "configMap": {"name": f"{name}-{certs.task_name(*task)}-stunnel"}},
                    {"name": "tls-certs", "secret": {"secretName": secret, "defaultMode": 0o400}}],
    }


def _network_policy(name: str, namespace: str, task: Tuple[str, int], tasks, mode: str, port: int,
                    tls: bool) -> Dict[str, Any]:
    """Ingress to `task`'s pod only from the tasks the peer table lets call it, on its one port
    (the TLS port with `tls`, else TensorFlow's); with `tls` also egress only to the tasks it may call
    (and DNS)."""
    job, index = task

    def pods(jobs):
        return [{"podSelector": {"matchLabels": {CLUSTER_LABEL: name},
                                 "matchExpressions": [{"key": JOB_LABEL, "operator": "In", "values": sorted(jobs)}]}}]

    callers = [j for j in peers.allowed_callers(mode, job) if any(t[0] == j for t in tasks)]
    spec: Dict[str, Any] = {"podSelector": {"matchLabels": _selector(name, job, index)},
                            "policyTypes": ["Ingress"],
                            "ingress": ([{"from": pods(callers), "ports": [{"protocol": "TCP", "port": port}]}]
                                        if callers else [])}
    if tls:
        callees = [j for j in peers.allowed_callees(mode, job) if any(t[0] == j for t in tasks)]
        spec["policyTypes"].append("Egress")
        spec["egress"] = [{"ports": [{"protocol": "UDP", "port": 53}, {"protocol": "TCP", "port": 53}]}]
        if callees:
            spec["egress"].insert(0, {"to": pods(callees), "ports": [{"protocol": "TCP", "port": TLS_PORT}]})
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": {"name": f"{name}-{job}-{index}-peers", "namespace": namespace,
                     "labels": _labels(name, job, index)},
        "spec": spec,
    }


def render_manifests(
    name: str,
    image: str,
    workers: int,
    evaluator: bool = True,
    command: Sequence[str] = DEFAULT_COMMAND,
    namespace: str = "default",
    port: int = DEFAULT_PORT,
    data_claim: Optional[str] = None,
    data_mount_path: str = "/data",
    model_claim: Optional[str] = None,
    model_mount_path: str = "/model",
    active_deadline_seconds: Optional[int] = None,
    cluster_mode: str = peers.BETWEEN_GRAPH,
    tls: bool = False,
    sidecar_image: str = DEFAULT_SIDECAR_IMAGE,
    tls_secret: str = DEFAULT_TLS_SECRET,
) -> List[Dict[str, Any]]:
    """Renders the Kubernetes objects of one secure-aggregation cluster.

    Per task (the chief, ``workers`` workers, the optional evaluator and the three
    ``tfe`` parties) one headless ``Service`` named ``<name>-<job>-<index>`` and
    one workload: a ``Job`` (restartPolicy OnFailure) running ``command`` for the
    chief, workers and evaluator; a single-replica ``Deployment`` running
    ``tfe-estimator server`` for each ``tfe`` party. Each pod has its own
    ``TF_CONFIG``; all of them list the same cluster. Last comes a
    ``NetworkPolicy`` admitting ingress to the cluster's pods only from the
    cluster's pods.

    Args:
      name: the cluster's name, a DNS-1123 label starting with a letter; it
        prefixes every object and is the value of the ``tfe-estimator/cluster``
        label.
      image: the container image; it must contain the training script and
        ``tfe_estimator`` (whose ``tfe-estimator`` command the servers run).
      workers: data owners besides the chief (>= 0).
      evaluator: whether to add an ``evaluator`` task.
      command: the training script's command (chief, workers, evaluator), as a
        list of arguments.
      namespace: the namespace of every object.
      port: the TensorFlow gRPC port of every task.
      data_claim: optional PersistentVolumeClaim name mounted read-only at
        ``data_mount_path`` in the chief, worker and evaluator pods (never in
        ``tfe`` pods); the placeholders ``{name}``, ``{job}`` and ``{index}``
        give each data owner its own claim, e.g. ``"{name}-data-{job}-{index}"``.
      data_mount_path: where ``data_claim`` is mounted.
      model_claim: optional PersistentVolumeClaim for the model directory,
        mounted read-write in the chief pod, which writes checkpoints, and in
        the evaluator pod, which reads them and writes its summaries to
        ``model_dir/eval`` (Estimator's evaluator writes there).
        The same placeholders work (``"{name}-model-{job}-{index}"``: each
        owner's own volume; the evaluator mounts the chief's). Each owner pod's
        ``TFE_ESTIMATOR_MODEL_DIR`` is ``<model_mount_path>/<job>-<index>`` and
        the evaluator's ``<model_mount_path>/chief-0``, which `TfeRunConfig`
        uses when the script passes no model_dir: owners never share a
        directory, even on one ReadWriteMany claim such as ``"{name}-model"``
        (a script that passes one model_dir to every owner is refused by the
        second owner: `tfe_estimator.cluster.model_dir_claim`).
        Without a claim, point the training script's ``model_dir`` at storage
        the chief and the evaluator can reach (e.g. ``gs://...``).
      model_mount_path: where ``model_claim`` is mounted.
      active_deadline_seconds: optional bound on every Job's run time
        (``activeDeadlineSeconds``): a chief waiting for a task that never
        comes back (TensorFlow has no timeout for a missing in-graph worker)
        then fails after that long instead of waiting indefinitely.
      cluster_mode: "between-graph" (default: every owner runs only its own
        graph; `model_claim` is mounted in every owner's pod, and the
        evaluator gets the chief's) or "in-graph"; exported to the pods as
        ``TFE_ESTIMATOR_CLUSTER_MODE`` and deciding the NetworkPolicies: one
        per task, admitting only the tasks `tfe_estimator.cluster.peers` lets
        call it.
      tls: mutual TLS on every link (`tfe_estimator.cluster.sidecar`): a
        ``tls-sidecar`` container (stunnel) per pod with its config in a
        ConfigMap per task and its key and certificates from the Secret
        `tls_secret`; TF_CONFIG names every task at ``localhost:<port + k>``
        (its sidecar's listener); Services and NetworkPolicies expose only
        the TLS port (8443), so TensorFlow's own port is reachable from its
        pod only, and each pod may connect out only to the tasks it may call.
      sidecar_image: the sidecar's image (``deploy/sidecar/Dockerfile``).
      tls_secret: the Secret name per task, with ``{name}``, ``{job}`` and
        ``{index}``; it must hold ``ca.crt`` and ``<job>-<index>.crt/.key``
        made for cluster `name` (``tfe-estimator certs --cluster NAME``).

    Returns:
      The manifests as JSON-compatible dicts: Services and workloads task by
      task, then the NetworkPolicy.

    Raises:
      ValueError: for an invalid argument, naming it and the fix.

    Example::

        >>> objs = render_manifests("demo", "example.com/train:1", workers=1)
        >>> [o["kind"] for o in objs][:2]
        ['Service', 'Job']
        >>> objs[1]["metadata"]["name"]
        'demo-chief-0'
    """
    _check_arguments(
        name,
        image,
        workers,
        command,
        namespace,
        port,
        {"data": (data_claim, data_mount_path), "model": (model_claim, model_mount_path)},
    )
    if active_deadline_seconds is not None and (
        isinstance(active_deadline_seconds, bool) or not isinstance(active_deadline_seconds, int)
        or active_deadline_seconds < 1
    ):
        raise ValueError(f"active_deadline_seconds={active_deadline_seconds!r} must be an integer >= 1 (seconds).")
    peers.validate_mode(cluster_mode, "cluster_mode")
    command = tuple(command)
    tasks = _tasks(workers, evaluator)
    tf_ports = {t: (port + k if tls else port) for k, t in enumerate(tasks)}
    if tls:
        _check_tls(name, tasks, port, sidecar_image, tls_secret)

    def address(job: str, index: int) -> str:
        if tls:  # the caller's own sidecar listens there for this task
            return f"localhost:{tf_ports[(job, index)]}"
        return f"{name}-{job}-{index}.{namespace}.svc:{port}"

    cluster = cluster_jobs(tasks, address)
    tls_addresses = {t: f"{name}-{certs.task_name(*t)}.{namespace}.svc:{TLS_PORT}" for t in tasks}

    manifests: List[Dict[str, Any]] = []
    for job, index in tasks:
        task_name = f"{name}-{job}-{index}"
        labels = _labels(name, job, index)
        tf_config = tf_config_json(cluster, job, index)
        exposed = ({"name": "tls", "port": TLS_PORT, "targetPort": TLS_PORT, "protocol": "TCP"} if tls else
                   {"name": "grpc", "port": port, "targetPort": port, "protocol": "TCP"})
        manifests.append(
            {
                "apiVersion": "v1",
                "kind": "Service",
                "metadata": {"name": task_name, "namespace": namespace, "labels": dict(labels)},
                "spec": {
                    "clusterIP": "None",
                    # TF servers dial each other while starting; resolve before readiness.
                    "publishNotReadyAddresses": True,
                    "selector": _selector(name, job, index),
                    "ports": [exposed],
                },
            }
        )
        sidecar = None
        if tls:
            config = stunnel_config((job, index), tasks, cluster_mode, f"{_TLS_DIR}/certs", name, tf_ports,
                                    tls_addresses)
            manifests.append({"apiVersion": "v1", "kind": "ConfigMap",
                              "metadata": {"name": f"{task_name}-stunnel", "namespace": namespace,
                                           "labels": dict(labels)},
                              "data": {"stunnel.conf": config}})
            sidecar = _sidecar(name, (job, index), sidecar_image, tls_secret.format(name=name, job=job, index=index))
        tf_port = tf_ports[(job, index)]
        if job == TFE_JOB:
            # The TFE parties never see data or the model: no volumes.
            pod_spec = _pod_spec(job, image, SERVER_COMMAND, tf_config, tf_port, "Always", mode=cluster_mode,
                                 sidecar=sidecar)
            manifests.append(
                {
                    "apiVersion": "apps/v1",
                    "kind": "Deployment",
                    "metadata": {"name": task_name, "namespace": namespace, "labels": dict(labels)},
                    "spec": {
                        "replicas": 1,
                        # Never two pods behind one task's address, not even during an update.
                        "strategy": {"type": "Recreate"},
                        "selector": {"matchLabels": _selector(name, job, index)},
                        "template": {"metadata": {"labels": dict(labels)}, "spec": pod_spec},
                    },
                }
            )
        else:
            mounts = []
            if data_claim is not None:
                mounts.append(("data", data_claim.format(name=name, job=job, index=index), data_mount_path, True))
            owners_dir = cluster_mode == peers.BETWEEN_GRAPH  # every owner checkpoints its own copy
            if model_claim is not None and (job in ("chief", "evaluator") or owners_dir):
                # The evaluator evaluates the chief's organisation's checkpoints (between-graph: the chief's claim).
                of = ("chief", 0) if job == "evaluator" and owners_dir else (job, index)
                claim = model_claim.format(name=name, job=of[0], index=of[1])
                # Read-write for all: owners write checkpoints, the evaluator model_dir/eval.
                mounts.append(("model", claim, model_mount_path, False))
            pod_spec = _pod_spec(job, image, command, tf_config, tf_port, "OnFailure", mounts, mode=cluster_mode,
                                 sidecar=sidecar)
            if model_claim is not None and (job in ("chief", "evaluator") or owners_dir):
                # Each owner its own directory even on one shared claim; the evaluator its owner's (the chief's).
                owner = "chief-0" if job == "evaluator" else f"{job}-{index}"
                pod_spec["containers"][0]["env"].append(
                    {"name": MODEL_DIR_ENV, "value": f"{model_mount_path.rstrip('/')}/{owner}"})
            manifests.append(
                {
                    "apiVersion": "batch/v1",
                    "kind": "Job",
                    "metadata": {"name": task_name, "namespace": namespace, "labels": dict(labels)},
                    "spec": {
                        "backoffLimit": 4,
                        "template": {"metadata": {"labels": dict(labels)}, "spec": pod_spec},
                    },
                }
            )
            if active_deadline_seconds is not None:
                manifests[-1]["spec"]["activeDeadlineSeconds"] = active_deadline_seconds

    # One NetworkPolicy per task: only the peers the cluster mode's table allows (cluster.peers).
    for task in tasks:
        manifests.append(_network_policy(name, namespace, task, tasks, cluster_mode,
                                         TLS_PORT if tls else port, tls))
    return manifests


def to_yaml(manifests: Sequence[Dict[str, Any]]) -> str:
    """Writes manifests as a multi-document YAML stream, through PyYAML.

    Args:
      manifests: JSON-compatible dicts, such as `render_manifests` returns.

    Returns:
      The stream, for ``kubectl apply -f``; keys keep their order, and the same
      input gives the same text.

    Example::

        >>> print(to_yaml([{"kind": "Namespace", "metadata": {"name": "ml"}}]), end="")
        ---
        kind: Namespace
        metadata:
          name: ml
    """
    import yaml  # pylint: disable=import-outside-toplevel

    return yaml.safe_dump_all(list(manifests), explicit_start=True, sort_keys=False, default_flow_style=False,
                              allow_unicode=True, width=1000)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG,
        description=(
            "Print Kubernetes manifests (a YAML stream) for a secure-aggregation cluster: a chief, "
            "N workers, an optional evaluator and 3 tfe servers, one headless Service each, "
            "and a NetworkPolicy. The training command follows '--'."
        ),
        epilog="Example: %(prog)s --name demo --image example.com/train:1 --workers 2 -- python train.py",
    )
    parser.add_argument("--name", required=True, help="cluster name (DNS-1123 label starting with a letter)")
    parser.add_argument("--image", required=True, help="container image with the training script and tfe_estimator")
    parser.add_argument("--workers", type=int, default=1, help="data owners besides the chief (default 1)")
    parser.add_argument("--no-evaluator", dest="evaluator", action="store_false", help="leave out the evaluator task")
    parser.add_argument("--namespace", default="default", help="namespace of every object (default 'default')")
    parser.add_argument("--port", type=int, default=DEFAULT_PORT, help=f"gRPC port (default {DEFAULT_PORT})")
    parser.add_argument(
        "--data-claim",
        default=None,
        help="PersistentVolumeClaim mounted read-only in chief/worker/evaluator pods; "
        "may use {name}, {job}, {index}, e.g. '{name}-data-{job}-{index}'",
    )
    parser.add_argument("--data-mount-path", default="/data", help="where --data-claim is mounted (default /data)")
    parser.add_argument(
        "--model-claim",
        default=None,
        help="PersistentVolumeClaim for model_dir, read-write in every owner pod (between-graph; the chief's "
        "only in-graph) and the evaluator pod (the chief's); each owner's TFE_ESTIMATOR_MODEL_DIR is "
        "<mount>/<job>-<index>, so one claim such as '{name}-model' or one per owner, '{name}-model-{job}-{index}'",
    )
    parser.add_argument("--model-mount-path", default="/model", help="where --model-claim is mounted (default /model)")
    parser.add_argument("--active-deadline-seconds", type=int, default=None,
                        help="bound every Job's run time (a chief waiting for a task that never comes back fails "
                        "after this long)")
    parser.add_argument("--cluster-mode", default=peers.BETWEEN_GRAPH,
                        help="between-graph (default: each owner runs only its own graph) or in-graph; decides "
                        "who may reach whom (one NetworkPolicy per task)")
    parser.add_argument("--tls", action="store_true",
                        help="mutual TLS on every link: a stunnel sidecar per pod, certificates from a Secret per "
                        "task, only the TLS port exposed")
    parser.add_argument("--sidecar-image", default=DEFAULT_SIDECAR_IMAGE,
                        help=f"the TLS sidecar's image (default {DEFAULT_SIDECAR_IMAGE}; deploy/sidecar/Dockerfile)")
    parser.add_argument("--tls-secret", default=DEFAULT_TLS_SECRET,
                        help=f"Secret per task with ca.crt and <job>-<index>.crt/.key (default {DEFAULT_TLS_SECRET!r})")
    parser.add_argument("--tfjob", action="store_true",
                        help="render one Kubeflow TFJob (kubeflow.org/v1) and a NetworkPolicy per replica type "
                        "instead (no --tls, no claims: see tfe_estimator.cluster.tfjob)")
    parser.add_argument("-o", "--output", default=None, help="write to this file instead of stdout")
    parser.add_argument(
        "command", nargs=argparse.REMAINDER, help=f"training command after '--' (default: {' '.join(DEFAULT_COMMAND)})"
    )
    return parser


def _tfjob(args, command) -> List[Dict[str, Any]]:
    """`--tfjob`: the TFJob rendering (`tfe_estimator.cluster.tfjob`), refusing what it cannot do."""
    unsupported = [flag for flag, value in (("--tls", args.tls), ("--data-claim", args.data_claim),
                                             ("--model-claim", args.model_claim)) if value]
    if unsupported:
        raise ValueError(f"{', '.join(unsupported)} cannot be used with --tfjob: every worker of a TFJob shares one "
                         "pod template, so per-task certificates and claims cannot be mounted (and the operator "
                         "writes TF_CONFIG from Service addresses). Render plain manifests instead (drop --tfjob).")
    from tfe_estimator.cluster.tfjob import render_tfjob  # pylint: disable=import-outside-toplevel

    return render_tfjob(args.name, args.image, args.workers, evaluator=args.evaluator,
                        command=command or DEFAULT_COMMAND, namespace=args.namespace, port=args.port,
                        cluster_mode=args.cluster_mode, active_deadline_seconds=args.active_deadline_seconds)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Prints the manifests for the cluster that the arguments describe.

    Args:
      argv: the arguments without the program name (default: ``sys.argv[1:]``),
        e.g. ``["--name", "demo", "--image", "example.com/train:1", "--", "python", "train.py"]``.

    Returns:
      0; bad arguments exit with status 2 and a message (argparse).
    """
    parser = _parser()
    args = parser.parse_args(argv)
    command = list(args.command)
    if command and command[0] == "--":
        command = command[1:]
    try:
        text = to_yaml(_tfjob(args, command) if args.tfjob else render_manifests(
            args.name,
            args.image,
            args.workers,
            evaluator=args.evaluator,
            command=command or DEFAULT_COMMAND,
            namespace=args.namespace,
            port=args.port,
            data_claim=args.data_claim,
            data_mount_path=args.data_mount_path,
            model_claim=args.model_claim,
            model_mount_path=args.model_mount_path,
            active_deadline_seconds=args.active_deadline_seconds,
            cluster_mode=args.cluster_mode,
            tls=args.tls,
            sidecar_image=args.sidecar_image,
            tls_secret=args.tls_secret,
        ))
    except ValueError as e:
        parser.error(str(e))
    if args.output:
        with open(args.output, "w", encoding="utf-8") as f:
            f.write(text)
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
