"""`tfe-estimator k8s`: Kubernetes manifests for a secure-aggregation cluster, from the command line.

The rendering is `tfe_estimator.cluster.manifests` (plain manifests),
`tfe_estimator.cluster.tfjob` (``--tfjob``) and, for one organisation's part
of a federation (``--party IDENTITY --federation FILE``),
`tfe_estimator.cluster.k8s_site`; their shared labels, defaults and checks are
`tfe_estimator.cluster.k8s_common`. This module re-exports the public names of
`manifests` and `k8s_common`, so ``kubernetes.render_manifests``
and ``kubernetes.CLUSTER_LABEL`` keep working. Nothing here imports
TensorFlow: rendering takes well under a second.

Example::

    from tfe_estimator.cluster import kubernetes

    manifests = kubernetes.render_manifests(
        "demo", "registry.example.com/tfe-train:1.0", workers=2,
        command=["python", "train.py"])
    print(kubernetes.to_yaml(manifests))

or from a shell::

    tfe-estimator k8s --name demo --image registry.example.com/tfe-train:1.0 \\
        --workers 2 -- python train.py | kubectl apply -f -
"""
import argparse
import shlex
import sys
from typing import Any, Dict, List, Optional, Sequence

from tfe_estimator.cluster import k8s_server, peers
from tfe_estimator.cluster.k8s_common import (CLUSTER_LABEL, DEFAULT_COMMAND, DEFAULT_PORT, DEFAULT_SIDECAR_IMAGE,
                                              DEFAULT_TLS_SECRET, INDEX_LABEL, JOB_LABEL, NUM_TFE_TASKS,
                                              SERVER_COMMAND, TLS_PORT, DEFAULT_RESOURCES, DEFAULT_RUN_AS_USER,
                                              parse_quantities, teardown_command)
from tfe_estimator.cluster.manifests import render_manifests, to_yaml
from tfe_estimator.cluster.spec import TFE_JOB
from tfe_estimator.cluster.tfjob import render_tfjob

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
    "PROG",
    "render_manifests",
    "to_yaml",
    "main",
]

