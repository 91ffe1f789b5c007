"""Clusters and deployment: TF_CONFIG, servers, the launcher, Kubernetes, the evaluator.

- `spec`: `TfeCluster`, the one definition of the cluster layout and TF_CONFIG.
- `peers`: who calls whom in each cluster mode (what transport authorisation allows).
- `certs`, `sidecar`: certificates and the stunnel TLS sidecar's configuration.
- `server`: the `tfe-estimator server` process of a TFE party.
- `launcher`: `tfe-estimator launch`, a local multi-process cluster (`isolation`, `netns`: its namespaces).
- `huge_pages`: the malloc tunable service-mode tasks start with (large messages without 4 KiB page faults).
- `k8s_common`: labels, defaults and argument checks of the Kubernetes renderers.
- `manifests`: plain Kubernetes manifests; `tfjob`: one Kubeflow TFJob.
- `kubernetes`: `tfe-estimator k8s` (and the re-exported rendering names).
- `evaluator`: an evaluator that survives checkpoint rotation.

Example::

    from tfe_estimator.cluster.spec import TfeCluster
    cluster = TfeCluster.from_tf_config()
"""
__all__ = []
