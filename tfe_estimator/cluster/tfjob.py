"""Renders a secure-aggregation cluster as one Kubeflow ``TFJob`` (``kubeflow.org/v1``).

The training operator runs one pod per replica and writes each pod's
TF_CONFIG itself, lowercasing the replica type into the job name: the
replica types here are ``Chief``, ``Worker``, ``Evaluator`` and ``TFE``, so the
servers' job is ``tfe``, as `tfe_estimator.cluster.spec` expects. Choices
that follow from how the operator behaves:

- Every replica's container is named ``tensorflow`` (the operator injects
  TF_CONFIG only there, and its webhook requires one) and its port
  ``tfjob-port`` (the operator reads the port from it).
- ``runPolicy.cleanPodPolicy: All``: the ``TFE`` servers never exit, and the
  operator fails a job only on Chief/Master/PS/Worker/Evaluator failures; with
  its default policy the servers would keep running after training.
- ``TFE`` replicas restart ``Always`` (a server restarts at the same address);
  owners ``OnFailure``.
- One NetworkPolicy per replica type (the pod template's labels name the job,
  not the index) admitting only the jobs the cluster mode's peer table
  (`tfe_estimator.cluster.peers`) lets call it.

Not rendered: service mode (``cluster_mode="service"``, refused: every owner
needs its own certificate and all workers share one pod template; the
operator also gives every owner a Service), and mutual TLS. The operator's TF_CONFIG names every task by its
Service address, where the TLS layout needs ``localhost:<port of task k>``;
and all workers share one pod template, so per-organisation certificates
cannot be mounted per worker. Use `tfe_estimator.cluster.manifests` with
``tls=True`` for that.

Example::

    from tfe_estimator.cluster import manifests, tfjob
    print(manifests.to_yaml(tfjob.render_tfjob("demo", "registry.example.com/tfe-train:1.0", workers=2)))
"""
from typing import Any, Dict, List, Optional, Sequence

from tfe_estimator.cluster import peers
from tfe_estimator.cluster.k8s_common import (CLUSTER_LABEL, DEFAULT_COMMAND, DEFAULT_PORT, JOB_LABEL, SERVER_COMMAND,
                                              DEFAULT_RESOURCES, DEFAULT_RUN_AS_USER, check_active_deadline_seconds,
                                              check_arguments, container_security_context, labels,
                                              pod_security_context)
from tfe_estimator.cluster.spec import LAUNCH_CLUSTER_MODE_ENV, NUM_TFE_TASKS, TFE_JOB

__all__ = ["render_tfjob", "REPLICA_TYPES", "CONTAINER_NAME", "PORT_NAME"]

#: TF_CONFIG job -> the TFJob replica type the operator lowercases into it.
REPLICA_TYPES = {"chief": "Chief", "worker": "Worker", "evaluator": "Evaluator", TFE_JOB: "TFE"}
#: The container the operator injects TF_CONFIG into (its webhook requires one of this name).
CONTAINER_NAME = "tensorflow"
#: The port name the operator reads each replica type's port from.
PORT_NAME = "tfjob-port"