#: The program name `main` reports in its usage and errors.
PROG = "tfe-estimator k8s"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG,
        description=(
            "Print Kubernetes manifests (a YAML stream) for a secure-aggregation cluster: a chief, "
            "N workers, an optional evaluator and the tfe servers (service mode, the default: the 2 "
            "aggregation servers; in-graph: 3 TensorFlow servers), one NetworkPolicy per task; with --party "
            "only one organisation's part of a federation. The training command follows '--'."
        ),
        epilog="Example: %(prog)s --name demo --image example.com/train:1 --workers 2 -- python train.py",
    )
    parser.add_argument("--name", required=True, help="cluster name (DNS-1123 label starting with a letter)")
    parser.add_argument("--image", default=None, help="container image with the training script and tfe_estimator")
    parser.add_argument("--workers", type=int, default=1, help="data owners besides the chief (default 1)")
    parser.add_argument("--evaluator", dest="evaluator", action="store_true", default=False,
                        help="add an evaluator task (it evaluates the chief's checkpoints as they appear; a script "
                        "that evaluates after training, as the README's train.py does, needs none)")
    parser.add_argument("--no-evaluator", dest="evaluator", action="store_false",
                        help="leave out the evaluator task (the default)")
    parser.add_argument("--namespace", default=None,
                        help="namespace of every object (default 'default'; give each cluster or party its own)")
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
        help="PersistentVolumeClaim for model_dir, read-write in every owner pod (service mode; the chief's "
        "only in-graph) and the evaluator pod (the chief's); each owner's TFE_ESTIMATOR_MODEL_DIR is "
        "<mount>/<job>-<index>, so one claim such as '{name}-model' or one per owner, '{name}-model-{job}-{index}'",
    )
    parser.add_argument("--model-mount-path", default="/model", help="where --model-claim is mounted (default /model)")
    parser.add_argument("--active-deadline-seconds", type=int, default=None,
                        help="bound every Job's run time (a chief waiting for a task that never comes back fails "
                        "after this long)")
    parser.add_argument("--cluster-mode", default=None,
                        help="service (the default; with --tfjob in-graph, the only mode a TFJob renders; across "
                        "organisations: 2 aggregation servers with mutual TLS, owners with no Service and no "
                        "ingress, each pod's certificate from its --tls-secret) or "
                        "in-graph (one organisation on a trusted network; the retired between-graph is refused); "
                        "decides who may reach whom (one NetworkPolicy per task)")
    parser.add_argument("--no-data-plane", dest="data_plane", action="store_false",
                        help="service mode: run the aggregation servers without their data port (--port + 1; with "
                        "--party a server's address port + 1), every call on gRPC; the data plane serves the "
                        "step's large calls at about half the servers' CPU")
    parser.add_argument("--server-image", default=None,
                        help="the aggregation servers' image (default --image): `tfe-estimator server` needs "
                        "tfe_estimator, not the owners' training script; with --party tfe:K it replaces --image")
    parser.add_argument("--metrics-port", type=int, default=None,
                        help=f"service mode: each aggregation server's `--metrics-port` (Prometheus text at /metrics) "
                        f"and its 'metrics' container port (default {k8s_server.DEFAULT_METRICS_PORT}); on no "
                        "Service, and its NetworkPolicy admits only --metrics-namespace/--metrics-pod-label")
    parser.add_argument("--no-metrics", dest="metrics", action="store_false",
                        help="service mode: render the servers without a metrics port")
    parser.add_argument("--metrics-namespace", default=None, metavar="NS",
                        help="the namespace of the site's monitoring (e.g. Prometheus), admitted to the servers' "
                        "metrics port (default: nobody; the federation ports stay closed to it)")
    parser.add_argument("--metrics-pod-label", action="append", default=[], metavar="KEY=VALUE",
                        help="only the pods with this label (in --metrics-namespace, else in --namespace) may "
                        "scrape the metrics port")
    parser.add_argument("--tls", action="store_true",
                        help="mutual TLS on every link: a stunnel sidecar per pod, certificates from a Secret per "
                        "task, only the TLS port exposed")
    parser.add_argument("--sidecar-image", default=DEFAULT_SIDECAR_IMAGE,
                        help=f"the TLS sidecar's image (default {DEFAULT_SIDECAR_IMAGE}; deploy/sidecar/Dockerfile)")
    parser.add_argument("--tls-secret", default=DEFAULT_TLS_SECRET,
                        help=f"Secret per task with ca.crt and <job>-<index>.crt/.key, with --tls and in service mode "
                        f"(default {DEFAULT_TLS_SECRET!r})")
    parser.add_argument("--requests", default=_quantities(DEFAULT_RESOURCES["requests"]),
                        help="resource requests of every TensorFlow container (default %(default)r; '' for none)")
    parser.add_argument("--limits", default=_quantities(DEFAULT_RESOURCES["limits"]),
                        help="resource limits of every TensorFlow container (default %(default)r; '' for none)")
    parser.add_argument("--run-as-user", type=int, default=DEFAULT_RUN_AS_USER,
                        help=f"non-root user id of every pod (default {DEFAULT_RUN_AS_USER}, deploy/Dockerfile's user)")
    parser.add_argument("--read-only-root", action="store_true",
                        help="read-only root filesystem for the TensorFlow containers (/tmp an emptyDir)")
    parser.add_argument("--teardown", action="store_true",
                        help="print the kubectl command that deletes everything rendered for --name (TLS ConfigMaps "
                        "included) instead of manifests; --image is then not needed")
    parser.add_argument("--tfjob", action="store_true",
                        help="render one Kubeflow TFJob (kubeflow.org/v1) and a NetworkPolicy per replica type "
                        "instead (no --tls, no claims: see tfe_estimator.cluster.tfjob)")
    site = parser.add_argument_group(
        "one organisation's party (service mode across organisations, tfe_estimator.cluster.k8s_site)")
    site.add_argument("--party", default=None, metavar="IDENTITY",
                      help="render only this party of --federation for its organisation's own cluster: an owner "
                      "(chief:0, worker:K: its Job, no ingress, egress to the two servers only) or a server "
                      "(tfe:0, tfe:1: its Deployment, an exposed Service, ingress on its port and data port only); "
                      "the owners come from the federation file, not --workers")
    site.add_argument("--federation", default=None, metavar="FILE",
                      help="the federation file (`tfe-estimator certs federation`): the owners, the servers and "
                      "their addresses")
    site.add_argument("--server-address", action="append", default=[], metavar="tfe:K=HOST:PORT",
                      help="a server's address instead of the federation file's (every site must render the same)")
    site.add_argument("--server-cidr", action="append", default=[], metavar="tfe:K=CIDR",
                      help="a server's IP range for the egress policies (needed when its address is a host name)")
    site.add_argument("--allow-from", action="append", default=[], metavar="CIDR",
                      help="a server admits only these IP ranges (the owners', and server0's for tfe:1) on its "
                      "port and data port (default: any source)")
    site.add_argument("--model-claim-size", default=None, metavar="SIZE",
                      help="an owner's party: render its --model-claim as a PersistentVolumeClaim of this size "
                      "(ReadWriteOnce, e.g. 10Gi); without it the site creates the claim")
    site.add_argument("--storage-class", default=None, metavar="NAME",
                      help="with --model-claim-size: the claim's StorageClass (default: the cluster's default)")
    site.add_argument("--expose", default="LoadBalancer", choices=("LoadBalancer", "NodePort", "ClusterIP"),
                      help="a server's Service type (default LoadBalancer; NodePort: the address's port is the "
                      "node port, the data port the next one; ClusterIP: you route the federation address, and "
                      "its port + 1, to it)")
    parser.add_argument("-o", "--output", default=None, help="write to this file instead of stdout")
    parser.add_argument(
        "command", nargs=argparse.REMAINDER, help=f"training command after '--' (default: {' '.join(DEFAULT_COMMAND)})"
    )
    return parser


