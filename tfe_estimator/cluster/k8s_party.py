"""What one party's role admits and needs on Kubernetes: the role checks, an owner's model claim, and the
list of what a site creates before it applies its part (`tfe_estimator.cluster.k8s_site`).

An aggregation server never sees an owner's data or model, so claims on a server are refused; an owner runs the
training image and serves no metrics, so a server image or metrics options on an owner are refused; an owner
needs a model claim (its checkpoints must outlive its container, and its egress reaches the two servers only).
Nothing here imports TensorFlow.

Example::

    from tfe_estimator.cluster import k8s_party

    k8s_party.check_roles("worker:0", False, "{name}-data", "{name}-model", "10Gi", None, None, None, None)
    for line in k8s_party.prerequisites("worker:0", "demo", "tfe", data_claim="{name}-data",
                                        model_claim="{name}-model"):
        print(line)
"""
import re
from typing import Any, Dict, List, Mapping, Optional

from tfe_estimator.cluster import k8s_server
from tfe_estimator.cluster.k8s_common import DEFAULT_TLS_SECRET
from tfe_estimator.cluster.model_dir_claim import MODEL_DIR_ENV
from tfe_estimator.cluster.spec import DATA_DIR_ENV, TFE_JOB

__all__ = ["check_roles", "model_claim_manifest", "prerequisites"]

_QUANTITY = re.compile(r"^[0-9]+(\.[0-9]+)?(Ki|Mi|Gi|Ti|Pi|Ei|k|M|G|T|P|E)?$")
_STORAGE_CLASS = re.compile(r"^[a-z0-9]([-.a-z0-9]*[a-z0-9])?$")


def check_roles(party: str, server: bool, data_claim: Optional[str], model_claim: Optional[str],
                model_claim_size: Optional[str], storage_class: Optional[str], server_image: Optional[str],
                metrics_namespace: Optional[str], metrics_pod_labels: Optional[Mapping[str, str]]) -> None:
    """Refuses an option that does not apply to `party`'s role (`server`: an aggregation server), naming it and
    the fix; an owner without `model_claim`; a bad claim size or storage class."""
    if server:
        given = [flag for flag, value in (("--data-claim", data_claim), ("--model-claim", model_claim),
                                          ("--model-claim-size", model_claim_size),
                                          ("--storage-class", storage_class)) if value is not None]
        if given:
            raise ValueError(f"{', '.join(given)}: {party} is an aggregation server, which never sees an owner's "
                             "data or model (its only volumes are its certificate and, for tfe:0, its state). Drop "
                             "them; each owner renders its own claims.")
        return
    given = [flag for flag, value in (("--server-image", server_image), ("--metrics-namespace", metrics_namespace),
                                      ("--metrics-pod-label", metrics_pod_labels or None)) if value is not None]
    if given:
        raise ValueError(f"{', '.join(given)}: {party} is a data owner, which runs the training image (--image) and "
                         "serves no metrics; these are for a server's party (tfe:0, tfe:1). Drop them.")
    if model_claim is None:
        raise ValueError(f"--party {party} needs --model-claim NAME (a PersistentVolumeClaim, e.g. '{{name}}-model'): "
                         "without it the owner's checkpoints stay in its container and are lost when it restarts "
                         "(its egress reaches the two servers only, so no remote storage either). Add "
                         "--model-claim-size SIZE (e.g. 10Gi) to render the claim too.")
    if model_claim_size is not None and not (isinstance(model_claim_size, str) and _QUANTITY.match(model_claim_size)):
        raise ValueError(f"--model-claim-size {model_claim_size!r} is not a storage quantity such as '10Gi' or "
                         "'500Mi'.")
    if storage_class is not None and model_claim_size is None:
        raise ValueError("--storage-class is the rendered model claim's: add --model-claim-size SIZE (or drop "
                         "--storage-class and create the claim yourself).")
    if storage_class is not None and not _STORAGE_CLASS.match(storage_class):
        raise ValueError(f"--storage-class {storage_class!r} is not a StorageClass name (lowercase letters, digits, "
                         "'-' and '.').")


def model_claim_manifest(claim: str, namespace: str, claim_labels: Dict[str, str], size: str,
           storage_class: Optional[str]) -> Dict[str, Any]:
    """An owner's model claim: ReadWriteOnce (one pod writes its checkpoints), `size`."""
    spec: Dict[str, Any] = {"accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": size}}}
    if storage_class is not None:
        spec["storageClassName"] = storage_class
    return {"apiVersion": "v1", "kind": "PersistentVolumeClaim",
            "metadata": {"name": claim, "namespace": namespace, "labels": dict(claim_labels)}, "spec": spec}


def prerequisites(party: str, name: str, namespace: str, tls_secret: str = DEFAULT_TLS_SECRET,
                  data_claim: Optional[str] = None, data_mount_path: str = "/data",
                  model_claim: Optional[str] = None, model_claim_size: Optional[str] = None,
                  metrics_port: Optional[int] = k8s_server.DEFAULT_METRICS_PORT, metrics_open: bool = False,
                  server_image: Optional[str] = None) -> List[str]:
    """What the site must have in its cluster before it applies `party`'s manifests, one line each.

    Example::

        >>> prerequisites("worker:0", "demo", "tfe", model_claim="{name}-model")[0]
        "namespace 'tfe' (kubectl create namespace tfe)"
    """
    job, index = party.partition(":")[0], int(party.partition(":")[2])
    lines = [f"namespace {namespace!r} (kubectl create namespace {namespace})" if namespace != "default" else
             "namespace 'default': give this party a namespace of its own (--namespace NS), where only its "
             "operators may create pods",
             f"Secret {tls_secret.format(name=name, job=job, index=index)!r} with this party's key: `tfe-estimator "
             f"certs secret --dir DIR --identity {party} --name {name} --namespace {namespace}`"]
    if job == TFE_JOB:
        if server_image is None:
            lines.append("the server runs --image (no --server-image): the owners' training image is not needed "
                         "by a server; give your own with --server-image")
        if index == 0:
            lines.append(f"server0's release log is on an emptyDir ({k8s_server.STATE_DIR}): it survives a "
                         "container restart, not a move to another node")
        if metrics_port is not None and not metrics_open:
            lines.append(f"metrics on port {metrics_port} admit nobody: name your monitoring with "
                         "--metrics-namespace NS (and --metrics-pod-label KEY=VALUE)")
        return lines
    if data_claim is None:
        lines.append("no --data-claim: the training script must find its data in the image")
    else:
        lines.append(f"PersistentVolumeClaim {data_claim.format(name=name, job=job, index=index)!r} holding this "
                     f"owner's data (mounted read-only at {data_mount_path}, {DATA_DIR_ENV})")
    if model_claim is not None:
        claim = model_claim.format(name=name, job=job, index=index)
        lines.append(f"PersistentVolumeClaim {claim!r} for the checkpoints ({MODEL_DIR_ENV}; rendered with them)"
                     if model_claim_size is not None else
                     f"PersistentVolumeClaim {claim!r} for the checkpoints ({MODEL_DIR_ENV}), read-write: create "
                     "it, or add --model-claim-size SIZE to render it")
    return lines
