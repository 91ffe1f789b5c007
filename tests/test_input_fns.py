"""Tests of input_fns: sharding across pipelines, epochs, shuffling, errors.

Datasets are iterated eagerly with an explicit `tf.distribute.InputContext`,
as Estimator would pass one per input pipeline.
"""
import re
import time

import numpy as np
import pytest
import tensorflow as tf

import input_fns
import tfe_estimator
from model_fns import logistic_regression

NUM_RECORDS = 30


def context(num_pipelines, pipeline_id, replicas=None):
    return tf.distribute.InputContext(
        num_input_pipelines=num_pipelines, input_pipeline_id=pipeline_id,
        num_replicas_in_sync=replicas or num_pipelines)


def record_ids(dataset):
    """The `id` feature of every record of a (features, labels) dataset, in order."""
    return [int(i) for features, _ in dataset for i in features["id"].numpy().ravel()]


def write_csv(path, ids, header=True):
    lines = ["id,x,label"] if header else []
    lines += [f"{i},{i / 10},{i % 2}" for i in ids]
    path.write_text("\n".join(lines) + "\n")
    return path


def write_tfrecord(path, ids):
    with tf.io.TFRecordWriter(str(path)) as writer:
        for i in ids:
            example = tf.train.Example(features=tf.train.Features(feature={
                "id": tf.train.Feature(int64_list=tf.train.Int64List(value=[i])),
                "x": tf.train.Feature(float_list=tf.train.FloatList(value=[i / 10, -i / 10])),
                "label": tf.train.Feature(int64_list=tf.train.Int64List(value=[i % 2])),
            }))
            writer.write(example.SerializeToString())
    return path


TFRECORD_SPEC = {
    "id": tf.io.FixedLenFeature([], tf.int64),
    "x": tf.io.FixedLenFeature([2], tf.float32),
    "label": tf.io.FixedLenFeature([], tf.int64),
}


def split(ids, num_files):
    return [ids[k::num_files] for k in range(num_files)]


def csv_fn(pattern, **kwargs):
    kwargs.setdefault("column_defaults", {"id": 0, "label": 0})
    return input_fns.csv_input_fn(pattern, "label", **kwargs)


def tfrecord_fn(pattern, **kwargs):
    return input_fns.tfrecord_input_fn(pattern, TFRECORD_SPEC, "label", **kwargs)


FILE_FORMATS = {
    "csv": (write_csv, csv_fn, "csv"),
    "tfrecord": (write_tfrecord, tfrecord_fn, "tfrecord"),
}


@pytest.fixture(params=sorted(FILE_FORMATS))
def file_format(request):
    return FILE_FORMATS[request.param]


# Sharding: across N pipelines every record is read exactly once per epoch.

@pytest.mark.parametrize("num_files,num_pipelines", [(4, 2), (3, 3), (5, 2), (1, 3), (2, 3)])
def test_every_record_read_once_across_pipelines(tmp_path, file_format, num_files, num_pipelines):
    # 4/2, 3/3, 5/2: file-level sharding; 1/3, 2/3: fewer files than pipelines, record-level.
    write, make_fn, ext = file_format
    for k, ids in enumerate(split(list(range(NUM_RECORDS)), num_files)):
        write(tmp_path / f"part-{k}.{ext}", ids)
    input_fn = make_fn(str(tmp_path / f"part-*.{ext}"), batch_size=2 * num_pipelines,
                       num_epochs=1, shuffle=False)

    shards = [record_ids(input_fn(context(num_pipelines, i))) for i in range(num_pipelines)]

    assert sorted(sum(shards, [])) == list(range(NUM_RECORDS))
    assert all(shards), f"an input pipeline read nothing: {shards}"


def test_file_level_sharding_gives_each_pipeline_whole_files(tmp_path):
    files = split(list(range(NUM_RECORDS)), 4)
    for k, ids in enumerate(files):
        write_csv(tmp_path / f"part-{k}.csv", ids)
    input_fn = csv_fn(str(tmp_path / "*.csv"), batch_size=4, num_epochs=1, shuffle=False)

    shards = [record_ids(input_fn(context(2, i))) for i in range(2)]

    assert shards == [files[0] + files[2], files[1] + files[3]]


def test_record_level_sharding_interleaves_records(tmp_path):
    write_tfrecord(tmp_path / "only.tfrecord", range(NUM_RECORDS))
    input_fn = tfrecord_fn(str(tmp_path / "*.tfrecord"), batch_size=3, num_epochs=1, shuffle=False)

    shards = [record_ids(input_fn(context(3, i))) for i in range(3)]

    assert shards == [list(range(i, NUM_RECORDS, 3)) for i in range(3)]


def test_numpy_records_split_across_pipelines():
    ids = np.arange(NUM_RECORDS)
    input_fn = input_fns.numpy_input_fn({"id": ids}, ids % 2, batch_size=4, num_epochs=2, seed=3)

    shards = [record_ids(input_fn(context(2, i))) for i in range(2)]

    assert sorted(sum(shards, [])) == sorted(2 * list(range(NUM_RECORDS)))
    assert set(shards[0]).isdisjoint(shards[1])