def _quantities(values: Dict[str, str]) -> str:
    return ",".join(f"{k}={v}" for k, v in values.items())


def _tfjob(args, command) -> List[Dict[str, Any]]:
    """`--tfjob`: the TFJob rendering (`tfe_estimator.cluster.tfjob`), refusing what it cannot do."""
    unsupported = [flag for flag, value in (("--tls", args.tls), ("--data-claim", args.data_claim),
                                             ("--model-claim", args.model_claim)) if value] + _metrics_flags(args)
    if unsupported:
        raise ValueError(f"{', '.join(unsupported)} cannot be used with --tfjob: every worker of a TFJob shares one "
                         "pod template, so per-task certificates and claims cannot be mounted (and the operator "
                         "writes TF_CONFIG from Service addresses). Render plain manifests instead (drop --tfjob).")
    return render_tfjob(args.name, args.image, args.workers, evaluator=args.evaluator,
                        command=command or DEFAULT_COMMAND, namespace=args.namespace or "default", port=args.port,
                        cluster_mode=args.cluster_mode or peers.IN_GRAPH,
                        active_deadline_seconds=args.active_deadline_seconds,
                        resources={"requests": parse_quantities(args.requests, "--requests"),
                                   "limits": parse_quantities(args.limits, "--limits")},
                        run_as_user=args.run_as_user)


def _metrics_flags(args, metrics_only: bool = False) -> List[str]:
    """The metrics (and server-image) flags given: what only service mode's servers use."""
    return [flag for flag, given in (("--server-image", args.server_image is not None and not metrics_only),
                                     ("--metrics-port", args.metrics_port is not None),
                                     ("--no-metrics", not args.metrics),
                                     ("--metrics-namespace", args.metrics_namespace is not None),
                                     ("--metrics-pod-label", bool(args.metrics_pod_label))) if given]


def _metrics_port(args) -> Optional[int]:
    if not args.metrics:
        if args.metrics_port is not None:
            raise ValueError("--no-metrics and --metrics-port contradict each other: drop one.")
        return None
    return k8s_server.DEFAULT_METRICS_PORT if args.metrics_port is None else args.metrics_port


def _labels(values: Sequence[str]) -> Dict[str, str]:
    result = {}
    for value in values:
        key, sep, rest = value.partition("=")
        if not sep or not key:
            raise ValueError(f"--metrics-pod-label {value!r}: expected KEY=VALUE, e.g. "
                             "'--metrics-pod-label app.kubernetes.io/name=prometheus'.")
        result[key] = rest
    return result


def _pairs(values: Sequence[str], flag: str) -> Dict[str, str]:
    result = {}
    for value in values:
        key, sep, rest = value.partition("=")
        if not sep or not rest:
            raise ValueError(f"{flag} {value!r}: expected IDENTITY=VALUE, e.g. '{flag} tfe:0=203.0.113.10/32'.")
        result[key.strip()] = rest.strip()
    return result


