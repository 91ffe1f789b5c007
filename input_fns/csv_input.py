"""`csv_input_fn`: an input_fn over CSV files.

Records are read by dataset ops only (`tf.io.matching_files`,
`tf.data.TextLineDataset`, `tf.io.decode_csv`), so in cluster mode each input
pipeline reads files on its own host; see `input_fns.sharding` for which files
or records each pipeline reads.

Column names, and the header row
--------------------------------
The names of the columns are the keys of the features dict, which Python needs
when the graph is built; a header row is data, which only the dataset ops read
when the graph runs. The two are reconciled like this:

* ``column_names=[...]`` (recommended; required in cluster mode when the files
  exist only on the workers). A file's first line that equals
  ``",".join(column_names)`` is a header and is skipped, so files with and
  without a header row both work.
* ``column_names=None``: the names come from the header row. This is the one
  documented exception to "no Python file access": when the input_fn is
  called, the first line of the first file matching the (resolved) pattern is
  read with `tf.io.gfile` on the machine building the graph (the chief). The
  records are still read only by dataset ops, and every file's first line is
  checked, when it is read, to equal that header, so files whose columns
  differ fail loudly instead of being parsed wrongly.

Either way, when the input_fn is called, the first line of every file matching
the pattern on this machine is read with `tf.io.gfile`, so a header row for
other columns, or a first record with the wrong number of fields, fails at once
with a `ValueError` naming the file, the expected and the found line and the
fix (not minutes later inside `DecodeCSV`).

Example::

    input_fn = csv_input_fn("/data/train-*.csv", label_key="label", batch_size=64,
                            column_names=["x1", "x2", "label"],
                            column_defaults={"label": 0})
    est.train(input_fn, steps=100)
"""
import csv
from typing import Callable, Mapping, Optional, Sequence, Union

import tensorflow as tf

from input_fns import _pipeline, sharding

__all__ = ["csv_input_fn"]

_CALLER = "csv_input_fn"

Defaults = Union[Sequence[object], Mapping[str, object], None]


def csv_input_fn(
    file_pattern: str,
    label_key: str,
    batch_size: int,
    column_names: Optional[Sequence[str]] = None,
    column_defaults: Defaults = None,
    num_epochs: Optional[int] = None,
    shuffle: bool = True,
    seed: Optional[int] = None,
) -> Callable[..., tf.data.Dataset]:
    """Returns `input_fn(input_context=None)` yielding `(features, labels)` batches.

    Args:
      file_pattern: a glob of CSV files; ``{worker}`` is replaced by the input
        pipeline id (0 without an `InputContext`).
      label_key: the column that is the label.
      batch_size: the global batch size.
      column_names: the names of the columns, in file order; None reads them
        from the header row (see the module docstring).
      column_defaults: per column, a default for empty fields (e.g. ``0.0``,
        ``0``, ``""``; its type is the column's type) or a `tf.DType` for a
        required field of that type; as a list aligned with the columns or a
        dict by name. Columns not given are required float32.
      num_epochs: how often to go through the data; None repeats forever.
      shuffle: whether to shuffle records (in a buffer of
        `input_fns._pipeline.SHUFFLE_BUFFER_SIZE`, every epoch).
      seed: the shuffle seed.

    Raises:
      ValueError: if `label_key` is not a column (naming the columns), for
        bad `column_names`/`column_defaults`, `batch_size` or `num_epochs`,
        or, with ``column_names=None``, if no file to read the header from
        matches on this machine; when the input_fn is called, if a matching
        file's first line is a header row for other columns or has the wrong
        number of fields (naming the file, both lines and the fix). No matching file at run time is an
        `InvalidArgumentError` naming the pattern.
    """
    _pipeline.check_epochs(num_epochs, _CALLER)
    sharding.per_replica_batch_size(batch_size, None, _CALLER)
    if column_names is not None:
        column_names = _check_names(column_names, label_key, "column_names")
        _record_defaults(column_names, column_defaults)

    def input_fn(input_context: Optional[tf.distribute.InputContext] = None) -> tf.data.Dataset:
        per_replica = sharding.per_replica_batch_size(batch_size, input_context, _CALLER)
        pattern = sharding.resolve_pattern(file_pattern, input_context)
        if column_names is None:
            header = _read_header(pattern)
            names = _check_names(next(csv.reader([header])), label_key, "the header row")
        else:
            header, names = ",".join(column_names), column_names
        _check_first_lines(pattern, header, names, require_header=column_names is None)
        defaults = _record_defaults(names, column_defaults)

        def read_file(filename):
            return _data_lines(filename, header, require_header=column_names is None)

        def parse_batch(lines):
            features = dict(zip(names, tf.io.decode_csv(lines, defaults)))
            return features, features.pop(label_key)

        lines = sharding.sharded_file_records(file_pattern, read_file, input_context, _CALLER)
        return _pipeline.shuffle_repeat_batch(
            lines, per_replica, num_epochs, shuffle, seed, parse_batch=parse_batch)

    return input_fn


