"""`tfrecord_input_fn`: an input_fn over TFRecord files of `tf.train.Example`s.

All file work is done by dataset ops (`tf.io.matching_files`,
`tf.data.TFRecordDataset`), so in cluster mode each pipeline reads files on
its own host; see `input_fns.sharding` for which files or records each
pipeline reads.

Example::

    spec = {"x": tf.io.FixedLenFeature([30], tf.float32),
            "label": tf.io.FixedLenFeature([], tf.int64)}
    input_fn = tfrecord_input_fn("/data/worker{worker}/*.tfrecord", spec, "label",
                                 batch_size=64)
"""
from typing import Callable, Mapping, Optional

import tensorflow as tf

from input_fns import _pipeline, sharding

__all__ = ["tfrecord_input_fn"]

_CALLER = "tfrecord_input_fn"


def tfrecord_input_fn(
    file_pattern: str,
    feature_spec: Mapping[str, object],
    label_key: str,
    batch_size: int,
    num_epochs: Optional[int] = None,
    shuffle: bool = True,
    seed: Optional[int] = None,
) -> Callable[..., tf.data.Dataset]:
    """Returns `input_fn(input_context=None)` yielding `(features, labels)` batches.

    Args:
      file_pattern: a glob of TFRecord files; ``{worker}`` is replaced by the
        input pipeline id (0 without an `InputContext`).
      feature_spec: a dict for `tf.io.parse_example`, e.g. from
        `tf.feature_column.make_parse_example_spec`, including `label_key`.
      label_key: the feature that is the label.
      batch_size: the global batch size.
      num_epochs: how often to go through the data; None repeats forever.
      shuffle: whether to shuffle records (in a buffer of
        `input_fns._pipeline.SHUFFLE_BUFFER_SIZE`, every epoch).
      seed: the shuffle seed.

    Raises:
      ValueError: if `label_key` is not in `feature_spec`, or for a bad
        `batch_size` or `num_epochs`. No matching file is an
        `InvalidArgumentError` naming the pattern when the pipeline runs.
    """
    if not isinstance(feature_spec, Mapping) or not feature_spec:
        raise ValueError(
            f"{_CALLER}: feature_spec must be a non-empty dict from feature name to "
            f"tf.io.FixedLenFeature/VarLenFeature, got {feature_spec!r}."
        )
    if label_key not in feature_spec:
        raise ValueError(
            f"{_CALLER}: label_key {label_key!r} is not in feature_spec; the features are "
            f"{sorted(feature_spec)}. Fix: add {label_key!r} to feature_spec (e.g. "
            "tf.io.FixedLenFeature([], tf.int64)) or pass one of those names."
        )
    feature_spec = dict(feature_spec)
    _pipeline.check_epochs(num_epochs, _CALLER)
    sharding.per_replica_batch_size(batch_size, None, _CALLER)

    def parse_batch(serialized):
        features = tf.io.parse_example(serialized, feature_spec)
        labels = features.pop(label_key)
        return features, labels

    def input_fn(input_context: Optional[tf.distribute.InputContext] = None) -> tf.data.Dataset:
        per_replica = sharding.per_replica_batch_size(batch_size, input_context, _CALLER)
        records = sharding.sharded_file_records(
            file_pattern, tf.data.TFRecordDataset, input_context, _CALLER)
        return _pipeline.shuffle_repeat_batch(
            records, per_replica, num_epochs, shuffle, seed, parse_batch=parse_batch)

    return input_fn
