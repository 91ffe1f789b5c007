"""Tests of model_fns: secure training matches its plaintext twin on real data.

Each model_fn trains twice on the same data in the same order: under
`tfe_estimator.TfeRunConfig(num_replicas=2)` (each replica computes the
gradient of half of every global batch; the halves are summed securely) and
under a `tf.estimator.RunConfig` without a strategy (the whole batch on one
device). The gradients then differ only by float summation order and the
fixed-point resolution (2**-32), so the stated tolerances are tight.
"""
import time

import numpy as np
import pytest
import tensorflow as tf
from sklearn.datasets import load_breast_cancer, load_digits
from sklearn.model_selection import train_test_split
from sklearn.preprocessing import StandardScaler

import tfe_estimator
from input_fns import numpy_input_fn
from model_fns import dnn_classifier, keras_optimizers, linear_regression, logistic_regression

KERAS = keras_optimizers()  # tf.keras.optimizers.legacy on TF >= 2.11, where Estimator needs it

SEED = 42
WEIGHT_ATOL = 1e-4  # secure vs plaintext weights after training, convex models


def split_and_scale(x, y):
    x_train, x_test, y_train, y_test = train_test_split(x, y, test_size=0.25, random_state=0, stratify=y)
    scaler = StandardScaler().fit(x_train)
    return (scaler.transform(x_train).astype(np.float32), y_train.astype(np.int32),
            scaler.transform(x_test).astype(np.float32), y_test.astype(np.int32))


def eval_input_fn(x, y):
    # One step sees the whole set: 2 replicas get half a batch each.
    return numpy_input_fn({"x": x}, y, batch_size=len(x) + len(x) % 2, num_epochs=1, shuffle=False)


def train_twins(model_fn, params, model_dir, x, y, x_test, y_test, steps, batch_size=64):
    """Trains and evaluates secure and plaintext twins; returns {name: (estimator, metrics)}."""
    configs = {
        "secure": tfe_estimator.TfeRunConfig(
            model_dir=str(model_dir / "secure"), num_replicas=2, tf_random_seed=SEED),
        "plaintext": tf.estimator.RunConfig(model_dir=str(model_dir / "plaintext"), tf_random_seed=SEED),
    }
    results = {}
    for name, config in configs.items():
        est = tf.estimator.Estimator(model_fn, params=params, config=config)
        est.train(numpy_input_fn({"x": x}, y, batch_size=batch_size, seed=SEED), steps=steps)
        results[name] = (est, est.evaluate(eval_input_fn(x_test, y_test)))
    return results


def columns(width):
    return [tf.feature_column.numeric_column("x", shape=(width,))]


@pytest.fixture(scope="module")
def breast_cancer():
    return split_and_scale(*load_breast_cancer(return_X_y=True))


@pytest.fixture(scope="module")
def breast_cancer_twins(breast_cancer, tmp_path_factory):
    x, y, x_test, y_test = breast_cancer
    params = {"feature_columns": columns(30), "optimizer": "adam", "learning_rate": 0.05}
    return train_twins(logistic_regression.model_fn, params, tmp_path_factory.mktemp("bc"),
                       x, y, x_test, y_test, steps=150)


@pytest.mark.slow
def test_logistic_regression_breast_cancer_secure_matches_plaintext(breast_cancer_twins):
    (secure, secure_metrics), (plain, plain_metrics) = (
        breast_cancer_twins["secure"], breast_cancer_twins["plaintext"])

    assert secure_metrics["accuracy"] >= 0.95, secure_metrics
    assert plain_metrics["accuracy"] >= 0.95, plain_metrics
    assert secure_metrics["global_step"] == plain_metrics["global_step"] == 150
    for name in ("logits/kernel", "logits/bias"):
        np.testing.assert_allclose(secure.get_variable_value(name), plain.get_variable_value(name),
                                   atol=WEIGHT_ATOL)
    for metric in ("accuracy", "auc", "precision", "recall", "average_loss", "label/mean"):
        assert secure_metrics[metric] == pytest.approx(plain_metrics[metric], abs=1e-4), metric


