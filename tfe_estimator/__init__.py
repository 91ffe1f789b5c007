"""tfe_estimator: secure aggregation for TensorFlow Estimator with TF Encrypted.

Change one line, the `RunConfig`, and an Estimator trains data-parallel while
each replica's gradients are secret-shared and summed by non-colluding TF
Encrypted servers::

    import tensorflow as tf
    import tfe_estimator

    config = tfe_estimator.TfeRunConfig(model_dir="/tmp/model", protocol="pond")
    est = tf.estimator.LinearRegressor(feature_columns=cols, config=config)
    tf.estimator.train_and_evaluate(est, train_spec, eval_spec)

Importing this package imports neither TensorFlow nor tf-encrypted: the public
names below are imported on first use (TensorFlow then, tf-encrypted when a
reduction is first built), so the Kubernetes renderer and the certificate tools
run without TensorFlow.
"""
import importlib
import sys

from tfe_estimator._version import __version__
from tfe_estimator.compat import check_tensorflow_version

if "tensorflow" in sys.modules:  # already imported: checking costs nothing, and refuses early
    check_tensorflow_version()

#: Public name -> the module defining it. Imported on first use (PEP 562), so that
#: TensorFlow-free parts (`tfe-estimator k8s`, `cluster.spec`, `cluster.certs`) start
#: in well under a second; `tfe_estimator.distribute` checks the TensorFlow version
#: before any of its modules touches TensorFlow's private APIs.
_EXPORTS = {
    "SecureAggregation": "tfe_estimator.distribute.aggregation",
    "PartyAuditError": "tfe_estimator.audit.party_audit",
    "PartyAuditHook": "tfe_estimator.audit.party_audit",
    "assert_no_plaintext_on_servers": "tfe_estimator.audit.party_audit",
    "audit_party_inputs": "tfe_estimator.audit.party_audit",
    "TfeCluster": "tfe_estimator.cluster.spec",
    "DistributedDP": "tfe_estimator.privacy.dp",
    "dp_epsilon": "tfe_estimator.privacy.dp",
    "EpsilonCallback": "tfe_estimator.privacy.keras_epsilon",
    "InsecureRandomnessError": "tfe_estimator.errors",
    "PlaintextOnServerError": "tfe_estimator.errors",
    "PRECISIONS": "tfe_estimator.secure.precision",
    "Precision": "tfe_estimator.secure.precision",
    "PROTOCOLS": "tfe_estimator.secure.protocols",
    "TfeRunConfig": "tfe_estimator.distribute.run_config",
    "TfeSettings": "tfe_estimator.distribute.run_config",
    "default_session_config": "tfe_estimator.distribute.run_config",
    "plaintext_twin_config": "tfe_estimator.distribute.run_config",
    "TfeStrategy": "tfe_estimator.distribute.strategy",
    "LocalMetricsExporter": "tfe_estimator.distribute.local_metrics",
    "evaluate_locally": "tfe_estimator.distribute.local_metrics",
    "OwnerMetrics": "tfe_estimator.owner.keras_evaluation",
    "ProgressCallback": "tfe_estimator.owner.keras_progress",
}
_SUBPACKAGES = ("audit", "cluster", "distribute", "privacy", "secure", "tools")


def __getattr__(name):
    if name in _EXPORTS:
        check_tensorflow_version()
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
        globals()[name] = value
        return value
    if name in _SUBPACKAGES:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_EXPORTS) | set(_SUBPACKAGES))


__all__ = [
    "__version__",
    "TfeRunConfig",
    "TfeSettings",
    "TfeStrategy",
    "SecureAggregation",
    "TfeCluster",
    "DistributedDP",
    "dp_epsilon",
    "EpsilonCallback",
    "InsecureRandomnessError",
    "PlaintextOnServerError",
    "Precision",
    "PRECISIONS",
    "PROTOCOLS",
    "assert_no_plaintext_on_servers",
    "audit_party_inputs",
    "PartyAuditHook",
    "PartyAuditError",
    "default_session_config",
    "plaintext_twin_config",
    "LocalMetricsExporter",
    "evaluate_locally",
    "OwnerMetrics",
    "ProgressCallback",
]
