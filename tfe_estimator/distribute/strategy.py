"""`TfeStrategy`: a `MirroredStrategy` whose reductions are `SecureAggregation`.

Example::

    strategy = tfe_estimator.TfeStrategy()   # 2 local replicas, 3 TFE parties
    with strategy.scope():                   # Keras, as under tf.distribute.MirroredStrategy()
        model = tf.keras.Sequential([tf.keras.layers.Dense(1, input_shape=(1,))])
        model.compile(loss="mse", optimizer="sgd")
    model.fit(dataset, epochs=2)
"""
import logging
from typing import Optional, Sequence

import tensorflow as tf
from tensorflow.python.distribute import cross_device_ops as cross_device_ops_lib
from tensorflow.python.distribute import distribute_lib
from tensorflow.python.distribute import distribute_utils
from tensorflow.python.distribute import mirrored_strategy
from tensorflow.python.distribute import summary_op_util
from tensorflow.python.distribute import values as value_lib
from tensorflow.python.util import nest

from tfe_estimator.distribute import distributed_eval, progress
from tfe_estimator.distribute.aggregation import SecureAggregation
from tfe_estimator.distribute.devices import cpus_needed, local_layout, validate_num_replicas, validate_party_devices
from tfe_estimator.distribute.logical_devices import check_logical_cpus, ensure_logical_cpus
from tfe_estimator.distribute.strategy_mode import SERVICE, pick_mode
from tfe_estimator.secure.protocols import check_supported, validate_protocol

__all__ = ["TfeStrategy"]

#: Summary lines already logged by this process: TfeRunConfig builds a train and an eval strategy
#: (and `replace()` builds them again) with the same layout; a user needs to read it once.
_LOGGED = set()


def _log_once(message: str, *args) -> None:
    line = message % args
    if line not in _LOGGED:
        _LOGGED.add(line)
        logging.getLogger("tfe_estimator").info(line)