def _party(args, command) -> List[Dict[str, Any]]:
    """`--party`: one organisation's part (`tfe_estimator.cluster.k8s_site`), refusing what does not apply."""
    from tfe_estimator.cluster import k8s_party, k8s_site  # pylint: disable=import-outside-toplevel
    from tfe_estimator.identity.federation import Federation  # pylint: disable=import-outside-toplevel

    if args.federation is None:
        raise ValueError(f"--party {args.party} needs --federation FILE (the federation file every site shares, "
                         "made by `tfe-estimator certs federation`).")
    unsupported = [flag for flag, value in (("--tfjob", args.tfjob), ("--tls", args.tls),
                                             ("--evaluator", args.evaluator)) if value]
    if args.cluster_mode not in (None, peers.SERVICE):
        unsupported.append(f"--cluster-mode {args.cluster_mode}")
    if unsupported:
        raise ValueError(f"{', '.join(unsupported)} cannot be used with --party: one organisation's part is a "
                         "service-mode party speaking mutual TLS itself. Drop them.")
    try:
        fed = Federation.load(args.federation)
    except OSError as e:
        raise ValueError(f"--federation {args.federation}: cannot read it ({e.strerror}); give the federation "
                         "file every site shares (`tfe-estimator certs federation --out FILE`).") from None
    namespace = args.namespace or "default"
    objs = k8s_site.render_party(
        fed, args.party, args.name, args.image or args.server_image, command=command or DEFAULT_COMMAND,
        namespace=namespace, server_addresses=_pairs(args.server_address, "--server-address"),
        server_cidrs=_pairs(args.server_cidr, "--server-cidr"), allow_from=args.allow_from, expose=args.expose,
        tls_secret=args.tls_secret, data_claim=args.data_claim, data_mount_path=args.data_mount_path,
        model_claim=args.model_claim, model_mount_path=args.model_mount_path,
        active_deadline_seconds=args.active_deadline_seconds,
        resources={"requests": parse_quantities(args.requests, "--requests"),
                   "limits": parse_quantities(args.limits, "--limits")},
        run_as_user=args.run_as_user, read_only_root=args.read_only_root, data_plane=args.data_plane,
        server_image=args.server_image, metrics_port=_metrics_port(args), metrics_namespace=args.metrics_namespace,
        metrics_pod_labels=_labels(args.metrics_pod_label), model_claim_size=args.model_claim_size,
        storage_class=args.storage_class)
    notes = k8s_party.prerequisites(
        args.party, args.name, namespace, tls_secret=args.tls_secret, data_claim=args.data_claim,
        data_mount_path=args.data_mount_path, model_claim=args.model_claim, model_claim_size=args.model_claim_size,
        metrics_port=_metrics_port(args), metrics_open=bool(args.metrics_namespace or args.metrics_pod_label),
        server_image=args.server_image)
    print(f"{PROG}: before applying {args.party}'s part, its cluster needs:\n" +
          "\n".join(f"  - {line}" for line in notes), file=sys.stderr)
    return objs


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
    if args.teardown:
        print(shlex.join(teardown_command(args.name, args.namespace or "default", tfjob=args.tfjob)))
        return 0
    if args.image is None and not (str(args.party).partition(":")[0] == TFE_JOB and args.server_image):
        parser.error("the following arguments are required: --image (or, for a server's --party, --server-image)")
    command = list(args.command)
    if command and command[0] == "--":
        command = command[1:]
    try:
        if args.party is not None:
            text = to_yaml(_party(args, command))
        elif args.federation is not None:
            raise ValueError("--federation is read only with --party IDENTITY (one organisation's part): add "
                             "--party, e.g. --party worker:0.")
        elif args.model_claim_size is not None or args.storage_class is not None:
            raise ValueError("--model-claim-size and --storage-class render one owner's model claim: use them with "
                             "--party chief:0 or worker:K (the whole cluster's claims are yours to create).")
        elif (args.cluster_mode or peers.SERVICE) != peers.SERVICE and _metrics_flags(args, metrics_only=True):
            raise ValueError(f"{', '.join(_metrics_flags(args, metrics_only=True))}: only service mode's "
                             f"aggregation servers serve metrics; drop them with --cluster-mode {args.cluster_mode}.")
        else:
            text = to_yaml(_tfjob(args, command) if args.tfjob else render_manifests(
                args.name,
                args.image,
                args.workers,
                evaluator=args.evaluator,
                command=command or DEFAULT_COMMAND,
                namespace=args.namespace or "default",
                port=args.port,
                data_claim=args.data_claim,
                data_mount_path=args.data_mount_path,
                model_claim=args.model_claim,
                model_mount_path=args.model_mount_path,
                active_deadline_seconds=args.active_deadline_seconds,
                cluster_mode=args.cluster_mode or peers.SERVICE,
                tls=args.tls,
                sidecar_image=args.sidecar_image,
                tls_secret=args.tls_secret,
                resources={"requests": parse_quantities(args.requests, "--requests"),
                           "limits": parse_quantities(args.limits, "--limits")},
                run_as_user=args.run_as_user,
                read_only_root=args.read_only_root,
                data_plane=args.data_plane,
                server_image=args.server_image,
                metrics_port=_metrics_port(args),
                metrics_namespace=args.metrics_namespace,
                metrics_pod_labels=_labels(args.metrics_pod_label),
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
