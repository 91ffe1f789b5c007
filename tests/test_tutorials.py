"""TensorFlow's Estimator tutorials, run as written with only the RunConfig line changed.

Each tutorial is written once, as a function of its `config` (the one line a
user changes), in the shape of TensorFlow's own:

- the premade-Estimator tutorial: `DNNClassifier` on iris (sklearn's copy), a
  30-row test set in one batch of the tutorial's 256 (one batch on two
  replicas: the second replica's batch is empty);
- the linear tutorial: `LinearClassifier` on titanic-like data made here, with
  categorical, bucketized and crossed columns (sparse features), evaluated in
  batches of 32 over 70 rows (three batches: two uneven steps);
- the Estimator guide's premade model: `LinearClassifier` on a vocabulary
  list, a hash bucket and a number, evaluated for a number of `steps` of the
  repeated training input (a step reads a batch per replica, as under
  TensorFlow's MirroredStrategy: the plaintext reference reads as many).

The secure run is `TfeRunConfig` (two local replicas). The plaintext twin
trains on the same replicas summed in the clear (`plaintext_twin_config`, so
both models are the same to float32 rounding) and evaluates as Estimator does
without a strategy, i.e. the metrics a plaintext user reads. Every metric,
Estimator's ``loss`` key included, must agree to 1e-5 relative: a replica
whose batch is empty once halved ``loss`` (issue 35) and crashed the sparse
columns' reshape.

In service mode (one multi-process test) two owners run the linear tutorial
under `tfe-estimator launch --cluster-mode service`
(tests/scripts/service_tutorial.py), each on its own rows; the twin's replica
r reads owner r's batches and evaluates the union of the owners' evaluation
rows, which is what federated evaluation reports to every owner. The same launch
then trains a newcomer's custom model_fn with batch normalization
(`batch_norm_custom`, under `train_and_evaluate`, checkpoints every 10 steps):
the owners' checkpoints, moving statistics included, are bit-identical and
equal to the twin's, and so are the metrics (issue 41: it crashed at the first
checkpoint save). Then a Keras model through `model_to_estimator`
(`keras_to_estimator`): the owners' checkpoints are bit-identical and equal to
the twin's, and the evaluation ``loss`` equals the mean squared error NumPy
computes from the final weights over the union of the evaluation rows (issue 41:
it was half of it on 2 replicas, the twin's too).
"""
import io
import json
import os
import sys

import numpy as np
import pytest
import tensorflow as tf

from model_fns import keras_optimizers  # tf.keras.optimizers.legacy where Estimator needs it (TF >= 2.11)
from launch_log import report

import tfe_estimator

pytestmark = pytest.mark.slow

DEVICES = [f"/job:localhost/replica:0/task:0/device:CPU:{i}" for i in range(2)]
RTOL = 1e-5
SEED = 7


def _secure(model_dir):
    return tfe_estimator.TfeRunConfig(model_dir=model_dir, tf_random_seed=SEED)


def _plaintext(model_dir):
    # The twin trains on the same replicas in the clear; it evaluates without a strategy.
    return tfe_estimator.plaintext_twin_config(DEVICES, model_dir=model_dir,
                                               tf_random_seed=SEED).replace(eval_distribute=None)


# ---- the tutorials, each a function of its RunConfig -------------------------------------------

def premade_iris(config, data):
    """tensorflow/docs site/en/tutorials/estimator/premade.ipynb, steps cut for CI."""
    (train_x, train_y), (test_x, test_y) = data

    def input_fn(features, labels, training=True, batch_size=256):
        dataset = tf.data.Dataset.from_tensor_slices((dict(features), labels))
        if training:
            dataset = dataset.repeat()  # the tutorial also shuffles; unseeded shuffles differ between runs
        return dataset.batch(batch_size)

    feature_columns = [tf.feature_column.numeric_column(key=key) for key in train_x]
    classifier = tf.estimator.DNNClassifier(feature_columns=feature_columns, hidden_units=[30, 10],
                                            n_classes=3, config=config)
    classifier.train(input_fn=lambda: input_fn(train_x, train_y, training=True), steps=5)
    return classifier.evaluate(input_fn=lambda: input_fn(test_x, test_y, training=False))


