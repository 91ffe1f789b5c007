"""One party's Kubernetes Secret: its key, its certificate and the public trust, nothing else.

Each organisation creates its own party's Secret in its own cluster (`tfe-estimator certs
secret`), which the pod `tfe-estimator k8s` renders mounts as its ``TFE_ESTIMATOR_TLS_DIR``.
Only the party's own files are taken, by name: a CA key or another party's key in the same
directory never enters a cluster; the key must belong to the certificate.

Example::

    manifest = party_secret("hospital-b/worker-0", "worker", 0, name="demo")
"""
import base64
import os
from typing import Dict, Optional

from tfe_estimator.identity import certs
from tfe_estimator.identity.federation import FEDERATION_FILE

__all__ = ["party_secret"]


def party_secret(directory: str, job: str, index: int, name: str, namespace: Optional[str] = None,
                 secret_name: str = "{name}-{job}-{index}-tls") -> Dict:
    """The Secret manifest (a dict) of task `job:index` from its TLS directory.

    Raises:
      ValueError: a file is missing, or the key is not the certificate's.
    """
    stem = certs.task_name(job, index)
    trust = FEDERATION_FILE if os.path.isfile(os.path.join(directory, FEDERATION_FILE)) else certs.CA_CERT
    data = {}
    for file in (f"{stem}.crt", f"{stem}.key", trust):
        path = os.path.join(directory, file)
        if not os.path.isfile(path):
            raise ValueError(f"{path} does not exist: make {job}:{index}'s files first (docs/deployment.md).")
        with open(path, "rb") as f:
            data[file] = f.read()
    if not certs.key_matches(data[f"{stem}.key"], data[f"{stem}.crt"]):
        raise ValueError(f"{stem}.key in {directory} is not the key of {stem}.crt: sign this party's own request.")
    metadata = {"name": secret_name.format(name=name, job=job, index=index),
                "labels": {"tfe-estimator/cluster": name}}
    if namespace:
        metadata["namespace"] = namespace
    return {"apiVersion": "v1", "kind": "Secret", "metadata": metadata, "type": "Opaque",
            "data": {k: base64.b64encode(v).decode("ascii") for k, v in data.items()}}
