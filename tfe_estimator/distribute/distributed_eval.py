"""Evaluation over replicas: every metric is that of one replica evaluating all the data.

`ReplicaEvaluation` is the part of `TfeStrategy`'s (and the plaintext twin's)
`MirroredExtended` that builds an evaluation: each replica's ``model_fn`` sees
the batch it gets as a single-replica evaluation would, and the metrics'
totals and counts combine to the single-replica evaluation of all the data.
Four things in TensorFlow, Keras and Estimator break that under a plain
`MirroredStrategy`; this module mends them while the strategy builds the
replicas' graphs (`ReplicaEvaluation._call_for_each_replica`):

- A model_fn that follows TensorFlow 2's convention scales its loss by
  ``1 / num_replicas_in_sync`` for a cross-replica SUM: Keras does
  (``losses_utils.scale_loss_for_distribution`` in the model that
  `model_to_estimator` compiles inside its model_fn), as does
  ``tf.nn.compute_average_loss``. Estimator's evaluation ``loss`` is the
  MEAN of the replicas' losses (below), so ``model_to_estimator`` reported
  half the true loss on 2 replicas. Canned heads scale only inside their
  train op, so their loss must not be summed either. While a replica builds
  an evaluation model_fn it therefore sees ``num_replicas_in_sync == 1``
  (`replicas_seen`), as it would evaluating alone; training is unchanged.
- `TfeStrategy(partial_batches=True)` (`TfeRunConfig`'s `eval_distribute`)
  gives a replica that finds no batch left in a step an empty batch.
  Estimator's ``loss`` metric is ``tf.compat.v1.metrics.mean(loss)`` run on
  every replica (estimator.py `_verify_and_create_loss_metric`): each replica
  adds its batch's loss and a count of 1, and the totals are summed across
  replicas. An empty replica adds loss 0 (or NaN) with count 1, so one batch on
  two replicas reported half the loss, three batches 3/4 of it. The plaintext
  ``loss`` is the mean of the batch losses; `masked_loss_mean` gives the
  mean a weight of 1 for a replica with rows and 0 (and its loss 0) for an
  empty one, which is exactly that mean.
- Feature columns reshape sparse ids to ``[batch, -1]``
  (feature_column_v2.py `_create_categorical_column_weighted_sum`), which
  TensorFlow cannot infer for an empty tensor ("reshape cannot infer the
  missing input size for an empty tensor"). `empty_safe_sparse_reshape`
  swaps in a `sparse_reshape` that gives the ``-1`` the size of the input's
  trailing dimensions in that case (as TensorFlow's own sequence columns do),
  and is the same op otherwise.
- The binary head's ``accuracy_baseline`` (head/binary_class_head.py
  `_update_accuracy_baseline`) is ``max(total, count - total)`` of the label
  mean's state, read on each replica (its own partial total), and Keras'
  `result()` reads replica 0's (``max(t0, c0 - t0) / count``): 0.257 for 0.6
  on two even batches, under any `MirroredStrategy`. `mend_accuracy_baseline`
  makes it ``max(m, 1 - m)`` of the label mean ``m`` over all replicas, its
  definition.

Example::

    class _Extended(distributed_eval.ReplicaEvaluation, mirrored_strategy.MirroredExtended):
        pass

    extended = _Extended(strategy, devices=devices, cross_device_ops=ops, partial_batches=True)
"""
import contextlib
import threading
from typing import Iterator, Optional

import tensorflow as tf
from tensorflow.python.ops import sparse_ops

from tfe_estimator import compat

__all__ = ["ReplicaEvaluation", "LossRows", "batch_has_rows", "masked_loss_mean", "empty_safe_sparse_reshape",
           "mend_accuracy_baseline", "replicas_seen"]

_PATCH_LOCK = threading.Lock()
_PATCH_DEPTH = [0]
_ORIGINAL_SPARSE_RESHAPE = sparse_ops.sparse_reshape
_BUILDING = threading.local()  # .evaluation: this (replica) thread is building an evaluation model_fn


def replicas_seen(num_replicas: int) -> int:
    """The ``num_replicas_in_sync`` a strategy reports: 1 to a replica building an evaluation model_fn.

    Such a replica evaluates its batch as one replica alone would (module
    docstring); everywhere else, including the merge functions run between
    the replicas' steps (another thread), it is `num_replicas`.
    """
    return 1 if getattr(_BUILDING, "evaluation", False) else num_replicas


@contextlib.contextmanager
def _building_evaluation() -> Iterator[None]:
    before = getattr(_BUILDING, "evaluation", False)
    _BUILDING.evaluation = True
    try:
        yield
    finally:
        _BUILDING.evaluation = before