@pytest.mark.slow
def test_predictions_of_securely_trained_model(breast_cancer, breast_cancer_twins):
    _, _, x_test, y_test = breast_cancer
    est, metrics = breast_cancer_twins["secure"]

    predictions = list(est.predict(numpy_input_fn({"x": x_test}, None, batch_size=50,
                                                  num_epochs=1, shuffle=False)))

    assert len(predictions) == len(x_test)
    assert {"logits", "logistic", "probabilities", "class_ids"} <= set(predictions[0])
    weights, bias = est.get_variable_value("logits/kernel"), est.get_variable_value("logits/bias")
    expected = 1 / (1 + np.exp(-(x_test @ weights + bias)))
    got = np.array([p["logistic"] for p in predictions])
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-6)
    class_ids = np.array([p["class_ids"][0] for p in predictions])
    assert np.mean(class_ids == y_test) == pytest.approx(metrics["accuracy"], abs=1e-6)


@pytest.mark.slow
def test_dnn_classifier_digits_secure_matches_plaintext(tmp_path):
    x, y, x_test, y_test = split_and_scale(*load_digits(return_X_y=True))
    params = {"feature_columns": columns(64), "hidden_units": [64, 32], "n_classes": 10,
              "optimizer": "adam", "learning_rate": 0.01}

    twins = train_twins(dnn_classifier.model_fn, params, tmp_path, x, y, x_test, y_test, steps=250)
    (secure, secure_metrics), (plain, plain_metrics) = twins["secure"], twins["plaintext"]

    assert secure_metrics["accuracy"] >= 0.95, secure_metrics
    assert plain_metrics["accuracy"] >= 0.95, plain_metrics
    # Same seed, same initial weights, same batches: the non-convex runs stay close
    # (measured: weights within 1e-6, identical accuracy).
    assert secure_metrics["accuracy"] == pytest.approx(plain_metrics["accuracy"], abs=1 / len(y_test))
    assert secure_metrics["average_loss"] == pytest.approx(plain_metrics["average_loss"], rel=1e-3)
    for layer in ("hiddenlayer_0", "hiddenlayer_1", "logits"):
        np.testing.assert_allclose(secure.get_variable_value(f"{layer}/kernel"),
                                   plain.get_variable_value(f"{layer}/kernel"), atol=1e-3)


@pytest.mark.slow
def test_linear_regression_recovers_weights_securely(linear_data, tmp_path):
    x, y, w = linear_data
    # An optimizer instance: copied per graph, so training twice (two graphs) works.
    params = {"feature_columns": columns(3), "optimizer": KERAS.SGD(0.1)}

    twins = train_twins(linear_regression.model_fn, params, tmp_path, x, y, x, y, steps=120)
    (secure, secure_metrics), (plain, plain_metrics) = twins["secure"], twins["plaintext"]
    secure.train(numpy_input_fn({"x": x}, y, batch_size=64, seed=1), steps=10)

    np.testing.assert_allclose(secure.get_variable_value("linear/kernel").ravel(), w, atol=1e-2)
    assert secure.get_variable_value("linear/bias")[0] == pytest.approx(0.3, abs=1e-2)
    assert secure_metrics["average_loss"] < 1e-3
    assert secure_metrics["average_loss"] == pytest.approx(plain_metrics["average_loss"], rel=1e-2, abs=1e-7)
    np.testing.assert_allclose(secure.get_variable_value("linear/kernel"),
                               plain.get_variable_value("linear/kernel"), atol=1e-2)
    assert secure.get_variable_value("global_step") == 130


EXPORT_CASES = {
    "linear_regression": (linear_regression.model_fn, {}, "predictions"),
    "logistic_regression": (logistic_regression.model_fn, {}, "probabilities"),
    # With dropout: predictions (and the export) must not drop units.
    "dnn_classifier": (dnn_classifier.model_fn, {"hidden_units": [8], "n_classes": 3, "dropout": 0.5},
                       "probabilities"),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(EXPORT_CASES))
