"""Evaluation with fewer batches than replicas is correct, never silently zero.

In graph mode MirroredStrategy's input iterator (TF 2.9 and 2.15,
`input_lib_v1.InputFunctionIterator`) has partial-batch support switched off:
when one replica gets a batch and another gets end-of-input, the step fails
with OutOfRange after some of the first replica's metric updates may already
have run. One batch of 512 rows on 2 replicas then evaluates to the right
numbers or to ``loss=0.0, label/mean=0.0`` depending on a race (plaintext
MirroredStrategy too: 1 of 8 runs here). With partial batches enabled
(`_enable_get_next_as_optional`), a replica without data gets an empty batch
and the metrics cover every row exactly.

Estimator's ``loss`` key is the mean of the batch losses (plaintext: one per
batch). Under a strategy Estimator averages the replicas' losses per step, so
a replica with an empty batch counted as a batch of loss 0: one batch on two
replicas reported half the loss, three batches 3/4 of it (issue 35). Sparse
feature columns crashed on the empty batch ("reshape cannot infer the missing
input size for an empty tensor"). `tfe_estimator.distribute.distributed_eval`
mends both; here every metric is compared with Estimator's own evaluation of
the same checkpoint without a strategy.

Every metric is also checked against NumPy on the final weights, for
`TfeRunConfig` and for the plaintext twin alike (issue 41: both reported half
of `model_to_estimator`'s loss, whose Keras model scales it by
1 / num_replicas_in_sync, and the twin a wrong ``accuracy_baseline``), so a bug
the two share cannot hide behind twin == ours.
"""
import numpy as np
import pytest
import tensorflow as tf

from model_fns import keras_optimizers  # tf.keras.optimizers.legacy where Estimator needs it (TF >= 2.11)

import tfe_estimator
from tfe_estimator import TfeRunConfig

ROWS = 512


@pytest.fixture
def data():
    rng = np.random.RandomState(0)
    x = rng.randn(ROWS, 3).astype(np.float32)
    return x, (x @ np.array([1.5, -2.0, 0.5], np.float32) + 0.3).astype(np.float32)


