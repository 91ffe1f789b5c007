"""Which records an input pipeline reads, and how big its batches are.

Under a distribution strategy Estimator calls an `input_fn` once per input
pipeline (one per host: the chief and each worker) with a
`tf.distribute.InputContext`. Each pipeline must read a disjoint part of the
data, and all pipelines together every record once per epoch:

* ``{worker}`` in a file pattern is replaced by the pipeline id: each worker
  reads all of its own local files, and nothing is sharded further.
* Otherwise, with at least as many matching files as pipelines, pipeline
  ``i`` reads files ``i, i + N, i + 2N, ...`` (file-level sharding, in the
  order `tf.io.matching_files` lists them); with fewer files, every pipeline
  reads all files and keeps records ``i, i + N, ...`` (record-level sharding).

The number of files is only known where the files are, so the choice is made
by graph ops when the pipeline runs, not in Python: in cluster mode the
Python of an `input_fn` runs on the chief, while its dataset ops run on the
pipeline's own host.

Example::

    ctx = tf.distribute.InputContext(num_input_pipelines=2, input_pipeline_id=1,
                                     num_replicas_in_sync=2)
    records = sharded_file_records("/data/part-*.csv", tf.data.TextLineDataset, ctx,
                                   caller="csv_input_fn")
"""
from typing import Callable, Optional

import tensorflow as tf

from tfe_estimator.validation import check_int

__all__ = [
    "WORKER_PLACEHOLDER",
    "pipeline_id",
    "num_pipelines",
    "resolve_pattern",
    "per_replica_batch_size",
    "matching_files",
    "shard_records",
    "sharded_file_records",
]

WORKER_PLACEHOLDER = "{worker}"


def pipeline_id(input_context: Optional[tf.distribute.InputContext]) -> int:
    """The input pipeline id, 0 without a context."""
    return input_context.input_pipeline_id if input_context is not None else 0


def num_pipelines(input_context: Optional[tf.distribute.InputContext]) -> int:
    """The number of input pipelines, 1 without a context."""
    return input_context.num_input_pipelines if input_context is not None else 1


def resolve_pattern(file_pattern: str, input_context: Optional[tf.distribute.InputContext]) -> str:
    """Replaces ``{worker}`` in `file_pattern` by the input pipeline id.

    Only that placeholder is replaced; other braces (e.g. glob ``[...]``) stay.
    """
    if not isinstance(file_pattern, str) or not file_pattern:
        raise TypeError(f"file_pattern must be a non-empty str, got {file_pattern!r}.")
    return file_pattern.replace(WORKER_PLACEHOLDER, str(pipeline_id(input_context)))


def per_replica_batch_size(
    batch_size: int, input_context: Optional[tf.distribute.InputContext], caller: str
) -> int:
    """The batch size of one replica; `batch_size` is the global batch size.

    Raises:
      ValueError: if `batch_size` is not a positive int or does not divide by
        the number of replicas in sync.
    """
    check_int(batch_size, f"{caller}: batch_size must be an int >= 1, got {batch_size!r}.", minimum=1)
    if input_context is None:
        return batch_size
    replicas = input_context.num_replicas_in_sync
    if batch_size % replicas:
        raise ValueError(
            f"{caller}: batch_size={batch_size} is the global batch size and must divide by the "
            f"number of replicas in sync ({replicas}). Fix: use a multiple of {replicas}, e.g. "
            f"{max(replicas, batch_size // replicas * replicas)}."
        )
    return input_context.get_per_replica_batch_size(batch_size)


def matching_files(pattern: str, caller: str) -> tf.Tensor:
    """The files matching `pattern`, by a graph op; fails at run time if none match.

    This is what `tf.data.Dataset.list_files(pattern, shuffle=False)` does,
    with a message that says which input_fn and pattern failed.
    """
    files = tf.io.matching_files(pattern)
    check = tf.debugging.assert_greater(
        tf.size(files), 0,
        message=(
            f"{caller}: no file matches file_pattern {pattern} . Check the path; in cluster "
            "mode the files must exist on the host of this input pipeline"
        ),
    )
    with tf.control_dependencies([check] if check is not None else []):
        return tf.identity(files)


def shard_records(
    dataset: tf.data.Dataset, input_context: Optional[tf.distribute.InputContext]
) -> tf.data.Dataset:
    """Record-level sharding: pipeline ``i`` of ``N`` keeps records ``i, i + N, ...``."""
    if num_pipelines(input_context) == 1:
        return dataset
    return dataset.shard(input_context.num_input_pipelines, input_context.input_pipeline_id)


def sharded_file_records(
    file_pattern: str,
    reader: Callable[[tf.Tensor], tf.data.Dataset],
    input_context: Optional[tf.distribute.InputContext],
    caller: str,
) -> tf.data.Dataset:
    """The records of this pipeline's shard of the files matching `file_pattern`.

    Args:
      file_pattern: a glob, possibly with ``{worker}``.
      reader: maps one file name (a string tensor) to a dataset of its records.
      input_context: the `tf.distribute.InputContext`, or None for one pipeline.
      caller: the public function's name, for messages.

    Returns:
      A dataset of records, in file order then record order.
    """
    pattern = resolve_pattern(file_pattern, input_context)
    files = matching_files(pattern, caller)
    count = num_pipelines(input_context)
    if count == 1 or WORKER_PLACEHOLDER in file_pattern:
        return tf.data.Dataset.from_tensor_slices(files).flat_map(reader)
    index = tf.constant(input_context.input_pipeline_id, tf.int64)
    by_file = tf.size(files, out_type=tf.int64) >= count

    def keep_file(position, _):
        return tf.logical_or(tf.logical_not(by_file), tf.equal(position % count, index))

    def keep_record(position, _):
        return tf.logical_or(by_file, tf.equal(position % count, index))

    records = (
        tf.data.Dataset.from_tensor_slices(files)
        .enumerate()
        .filter(keep_file)
        .flat_map(lambda _, name: reader(name))
    )
    return records.enumerate().filter(keep_record).map(lambda _, record: record)