def test_predict_and_export_saved_model(name, tmp_path):
    model_fn, extra, output = EXPORT_CASES[name]
    cols = columns(4)
    params = {"feature_columns": cols, **extra}
    rng = np.random.RandomState(0)
    x = rng.randn(32, 4).astype(np.float32)
    y = rng.randint(0, 2, size=32)
    est = tf.estimator.Estimator(model_fn, params=params, config=tfe_estimator.TfeRunConfig(
        model_dir=str(tmp_path / "model"), num_replicas=2))
    est.train(numpy_input_fn({"x": x}, y.astype(np.float32 if "linear" in name else np.int32),
                             batch_size=8), steps=3)

    predicted = np.array([p[output] for p in est.predict(
        numpy_input_fn({"x": x}, None, batch_size=8, num_epochs=1, shuffle=False))])
    export_dir = est.export_saved_model(
        str(tmp_path / "export"),
        tf.estimator.export.build_parsing_serving_input_receiver_fn(
            tf.feature_column.make_parse_example_spec(cols)))
    serving = tf.saved_model.load(export_dir.decode()).signatures["predict"]
    examples = [tf.train.Example(features=tf.train.Features(feature={
        "x": tf.train.Feature(float_list=tf.train.FloatList(value=row))})).SerializeToString()
        for row in x]
    served = serving(examples=tf.constant(examples))[output].numpy()

    assert predicted.shape[0] == 32 and np.all(np.isfinite(predicted))
    np.testing.assert_allclose(served, predicted, rtol=1e-5, atol=1e-6)
    assert est.get_variable_value("global_step") == 3


# Bad params: clear errors at graph-build time.

def call_model_fn(model_fn, params, mode=tf.estimator.ModeKeys.TRAIN):
    with tf.Graph().as_default():
        features = {"x": tf.zeros([4, 4])}
        labels = tf.zeros([4, 1], tf.int32)
        return model_fn(features, labels, mode, params, tf.estimator.RunConfig())


@pytest.mark.parametrize("model_fn,params,error,match", [
    (dnn_classifier.model_fn, {"feature_columns": columns(4), "hiden_units": [8]}, ValueError,
     r"unknown params key 'hiden_units'\. Allowed keys: \['dropout', 'feature_columns', "
     r"'hidden_units', 'label_vocabulary', 'learning_rate', 'n_classes', 'optimizer', 'weight_column'\]\. "
     r"Fix: remove or rename"),
    (dnn_classifier.model_fn, {"feature_columns": columns(4)}, ValueError,
     r"model_fns\.dnn_classifier\.model_fn: params key 'hidden_units' is required but missing"),
    (logistic_regression.model_fn, {}, ValueError,
     r"params key 'feature_columns' is required but missing\. Allowed keys: .* Fix: pass"),
    (linear_regression.model_fn, {"feature_columns": columns(4), "optimizer": "adamw"}, ValueError,
     r"'adamw' is not a known optimizer name\. Known names: \['adagrad', 'adam', 'ftrl', 'rmsprop', 'sgd'\]"),
    (linear_regression.model_fn, {"feature_columns": columns(4),
                                  "optimizer": tf.compat.v1.train.GradientDescentOptimizer(0.1)},
     TypeError, r"must be an optimizer name .*TF1 tf\.compat\.v1\.train optimizers are not supported"),
    (logistic_regression.model_fn, {"feature_columns": columns(4), "n_classes": 1}, ValueError,
     r"params\['n_classes'\] must be an int >= 2; got 1"),
    (logistic_regression.model_fn, {"feature_columns": columns(4), "learning_rate": 0.1,
                                    "optimizer": KERAS.Adam(0.1)}, ValueError,
     r"'learning_rate' applies only when 'optimizer' is a name"),
    (dnn_classifier.model_fn, {"feature_columns": columns(4), "hidden_units": [8, 0]}, ValueError,
     r"params\['hidden_units'\] must be a non-empty list of positive ints"),
    (dnn_classifier.model_fn, {"feature_columns": columns(4), "hidden_units": [8], "dropout": 1.5},
     ValueError, r"params\['dropout'\] must be None or a drop probability in \[0, 1\); got 1\.5"),
    (linear_regression.model_fn, {"feature_columns": [], "learning_rate": 0.1}, ValueError,
     r"params\['feature_columns'\] must be a non-empty list of feature columns"),
    (linear_regression.model_fn, {"feature_columns": columns(4), "learning_rate": -1}, ValueError,
     r"params\['learning_rate'\] must be a number > 0; got -1"),
    (linear_regression.model_fn, {"feature_columns": columns(4), "optimizer": lambda: "sgd"},
     TypeError, r"callable that returned str; it must return a Keras optimizer"),
])
def test_bad_params_raise_clear_errors(model_fn, params, error, match):
    with pytest.raises(error, match=match):
        call_model_fn(model_fn, params)