@pytest.mark.slow
@pytest.mark.parametrize("batches", [1, 3])
def test_evaluate_with_fewer_or_uneven_batches_than_replicas_covers_every_row(batches, data, tmp_path):
    x, y = data
    cols = [tf.feature_column.numeric_column("x", shape=[3])]
    est = tf.estimator.LinearRegressor(cols, config=TfeRunConfig(model_dir=str(tmp_path), num_replicas=2),
                                       optimizer=lambda: keras_optimizers().SGD(0.05))
    est.train(lambda: tf.data.Dataset.from_tensor_slices(({"x": x}, y)).repeat().batch(32), steps=10)
    w = est.get_variable_value("linear/linear_model/x/weights").ravel()
    b = est.get_variable_value("linear/linear_model/bias_weights")
    expected_mse = float(np.mean((x @ w + b - y) ** 2))
    for _ in range(4):  # the failure was a race: repeat
        metrics = est.evaluate(lambda: tf.data.Dataset.from_tensor_slices(({"x": x}, y)).batch(-(-ROWS // batches)))
        assert metrics["average_loss"] == pytest.approx(expected_mse, rel=1e-4)
        assert metrics["label/mean"] == pytest.approx(float(y.mean()), abs=1e-4)
        # the plaintext `loss`: the mean over batches of each batch's mean squared error
        size = -(-ROWS // batches)
        batch_mse = [np.mean((x[i:i + size] @ w + b - y[i:i + size]) ** 2) for i in range(0, ROWS, size)]
        assert metrics["loss"] == pytest.approx(float(np.mean(batch_mse)), rel=1e-4)


def _sparse_data(rows, seed):
    rng = np.random.RandomState(seed)
    sex = rng.choice(["male", "female"], rows)
    age = rng.uniform(1, 80, rows).astype(np.float32)
    y = ((sex == "female") ^ (rng.rand(rows) < 0.2)).astype(np.int64)
    return {"sex": sex, "town": rng.choice(["S", "C", "Q"], rows), "age": age}, y


def _linear_v2(config):
    sex = tf.feature_column.categorical_column_with_vocabulary_list("sex", ["male", "female"])
    town = tf.feature_column.categorical_column_with_hash_bucket("town", 8)
    age = tf.feature_column.bucketized_column(tf.feature_column.numeric_column("age"), [18, 30, 50])
    cols = [sex, town, age, tf.feature_column.crossed_column([age, "sex"], hash_bucket_size=20)]
    return tf.estimator.LinearClassifier(cols, config=config)


def _dnn_v1(config):
    # Estimator's v1 head computes accuracy_baseline on each replica (a PerReplica it could not fetch).
    sex = tf.feature_column.categorical_column_with_vocabulary_list("sex", ["male", "female"])
    town = tf.feature_column.categorical_column_with_hash_bucket("town", 8)
    age = tf.feature_column.bucketized_column(tf.feature_column.numeric_column("age"), [18, 30, 50])
    cols = [tf.feature_column.embedding_column(sex, 3), tf.feature_column.indicator_column(town), age,
            tf.feature_column.indicator_column(tf.feature_column.crossed_column([age, "sex"], hash_bucket_size=20))]
    return tf.compat.v1.estimator.DNNClassifier([8], cols, config=config)


@pytest.mark.slow
@pytest.mark.parametrize("make,batches", [
    # 1 batch (replica 1 empty); 3 uneven batches (replica 1 empty in the second step).
    (_linear_v2, (70, 30)),
    (_dnn_v1, (30,)),
], ids=["linear-v2", "dnn-v1"])
def test_sparse_columns_evaluate_every_batch_count_to_the_plaintext_metrics_loss_included(make, batches, tmp_path):
    # Prepare: a classifier on categorical, hashed, bucketized and crossed columns, trained secure.
    features, y = _sparse_data(70, 0)
    secure = make(TfeRunConfig(model_dir=str(tmp_path), num_replicas=2))
    secure.train(lambda: tf.data.Dataset.from_tensor_slices((features, y)).repeat().batch(16), steps=3)
    plain = make(tf.estimator.RunConfig(model_dir=str(tmp_path)))
    for batch in batches:
        def input_fn(batch=batch):
            return tf.data.Dataset.from_tensor_slices((features, y)).batch(batch)

        # Execute
        got, want = secure.evaluate(input_fn, name=f"b{batch}"), plain.evaluate(input_fn, name=f"p{batch}")
        # Assert: every metric, `loss` included, is Estimator's own without a strategy.
        assert got.keys() == want.keys()
        for key in want:
            assert got[key] == pytest.approx(want[key], rel=1e-5, abs=1e-7), (batch, key, got[key], want[key])


def test_the_empty_safe_sparse_reshape_infers_minus_one_for_an_empty_batch_and_is_the_op_otherwise():
    from tensorflow.python.ops import sparse_ops  # pylint: disable=import-outside-toplevel

    from tfe_estimator.distribute import distributed_eval  # pylint: disable=import-outside-toplevel

    empty = tf.SparseTensor(tf.zeros([0, 2], tf.int64), tf.zeros([0], tf.int64), [0, 3])
    full = tf.SparseTensor([[0, 1], [2, 0]], tf.constant([4, 5], tf.int64), [3, 2])
    with pytest.raises(tf.errors.InvalidArgumentError, match="cannot infer"):
        sparse_ops.sparse_reshape(empty, [tf.shape(empty)[0], -1])  # TensorFlow's own op
    with distributed_eval.empty_safe_sparse_reshape():
        reshaped = sparse_ops.sparse_reshape(empty, [tf.shape(empty)[0], -1])
        same = sparse_ops.sparse_reshape(full, [-1, 1])
    assert reshaped.dense_shape.numpy().tolist() == [0, 3]
    assert same.dense_shape.numpy().tolist() == [6, 1] and same.indices.numpy().tolist() == [[1, 0], [4, 0]]
    assert sparse_ops.sparse_reshape is distributed_eval._ORIGINAL_SPARSE_RESHAPE  # restored
    # Which replicas have rows: any tensor's batch dimension, dense or sparse.
    assert bool(distributed_eval.batch_has_rows(({"a": tf.zeros([0, 2]), "s": empty}, tf.zeros([0]))).numpy()) is False
    assert bool(distributed_eval.batch_has_rows(({"s": full}, None)).numpy()) is True
    assert distributed_eval.batch_has_rows(({"scalar": tf.constant(1.0)}, None)) is None


# ------------------------------------------------- every metric against NumPy, ours and the plaintext twin

TWIN_DEVICES = [f"/job:localhost/replica:0/task:0/device:CPU:{i}" for i in range(2)]


def _config(kind, model_dir):
    """Two replicas, secure (TfeRunConfig) or the plaintext twin, on one model_dir."""
    if kind == "tfe":
        return TfeRunConfig(model_dir=model_dir, num_replicas=2, tf_random_seed=3)
    return tfe_estimator.plaintext_twin_config(TWIN_DEVICES, model_dir=model_dir, tf_random_seed=3)


def _batch_losses(per_row, size):
    """Estimator's `loss` key without a strategy: the mean over batches of each batch's mean loss."""
    return float(np.mean([per_row[i:i + size].mean() for i in range(0, len(per_row), size)]))


def _keras_estimator(config):
    tf.keras.utils.set_random_seed(0)
    model = tf.keras.Sequential([tf.keras.layers.Dense(1, input_shape=(3,))])
    model.compile(optimizer=keras_optimizers().SGD(0.05), loss="mse")  # model_to_estimator needs the legacy one
    est = tf.keras.estimator.model_to_estimator(keras_model=model, config=config)
    weights = ("layer_with_weights-0/kernel/.ATTRIBUTES/VARIABLE_VALUE",
               "layer_with_weights-0/bias/.ATTRIBUTES/VARIABLE_VALUE")
    return est, model.input_names[0], weights


def _averaged_loss_model_fn(features, labels, mode):
    # TensorFlow 2's convention: a per-replica loss scaled by 1 / num_replicas_in_sync for a SUM.
    prediction = tf.compat.v1.layers.dense(features["x"], 1, name="d")
    loss = tf.nn.compute_average_loss(tf.reduce_sum(tf.square(prediction - labels), axis=1))
    train_op = tf.compat.v1.train.GradientDescentOptimizer(0.05).minimize(
        loss, global_step=tf.compat.v1.train.get_global_step())
    return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op, eval_metric_ops={
        "mse": tf.compat.v1.metrics.mean_squared_error(labels, prediction)})


def _custom_estimator(config):
    return tf.estimator.Estimator(_averaged_loss_model_fn, config=config), "x", ("d/kernel", "d/bias")


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["tfe", "twin"])
@pytest.mark.parametrize("make", [_keras_estimator, _custom_estimator], ids=["model_to_estimator", "custom"])
def test_a_loss_scaled_for_the_replicas_evaluates_to_the_numpy_mean_loss(make, kind, data, tmp_path):
    # Prepare: Keras scales its loss by 1 / num_replicas_in_sync in model_to_estimator's model_fn, as does
    # tf.nn.compute_average_loss; Estimator's evaluation averaged those over 2 replicas: half the loss.
    x, y = data[0], data[1][:, None]
    est, name, weights = make(_config(kind, str(tmp_path)))
    est.train(lambda: tf.data.Dataset.from_tensor_slices(({name: x}, y)).repeat().batch(32), steps=3)
    w, b = (est.get_variable_value(v) for v in weights)
    squared = ((x @ w + b - y) ** 2).ravel()
    for size in (ROWS, 200):  # one batch (replica 1 empty); 3 uneven batches (200, 200, 112)
        # Execute
        metrics = est.evaluate(lambda size=size: tf.data.Dataset.from_tensor_slices(({name: x}, y)).batch(size),
                               name=str(size))
        # Assert: the NumPy loss of the final weights (one batch: the true mean loss).
        assert metrics["loss"] == pytest.approx(_batch_losses(squared, size), rel=1e-5), (size, metrics)
        assert metrics.get("mse", squared.mean()) == pytest.approx(float(squared.mean()), rel=1e-5)
    assert not np.allclose(squared.mean(), _batch_losses(squared, 200), rtol=1e-4)  # the two kinds of mean differ


BINARY_BATCHES = (35, 30)  # even batches (one per replica); uneven (30, 30, 10: replica 1 empty at step 2)


@pytest.fixture(scope="module")
def binary_classifier(tmp_path_factory):
    """A LinearClassifier trained 3 steps on 2 secure replicas, its evaluation rows (70) and the metrics
    of a single-replica evaluation (a plain RunConfig) of them in each batch size."""
    rng = np.random.RandomState(0)
    x = rng.randn(70, 3).astype(np.float32)
    y = ((x @ np.array([1.5, -2.0, 0.5]) + 0.8 + rng.randn(70)) > 0).astype(np.int64)  # 42 of 70 positive
    model_dir = str(tmp_path_factory.mktemp("binary"))
    tf.compat.v1.reset_default_graph()
    _linear_classifier(_config("tfe", model_dir)).train(
        lambda: tf.data.Dataset.from_tensor_slices(({"x": x}, y)).repeat().batch(16), steps=3)
    alone = _linear_classifier(tf.estimator.RunConfig(model_dir=model_dir))
    return model_dir, x, y, {size: alone.evaluate(_batches(x, y, size), name=f"one{size}") for size in BINARY_BATCHES}


def _batches(x, y, size):
    return lambda: tf.data.Dataset.from_tensor_slices(({"x": x}, y)).batch(size)


def _linear_classifier(config):
    return tf.estimator.LinearClassifier([tf.feature_column.numeric_column("x", shape=[3])], config=config,
                                         optimizer=lambda: keras_optimizers().SGD(0.1))


def _numpy_binary_metrics(est, x, y, size):
    """The binary head's metrics, computed with NumPy from the checkpoint's weights."""
    w = est.get_variable_value("linear/linear_model/x/weights").ravel()
    b = est.get_variable_value("linear/linear_model/bias_weights")[0]
    logits = (x @ w + b).astype(np.float64)
    p = 1 / (1 + np.exp(-logits))
    predicted = p > 0.5
    cross_entropy = np.maximum(logits, 0) - logits * y + np.log1p(np.exp(-np.abs(logits)))
    m = y.mean()
    return {"accuracy": np.mean(predicted == y), "accuracy_baseline": max(m, 1 - m), "label/mean": m,
            "prediction/mean": p.mean(), "average_loss": cross_entropy.mean(),
            "precision": np.sum(predicted & (y == 1)) / np.sum(predicted),
            "recall": np.sum(predicted & (y == 1)) / np.sum(y == 1),
            "loss": _batch_losses(cross_entropy, size)}


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["tfe", "twin"])
def test_a_binary_classifier_evaluates_to_numpy_and_to_one_replica_every_metric(kind, binary_classifier):
    model_dir, x, y, alone = binary_classifier
    ours = _linear_classifier(_config(kind, model_dir))
    for size in BINARY_BATCHES:
        # Execute
        got, want = ours.evaluate(_batches(x, y, size), name=f"{kind}{size}"), alone[size]
        # Assert: NumPy from the final weights, and every key (auc included) as one replica evaluates.
        for key, value in _numpy_binary_metrics(ours, x, y, size).items():
            assert got[key] == pytest.approx(value, rel=1e-5), (kind, size, key, got[key], value)
        assert got.keys() == want.keys()
        for key in want:
            assert got[key] == pytest.approx(want[key], rel=1e-5, abs=1e-7), (kind, size, key, got[key], want[key])


def _strategy(kind):
    from tfe_estimator.owner.estimator import EstimatorServiceStrategy  # pylint: disable=import-outside-toplevel
    from tfe_estimator.owner.service_strategy import ServiceBinding  # pylint: disable=import-outside-toplevel

    if kind == "tfe":
        return TfeRunConfig(num_replicas=2).eval_distribute, 2
    if kind == "twin":
        return tfe_estimator.plaintext_twin_config(TWIN_DEVICES).eval_distribute, 2
    binding = ServiceBinding(addresses=("localhost:1", "localhost:2"), tls_dir="/nonexistent", owner="chief:0",
                             owners=("chief:0", "worker:0", "worker:1"))
    return EstimatorServiceStrategy(binding, num_replicas=2, evaluation=True), 6  # 2 local replicas x 3 owners


@pytest.mark.parametrize("kind", ["tfe", "twin", "service"])
def test_a_replica_building_an_evaluation_model_fn_sees_one_replica_and_everything_else_all(kind):
    # Prepare: what a model_fn reads to scale its loss for a sum over replicas (Keras, tf.nn.compute_average_loss).
    seen = {}

    def model_fn(features, labels, mode, config):
        del labels, config
        seen.setdefault(mode, set()).add((tf.distribute.get_strategy().num_replicas_in_sync,
                                          tf.distribute.get_replica_context().num_replicas_in_sync))
        return tf.reduce_sum(features)

    with tf.Graph().as_default():
        strategy, replicas = _strategy(kind)
        with strategy.scope():
            # Execute: the calls Estimator makes, in training and evaluation.
            for mode in (tf.estimator.ModeKeys.TRAIN, tf.estimator.ModeKeys.EVAL, tf.estimator.ModeKeys.PREDICT):
                strategy.extended.call_for_each_replica(model_fn, args=(tf.ones([2, 1]), None, mode, None))
        # Assert: alone only while building an evaluation; the strategy itself (merge calls, reductions) unchanged.
        assert seen == {"train": {(replicas, replicas)}, "eval": {(1, 1)}, "infer": {(replicas, replicas)}}
        assert strategy.num_replicas_in_sync == replicas
