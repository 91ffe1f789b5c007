"""The distribute layer: TensorFlow's `tf.distribute` plumbing around the secure sum.

- `aggregation`: `SecureAggregation`, the `CrossDeviceOps`.
- `strategy`: `TfeStrategy`, a MirroredStrategy routed through it.
- `strategy_mode`: which `TfeStrategy()` a process gets (one machine, or a TF_CONFIG cluster's).
- `run_config`: `TfeRunConfig`, the one line a user changes.
- `devices`, `logical_devices`: replica and party placement.
- `checkpoint_replicas`: model_dir compatibility checks.

A data owner's side of service mode (its strategy, sums, handshake, and the Estimator and Keras adapters) is
the package `tfe_estimator.owner`, on top of this one.

Example::

    from tfe_estimator.distribute.run_config import TfeRunConfig
    config = TfeRunConfig(model_dir="/tmp/model", protocol="pond")
"""
from tfe_estimator.compat import check_tensorflow_version

check_tensorflow_version()  # before any module here touches TensorFlow's private APIs

__all__ = []