@pytest.mark.parametrize("optimizer", ["SGD", "ftrl", lambda: KERAS.RMSprop(0.01), KERAS.Adagrad(0.1)])
def test_optimizer_specs_build_a_train_op(optimizer):
    spec = call_model_fn(linear_regression.model_fn,
                         {"feature_columns": columns(4), "optimizer": optimizer})

    assert spec.train_op is not None and spec.loss is not None


@pytest.mark.skipif(keras_optimizers() is tf.keras.optimizers, reason="TF < 2.11: the Keras optimizers are Estimator's")
@pytest.mark.parametrize("as_callable", [False, True], ids=["instance", "callable"])
def test_new_keras_optimizer_is_refused_with_the_legacy_fix(as_callable):
    # Built in a graph of its own: a new Keras optimizer creates a variable when constructed.
    with tf.Graph().as_default():
        optimizer = (lambda: tf.keras.optimizers.SGD(0.1)) if as_callable else tf.keras.optimizers.SGD(0.1)
    with pytest.raises(TypeError, match=r"needs a tf\.keras\.optimizers\.legacy optimizer; use "
                                        r"tf\.keras\.optimizers\.legacy\.SGD"):
        call_model_fn(linear_regression.model_fn, {"feature_columns": columns(4), "optimizer": optimizer})


def _string_label_spec(model_fn, params):
    with tf.Graph().as_default():
        features = {"x": tf.constant([[0.5], [1.5]])}
        labels = tf.constant([["no"], ["yes"]], name="label")
        return model_fn(features, labels, tf.estimator.ModeKeys.TRAIN, params)


@pytest.mark.parametrize("model_fn, fix", [
    (dnn_classifier.model_fn, r"params\['label_vocabulary'\]=\[\.\.\.\]"),
    (logistic_regression.model_fn, r"params\['label_vocabulary'\]=\[\.\.\.\]"),
    (linear_regression.model_fn, r"read the label column as a number"),
])
def test_string_labels_without_a_vocabulary_fail_naming_the_labels_and_the_fix(model_fn, fix):
    params = {"feature_columns": [tf.feature_column.numeric_column("x")]}
    if model_fn is dnn_classifier.model_fn:
        params["hidden_units"] = [2]
    start = time.monotonic()
    with pytest.raises(ValueError, match=r"The labels \(label:0\) are strings \(dtype string\).*Fix: .*" + fix):
        _string_label_spec(model_fn, params)
    assert time.monotonic() - start < 10


def test_dnn_classifier_trains_on_string_labels_with_a_vocabulary_and_weights(tmp_path):
    # Prepare: string labels and a per-example weight column, as Estimator's canned heads take them.
    x = np.array([[-2.0], [-1.0], [1.0], [2.0]] * 8, dtype=np.float32)
    labels = np.array([["no"], ["no"], ["yes"], ["yes"]] * 8)
    weights = np.ones((32, 1), dtype=np.float32)

    def input_fn():
        return tf.data.Dataset.from_tensor_slices(({"x": x, "w": weights}, labels)).repeat().batch(8)

    est = tf.estimator.Estimator(dnn_classifier.model_fn, model_dir=str(tmp_path), params={
        "feature_columns": [tf.feature_column.numeric_column("x")], "hidden_units": [4],
        "label_vocabulary": ["no", "yes"], "weight_column": "w", "optimizer": "adam", "learning_rate": 0.1})
    # Execute
    est.train(input_fn, steps=30)
    metrics = est.evaluate(input_fn, steps=2)
    # Assert
    assert metrics["accuracy"] == 1.0, metrics


def test_label_vocabulary_must_match_n_classes():
    params = {"feature_columns": [tf.feature_column.numeric_column("x")], "hidden_units": [2],
              "label_vocabulary": ["a", "b", "c"]}
    with pytest.raises(ValueError, match=r"label_vocabulary has 3 class names but n_classes is 2.*n_classes'\]=3"):
        _string_label_spec(dnn_classifier.model_fn, params)