def linear_titanic(config, data):
    """tensorflow/docs site/en/tutorials/estimator/linear.ipynb (base and derived feature columns)."""
    (dftrain, y_train), (dfeval, y_eval) = data

    def make_input_fn(data_df, label_df, num_epochs=10, batch_size=32):
        def input_function():
            return tf.data.Dataset.from_tensor_slices((dict(data_df), label_df)).batch(batch_size).repeat(num_epochs)
        return input_function

    feature_columns = []
    for name in ["sex", "n_siblings_spouses", "parch", "class", "deck", "embark_town", "alone"]:
        vocabulary = sorted(set(dftrain[name]))
        feature_columns.append(tf.feature_column.categorical_column_with_vocabulary_list(name, vocabulary))
    for name in ["age", "fare"]:
        feature_columns.append(tf.feature_column.numeric_column(name, dtype=tf.float32))
    age = tf.feature_column.numeric_column("age")
    age_buckets = tf.feature_column.bucketized_column(age, boundaries=[18, 25, 30, 35, 40, 45, 50, 55, 60, 65])
    age_x_gender = tf.feature_column.crossed_column(["age", "sex"], hash_bucket_size=100)
    linear_est = tf.estimator.LinearClassifier(feature_columns=feature_columns + [age_buckets, age_x_gender],
                                               config=config)
    linear_est.train(make_input_fn(dftrain, y_train, num_epochs=None), steps=5)
    return linear_est.evaluate(make_input_fn(dfeval, y_eval, num_epochs=1))


def guide_premade(config, data, eval_steps=3):
    """tensorflow/docs site/en/guide/estimator.ipynb, "Using premade Estimators" (evaluate for `steps`).

    A step of a distributed evaluation reads one batch per replica (as under
    TensorFlow's MirroredStrategy): the plaintext reference reads the same
    batches with ``eval_steps`` times the number of replicas.
    """
    (dftrain, y_train), _ = data
    columns = {"age": dftrain["age"], "class": dftrain["class"], "embark_town": dftrain["embark_town"]}

    def train_input_fn():
        return tf.data.Dataset.from_tensor_slices((columns, y_train)).batch(32).repeat()

    age = tf.feature_column.numeric_column("age")
    cls = tf.feature_column.categorical_column_with_vocabulary_list("class", ["First", "Second", "Third"])
    embark = tf.feature_column.categorical_column_with_hash_bucket("embark_town", 32)
    model = tf.estimator.LinearClassifier(feature_columns=[embark, cls, age], n_classes=2, config=config)
    model = model.train(input_fn=train_input_fn, steps=5)
    return model.evaluate(train_input_fn, steps=eval_steps)


BATCH_NORM_STEPS, BATCH_NORM_SAVE_STEPS = 20, 10
#: The batch-norm model's tolerance against the plaintext twin: the service's sums are exact to 2**-32 per
#: summand (precision "low"), below float32's rounding, so the runs differ only where float32 rounds a sum
#: differently (measured: every weight equal but dense/bias, 7.7e-11 off weights of ~3e-8 that BN cancels).
BN_RTOL, BN_ATOL = RTOL, 1e-7


def batch_norm_model_fn(features, labels, mode):
    """A newcomer's custom model_fn: Dense -> `tf.compat.v1.layers.batch_normalization` -> Dense, MSE, its own
    ``eval_metric_ops``, the moving statistics' updates (UPDATE_OPS) run with the train op as TensorFlow's docs
    write it."""
    inputs = tf.stack([features["age"] / 80.0, features["fare"] / 50.0], axis=1)
    hidden = tf.compat.v1.layers.dense(inputs, 4, kernel_initializer=tf.compat.v1.glorot_uniform_initializer(1))
    hidden = tf.compat.v1.layers.batch_normalization(hidden, training=mode == tf.estimator.ModeKeys.TRAIN)
    prediction = tf.compat.v1.layers.dense(tf.nn.relu(hidden), 1,
                                           kernel_initializer=tf.compat.v1.glorot_uniform_initializer(2))
    target = tf.cast(tf.reshape(labels, [-1, 1]), tf.float32)
    loss = tf.compat.v1.losses.mean_squared_error(target, prediction)
    if mode == tf.estimator.ModeKeys.EVAL:
        return tf.estimator.EstimatorSpec(mode, loss=loss, eval_metric_ops={
            "mae": tf.compat.v1.metrics.mean_absolute_error(target, prediction)})
    optimizer = tf.compat.v1.train.GradientDescentOptimizer(0.2)
    with tf.control_dependencies(tf.compat.v1.get_collection(tf.compat.v1.GraphKeys.UPDATE_OPS)):
        train_op = optimizer.minimize(loss, global_step=tf.compat.v1.train.get_global_step())
    return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)