class _TfeExtended(distributed_eval.ReplicaEvaluation, mirrored_strategy.MirroredExtended):
    """`MirroredExtended` whose every cross-replica path is `SecureAggregation`.

    `MirroredExtended` does not always use the `cross_device_ops` it is given
    (read in each stack's ``tensorflow/python/distribute/mirrored_strategy.py``):

    - TF 2.10+ `_reduce_to` hands every reduction whose destinations include a
      CPU device (or do not match the value's devices) to a fresh plaintext
      `ReductionToOneDevice`; TF 2.9 does so only when collective ops are in use.
    - `_get_cross_device_ops` returns a fresh `ReductionToOneDevice` for every
      int32 value (TF 2.10+ always, TF 2.9 with collective ops), and the
      collective all-reduce whenever `_use_merge_call()` is False (XLA on GPUs).
    - `_initialize_strategy` builds collective ops (plaintext NCCL/RING sums)
      with `_make_collective_ops` (TF 2.9) or `_make_collective_ops_with_fallbacks`
      (TF 2.10+).

    Every one of those paths would sum replicas' values in the clear, so each
    is overridden here to go through the strategy's `SecureAggregation`;
    `tests/test_strategy_routing.py` spies on it on both stacks. Evaluation
    (partial batches, the metrics) is `distributed_eval.ReplicaEvaluation`'s.
    """

    def __init__(self, container_strategy, devices, cross_device_ops, num_cpus, partial_batches=False):
        if not isinstance(cross_device_ops, SecureAggregation):
            raise TypeError(
                "TfeStrategy's cross-device ops must be a SecureAggregation, got "
                f"{type(cross_device_ops).__name__}."
            )
        self._tfe_num_cpus = num_cpus
        super().__init__(container_strategy, devices=devices, cross_device_ops=cross_device_ops,
                         partial_batches=partial_batches)

    # Where MirroredExtended would build plaintext collective ops: ours instead,
    # so even a path that reaches `self._collective_ops` sums securely.
    def _make_collective_ops(self, devices):  # TF 2.9
        del devices
        return self._cross_device_ops

    def _make_collective_ops_with_fallbacks(self):  # TF 2.10+
        return self._cross_device_ops

    def _use_merge_call(self):
        # Always reduce through merge_call, i.e. through SecureAggregation
        # (without it, MirroredExtended uses collective ops under XLA).
        return True

    def _get_cross_device_ops(self, value):
        # The one routing point: every override below asks it. No dtype
        # (int32) or device shortcut: every value is summed securely.
        del value
        return self._cross_device_ops

    def _reduce_to(self, reduce_op, value, destinations, options):
        if distribute_utils.is_mirrored(value) and reduce_op == tf.distribute.ReduceOp.MEAN:
            return value  # already equal on every replica: nothing to combine

        def reduce_one(v):
            if not isinstance(v, value_lib.DistributedValues):
                # One value shared by all replicas (e.g. a constant), not a
                # per-replica secret: MirroredExtended's own rule applies.
                return cross_device_ops_lib.reduce_non_distributed_value(
                    reduce_op, v, destinations, self._num_replicas_in_sync)
            # No CPU-destination shortcut to a plaintext ReductionToOneDevice.
            return self._get_cross_device_ops(v).reduce(
                reduce_op, v, destinations=destinations,
                options=self._communication_options.merge(options))

        return nest.map_structure(reduce_one, value)

    def _batch_reduce_to(self, reduce_op, value_destination_pairs, options):
        ops = {id(self._get_cross_device_ops(v)): self._get_cross_device_ops(v)
               for v, _ in value_destination_pairs} or {0: self._cross_device_ops}
        if len(ops) != 1:
            raise ValueError("TfeStrategy routes every value of one batch_reduce_to to one cross-device ops.")
        return next(iter(ops.values())).batch_reduce(
            reduce_op, value_destination_pairs, options=self._communication_options.merge(options))

    def _broadcast_to(self, tensor, destinations):
        if isinstance(tensor, (float, int)):
            return tensor  # MirroredExtended's fast path for Python numbers
        return self._get_cross_device_ops(tensor).broadcast(tensor, destinations or self._devices)

    def _gather_to_implementation(self, value, destinations, axis, options):
        if not isinstance(value, value_lib.DistributedValues):
            return value
        # SecureAggregation refuses: a gather reveals each replica's values.
        return self._get_cross_device_ops(value)._gather(  # pylint: disable=protected-access
            value, destinations=destinations, axis=axis,
            options=self._communication_options.merge(options))

    def _replica_ctx_all_reduce(self, reduce_op, value, options=None):
        # StrategyExtendedV2's path: merge_call -> batch_reduce_to -> SecureAggregation
        # (MirroredExtended's would call collective ops directly without merge_call).
        return super(mirrored_strategy.MirroredExtended, self)._replica_ctx_all_reduce(  # pylint: disable=bad-super-call
            reduce_op, value, options)

    def _call_for_each_replica(self, fn, args, kwargs):
        # TensorFlow records the v1 summaries a replica function writes (a head's
        # `loss`, a DNN's activation histograms) from replica 0 alone: statistics of
        # one replica's (one owner's) batch, written to model_dir as the training's
        # own. Under TfeStrategy no replica records them (TensorFlow's own switch,
        # which it flips the same way for XLA); with no `loss` summary, Estimator
        # writes the reduced loss, i.e. the secure sum, under that name.
        # A training EstimatorSpec also gets the progress line (`progress.ProgressHook`).
        # Evaluation (empty batches, the `loss` metric, the accuracy baseline) is
        # `distributed_eval.ReplicaEvaluation`'s, which this calls.
        def replica_fn(*a, **k):
            return progress.with_progress(fn(*a, **k), a)

        original = summary_op_util.skip_summary
        summary_op_util.skip_summary = lambda: tf.distribute.get_replica_context() is not None \
            and not tf.distribute.in_cross_replica_context() or original()
        try:
            return super()._call_for_each_replica(replica_fn, args, kwargs)
        finally:
            summary_op_util.skip_summary = original

    def _update_config_proto(self, config_proto):
        updated = super()._update_config_proto(config_proto)
        if updated.device_count.get("CPU", 1) < self._tfe_num_cpus:
            updated.device_count["CPU"] = self._tfe_num_cpus
        return updated


class _PicksMode(type):
    """`TfeStrategy`'s metaclass: ``TfeStrategy()`` with no devices is local replicas or, under a service-mode
    TF_CONFIG cluster, this data owner's part (Keras across organisations, `keras_fit`);
    `strategy_mode.pick_mode` is the one place that decides. Only a call of the class decides: a deep copy
    (Estimator copies its config, ``cls.__new__(cls)``) and `TfeRunConfig` (explicit devices) never get here."""

    def __call__(cls, *args, **kwargs):
        if cls is TfeStrategy and not args and kwargs.get("devices") is None \
                and kwargs.get("server_devices") is None and pick_mode() == SERVICE:
            from tfe_estimator.owner import keras_fit  # pylint: disable=import-outside-toplevel

            return keras_fit.owner_strategy_from_environment(**kwargs)
        return super().__call__(*args, **kwargs)


