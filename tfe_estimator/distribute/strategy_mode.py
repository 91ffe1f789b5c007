"""Which `TfeStrategy()` a process gets: local replicas, or its owner's part of a cluster.

One place decides, from TF_CONFIG as `TfeRunConfig` does for Estimator:
without a cluster in TF_CONFIG, `num_replicas` local replicas summed securely
in this process (`LOCAL`); with a cluster (the owners and the `tfe` job that
`tfe-estimator launch`, `k8s --party` and the deployment page give every owner),
service mode for this owner (`SERVICE`).

Example::

    >>> pick_mode(environ={})
    'local'
"""
from typing import Mapping, Optional

from tfe_estimator.cluster import spec as cluster_lib

__all__ = ["LOCAL", "SERVICE", "pick_mode"]

LOCAL = "local"
SERVICE = "service"


def pick_mode(environ: Optional[Mapping[str, str]] = None) -> str:
    """`LOCAL` without a cluster in TF_CONFIG; a cluster's mode otherwise.

    Args:
      environ: the environment to read TF_CONFIG from (default `os.environ`).

    Raises:
      ValueError: for a TF_CONFIG that is set but invalid (naming TF_CONFIG and the fix).
      NotImplementedError: for a TF_CONFIG cluster: `TfeStrategy()` across
        organisations (service mode under Keras) is not built yet.
    """
    spec = cluster_lib.TfeCluster.from_environment(environ)
    if spec is None:
        return LOCAL
    # Service mode under Keras and custom training loops plugs in here (issue 40, item 2).
    raise NotImplementedError(
        f"tfe_estimator.TfeStrategy() found a cluster in TF_CONFIG (this task is "
        f"{spec.task_type}:{spec.task_index}; '{cluster_lib.TFE_JOB}' job {list(spec.jobs[cluster_lib.TFE_JOB])}), "
        "but TfeStrategy across organisations (service mode for Keras and custom training loops) is not "
        "available yet. Estimator trains across organisations with tfe_estimator.TfeRunConfig; to train on "
        "this machine, unset TF_CONFIG (`del os.environ['TF_CONFIG']`) or pass devices= explicitly.")