def _rows(leaf) -> Optional[tf.Tensor]:
    if isinstance(leaf, tf.SparseTensor):
        return leaf.dense_shape[0]
    if isinstance(leaf, tf.RaggedTensor):
        return tf.cast(leaf.nrows(), tf.int64)
    if isinstance(leaf, tf.Tensor) and leaf.shape.rank is not None and leaf.shape.rank >= 1:
        return tf.cast(tf.shape(leaf, out_type=tf.int64)[0], tf.int64)
    return None


def batch_has_rows(batch) -> Optional[tf.Tensor]:
    """A bool scalar: whether a replica's batch (features, labels) has at least one row.

    None when no tensor in it has a batch dimension (nothing to tell by).
    """
    rows = [r for r in (_rows(leaf) for leaf in tf.nest.flatten(batch)) if r is not None]
    if not rows:
        return None
    return tf.reduce_max(tf.stack(rows)) > 0


class LossRows:
    """Evaluation specs' per-replica losses and whether each replica's batch had rows.

    Kept by the strategy between Estimator's two `call_for_each_replica`
    calls (the model_fn, then ``metrics.mean(spec.loss)``), by the loss's
    identity, so Estimators sharing a config may build evaluations at once
    (the last `_KEEP`). It holds graph tensors, which Estimator's
    `copy.deepcopy` of its config cannot copy: a copy starts empty.
    """

    _KEEP = 8

    def __init__(self):
        self._pending = {}  # id(loss) -> (loss, has_rows)
        self._lock = threading.Lock()

    def __deepcopy__(self, memo):
        return type(self)()

    def record(self, loss, has_rows) -> None:
        with self._lock:
            self._pending[id(loss)] = (loss, has_rows)
            while len(self._pending) > self._KEEP:
                self._pending.pop(next(iter(self._pending)))

    def take(self, value):
        """`has_rows` if `value` is a recorded loss (then forgotten), else None."""
        with self._lock:
            entry = self._pending.get(id(value))
            if entry is None or entry[0] is not value:
                return None
            del self._pending[id(value)]
            return entry[1]


def masked_loss_mean(mean_fn):
    """Estimator's per-replica ``mean_fn(loss)``, counting only a replica whose batch has rows.

    Returns the function for `call_for_each_replica`, with args
    ``(loss, has_rows)`` (each a per-replica value).
    """

    def mean(loss, replica_has_rows):
        loss = tf.convert_to_tensor(loss)
        weight = tf.cast(replica_has_rows, loss.dtype)
        # where, not a product: an empty batch's loss may be NaN (a mean over no rows).
        return mean_fn(tf.where(replica_has_rows, loss, tf.zeros_like(loss)),
                       weights=tf.broadcast_to(weight, tf.shape(loss)))

    return mean


def _sparse_reshape(sp_input, shape, name=None):
    shape = tf.cast(shape, tf.int64)
    if shape.shape.rank != 1:
        return _ORIGINAL_SPARSE_RESHAPE(sp_input, shape, name=name)
    unknown = tf.equal(shape, -1)
    given = tf.reduce_prod(tf.where(unknown, tf.ones_like(shape), shape))
    # The -1 may stand anywhere; it takes the size of the input's dimensions from there on.
    position = tf.argmax(tf.cast(unknown, tf.int32), output_type=tf.int32)
    trailing = tf.reduce_prod(sp_input.dense_shape[position:])
    fixed = tf.where(tf.logical_and(unknown, tf.equal(given, 0)), tf.fill(tf.shape(shape), trailing), shape)
    return _ORIGINAL_SPARSE_RESHAPE(sp_input, fixed, name=name)


@contextlib.contextmanager
def empty_safe_sparse_reshape() -> Iterator[None]:
    """While open, TensorFlow's `sparse_ops.sparse_reshape` also reshapes empty tensors to ``[0, -1]``.

    It is the same op for every input the original accepts, so another graph
    built meanwhile in this process is unaffected.
    """
    with _PATCH_LOCK:
        _PATCH_DEPTH[0] += 1
        sparse_ops.sparse_reshape = _sparse_reshape
    try:
        yield
    finally:
        with _PATCH_LOCK:
            _PATCH_DEPTH[0] -= 1
            if not _PATCH_DEPTH[0]:
                sparse_ops.sparse_reshape = _ORIGINAL_SPARSE_RESHAPE


_BASELINE = "accuracy_baseline"
_LABEL_MEAN = "label/mean"