class TfeStrategy(tf.compat.v1.distribute.MirroredStrategy, metaclass=_PicksMode):
    """Data-parallel training whose cross-replica sums are TF Encrypted secure sums.

    `TfeStrategy()` replaces `tf.distribute.MirroredStrategy()` in a Keras
    `model.fit` or a custom training loop (`strategy.run`, `strategy.reduce`,
    `strategy.experimental_distribute_dataset`) and trains exactly like it on
    the same replica devices. Built eagerly without `devices`, it gives
    TensorFlow's eager runtime the logical CPU devices its replicas and parties
    need (`tfe_estimator.distribute.logical_devices`), whatever ran before,
    unless the runtime already started with several but too few: `scope()` then
    raises a clear error.

    Args:
      devices: the replica devices. None: `num_replicas` local replicas (GPUs
        if there are that many, otherwise CPU devices).
      protocol: "pond" or "aby3" (see `tfe_estimator.secure.protocols`).
      precision: "low" or "high" (see `tfe_estimator.secure.precision`).
      server_devices: the devices of the three TFE parties. None with
        `devices=None`: three local CPU devices of their own.
      clip_norm: optional per-replica L2 clipping of updates before they are
        shared (see `SecureAggregation`).
      implementation: "auto" or "tf-encrypted" (the reference implementation;
        see `SecureAggregation`).
      update_ring_bits: 64, or 32 for clipped updates on a 32-bit ring (half
        the bytes; needs `clip_norm`; see `SecureAggregation`).
      dp: optional `tfe_estimator.DistributedDP` (noise added inside the
        secure sum; see `SecureAggregation` and `tfe_estimator.privacy.dp`).
      partial_batches: give a replica that has no data left in a step an
        empty batch instead of failing the step. Evaluation needs it to be
        exact when the input has fewer batches than replicas (otherwise the
        metrics are right or 0.0 by a race; `distributed_eval` keeps Estimator's
        `loss`, sparse feature columns and `accuracy_baseline` exact on the
        empty batches); it costs a cross-worker
        synchronisation per step on a cluster (about 10 ms on the loopback
        benchmark), so `TfeRunConfig` turns it on for `eval_distribute` only.
      num_replicas: with `devices=None`, how many local replicas (default 2).

    Raises:
      ValueError: for an unknown protocol or precision, a bad `clip_norm`, or
        `num_replicas` that disagrees with `devices`.
      NotImplementedError: without `devices`, for a cluster in TF_CONFIG
        (`tfe_estimator.distribute.strategy_mode.pick_mode`).
      NotImplementedError: for a protocol and precision this TensorFlow cannot
        run (`tfe_estimator.secure.protocols.check_supported`, e.g. ABY3 at "high" on
        TensorFlow 2.15).

    Graph-mode sessions create CPU devices from `ConfigProto.device_count`;
    Estimator passes its session config through this strategy's
    `update_config_proto` for training, which adds what the layout needs.
    `TfeRunConfig` also sets it for evaluation; with a plain `RunConfig`
    use `session_config=strategy.update_config_proto(tf.compat.v1.ConfigProto())`.

    Example::

        strategy = TfeStrategy()
        with strategy.scope():
            model = tf.keras.Sequential([tf.keras.layers.Dense(1, input_shape=(1,))])
            model.compile(loss="mse", optimizer="sgd")
        model.fit(dataset, epochs=2)

        # Estimator (or use tfe_estimator.TfeRunConfig):
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
        implementation: str = "auto",
        dp=None,
        partial_batches: bool = False,
        update_ring_bits: int = 64,
        num_replicas: Optional[int] = None,
    ) -> None:
        protocol = validate_protocol(protocol)
        check_supported(protocol, precision)
        if devices is None:
            devices, default_servers = local_layout(validate_num_replicas(num_replicas), protocol)
            server_devices = server_devices or default_servers
            if tf.executing_eagerly():  # Keras or a custom loop: the eager runtime needs the devices
                ensure_logical_cpus(cpus_needed(list(devices) + list(server_devices)))
        elif num_replicas is not None and validate_num_replicas(num_replicas) != len(devices):
            raise ValueError(
                f"TfeStrategy(num_replicas={num_replicas}) but devices= lists {len(devices)} replica devices: "
                f"{list(devices)}. Pass one of the two.")
        ops = SecureAggregation(protocol=protocol, precision=precision, server_devices=server_devices,
                                clip_norm=clip_norm, implementation=implementation,
                                dp=dp,  # differential privacy: see tfe_estimator.privacy.dp
                                update_ring_bits=update_ring_bits)
        ops.precision.check_headroom(len(devices))
        validate_party_devices(protocol, ops.server_devices, devices)
        # MirroredStrategy refuses remote (in-graph multi-worker) devices when
        # built eagerly; Estimator only ever uses it in graph mode.
        with tf.Graph().as_default():
            extended = _TfeExtended(
                self, list(devices), ops, cpus_needed(list(devices) + list(server_devices or ())),
                partial_batches=bool(partial_batches),
            )
        # MirroredStrategyV1.__init__ would build a plain MirroredExtended.
        distribute_lib.StrategyV1.__init__(self, extended)  # pylint: disable=non-parent-init-called
        _log_once("secure aggregation: protocol=%s precision=%s implementation=%s, %d replicas %s, parties %s",
                  protocol, ops.precision.name, ops.implementation, len(devices), list(devices),
                  list(ops.server_devices))

    def scope(self):
        """The strategy's scope; for Keras, first checks the process has the CPU devices it needs."""
        if tf.compat.v1.executing_eagerly_outside_functions():  # Keras; Estimator builds in a graph
            check_logical_cpus(self)
        return super().scope()

    @property
    def secure_aggregation(self) -> SecureAggregation:
        """The `SecureAggregation` doing this strategy's reductions."""
        return self.extended._cross_device_ops  # pylint: disable=protected-access