def _check_names(names, label_key, source):
    if isinstance(names, str) or not names or not all(isinstance(n, str) and n for n in names):
        raise ValueError(f"{_CALLER}: {source} must be a non-empty list of column names, got {names!r}.")
    names = [n.strip() for n in names]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise ValueError(f"{_CALLER}: {source} names columns {duplicates} more than once: {names}.")
    if label_key not in names:
        raise ValueError(
            f"{_CALLER}: label_key {label_key!r} is not a column; the columns (from {source}) are "
            f"{names}. Fix: pass one of them as label_key."
        )
    return names


def _record_defaults(names, column_defaults):
    """`tf.io.decode_csv` record defaults for `names` from the user's defaults."""
    if column_defaults is None:
        column_defaults = {}
    if isinstance(column_defaults, Mapping):
        unknown = sorted(set(column_defaults) - set(names))
        if unknown:
            raise ValueError(
                f"{_CALLER}: column_defaults names columns {unknown} that do not exist; the columns "
                f"are {names}."
            )
        column_defaults = [column_defaults.get(name, tf.float32) for name in names]
    elif isinstance(column_defaults, str) or len(column_defaults) != len(names):
        raise ValueError(
            f"{_CALLER}: column_defaults must be a dict by column name or a list with one entry "
            f"per column ({len(names)}: {names}); got {column_defaults!r}."
        )
    return [tf.constant([], d) if isinstance(d, tf.dtypes.DType) else [d] for d in column_defaults]


def _read_header(pattern):
    """The first line of the first file matching `pattern`, read in Python (see module doc)."""
    files = sorted(tf.io.gfile.glob(pattern))
    if not files:
        raise ValueError(
            f"{_CALLER}: column_names is None, so the column names come from the header row of "
            f"the first file matching '{pattern}', but no file matches it on this machine (the one "
            "building the graph). Fix: check the path, or pass column_names=[...] (needed in "
            "cluster mode when the files exist only on the workers; a header row equal to them "
            "is skipped)."
        )
    with tf.io.gfile.GFile(files[0], "r") as handle:
        header = handle.readline().strip()
    if not header:
        raise ValueError(f"{_CALLER}: the first line of {files[0]} is empty; expected a header row.")
    return header


def _check_first_lines(pattern, header, names, require_header):
    """Fails now, naming the file, if a local file's first line cannot be `header` or a record of `names`.

    Reads the first line of every file matching `pattern` on this machine with `tf.io.gfile` (none in
    cluster mode when the files exist only on the workers; their pipelines still check at run time).
    A first line that is not `header` must have one field per column and share no field with the
    column names (else it is a header row for other columns).
    """
    source = "the header row of the first matching file" if require_header else "column_names"
    for filename in sorted(tf.io.gfile.glob(pattern)):
        with tf.io.gfile.GFile(filename, "r") as handle:
            first = handle.readline().strip()
        if not first or first == header:
            continue
        fields = [f.strip() for f in next(csv.reader([first]))]
        if require_header or len(fields) != len(names) or set(fields) & set(names):
            raise ValueError(
                f"{_CALLER}: the first line of {filename} does not match {source}.\n"
                f"  expected: {header}\n"
                f"  found:    {first}\n"
                f"({len(fields)} fields, {len(names)} columns.) Fix: give column_names=[...] the file's columns in "
                "file order (a first line equal to them is skipped as the header row), or column_names=None to "
                "take the names from the header row; or fix the file."
            )


def _data_lines(filename, header, require_header):
    """The non-empty lines of one file without its header row.

    A first line equal to `header` is dropped. With `require_header`, a first
    line that differs fails the pipeline with the file name.
    """
    def keep(position, line):
        line = tf.strings.strip(line)
        is_header = tf.logical_and(tf.equal(position, 0), tf.equal(line, header))
        checks = []
        if require_header:
            checks.append(tf.debugging.Assert(
                tf.logical_or(position > 0, is_header),
                [f"{_CALLER}: the first line of", filename,
                 "is not the header row of the first matching file:", header, "but:", line],
                summarize=1))
        with tf.control_dependencies(checks):
            return tf.logical_and(tf.logical_not(is_header), tf.strings.length(line) > 0)

    return tf.data.TextLineDataset(filename).enumerate().filter(keep).map(lambda _, line: line)
