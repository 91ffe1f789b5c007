"""Renders plain Kubernetes manifests for a secure-aggregation cluster.

One cluster is, for ``workers=1`` with an evaluator::

    chief-0, worker-0      data owners: the user's training script, a Job each
    evaluator-0            the user's training script, a Job
    tfe-0, tfe-1, tfe-2    TFE parties: ``tfe-estimator server``, a Deployment each

Every task gets its own headless ``Service`` named ``<name>-<job>-<index>``
and its own ``TF_CONFIG`` whose addresses are those Services' DNS names,
``<name>-<job>-<index>.<namespace>.svc:<port>``. One ``NetworkPolicy`` per
task admits ingress to its pod only from the tasks the cluster mode's peer
table (`tfe_estimator.cluster.peers`) lets call it, because TensorFlow's gRPC
runtime has neither TLS nor authentication (``tls=True`` adds mutual TLS).

The layout (which tasks exist) is `tfe_estimator.cluster.spec.cluster_tasks`, the
same one the loopback launcher uses, and the ``tfe`` pods run
`tfe_estimator.cluster.server.server_command()`. The labels, defaults and
argument checks are `tfe_estimator.cluster.k8s_common`'s (shared with the
TFJob renderer); `tfe_estimator.cluster.kubernetes` is the command line and
re-exports this module's names. `to_yaml` writes a multi-document
YAML stream through PyYAML, so the output can go straight to
``kubectl apply -f -``.

Example::

    from tfe_estimator.cluster import manifests

    objs = manifests.render_manifests(
        "demo", "registry.example.com/tfe-train:1.0", workers=2,
        command=["python", "train.py"])
    print(manifests.to_yaml(objs))

or from a shell::

    tfe-estimator k8s --name demo --image registry.example.com/tfe-train:1.0 \\
        --workers 2 -- python train.py | kubectl apply -f -
"""
from typing import Any, Dict, List, Optional, Sequence, Tuple

from tfe_estimator.cluster import certs, peers
from tfe_estimator.cluster.k8s_common import (DEFAULT_RESOURCES, DEFAULT_RUN_AS_USER, container_security_context,
                                              pod_security_context)
from tfe_estimator.cluster.k8s_common import (DEFAULT_COMMAND, DEFAULT_PORT, DEFAULT_SIDECAR_IMAGE, DEFAULT_TLS_SECRET,
                                              NUM_TFE_TASKS, SERVER_COMMAND, SERVICE_TFE_TASKS, TLS_DIR, TLS_PORT,
                                              CLUSTER_LABEL, JOB_LABEL, check_active_deadline_seconds,
                                              check_arguments, check_image, check_tls, check_tls_secret, labels,
                                              selector)
from tfe_estimator.cluster.k8s_common import tasks as all_tasks
from tfe_estimator.cluster import k8s_server
from tfe_estimator.cluster.huge_pages import HUGE_PAGES_TUNABLE, TUNABLES_ENV
from tfe_estimator.cluster.model_dir_claim import MODEL_DIR_ENV
from tfe_estimator.cluster.sidecar import stunnel_config
from tfe_estimator.cluster.spec import (DATA_DIR_ENV, DATA_OWNER_JOBS, LAUNCH_CLUSTER_MODE_ENV, TFE_JOB, TLS_DIR_ENV,
                                        cluster_jobs, tf_config_json)

__all__ = ["render_manifests", "to_yaml", "SERVICE_CERT_DIR", "data_port"]

#: Service mode: where every pod's certificate Secret is mounted (its ``TFE_ESTIMATOR_TLS_DIR``).
SERVICE_CERT_DIR = f"{TLS_DIR}/certs"


def data_port(port: int) -> int:
    """Service mode: an aggregation server's data port (``tfe-estimator server --data-port``) beside its service
    port `port`: the next one.

    Example::

        >>> data_port(2222)
        2223
    """
    return port + 1


