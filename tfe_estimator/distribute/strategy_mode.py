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
import os
from typing import Mapping, Optional

from tfe_estimator.cluster import peers
from tfe_estimator.cluster import spec as cluster_lib

__all__ = ["LOCAL", "SERVICE", "pick_mode"]

LOCAL = "local"
SERVICE = "service"


def pick_mode(environ: Optional[Mapping[str, str]] = None) -> str:
    """`LOCAL` without a cluster in TF_CONFIG; `SERVICE` for a data owner of a service-mode cluster.

    Args:
      environ: the environment to read TF_CONFIG and the cluster mode from (default `os.environ`).

    Raises:
      ValueError: for a TF_CONFIG that is set but invalid (naming TF_CONFIG and the fix).
      NotImplementedError: for an evaluator task, or a cluster in the in-graph mode: Keras and custom
        training loops train across owners in service mode only.
    """
    environ = os.environ if environ is None else environ
    spec = cluster_lib.TfeCluster.from_environment(environ)
    if spec is None:
        return LOCAL
    mode = peers.cluster_mode(environ=environ)
    if spec.is_evaluator or mode != peers.SERVICE:
        task = f"{spec.task_type}:{spec.task_index}"
        raise NotImplementedError(
            f"tfe_estimator.TfeStrategy() found a cluster in TF_CONFIG (this task is {task}, "
            f"cluster_mode={mode!r} from {cluster_lib.LAUNCH_CLUSTER_MODE_ENV}): Keras and custom training loops "
            "train across owners as the chief or a worker in service mode only. Launch with --cluster-mode "
            "service, or train with an Estimator and TfeRunConfig (in-graph, or an evaluator task); to train on "
            "this machine, unset TF_CONFIG (`del os.environ['TF_CONFIG']`) or pass devices= explicitly.")
    return SERVICE