def batch_norm_input_fn(frame, training=True):
    """The `batch_norm_model_fn`'s input: the titanic frame's age and fare, batches of 32 (repeated to train)."""
    columns, labels = frame
    dataset = tf.data.Dataset.from_tensor_slices(({"age": columns["age"], "fare": columns["fare"]}, labels))
    return dataset.batch(32).repeat() if training else dataset.batch(32)


def batch_norm_custom(config, data, steps=BATCH_NORM_STEPS):
    """`batch_norm_model_fn` trained with `tf.estimator.train_and_evaluate` (an evaluation after every
    checkpoint)."""
    train, evaluation = data
    estimator = tf.estimator.Estimator(batch_norm_model_fn, config=config)
    metrics, _ = tf.estimator.train_and_evaluate(
        estimator, tf.estimator.TrainSpec(lambda: batch_norm_input_fn(train), max_steps=steps),
        tf.estimator.EvalSpec(lambda: batch_norm_input_fn(evaluation, training=False), steps=None, throttle_secs=0,
                              start_delay_secs=0))
    return metrics


KERAS_STEPS = 4
#: The Keras model's variables in its Estimator's checkpoint (object-based names), kernel first.
KERAS_WEIGHTS = ("layer_with_weights-0/kernel/.ATTRIBUTES/VARIABLE_VALUE",
                 "layer_with_weights-0/bias/.ATTRIBUTES/VARIABLE_VALUE")


def keras_inputs(frame):
    """The Keras model's rows of a titanic frame: (age / 80, fare / 50) and the label as float32 [rows, 1]."""
    columns, labels = frame
    x = np.stack([columns["age"] / 80.0, columns["fare"] / 50.0], axis=1).astype(np.float32)
    return x, labels.astype(np.float32).reshape(-1, 1)


def keras_to_estimator(config, data, steps=KERAS_STEPS):
    """A newcomer's Keras model as an Estimator: `Sequential` Dense(1), SGD and MSE, `model_to_estimator`,
    trained `steps` steps on batches of 32 and evaluated in batches of 32."""
    train, evaluation = (keras_inputs(frame) for frame in data)
    tf.keras.utils.set_random_seed(SEED)  # Keras initialises from its own seed, not tf_random_seed
    model = tf.keras.Sequential([tf.keras.layers.Dense(1, input_shape=(2,))])
    model.compile(optimizer=keras_optimizers().SGD(0.1), loss="mse")  # model_to_estimator needs the legacy one
    estimator = tf.keras.estimator.model_to_estimator(keras_model=model, config=config)
    estimator.train(lambda: tf.data.Dataset.from_tensor_slices(train).batch(32).repeat(), steps=steps)
    return estimator.evaluate(lambda: tf.data.Dataset.from_tensor_slices(evaluation).batch(32))


# ---- data the tests make ------------------------------------------------------------------------

@pytest.fixture(scope="module")
def iris():
    from sklearn.datasets import load_iris  # pylint: disable=import-outside-toplevel

    bunch = load_iris()
    names = ["SepalLength", "SepalWidth", "PetalLength", "PetalWidth"]
    order = np.random.RandomState(0).permutation(len(bunch.target))
    x, y = bunch.data[order].astype(np.float32), bunch.target[order].astype(np.int64)
    split = lambda rows: ({n: x[rows, i] for i, n in enumerate(names)}, y[rows])  # noqa: E731
    return split(slice(0, 120)), split(slice(120, 150))


