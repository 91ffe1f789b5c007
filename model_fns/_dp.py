"""The DP-SGD path of the model_fns, taken when the RunConfig carries a `DistributedDP`.

With ``TfeRunConfig(dp=DistributedDP(l2_norm_clip, noise_multiplier))`` each
replica computes the unreduced per-example loss of Estimator's head, clips
each example's gradient to `l2_norm_clip` and sums them
(`tfe_estimator.privacy.dp.make_dp_optimizer`, on tensorflow-privacy's vectorized
clipping); `SecureAggregation` adds the noise inside the secure sum; the
optimizer applies the noisy sum divided by the global batch size. The
head's losses, metrics, predictions and exports are unchanged; evaluation
adds the metrics `dp_epsilon` (against `colluding_owners` owners who pool
their own noise: the guarantee) and `dp_epsilon_outsiders`, and training logs
both at its end (TensorFlow's logger), when the `DistributedDP` has
`num_examples`. Under DP the reported loss and metrics are the chief's
replica's own (see `SecureAggregation`): no un-noised value from another
owner's data. In service mode with ``count_repeated_releases=True`` the
steps the servers released twice (`tfe_estimator.owner.training_run`)
count twice in both.

What the checkpoint keeps for the epsilon of evaluation:

- ``dp_noise_parties``: N of the training's accounting (`noise_parties`: its
  replicas, or its owners through the aggregation service), a constant of the
  training graph, so that an evaluator with another number of replicas reports
  the training's epsilon, not one for its own replica count.
- ``dp_global_batch_size``, only without ``expected_batch_size`` (fixed-size
  batches, each replica the same size, so the sum tells no owner anything it
  does not know): the sum of the replicas' batch sizes of the last step, through
  the secure sum. With ``expected_batch_size`` (Poisson-sampled batches) the
  accounting uses the expected size and no batch size is summed across owners:
  the sum, un-noised, would tell every owner the others' sampled batch sizes.

Example::

    dp = tfe_estimator.DistributedDP(1.0, 1.1, num_examples=60000)
    est = tf.estimator.Estimator(logistic_regression.model_fn, params=params,
                                 config=tfe_estimator.TfeRunConfig(dp=dp))
"""
from typing import Any, Mapping, Sequence

import tensorflow as tf

from model_fns._params import make_optimizer
# The eval metrics of the evaluated checkpoint's epsilon: against t colluding owners, and against outsiders.
from tfe_estimator.privacy.dp import EPSILON_METRIC, OUTSIDER_EPSILON_METRIC

__all__ = ["dp_settings", "dp_estimator_spec", "EPSILON_METRIC", "OUTSIDER_EPSILON_METRIC"]

_BATCH_VARIABLE = "dp_global_batch_size"
_PARTIES_VARIABLE = "dp_noise_parties"


def dp_settings(config):
    """The `DistributedDP` of a `TfeRunConfig`, or None."""
    settings = getattr(config, "tfe_settings", None)
    return getattr(settings, "dp", None)


def _per_example_loss(head, features, labels, logits):
    # The head's own loss before its reduction (what tensorflow-privacy's DP
    # heads compute), one row per example.
    processed = head._processed_labels(logits, labels)  # pylint: disable=protected-access
    unweighted, weights = head._unweighted_loss_and_weights(logits, processed, features)  # pylint: disable=protected-access
    loss = tf.keras.__internal__.losses.compute_weighted_loss(
        unweighted, sample_weight=weights, reduction=tf.keras.losses.Reduction.NONE)
    return tf.reshape(loss, [tf.shape(logits)[0], -1])


def _batch_variable():
    # The global batch size of the last training step, kept in the checkpoint
    # so that evaluation can report the epsilon of the checkpoint it evaluates.
    # Each replica assigns its own batch size and the variable SUMs them through
    # the secure sum (ONLY_FIRST_REPLICA would copy replica 0's in plaintext).
    return tf.compat.v1.get_variable(
        _BATCH_VARIABLE, shape=[], dtype=tf.int64, initializer=tf.compat.v1.zeros_initializer(),
        trainable=False, aggregation=tf.VariableAggregation.SUM)