def _pod_spec(
    job: str,
    image: str,
    command: Sequence[str],
    tf_config: str,
    port: int,
    restart_policy: str,
    mounts: Sequence[Tuple[str, str, str, bool]] = (),
    mode: str = peers.SERVICE,
    sidecar: Optional[Dict[str, Any]] = None,
    resources: Optional[Dict[str, Dict[str, str]]] = None,
    run_as_user: int = DEFAULT_RUN_AS_USER,
    read_only_root: bool = False,
    cert_secret: Optional[str] = None,
    listens: bool = True,
) -> Dict[str, Any]:
    """A pod spec; `mounts` are (volume name, claim name, mount path, read-only); `sidecar` adds the TLS sidecar.

    `cert_secret` (service mode) mounts that Secret read-only at `SERVICE_CERT_DIR` in the container and names
    the directory in ``TFE_ESTIMATOR_TLS_DIR``; without `listens` the container declares no port (a service-mode
    owner accepts no connection).

    Every pod runs as `run_as_user` (non-root) under the RuntimeDefault seccomp profile, its containers without
    capabilities or privilege escalation; with `read_only_root` the TensorFlow container's root filesystem is
    read-only and /tmp an emptyDir.
    """
    container: Dict[str, Any] = {
        "name": "tensorflow" if job != TFE_JOB else "tfe-server",
        "image": image,
        "command": list(command),
        "env": [{"name": "TF_CONFIG", "value": tf_config}, {"name": LAUNCH_CLUSTER_MODE_ENV, "value": mode}],
        "ports": [{"name": "grpc", "containerPort": port, "protocol": "TCP"}],
        "securityContext": container_security_context(read_only_root),
    }
    if not listens:
        del container["ports"]
    if resources:
        container["resources"] = {kind: dict(values) for kind, values in resources.items() if values}
    spec: Dict[str, Any] = {
        "restartPolicy": restart_policy,
        "securityContext": pod_security_context(run_as_user),
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
    if cert_secret is not None:
        container["env"].append({"name": TLS_DIR_ENV, "value": SERVICE_CERT_DIR})
        container["env"].append({"name": TUNABLES_ENV, "value": HUGE_PAGES_TUNABLE})  # see cluster.huge_pages
        container.setdefault("volumeMounts", []).append(
            {"name": "tls-certs", "mountPath": SERVICE_CERT_DIR, "readOnly": True})
        # 0440: the pod's fsGroup makes the key readable by the non-root user, and by nobody else.
        spec["volumes"] = spec.get("volumes", []) + [
            {"name": "tls-certs", "secret": {"secretName": cert_secret, "defaultMode": 0o440}}]
    if read_only_root:
        container.setdefault("volumeMounts", []).append({"name": "tmp", "mountPath": "/tmp"})
        spec["volumes"] = spec.get("volumes", []) + [{"name": "tmp", "emptyDir": {}}]
    return spec


def _sidecar(name: str, task: Tuple[str, int], image: str, secret: str) -> Dict[str, Any]:
    """The TLS sidecar container of `task`'s pod and its volumes (its stunnel config, its Secret)."""
    return {
        "container": {
            "name": "tls-sidecar",
            "image": image,
            "restartPolicy": "Always",
            "command": ["stunnel4", f"{TLS_DIR}/config/stunnel.conf"],
            "ports": [{"name": "tls", "containerPort": TLS_PORT, "protocol": "TCP"}],
            "securityContext": {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
                                "capabilities": {"drop": ["ALL"]}},
            "volumeMounts": [{"name": "tls-config", "mountPath": f"{TLS_DIR}/config", "readOnly": True},
                             {"name": "tls-certs", "mountPath": f"{TLS_DIR}/certs", "readOnly": True}],
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
    spec: Dict[str, Any] = {"podSelector": {"matchLabels": selector(name, job, index)},
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
                     "labels": labels(name, job, index)},
        "spec": spec,
    }


def _service_network_policy(name: str, namespace: str, task: Tuple[str, int], tasks, port: int,
                            data_plane: bool = True, metrics: Sequence[Dict[str, Any]] = ()) -> Dict[str, Any]:
    """Service mode: who may connect to and from `task`'s pod.

    An owner (chief, worker) and the evaluator accept nothing (deny-all ingress); an owner may connect out to
    the two aggregation servers' ports only (the service port and, with `data_plane`, the data port, and DNS),
    the evaluator to nothing but DNS. Server0 accepts the owners; server1 the owners and server0 (its blinded
    part), on those ports; server0 may connect out to server1 only, server1 to nothing (and DNS). The peer
    table's SERVICE row (`tfe_estimator.cluster.peers`), narrowed to the task: tfe-1 calls nobody. A server's
    `metrics` rule (`k8s_server.metrics_ingress`) admits the site's monitoring to its metrics port only.
    """
    job, index = task
    owner_jobs = sorted({j for j, _ in tasks if j in DATA_OWNER_JOBS})
    owners = {"podSelector": {"matchLabels": {CLUSTER_LABEL: name},
                              "matchExpressions": [{"key": JOB_LABEL, "operator": "In", "values": owner_jobs}]}}

    def server(k: int) -> Dict[str, Any]:
        return {"podSelector": {"matchLabels": selector(name, TFE_JOB, k)}}

    service_port = [{"protocol": "TCP", "port": p} for p in ((port, data_port(port)) if data_plane else (port,))]
    dns = {"ports": [{"protocol": "UDP", "port": 53}, {"protocol": "TCP", "port": 53}]}
    ingress: List[Dict[str, Any]] = []
    egress: List[Dict[str, Any]] = []
    if job == TFE_JOB:
        ingress = [{"from": [owners] + ([server(0)] if index == 1 else []), "ports": service_port}, *metrics]
        if index == 0:
            egress.append({"to": [server(1)], "ports": service_port})
    elif job in DATA_OWNER_JOBS:
        egress.append({"to": [server(k) for k in range(SERVICE_TFE_TASKS)], "ports": service_port})
    egress.append(dns)
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": {"name": f"{name}-{job}-{index}-peers", "namespace": namespace,
                     "labels": labels(name, job, index)},
        "spec": {"podSelector": {"matchLabels": selector(name, job, index)}, "policyTypes": ["Ingress", "Egress"],
                 "ingress": ingress, "egress": egress},
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
    cluster_mode: str = peers.SERVICE,
    tls: bool = False,
    sidecar_image: str = DEFAULT_SIDECAR_IMAGE,
    tls_secret: str = DEFAULT_TLS_SECRET,
    resources: Optional[Dict[str, Dict[str, str]]] = None,
    run_as_user: int = DEFAULT_RUN_AS_USER,
    read_only_root: bool = False,
    data_plane: bool = True,
    server_image: Optional[str] = None,
    metrics_port: Optional[int] = k8s_server.DEFAULT_METRICS_PORT,
    metrics_namespace: Optional[str] = None,
    metrics_pod_labels: Optional[Dict[str, str]] = None,
) -> List[Dict[str, Any]]:
    """Renders the Kubernetes objects of one secure-aggregation cluster.

    Per task (the chief, ``workers`` workers, the optional evaluator and the three
    ``tfe`` parties) one headless ``Service`` named ``<name>-<job>-<index>`` and
    one workload: a ``Job`` (restartPolicy OnFailure) running ``command`` for the
    chief, workers and evaluator; a single-replica ``Deployment`` running
    ``tfe-estimator server`` for each ``tfe`` party. Each pod has its own
    ``TF_CONFIG``; all of them list the same cluster. Last come one
    ``NetworkPolicy`` per task admitting ingress to its pod only from the
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
      cluster_mode: "service" (the default) or "in-graph" (the retired
        "between-graph" is refused naming both); exported to the
        pods as ``TFE_ESTIMATOR_CLUSTER_MODE`` and deciding the
        NetworkPolicies: one per task, admitting only the tasks
        `tfe_estimator.cluster.peers` lets call it. "service" (across
        organisations, `tfe_estimator.service`): exactly two ``tfe`` pods,
        the aggregation servers, each with a Service on `port` and on its data
        port ``port + 1`` (`data_port`: ``tfe-estimator server --data-port``);
        the owners and the evaluator get no Service, declare no port and deny
        all ingress; an owner may connect out only to the two servers' ports
        (and DNS); server0 admits the owners, server1 the owners and server0.
        Every pod mounts its task's certificate Secret (`tls_secret`) at
        ``/etc/tfe-tls/certs``, named by ``TFE_ESTIMATOR_TLS_DIR``; the
        service speaks mutual TLS itself, so there is no sidecar (`tls` changes
        nothing). The owners' model_dir must be on `model_claim` (or on storage
        you open an egress policy to: the rendered one admits only the servers).
      tls: mutual TLS on every link (`tfe_estimator.cluster.sidecar`): a
        ``tls-sidecar`` container (stunnel) per pod with its config in a
        ConfigMap per task and its key and certificates from the Secret
        `tls_secret`; TF_CONFIG names every task at ``localhost:<port + k>``
        (its sidecar's listener); Services and NetworkPolicies expose only
        the TLS port (8443), so TensorFlow's own port is reachable from its
        pod only, and each pod may connect out only to the tasks it may call.
      sidecar_image: the sidecar's image (``deploy/sidecar/Dockerfile``).
      tls_secret: the Secret name per task (with `tls`, and always in service
        mode), with ``{name}``, ``{job}`` and ``{index}``; it must hold
        ``ca.crt`` and ``<job>-<index>.crt/.key`` made for cluster `name`
        (``tfe-estimator certs --cluster NAME``). One Secret per task, created
        by the organisation that runs that pod: no key leaves it.
      resources: requests and limits of every TensorFlow container (default
        `k8s_common.DEFAULT_RESOURCES`; ``{}`` for none).
      run_as_user: the non-root user id every pod runs as (default 1000, the
        user of ``deploy/Dockerfile``'s image).
      read_only_root: a read-only root filesystem for the TensorFlow
        containers, with an emptyDir at /tmp (the sidecar's root is always
        read-only).
      data_plane: service mode: each aggregation server's data port ``port + 1``
        (the default); False (``--no-data-plane``) renders the servers without
        ``--data-port``, their Services and NetworkPolicies on `port` only, and
        every call goes over gRPC. In-graph mode has no data plane either way.
      server_image: the ``tfe`` pods' image (default `image`): a server needs ``tfe_estimator``, not the
        training script.
      metrics_port: service mode: each aggregation server's ``--metrics-port`` and ``metrics`` container
        port (default 9100; None: no metrics). Not on any Service; its NetworkPolicy admits only
        `metrics_namespace`/`metrics_pod_labels` (`k8s_server.metrics_sources`; neither: nobody).
      metrics_namespace, metrics_pod_labels: the site's monitoring (e.g. ``"monitoring"``,
        ``{"app.kubernetes.io/name": "prometheus"}``), admitted to the metrics port only.

    In service mode each server also gets startup, readiness and liveness probes running
    ``tfe-estimator health`` in its pod (its own health service over mutual TLS), and server0 its state
    directory (``TFE_ESTIMATOR_STATE_DIR``, the release log) on an emptyDir (`k8s_server`).

    Returns:
      The manifests as JSON-compatible dicts: Services and workloads task by
      task (with ``tls``, each task's stunnel ConfigMap too), then one
      NetworkPolicy per task.

    Raises:
      ValueError: for an invalid argument, naming it and the fix.

    Example::

        >>> objs = render_manifests("demo", "example.com/train:1", workers=1)
        >>> [o["kind"] for o in objs][:2]
        ['Job', 'Job']
        >>> objs[0]["metadata"]["name"]
        'demo-chief-0'
    """
    check_arguments(
        name,
        image,
        workers,
        command,
        namespace,
        port,
        {"data": (data_claim, data_mount_path), "model": (model_claim, model_mount_path)},
    )
    check_active_deadline_seconds(active_deadline_seconds)
    resources = DEFAULT_RESOURCES if resources is None else resources
    pod_security_context(run_as_user)  # refuses root before anything is rendered
    peers.validate_mode(cluster_mode, "cluster_mode")
    if not isinstance(data_plane, bool):
        raise TypeError(f"data_plane={data_plane!r} must be True (the servers' data ports) or False (gRPC only).")
    command = tuple(command)
    if server_image is not None:
        check_image(server_image, "server_image")
    service = cluster_mode == peers.SERVICE  # the aggregation service speaks mutual TLS itself: no sidecars
    tasks = all_tasks(workers, evaluator, SERVICE_TFE_TASKS if service else NUM_TFE_TASKS)
    sidecars = tls and not service
    data_plane = data_plane and service  # only the aggregation service has a data plane
    tf_ports = {t: (port + k if sidecars else port) for k, t in enumerate(tasks)}
    if sidecars:
        check_tls(name, tasks, port, sidecar_image, tls_secret)
    if service:
        check_tls_secret(name, tasks, tls_secret)
        if data_plane and data_port(port) > 65535:
            raise ValueError(f"port={port} in service mode: each aggregation server's data plane listens on the next "
                             f"port ({data_port(port)}), which must stay below 65536. Use e.g. --port {DEFAULT_PORT} "
                             "(or --no-data-plane: every call on gRPC).")
        k8s_server.check_metrics_port(metrics_port, {port: f"service port (--port {port})", **(
            {data_port(port): f"data port (--port + 1, {data_port(port)})"} if data_plane else {})})
    metrics_port = metrics_port if service else None  # the in-graph TensorFlow servers serve no metrics
    metrics = k8s_server.metrics_ingress(metrics_port, k8s_server.metrics_sources(metrics_namespace,
                                                                                 dict(metrics_pod_labels or {})))

    def address(job: str, index: int) -> str:
        if sidecars:  # the caller's own sidecar listens there for this task
            return f"localhost:{tf_ports[(job, index)]}"
        return f"{name}-{job}-{index}.{namespace}.svc:{port}"

    cluster = cluster_jobs(tasks, address)
    tls_addresses = {t: f"{name}-{certs.task_name(*t)}.{namespace}.svc:{TLS_PORT}" for t in tasks}

    pod_options = {"resources": resources, "run_as_user": run_as_user, "read_only_root": read_only_root}
    manifests: List[Dict[str, Any]] = []
    for job, index in tasks:
        task_name = f"{name}-{job}-{index}"
        task_labels = labels(name, job, index)
        tf_config = tf_config_json(cluster, job, index)
        exposed = ({"name": "tls", "port": TLS_PORT, "targetPort": TLS_PORT, "protocol": "TCP"} if sidecars else
                   {"name": "grpc", "port": port, "targetPort": port, "protocol": "TCP"})
        cert_options = {}
        if service:  # every pod its own certificate; only the servers listen, so only they get a Service
            cert_options = {"cert_secret": tls_secret.format(name=name, job=job, index=index),
                            "listens": job == TFE_JOB}
        ports = [exposed]
        if data_plane:  # the server's data plane (`tfe_estimator.service.data_plane`), mutual TLS too
            ports.append({"name": "data", "port": data_port(port), "targetPort": data_port(port), "protocol": "TCP"})
        if not service or job == TFE_JOB:
            manifests.append({
                "apiVersion": "v1",
                "kind": "Service",
                "metadata": {"name": task_name, "namespace": namespace, "labels": dict(task_labels)},
                "spec": {
                    "clusterIP": "None",
                    # TF servers dial each other while starting; resolve before readiness.
                    "publishNotReadyAddresses": True,
                    "selector": selector(name, job, index),
                    "ports": ports,
                },
            })
        sidecar = None
        if sidecars:
            config = stunnel_config((job, index), tasks, cluster_mode, f"{TLS_DIR}/certs", name, tf_ports,
                                    tls_addresses)
            manifests.append({"apiVersion": "v1", "kind": "ConfigMap",
                              "metadata": {"name": f"{task_name}-stunnel", "namespace": namespace,
                                           "labels": dict(task_labels)},
                              "data": {"stunnel.conf": config}})
            sidecar = _sidecar(name, (job, index), sidecar_image, tls_secret.format(name=name, job=job, index=index))
        tf_port = tf_ports[(job, index)]
        if job == TFE_JOB:
            # The TFE parties never see data or the model: no volumes.
            server = (k8s_server.server_command(data_port(port) if data_plane else None, metrics_port) if service
                      else SERVER_COMMAND)
            pod_spec = _pod_spec(job, server_image or image, server, tf_config, tf_port, "Always",
                                 mode=cluster_mode, sidecar=sidecar, **pod_options, **cert_options)
            if data_plane:
                pod_spec["containers"][0]["ports"].append(
                    {"name": "data", "containerPort": data_port(port), "protocol": "TCP"})
            if service:
                k8s_server.add_server_parts(pod_spec, index, metrics_port)
            manifests.append(
                {
                    "apiVersion": "apps/v1",
                    "kind": "Deployment",
                    "metadata": {"name": task_name, "namespace": namespace, "labels": dict(task_labels)},
                    "spec": {
                        "replicas": 1,
                        # Never two pods behind one task's address, not even during an update.
                        "strategy": {"type": "Recreate"},
                        "selector": {"matchLabels": selector(name, job, index)},
                        "template": {"metadata": {"labels": dict(task_labels)}, "spec": pod_spec},
                    },
                }
            )
        else:
            mounts = []
            if data_claim is not None:
                mounts.append(("data", data_claim.format(name=name, job=job, index=index), data_mount_path, True))
            owners_dir = cluster_mode == peers.SERVICE  # every owner its own checkpoints
            if model_claim is not None and (job in ("chief", "evaluator") or owners_dir):
                # The evaluator evaluates the chief's organisation's checkpoints (service mode: the chief's claim).
                of = ("chief", 0) if job == "evaluator" and owners_dir else (job, index)
                claim = model_claim.format(name=name, job=of[0], index=of[1])
                # Read-write for all: owners write checkpoints, the evaluator model_dir/eval.
                mounts.append(("model", claim, model_mount_path, False))
            pod_spec = _pod_spec(job, image, command, tf_config, tf_port, "OnFailure", mounts, mode=cluster_mode,
                                 sidecar=sidecar, **pod_options, **cert_options)
            if data_claim is not None:  # where the owner's files are (the README's train.py reads it)
                pod_spec["containers"][0]["env"].append({"name": DATA_DIR_ENV, "value": data_mount_path})
            if model_claim is not None and (job in ("chief", "evaluator") or owners_dir):
                # Each owner its own directory even on one shared claim; the evaluator its owner's (the chief's).
                owner = "chief-0" if job == "evaluator" else f"{job}-{index}"
                pod_spec["containers"][0]["env"].append(
                    {"name": MODEL_DIR_ENV, "value": f"{model_mount_path.rstrip('/')}/{owner}"})
            manifests.append(
                {
                    "apiVersion": "batch/v1",
                    "kind": "Job",
                    "metadata": {"name": task_name, "namespace": namespace, "labels": dict(task_labels)},
                    "spec": {
                        "backoffLimit": 4,
                        "template": {"metadata": {"labels": dict(task_labels)}, "spec": pod_spec},
                    },
                }
            )
            if active_deadline_seconds is not None:
                manifests[-1]["spec"]["activeDeadlineSeconds"] = active_deadline_seconds

    # One NetworkPolicy per task: only the peers the cluster mode's table allows (cluster.peers).
    for task in tasks:
        if service:
            manifests.append(_service_network_policy(name, namespace, task, tasks, port, data_plane, metrics))
        else:
            manifests.append(_network_policy(name, namespace, task, tasks, cluster_mode, TLS_PORT if tls else port,
                                             tls))
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
