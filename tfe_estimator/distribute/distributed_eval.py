"""Evaluation over replicas whose batches differ or are empty: the plaintext metrics, no crash.

`TfeStrategy(partial_batches=True)` (`TfeRunConfig`'s `eval_distribute`) gives
a replica that finds no batch left in a step an empty batch. Three things in
TensorFlow and Estimator assume replicas' batches are never empty or uneven;
this module mends them while the strategy builds the replicas' graphs (see
`TfeStrategy._call_for_each_replica`):

- Estimator's ``loss`` metric is ``tf.compat.v1.metrics.mean(loss)`` run on
  every replica (estimator.py `_verify_and_create_loss_metric`): each replica
  adds its batch's loss and a count of 1, and the totals are summed across
  replicas. An empty replica adds loss 0 (or NaN) with count 1, so one batch on
  two replicas reported half the loss, three batches 3/4 of it. The plaintext
  twin's ``loss`` is the mean of the batch losses; `loss_mean_args` gives the
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
  mean computed from each replica's local total, and Keras' `result()` reads
  replica 0's (``max(t0, c0 - t0) / count``): 0.286 for 0.5 on three uneven
  batches. `mend_accuracy_baseline` makes it ``max(m, 1 - m)`` of the label
  mean ``m`` summed over all replicas, its definition.

Example::

    has_rows = batch_has_rows((features, labels))   # in a replica's function
    with empty_safe_sparse_reshape():
        spec = model_fn(features, labels, "eval", config)
"""
import contextlib
import threading
from typing import Iterator, Optional

import tensorflow as tf
from tensorflow.python.ops import sparse_ops

__all__ = ["LossRows", "batch_has_rows", "masked_loss_mean", "empty_safe_sparse_reshape", "mend_accuracy_baseline"]

_PATCH_LOCK = threading.Lock()
_PATCH_DEPTH = [0]
_ORIGINAL_SPARSE_RESHAPE = sparse_ops.sparse_reshape


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