def _parties_variable(parties: int):
    # N of the training's accounting, in the checkpoint: a constant of the training graph (never
    # assigned), restored by evaluation, whatever its own number of replicas.
    return tf.compat.v1.get_variable(
        _PARTIES_VARIABLE, shape=[], dtype=tf.int64, initializer=tf.compat.v1.constant_initializer(parties),
        trainable=False, aggregation=tf.VariableAggregation.NONE)


def _epsilon_metrics(dp, batch_variable, parties_variable, model_dir=None):
    def epsilons(steps, batch, parties):
        from tfe_estimator.owner.training_run import recorded_repeated_releases  # pylint: disable=import-outside-toplevel

        batch = dp.expected_batch_size or int(batch)
        if batch <= 0:
            return [float("nan")] * 2  # no training step recorded yet
        # Service mode: steps the servers released twice count twice (DistributedDP(count_repeated_releases)).
        return list(dp.epsilons(batch, int(steps) + recorded_repeated_releases(model_dir), int(parties)))

    def value(_=None):
        step = tf.compat.v1.train.get_global_step()
        batch = tf.constant(0, tf.int64) if batch_variable is None else tf.identity(batch_variable)
        return tf.py_function(epsilons, [tf.identity(step), batch, tf.identity(parties_variable)], [tf.float64] * 2)

    # Like tf.compat.v1.metrics: the value is built once, in cross-replica context.
    context = tf.distribute.get_replica_context()
    outsiders, colluders = value() if context is None else context.merge_call(value)
    return {EPSILON_METRIC: (colluders, tf.no_op()), OUTSIDER_EPSILON_METRIC: (outsiders, tf.no_op())}


def dp_estimator_spec(
    dp,
    head,
    features,
    labels,
    mode: str,
    logits: tf.Tensor,
    params: Mapping[str, Any],
    layers: Sequence[tf.keras.layers.Layer],
    model_dir=None,
) -> tf.estimator.EstimatorSpec:
    """The head's `EstimatorSpec` with DP-SGD training (see the module docstring)."""
    from tfe_estimator.owner.service_strategy import repeated_releases  # pylint: disable=import-outside-toplevel
    from tfe_estimator.privacy.dp import EpsilonLoggingHook, make_dp_optimizer, noise_parties  # pylint: disable=import-outside-toplevel

    trainable = [v for layer in layers for v in layer.trainable_variables]
    parties = noise_parties()
    batch_variable = parties_variable = None
    if mode != tf.estimator.ModeKeys.PREDICT:
        parties_variable = _parties_variable(parties)
        if dp.expected_batch_size is None:
            batch_variable = _batch_variable()
    if mode != tf.estimator.ModeKeys.TRAIN:
        spec = head.create_estimator_spec(features=features, mode=mode, logits=logits, labels=labels)
        if mode == tf.estimator.ModeKeys.EVAL and dp.num_examples is not None:
            metrics = dict(spec.eval_metric_ops or {})
            metrics.update(_epsilon_metrics(dp, batch_variable, parties_variable, model_dir))
            spec = spec._replace(eval_metric_ops=metrics)
        return spec
    optimizer = make_dp_optimizer(make_optimizer(params), dp.l2_norm_clip, dp.expected_batch_size)
    optimizer.iterations = tf.compat.v1.train.get_or_create_global_step()
    per_example = _per_example_loss(head, features, labels, logits)
    num_replicas = tf.distribute.get_strategy().num_replicas_in_sync
    global_batch = tf.cast(tf.shape(logits)[0] * num_replicas, tf.int64)

    def train_op_fn(scalar_loss):
        del scalar_loss  # the head's reduced loss: reported, not differentiated
        update = optimizer.get_updates(per_example, trainable)[0]
        if batch_variable is None:  # Poisson batches: accounted with expected_batch_size, sizes stay local
            return update
        with tf.control_dependencies([update]):
            return batch_variable.assign(tf.cast(tf.shape(logits)[0], tf.int64)).op  # summed: the global batch

    spec = head.create_estimator_spec(features=features, mode=mode, logits=logits, labels=labels,
                                      train_op_fn=train_op_fn, trainable_variables=trainable)
    hooks = list(spec.training_hooks or ())
    if dp.num_examples is not None:
        graph = tf.compat.v1.get_default_graph()
        hooks.append(EpsilonLoggingHook(dp, global_batch, parties, repeated_releases=lambda: repeated_releases(graph)))
    return spec._replace(training_hooks=hooks)

