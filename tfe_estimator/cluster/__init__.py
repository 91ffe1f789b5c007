"""Clusters and deployment: TF_CONFIG, servers, the launcher, Kubernetes, the evaluator.

- `spec`: `TfeCluster`, the one definition of the cluster layout and TF_CONFIG;
  `task_from_tf_config()` (also here) for a training script's own task.
- `peers`: who calls whom in each cluster mode (what transport authorisation allows).
- `certs`, `sidecar`: certificates and the stunnel TLS sidecar's configuration.
- `server`: the `tfe-estimator server` process of a TFE party.
- `launcher`: `tfe-estimator launch`, a local multi-process cluster (`isolation`, `netns`: its namespaces).
- `huge_pages`: the malloc tunable service-mode tasks start with (large messages without 4 KiB page faults).
- `k8s_common`: labels, defaults and argument checks of the Kubernetes renderers.
- `manifests`: plain Kubernetes manifests; `tfjob`: one Kubeflow TFJob.
- `kubernetes`: `tfe-estimator k8s` (and the re-exported rendering names).
- `evaluator`: an evaluator that survives checkpoint rotation and waits quietly for checkpoints.
- `quiet`: TensorFlow's INFO lines and deprecation blocks hidden in cluster tasks unless asked.

Example::

    from tfe_estimator.cluster import task_from_tf_config
    job, index = task_from_tf_config()  # ("worker", 0), or a ValueError naming TF_CONFIG and the fix
"""
__all__ = ["task_from_tf_config"]


def task_from_tf_config(environ=None):
    """This task's ``(type, index)`` from TF_CONFIG (`spec.task_from_tf_config`; imported on first call)."""
    from tfe_estimator.cluster import spec  # pylint: disable=import-outside-toplevel

    return spec.task_from_tf_config(environ)
