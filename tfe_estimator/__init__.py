"""tfe_estimator: secure aggregation for TensorFlow Estimator with TF Encrypted.

Change one line, the `RunConfig`, and an Estimator trains data-parallel while
each replica's gradients are secret-shared and summed by non-colluding TF
Encrypted servers::

    import tensorflow as tf
    import tfe_estimator

    config = tfe_estimator.TfeRunConfig(model_dir="/tmp/model", protocol="pond")
    est = tf.estimator.LinearRegressor(feature_columns=cols, config=config)
    tf.estimator.train_and_evaluate(est, train_spec, eval_spec)

Importing this package imports TensorFlow but neither starts its runtime nor
imports tf-encrypted; that happens when a reduction is first built.
"""
from tfe_estimator._version import __version__
from tfe_estimator.compat import check_tensorflow_version

check_tensorflow_version()  # before any module below touches TensorFlow's private APIs

from tfe_estimator.distribute.aggregation import SecureAggregation
from tfe_estimator.audit.party_audit import PartyAuditError, PartyAuditHook, assert_no_plaintext_on_servers, audit_party_inputs
from tfe_estimator.cluster.spec import TfeCluster
from tfe_estimator.privacy.dp import DistributedDP, dp_epsilon
from tfe_estimator.errors import InsecureRandomnessError, PlaintextOnServerError
from tfe_estimator.secure.precision import PRECISIONS, Precision
from tfe_estimator.secure.protocols import PROTOCOLS
from tfe_estimator.distribute.run_config import TfeRunConfig, TfeSettings, default_session_config, plaintext_twin_config
from tfe_estimator.distribute.strategy import TfeStrategy
from tfe_estimator.distribute.between_graph import BetweenGraphStrategy

__all__ = [
    "__version__",
    "TfeRunConfig",
    "TfeSettings",
    "TfeStrategy",
    "BetweenGraphStrategy",
    "SecureAggregation",
    "TfeCluster",
    "DistributedDP",
    "dp_epsilon",
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
]