def test_worker_placeholder_reads_only_that_workers_files(tmp_path, file_format):
    write, make_fn, ext = file_format
    for worker in range(2):
        (tmp_path / f"worker{worker}").mkdir()
        write(tmp_path / f"worker{worker}" / f"a.{ext}", range(worker * 100, worker * 100 + 5))
        write(tmp_path / f"worker{worker}" / f"b.{ext}", range(worker * 100 + 5, worker * 100 + 7))
    input_fn = make_fn(str(tmp_path / "worker{worker}" / f"*.{ext}"), batch_size=2,
                       num_epochs=1, shuffle=False)

    shards = [record_ids(input_fn(context(2, i))) for i in range(2)]
    no_context = record_ids(input_fn())

    assert shards == [list(range(0, 7)), list(range(100, 107))]
    assert no_context == list(range(0, 7))


# Batches, epochs, shuffling.

def test_batches_are_per_replica_and_global_without_context():
    ids = np.arange(NUM_RECORDS)
    input_fn = input_fns.numpy_input_fn({"id": ids}, ids, batch_size=8, num_epochs=1, shuffle=False)

    with_context = [len(labels) for _, labels in input_fn(context(1, 0, replicas=2))]
    without = [len(labels) for _, labels in input_fn()]

    assert with_context == [4] * 7 + [2]
    assert without == [8, 8, 8, 6]


def test_num_epochs_shuffle_and_seed_are_honoured(tmp_path):
    write_csv(tmp_path / "data.csv", range(NUM_RECORDS))
    pattern = str(tmp_path / "data.csv")

    ordered = record_ids(csv_fn(pattern, batch_size=5, num_epochs=3, shuffle=False)())
    seeded = [record_ids(csv_fn(pattern, batch_size=5, num_epochs=3, seed=7)()) for _ in range(2)]
    other_seed = record_ids(csv_fn(pattern, batch_size=5, num_epochs=3, seed=8)())

    assert ordered == 3 * list(range(NUM_RECORDS))
    assert seeded[0] == seeded[1], "the same seed must give the same order"
    assert seeded[0] != other_seed and seeded[0] != ordered
    epochs = [seeded[0][k * NUM_RECORDS:(k + 1) * NUM_RECORDS] for k in range(3)]
    assert all(sorted(epoch) == list(range(NUM_RECORDS)) for epoch in epochs), "epochs must not mix"
    assert epochs[0] != epochs[1], "each epoch is reshuffled"


def test_forever_without_num_epochs():
    ids = np.arange(6)
    dataset = input_fns.numpy_input_fn({"id": ids}, ids, batch_size=4)()

    assert len(list(dataset.take(10))) == 10


# CSV columns and header.

def test_csv_header_names_the_columns_and_types_follow_defaults(tmp_path):
    write_csv(tmp_path / "a.csv", [1, 2])
    write_csv(tmp_path / "b.csv", [3])

    features, labels = next(iter(input_fns.csv_input_fn(
        str(tmp_path / "*.csv"), "label", batch_size=3, column_defaults={"id": 0, "label": 0},
        num_epochs=1, shuffle=False)()))

    assert sorted(features) == ["id", "x"]
    assert features["id"].numpy().tolist() == [1, 2, 3]
    np.testing.assert_allclose(features["x"].numpy(), [0.1, 0.2, 0.3], rtol=1e-6)
    assert labels.dtype == tf.int32 and labels.numpy().tolist() == [1, 0, 1]


def test_csv_column_names_read_files_with_or_without_header(tmp_path):
    write_csv(tmp_path / "with.csv", [1, 2], header=True)
    write_csv(tmp_path / "without.csv", [3, 4], header=False)

    ids = record_ids(csv_fn(str(tmp_path / "*.csv"), batch_size=4, column_names=["id", "x", "label"],
                            num_epochs=1, shuffle=False)())

    assert ids == [1, 2, 3, 4]


# Clear errors.

def test_csv_missing_label_column_names_it_and_the_columns(tmp_path):
    write_csv(tmp_path / "a.csv", [1])

    with pytest.raises(ValueError, match=r"label_key 'target' is not a column.*\['id', 'x', 'label'\]"):
        input_fns.csv_input_fn(str(tmp_path / "a.csv"), "target", batch_size=2)()
    with pytest.raises(ValueError, match=r"label_key 'target' is not a column.*\['a', 'b'\]"):
        input_fns.csv_input_fn("unused", "target", batch_size=2, column_names=["a", "b"])


def test_tfrecord_missing_label_names_it_and_the_features():
    with pytest.raises(ValueError, match=r"label_key 'target' is not in feature_spec.*\['id', 'label', 'x'\]"):
        input_fns.tfrecord_input_fn("unused", TFRECORD_SPEC, "target", batch_size=2)


