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

from tfe_estimator.cluster.spec import NUM_TFE_TASKS, TFE_JOB, cluster_jobs, cluster_tasks, tf_config_json
from tfe_estimator.cluster.server import server_command

__all__ = [
    "CLUSTER_LABEL",
    "JOB_LABEL",
    "INDEX_LABEL",
    "DEFAULT_PORT",
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
) -> Dict[str, Any]:
    """A pod spec; `mounts` are (volume name, claim name, mount path, read-only)."""
    container: Dict[str, Any] = {
        "name": "tensorflow" if job != TFE_JOB else "tfe-server",
        "image": image,
        "command": list(command),
        "env": [{"name": "TF_CONFIG", "value": tf_config}],
        "ports": [{"name": "grpc", "containerPort": port, "protocol": "TCP"}],
    }
    spec: Dict[str, Any] = {
        "restartPolicy": restart_policy,
        # Nothing here talks to the Kubernetes API: keep its credentials out of the pod.
        "automountServiceAccountToken": False,
        "enableServiceLinks": False,
        "containers": [container],
    }
    if mounts:
        container["volumeMounts"] = [
            {"name": volume, "mountPath": path, "readOnly": read_only} for volume, _, path, read_only in mounts
        ]
        spec["volumes"] = [
            {"name": volume, "persistentVolumeClaim": {"claimName": claim, "readOnly": read_only}}
            for volume, claim, _, read_only in mounts
        ]
    return spec


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
        The same placeholders work, but chief and evaluator must see the same
        files, so it is usually one ReadWriteMany claim such as ``"{name}-model"``.
        Without it, point the training script's ``model_dir`` at storage both
        can reach (e.g. ``gs://...``).
      model_mount_path: where ``model_claim`` is mounted.
      active_deadline_seconds: optional bound on every Job's run time
        (``activeDeadlineSeconds``): a chief waiting for a task that never
        comes back (TensorFlow has no timeout for a missing in-graph worker)
        then fails after that long instead of waiting indefinitely.

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
    command = tuple(command)
    tasks = _tasks(workers, evaluator)

    def address(job: str, index: int) -> str:
        return f"{name}-{job}-{index}.{namespace}.svc:{port}"

    cluster = cluster_jobs(tasks, address)

    manifests: List[Dict[str, Any]] = []
    for job, index in tasks:
        task_name = f"{name}-{job}-{index}"
        labels = _labels(name, job, index)
        tf_config = tf_config_json(cluster, job, index)
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
                    "ports": [{"name": "grpc", "port": port, "targetPort": port, "protocol": "TCP"}],
                },
            }
        )
        if job == TFE_JOB:
            # The TFE parties never see data or the model: no volumes.
            pod_spec = _pod_spec(job, image, SERVER_COMMAND, tf_config, port, "Always")
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
            if model_claim is not None and job in ("chief", "evaluator"):
                claim = model_claim.format(name=name, job=job, index=index)
                # Read-write for both: the chief writes checkpoints, the evaluator model_dir/eval.
                mounts.append(("model", claim, model_mount_path, False))
            pod_spec = _pod_spec(job, image, command, tf_config, port, "OnFailure", mounts)
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

    cluster_pods = {"matchLabels": {CLUSTER_LABEL: name}}
    manifests.append(
        {
            "apiVersion": "networking.k8s.io/v1",
            "kind": "NetworkPolicy",
            "metadata": {"name": f"{name}-cluster-only", "namespace": namespace, "labels": _labels(name)},
            "spec": {
                # TensorFlow's gRPC has no TLS or authentication: only the cluster's own
                # pods (same namespace, same label) may connect to the cluster's pods.
                "podSelector": cluster_pods,
                "policyTypes": ["Ingress"],
                "ingress": [
                    {
                        "from": [{"podSelector": cluster_pods}],
                        "ports": [{"protocol": "TCP", "port": port}],
                    }
                ],
            },
        }
    )
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
        help="PersistentVolumeClaim for model_dir, read-write in the chief pod (checkpoints) and the "
        "evaluator pod (model_dir/eval); usually one ReadWriteMany claim such as '{name}-model'",
    )
    parser.add_argument("--model-mount-path", default="/model", help="where --model-claim is mounted (default /model)")
    parser.add_argument("--active-deadline-seconds", type=int, default=None,
                        help="bound every Job's run time (a chief waiting for a task that never comes back fails "
                        "after this long)")
    parser.add_argument("-o", "--output", default=None, help="write to this file instead of stdout")
    parser.add_argument(
        "command", nargs=argparse.REMAINDER, help=f"training command after '--' (default: {' '.join(DEFAULT_COMMAND)})"
    )
    return parser


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
        text = to_yaml(
            render_manifests(
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
            )
        )
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
