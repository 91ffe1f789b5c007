"""`numpy_input_fn`: an input_fn over in-memory numpy arrays.

The arrays become constants of the graph, so this is for data that fits in
memory on the machine that builds the graph (one machine, tests, demos).
With a `tf.distribute.InputContext` of N pipelines, pipeline ``i`` keeps
records ``i, i + N, ...``.

Example::

    input_fn = numpy_input_fn({"x": x_train}, y_train, batch_size=64, seed=0)
    est.train(input_fn, steps=100)
    est.evaluate(numpy_input_fn({"x": x_test}, y_test, batch_size=64,
                                num_epochs=1, shuffle=False))
"""
from typing import Callable, Mapping, Optional

import numpy as np
import tensorflow as tf

from input_fns import _pipeline, sharding

__all__ = ["numpy_input_fn"]

_CALLER = "numpy_input_fn"


def numpy_input_fn(
    features: Mapping[str, np.ndarray],
    labels: Optional[np.ndarray],
    batch_size: int,
    num_epochs: Optional[int] = None,
    shuffle: bool = True,
    seed: Optional[int] = None,
) -> Callable[..., tf.data.Dataset]:
    """Returns `input_fn(input_context=None)` yielding `(features, labels)` batches.

    Args:
      features: a dict from feature name to an array whose first dimension is
        the record.
      labels: an array with the same first dimension, or None (for `predict`:
        the dataset then yields features only).
      batch_size: the global batch size; each replica gets
        ``batch_size / num_replicas_in_sync`` records per step.
      num_epochs: how often to go through the data; None repeats forever.
      shuffle: whether to shuffle the records (fully, every epoch).
      seed: the shuffle seed.

    Raises:
      TypeError, ValueError: for features that are not a dict of arrays of the
        same length as `labels`, or a bad `batch_size` or `num_epochs` (the
        batch size is checked against the replicas when `input_fn` is called).
    """
    if not isinstance(features, Mapping) or not features:
        raise TypeError(
            f"{_CALLER}: features must be a non-empty dict from feature name to numpy array, "
            f"got {type(features).__name__}. Fix: pass {{'x': x}} and use the name in your "
            "feature columns."
        )
    features = {name: np.asarray(value) for name, value in features.items()}
    lengths = {name: len(value) for name, value in features.items()}
    if labels is not None:
        labels = np.asarray(labels)
        lengths["<labels>"] = len(labels)
    if len(set(lengths.values())) != 1:
        raise ValueError(
            f"{_CALLER}: features and labels must have the same number of records (first "
            f"dimension); got {lengths}."
        )
    _pipeline.check_epochs(num_epochs, _CALLER)
    sharding.per_replica_batch_size(batch_size, None, _CALLER)
    num_records = next(iter(lengths.values()))

    def input_fn(input_context: Optional[tf.distribute.InputContext] = None) -> tf.data.Dataset:
        per_replica = sharding.per_replica_batch_size(batch_size, input_context, _CALLER)
        data = features if labels is None else (features, labels)
        dataset = sharding.shard_records(tf.data.Dataset.from_tensor_slices(data), input_context)
        return _pipeline.shuffle_repeat_batch(
            dataset, per_replica, num_epochs, shuffle, seed, buffer_size=max(num_records, 1))

    return input_fn