def _titanic_frame(rng, rows):
    """Titanic-shaped columns: the linear tutorial's names and vocabularies, and a label that depends on them."""
    sex = rng.choice(["male", "female"], rows)
    cls = rng.choice(["First", "Second", "Third"], rows)
    age = rng.uniform(1, 80, rows).astype(np.float32)
    fare = rng.gamma(2.0, 15.0, rows).astype(np.float32)
    survived = ((sex == "female").astype(float) + (cls == "First") * 0.5 - age / 200
                + rng.normal(0, 0.4, rows) > 0.5).astype(np.int64)
    return {"sex": sex, "n_siblings_spouses": rng.choice(np.array([0, 1, 2, 3]), rows),
            "parch": rng.choice(np.array([0, 1, 2]), rows), "class": cls,
            "deck": rng.choice(["A", "B", "C", "unknown"], rows),
            "embark_town": rng.choice(["Southampton", "Cherbourg", "Queenstown"], rows),
            "alone": rng.choice(["y", "n"], rows), "age": age, "fare": fare}, survived


@pytest.fixture(scope="module")
def titanic():
    """160 training and 70 evaluation rows."""
    rng = np.random.RandomState(1)
    return _titanic_frame(rng, 160), _titanic_frame(rng, 70)


def _assert_same_metrics(secure, plain):
    assert secure.keys() == plain.keys()
    assert secure["global_step"] == plain["global_step"]
    for key in plain:
        assert secure[key] == pytest.approx(plain[key], rel=RTOL, abs=1e-7), (key, repr(secure), repr(plain))


@pytest.mark.parametrize("tutorial,dataset", [(premade_iris, "iris"), (linear_titanic, "titanic"),
                                              (guide_premade, "titanic")])
def test_the_tutorial_with_tfe_run_config_reports_the_plaintext_metrics(tutorial, dataset, request, tmp_path):
    data = request.getfixturevalue(dataset)
    per_replica = {"eval_steps": 3 * len(DEVICES)} if tutorial is guide_premade else {}
    plain = tutorial(_plaintext(str(tmp_path / "plain")), data, **per_replica)
    secure = tutorial(_secure(str(tmp_path / "secure")), data)
    _assert_same_metrics(secure, plain)


def _rows(frame, start, stop):
    columns, labels = frame
    return {k: v[start:stop] for k, v in columns.items()}, labels[start:stop]


def _concatenate(frames):
    return ({k: np.concatenate([f[0][k] for f in frames]) for k in frames[0][0]},
            np.concatenate([f[1] for f in frames]))