def test_csv_header_mismatch_fails_naming_the_file(tmp_path):
    write_csv(tmp_path / "a.csv", [1])
    (tmp_path / "b.csv").write_text("id,label,x\n2,0,0.2\n")

    # Checked when the input_fn is called, in Python, before any dataset runs.
    with pytest.raises(ValueError, match=r"first line of .*b\.csv does not match the header row") as info:
        csv_fn(str(tmp_path / "*.csv"), batch_size=2, num_epochs=1, shuffle=False)()
    assert "expected: id,x,label" in str(info.value) and "found:    id,label,x" in str(info.value)


@pytest.mark.parametrize("first_line", ["id,x", "id,label,x", "1,0.1"])
def test_csv_first_line_not_matching_column_names_fails_at_once(tmp_path, first_line):
    # Prepare: a header row lacking a column, one with the columns reordered, a record with too few fields.
    (tmp_path / "good.csv").write_text("id,x,label\n1,0.1,0\n")
    (tmp_path / "bad.csv").write_text(f"{first_line}\n2,0.2,1\n")
    fn = csv_fn(str(tmp_path / "*.csv"), batch_size=2, column_names=["id", "x", "label"])
    start = time.monotonic()
    # Execute
    with pytest.raises(ValueError) as info:
        fn()
    # Assert: the file, both lines and the fix, within seconds.
    text = str(info.value)
    assert f"the first line of {tmp_path / 'bad.csv'} does not match column_names" in text
    assert "expected: id,x,label" in text and f"found:    {first_line}" in text and "Fix: give column_names" in text
    assert time.monotonic() - start < 5


def test_no_matching_files_names_the_pattern(tmp_path, file_format):
    _, make_fn, ext = file_format
    pattern = str(tmp_path / f"missing-*.{ext}")
    kwargs = {"column_names": ["id", "x", "label"]} if ext == "csv" else {}

    with pytest.raises(tf.errors.InvalidArgumentError, match=re.escape(f"no file matches file_pattern {pattern} .")):
        list(make_fn(pattern, batch_size=2, **kwargs)(context(2, 1)))


def test_csv_header_mode_without_files_explains_column_names(tmp_path):
    with pytest.raises(ValueError, match=r"no file matches it on this machine.*pass column_names"):
        csv_fn(str(tmp_path / "none-*.csv"), batch_size=2)()


def test_batch_size_must_divide_by_replicas():
    input_fn = input_fns.numpy_input_fn({"id": np.arange(10)}, np.arange(10), batch_size=5)

    with pytest.raises(ValueError, match=r"batch_size=5 .* number of replicas in sync \(2\)"):
        input_fn(context(1, 0, replicas=2))


@pytest.mark.parametrize("kwargs,match", [
    ({"num_epochs": 0}, "num_epochs must be None"),
    ({"batch_size": 0}, "batch_size must be an int >= 1"),
])
def test_bad_epochs_and_batch_size(kwargs, match):
    args = {"batch_size": 4, **kwargs}
    with pytest.raises(ValueError, match=match):
        input_fns.numpy_input_fn({"id": np.arange(4)}, np.arange(4), **args)


def test_numpy_length_mismatch():
    with pytest.raises(ValueError, match="same number of records"):
        input_fns.numpy_input_fn({"id": np.arange(4)}, np.arange(5), batch_size=2)


# With an Estimator and secure aggregation.

@pytest.mark.slow
def test_csv_input_fn_trains_under_secure_aggregation(tmp_path):
    # A linearly separable problem (label = a + b > 0) in two CSV files with headers.
    rng = np.random.RandomState(0)
    x = rng.randn(400, 2)
    y = (x.sum(axis=1) > 0).astype(int)
    for k in range(2):
        rows = ["a,b,label"] + [f"{x[i, 0]},{x[i, 1]},{y[i]}" for i in range(k, 400, 2)]
        (tmp_path / f"part-{k}.csv").write_text("\n".join(rows) + "\n")
    columns = [tf.feature_column.numeric_column("a"), tf.feature_column.numeric_column("b")]
    est = tf.estimator.Estimator(
        logistic_regression.model_fn, params={"feature_columns": columns},
        config=tfe_estimator.TfeRunConfig(model_dir=str(tmp_path / "model"), num_replicas=2))

    est.train(input_fns.csv_input_fn(str(tmp_path / "part-*.csv"), "label", batch_size=32,
                                     column_defaults={"label": 0}, seed=0), steps=60)
    weights = est.get_variable_value("logits/kernel").ravel()

    # Both weights grow positive and about equal, as the separating line a + b = 0 says.
    assert weights.min() > 0.5, weights
    assert abs(weights[0] - weights[1]) < 0.5 * weights.max(), weights


@pytest.mark.slow
def test_no_matching_files_fails_secure_training_naming_the_pattern(tmp_path):
    pattern = str(tmp_path / "missing-*.csv")
    est = tf.estimator.Estimator(
        logistic_regression.model_fn,
        params={"feature_columns": [tf.feature_column.numeric_column("a")]},
        config=tfe_estimator.TfeRunConfig(model_dir=str(tmp_path / "model"), num_replicas=2))

    with pytest.raises(tf.errors.InvalidArgumentError, match=re.escape(f"no file matches file_pattern {pattern} .")):
        est.train(input_fns.csv_input_fn(pattern, "label", batch_size=4, column_names=["a", "label"]), steps=1)