def mend_accuracy_baseline(eval_metric_ops: dict) -> None:
    """Sets each ``[<head>/]accuracy_baseline`` value to ``max(m, 1 - m)`` of its head's label mean (in place).

    The label mean is a cross-replica result (Keras' `result()`, or v1
    `metrics.mean`), so a distributed value's replicas hold the same number.
    Estimator v1 heads compute the baseline on each replica from it, a
    `PerReplica` that Estimator cannot fetch ("Argument `fetch` = PerReplica
    ... has invalid type"): it becomes one tensor too. Anything else is left
    as it is.
    """
    for key, pair in list(eval_metric_ops.items()):
        if not (key == _BASELINE or key.endswith("/" + _BASELINE)):
            continue
        label_mean = eval_metric_ops.get(key[:-len(_BASELINE)] + _LABEL_MEAN)
        if not (isinstance(pair, tuple) and isinstance(label_mean, tuple)):
            continue
        baseline, mean = (_one_value(pair[0]), _one_value(label_mean[0]))
        if baseline is None or mean is None:
            continue
        with tf.control_dependencies([baseline]):  # Estimator reads it after the updates, as before
            value = tf.maximum(mean, 1.0 - mean, name="accuracy_baseline_over_replicas")
        eval_metric_ops[key] = (tf.cast(value, baseline.dtype), pair[1])


def _one_value(value) -> Optional[tf.Tensor]:
    """A cross-replica metric value as one tensor: itself, or a distributed value's first replica's."""
    if isinstance(value, tf.Tensor):
        return value
    values = getattr(value, "values", None)  # a tf.distribute DistributedValues (PerReplica, Mirrored)
    if isinstance(values, tuple) and values and all(isinstance(v, tf.Tensor) for v in values):
        return values[0]
    return None


def _is_eval_model_fn_call(args) -> bool:
    # Estimator calls model_fn through call_for_each_replica with (features, labels, mode, config).
    return len(args) >= 3 and isinstance(args[2], str) and compat.has_estimator() \
        and args[2] == tf.estimator.ModeKeys.EVAL


class ReplicaEvaluation:
    """A `MirroredExtended` mixin: evaluation metrics equal to one replica's evaluation of all the data.

    Put it before `MirroredExtended` in the bases; ``partial_batches`` is
    `TfeStrategy`'s argument (give a replica without data an empty batch).
    What it mends, and why, is in the module docstring.
    """

    def __init__(self, *args, partial_batches: bool = False, **kwargs):
        self._tfe_partial_batches = bool(partial_batches)
        self._tfe_eval_loss = LossRows()
        super().__init__(*args, **kwargs)

    @property
    def _num_replicas_in_sync(self):
        return replicas_seen(super()._num_replicas_in_sync)

    def _call_for_each_replica(self, fn, args, kwargs):
        evaluation = _is_eval_model_fn_call(args)
        has_rows = self._tfe_eval_loss.take(args[0]) if len(args) == 1 and not kwargs else None
        if has_rows is not None:
            # Estimator's `loss` metric: metrics.mean(spec.loss) on each replica.
            fn, args = masked_loss_mean(fn), (args[0], has_rows)
        if not evaluation:
            return super()._call_for_each_replica(fn, args, kwargs)

        def replica_fn(*a, **k):
            with _building_evaluation():
                result = fn(*a, **k)
            rows = batch_has_rows(a[:2])  # a: features, labels, mode, config
            return result, (tf.constant(True) if rows is None else rows)

        with empty_safe_sparse_reshape() if self._tfe_partial_batches else contextlib.nullcontext():
            spec, has_rows = super()._call_for_each_replica(replica_fn, args, kwargs)
        if getattr(spec, "loss", None) is not None:
            self._tfe_eval_loss.record(spec.loss, has_rows)
        if isinstance(getattr(spec, "eval_metric_ops", None), dict):
            mend_accuracy_baseline(spec.eval_metric_ops)
        return spec

    def _make_input_fn_iterator(self, input_fn,
                                replication_mode=tf.distribute.InputReplicationMode.PER_WORKER):
        # Graph-mode MirroredStrategy has partial batches off: a step where one
        # replica gets end-of-input fails after some metric updates ran, and
        # evaluate() returned right values or 0.0 by a race (issue 12). With
        # get_next_as_optional, a replica without data contributes nothing.
        iterator = super()._make_input_fn_iterator(input_fn, replication_mode)
        if self._tfe_partial_batches:
            iterator._enable_get_next_as_optional = True  # pylint: disable=protected-access
        return iterator
