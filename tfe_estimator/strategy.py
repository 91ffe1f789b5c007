"""`TfeStrategy`: a `MirroredStrategy` whose reductions are `SecureAggregation`.

Example::

    strategy = tfe_estimator.TfeStrategy(protocol="pond")   # 2 local replicas
    config = tf.estimator.RunConfig(train_distribute=strategy,
                                    eval_distribute=strategy)
    est = tf.estimator.LinearRegressor(feature_columns=cols, config=config)
"""
from typing import Optional, Sequence

import tensorflow as tf
from tensorflow.python.distribute import distribute_lib
from tensorflow.python.distribute import mirrored_strategy

from tfe_estimator.aggregation import SecureAggregation
from tfe_estimator.devices import cpus_needed, local_layout, DEFAULT_NUM_REPLICAS
from tfe_estimator.protocols import validate_protocol

__all__ = ["TfeStrategy"]


class _TfeExtended(mirrored_strategy.MirroredExtended):
    """`MirroredExtended` that asks sessions for the CPU devices it places on."""

    def __init__(self, container_strategy, devices, cross_device_ops, num_cpus):
        self._tfe_num_cpus = num_cpus
        super().__init__(container_strategy, devices=devices, cross_device_ops=cross_device_ops)

    def _make_collective_ops(self, devices):
        # MirroredStrategy keeps a CollectiveAllReduce (and its thread pool)
        # for XLA-on-GPU steps without merge_call. Those reductions would be
        # plaintext NCCL sums, so there are none here; see _use_merge_call.
        del devices
        return None

    def _use_merge_call(self):
        # Always reduce through merge_call, i.e. through SecureAggregation.
        return True

    def _update_config_proto(self, config_proto):
        updated = super()._update_config_proto(config_proto)
        if updated.device_count.get("CPU", 1) < self._tfe_num_cpus:
            updated.device_count["CPU"] = self._tfe_num_cpus
        return updated


class TfeStrategy(tf.compat.v1.distribute.MirroredStrategy):
    """Data-parallel training whose cross-replica sums are TF Encrypted secure sums.

    Args:
      devices: the replica devices. None: 2 local replicas (GPUs if there are
        2, otherwise CPU devices).
      protocol: "pond" or "aby3" (see `tfe_estimator.protocols`).
      precision: "low" or "high" (see `tfe_estimator.precision`).
      server_devices: the devices of the three TFE parties. None with
        `devices=None`: three local CPU devices of their own.
      clip_norm: optional per-replica L2 clipping of updates before they are
        shared (see `SecureAggregation`).

    Graph-mode sessions create CPU devices from `ConfigProto.device_count`;
    Estimator passes its session config through this strategy's
    `update_config_proto` for training, which adds what the layout needs.
    `TfeRunConfig` also sets it for evaluation; with a plain `RunConfig`
    use `session_config=strategy.update_config_proto(tf.compat.v1.ConfigProto())`.

    Example::

        strategy = TfeStrategy()
        config = tf.estimator.RunConfig(
            train_distribute=strategy, eval_distribute=strategy,
            session_config=strategy.update_config_proto(
                tfe_estimator.default_session_config()))
    """

    def __init__(
        self,
        devices: Optional[Sequence[str]] = None,
        protocol: str = "pond",
        precision: str = "low",
        server_devices: Optional[Sequence[str]] = None,
        clip_norm: Optional[float] = None,
    ) -> None:
        protocol = validate_protocol(protocol)
        if devices is None:
            devices, default_servers = local_layout(DEFAULT_NUM_REPLICAS, protocol)
            server_devices = server_devices or default_servers
        ops = SecureAggregation(protocol=protocol, precision=precision, server_devices=server_devices,
                                clip_norm=clip_norm)
        ops.precision.check_headroom(len(devices))
        # MirroredStrategy refuses remote (in-graph multi-worker) devices when
        # built eagerly; Estimator only ever uses it in graph mode.
        with tf.Graph().as_default():
            extended = _TfeExtended(
                self, list(devices), ops, cpus_needed(list(devices) + list(server_devices or ()))
            )
        # MirroredStrategyV1.__init__ would build a plain MirroredExtended.
        distribute_lib.StrategyV1.__init__(self, extended)  # pylint: disable=non-parent-init-called

    @property
    def secure_aggregation(self) -> SecureAggregation:
        """The `SecureAggregation` doing this strategy's reductions."""
        return self.extended._cross_device_ops  # pylint: disable=protected-access