@pytest.mark.multiprocess
def test_two_owners_in_service_mode_report_the_plaintext_metrics_of_the_linear_tutorial(tmp_path, monkeypatch):
    from tfe_estimator.cluster.launcher import Launcher  # pylint: disable=import-outside-toplevel

    # Keys put when the step starts, as at a distance (on loopback "auto" puts them with the shares): the launch
    # covers that path with evaluations of many sums, the saver's reads and model_to_estimator.
    monkeypatch.setenv("TFE_ESTIMATOR_EARLY_KEY", "on")

    # Prepare: each owner's own rows (96 training rows: 3 batches; 64 and 32 evaluation rows: 2 and 1 batches).
    rng = np.random.RandomState(3)
    owners = {"chief-0": (_titanic_frame(rng, 96), _titanic_frame(rng, 64)),
              "worker-0": (_titanic_frame(rng, 96), _titanic_frame(rng, 32))}
    for owner, (train, evaluation) in owners.items():
        os.makedirs(tmp_path / owner)
        np.savez(tmp_path / owner / "titanic.npz", train=train[1], eval=evaluation[1],
                 **{f"train_{k}": v for k, v in train[0].items()}, **{f"eval_{k}": v for k, v in evaluation[0].items()})
    # The twin's replica r reads owner r's batches (batches go to the replicas in turn); it evaluates the union.
    chunks = [_rows(owners[o][0], i, i + 32) for i in range(0, 96, 32) for o in owners]
    union = _concatenate([owners[o][1] for o in owners])
    plain = linear_titanic(_plaintext(str(tmp_path / "plain")), (_concatenate(chunks), union))
    bn_config = tfe_estimator.plaintext_twin_config(DEVICES, model_dir=str(tmp_path / "bn_plain"), tf_random_seed=SEED,
                                                    save_checkpoints_steps=BATCH_NORM_SAVE_STEPS)
    bn_plain = batch_norm_custom(bn_config.replace(eval_distribute=None), (_concatenate(chunks), union))
    keras_plain = keras_to_estimator(_plaintext(str(tmp_path / "keras_plain")), (_concatenate(chunks), union))
    # Execute: `tfe-estimator launch --cluster-mode service` of the tutorial with TfeRunConfig.
    out = io.StringIO()
    script = os.path.join(os.path.dirname(__file__), "scripts", "service_tutorial.py")
    launcher = Launcher([sys.executable, script], workers=1, task_cwd=str(tmp_path / "{job}-{index}"), out=out,
                        cluster_mode="service", down_timeout=120)
    status = launcher.run()
    # Assert: every owner reads the metrics of the union, equal to the twin's, `loss` included.
    assert status == 0, report(out.getvalue())
    for owner in owners:
        with open(tmp_path / owner / "metrics.json") as f:
            _assert_same_metrics(json.load(f), plain)
    # The custom model_fn with batch normalization trained in the same launch (issue 41): the owners' checkpoints
    # are bit-identical, moving statistics included (the saver's on-read sums), and equal to the twin's.
    twin = _assert_owners_equal_the_twin(tmp_path, "bn", bn_plain, {"loss", "mae", "global_step"})
    assert {"batch_normalization/moving_mean", "batch_normalization/moving_variance"} <= twin.keys()
    assert twin["global_step"] == BATCH_NORM_STEPS
    assert not np.allclose(twin["batch_normalization/moving_mean"], 0.0)  # the statistics moved
    # model_to_estimator in the same launch (issue 41): owners equal to the twin, and the evaluation `loss` is the
    # true mean loss over the union's 96 evaluation rows (3 batches of 32: the mean of the batches' losses is it).
    _assert_owners_equal_the_twin(tmp_path, "keras", keras_plain, {"loss", "global_step"})
    kernel, bias = (_checkpoint(tmp_path / "chief-0" / "keras_model")[name] for name in KERAS_WEIGHTS)
    x, y = keras_inputs(union)
    true_loss = float(np.mean((x.astype(np.float64) @ kernel + bias - y) ** 2))
    for owner in owners:
        with open(tmp_path / owner / "keras_metrics.json") as f:
            secure = json.load(f)
        assert secure["global_step"] == KERAS_STEPS
        assert secure["loss"] == pytest.approx(true_loss, rel=1e-5), (owner, secure, true_loss)


def _assert_owners_equal_the_twin(tmp_path, model, twin_metrics, keys):
    """The owners' checkpoints in ``{model}_model`` are bit-identical and equal to the twin's (``{model}_plain``)
    within the batch-norm model's tolerance, and so are their metrics (``{model}_metrics.json``, `keys`). Returns
    the twin's checkpoint."""
    weights = {owner: _checkpoint(tmp_path / owner / f"{model}_model") for owner in ("chief-0", "worker-0")}
    twin = _checkpoint(tmp_path / f"{model}_plain")
    assert weights["chief-0"].keys() == twin.keys()
    for name, value in twin.items():
        np.testing.assert_array_equal(weights["chief-0"][name], weights["worker-0"][name], err_msg=name)
        if np.asarray(value).dtype.kind in "fiu":  # not a Keras checkpoint's object graph (bytes)
            np.testing.assert_allclose(weights["chief-0"][name], value, rtol=BN_RTOL, atol=BN_ATOL, err_msg=name)
    for owner in weights:
        with open(tmp_path / owner / f"{model}_metrics.json") as f:
            secure = json.load(f)
        assert secure.keys() == twin_metrics.keys() == keys
        for key in twin_metrics:
            assert secure[key] == pytest.approx(twin_metrics[key], rel=BN_RTOL, abs=BN_ATOL), (key, secure,
                                                                                              twin_metrics)
    return twin


def _checkpoint(model_dir):
    """Every variable of the latest checkpoint in `model_dir`, by name."""
    return {name: tf.train.load_variable(str(model_dir), name) for name, _ in tf.train.list_variables(str(model_dir))}