def render_tfjob(name: str, image: str, workers: int, evaluator: bool = True,
                 command: Sequence[str] = DEFAULT_COMMAND, namespace: str = "default", port: int = DEFAULT_PORT,
                 cluster_mode: str = peers.IN_GRAPH,
                 active_deadline_seconds: Optional[int] = None,
                 resources: Optional[Dict[str, Dict[str, str]]] = None,
                 run_as_user: int = DEFAULT_RUN_AS_USER) -> List[Dict[str, Any]]:
    """The TFJob of one cluster and one NetworkPolicy per replica type.

    Args:
      name: the TFJob's name (a DNS-1035 label; the operator names pods ``<name>-<type>-<index>``).
      image, workers, evaluator, command, namespace, port: as `manifests.render_manifests`.
      cluster_mode: "in-graph" (the default and the only mode a TFJob renders): exported to the pods and
        deciding the policies.
      active_deadline_seconds: optional bound on the whole job (``runPolicy.activeDeadlineSeconds``).
      resources, run_as_user: as `manifests.render_manifests` (requests/limits; the non-root user).

    Raises:
      ValueError: for an invalid argument, naming it and the fix.
    """
    no_claims = {"data": (None, "/data"), "model": (None, "/model")}
    check_arguments(name, image, workers, command, namespace, port, no_claims)
    peers.validate_mode(cluster_mode, "cluster_mode")
    if cluster_mode == peers.SERVICE:
        raise ValueError(
            "cluster_mode='service' cannot be rendered as a TFJob: each data owner needs its own certificate "
            "(a Secret per task) but all workers of a TFJob share one pod template, the operator gives every "
            "owner a Service (service-mode owners accept no connection). Render plain manifests instead: "
            "`tfe-estimator k8s --cluster-mode service` without --tfjob (manifests.render_manifests).")
    check_active_deadline_seconds(active_deadline_seconds)
    resources = DEFAULT_RESOURCES if resources is None else resources
    pod_security = pod_security_context(run_as_user)
    replicas = {"chief": 1, "worker": workers, "evaluator": int(evaluator), TFE_JOB: NUM_TFE_TASKS}
    specs = {}
    for job, count in replicas.items():
        if count == 0:
            continue
        container = {
            "name": CONTAINER_NAME,
            "image": image,
            "command": list(SERVER_COMMAND if job == TFE_JOB else command),
            "env": [{"name": LAUNCH_CLUSTER_MODE_ENV, "value": cluster_mode}],
            "ports": [{"name": PORT_NAME, "containerPort": port, "protocol": "TCP"}],
            "securityContext": container_security_context(read_only_root=False),
        }
        if resources:
            container["resources"] = {kind: dict(values) for kind, values in resources.items() if values}
        specs[REPLICA_TYPES[job]] = {
            "replicas": count,
            "restartPolicy": "Always" if job == TFE_JOB else "OnFailure",
            "template": {
                "metadata": {"labels": _job_labels(name, job)},
                "spec": {"automountServiceAccountToken": False, "enableServiceLinks": False,
                         "securityContext": dict(pod_security), "containers": [container]},
            },
        }
    run_policy: Dict[str, Any] = {"cleanPodPolicy": "All", "backoffLimit": 4}
    if active_deadline_seconds is not None:
        run_policy["activeDeadlineSeconds"] = active_deadline_seconds
    job_object = {
        "apiVersion": "kubeflow.org/v1",
        "kind": "TFJob",
        "metadata": {"name": name, "namespace": namespace, "labels": labels(name)},
        "spec": {"runPolicy": run_policy, "tfReplicaSpecs": specs},
    }
    jobs = [job for job, count in replicas.items() if count]
    return [job_object] + [_policy(name, namespace, job, jobs, cluster_mode, port) for job in jobs]


def _job_labels(name: str, job: str) -> Dict[str, str]:
    result = labels(name)
    result.update({"app.kubernetes.io/component": job, JOB_LABEL: job})
    return result


def _policy(name: str, namespace: str, job: str, jobs: Sequence[str], mode: str, port: int) -> Dict[str, Any]:
    callers = sorted(j for j in peers.allowed_callers(mode, job) if j in jobs)
    selector = {"matchLabels": {CLUSTER_LABEL: name, JOB_LABEL: job}}
    ingress = []
    if callers:
        ingress = [{"from": [{"podSelector": {"matchLabels": {CLUSTER_LABEL: name},
                                              "matchExpressions": [{"key": JOB_LABEL, "operator": "In",
                                                                    "values": callers}]}}],
                    "ports": [{"protocol": "TCP", "port": port}]}]
    return {"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
            "metadata": {"name": f"{name}-{job}-peers", "namespace": namespace, "labels": _job_labels(name, job)},
            "spec": {"podSelector": selector, "policyTypes": ["Ingress"], "ingress": ingress}}
