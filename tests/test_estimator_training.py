"""Canned Estimators trained with TfeRunConfig against their plaintext twin."""
import numpy as np
import pytest
import tensorflow as tf

import tfe_estimator

pytestmark = pytest.mark.slow

REPLICAS = ["/job:localhost/replica:0/task:0/device:CPU:0", "/job:localhost/replica:0/task:0/device:CPU:1"]
WEIGHT_TOL = 1e-2  # the acceptance bound; observed differences are ~1e-6
COLS = [tf.feature_column.numeric_column("x", shape=[3])]


def _plaintext_config(model_dir):
    """The twin: MirroredStrategy with ReductionToOneDevice on the same devices."""
    return tfe_estimator.plaintext_twin_config(REPLICAS, model_dir=model_dir, tf_random_seed=7)


def _input_fn(x, y, batch=32, repeat=True):
    def input_fn():
        dataset = tf.data.Dataset.from_tensor_slices(({"x": x}, y))
        return (dataset.repeat() if repeat else dataset).batch(batch)

    return input_fn


def _evaluate(est, x, y):
    """Evaluates on every example exactly once."""
    return est.evaluate(_input_fn(x, y, repeat=False), steps=None)


def _linear(config):
    return tf.estimator.LinearRegressor(
        feature_columns=COLS, config=config, optimizer=lambda: tf.keras.optimizers.SGD(0.05)
    )


def _dnn(config):
    return tf.estimator.DNNRegressor(
        hidden_units=[8, 4], feature_columns=COLS, config=config,
        optimizer=lambda: tf.keras.optimizers.Adam(0.01),
    )


def _variables(est):
    return {n: est.get_variable_value(n) for n in est.get_variable_names() if "Adam" not in n and "Ftrl" not in n}


@pytest.mark.parametrize(
    "make, protocol",
    [(_linear, "pond"), (_dnn, "pond"), (_linear, "aby3")],
    ids=["LinearRegressor-pond", "DNNRegressor-pond", "LinearRegressor-aby3"],
)
def test_canned_estimator_matches_plaintext_twin(make, protocol, tmp_path, linear_data):
    # Prepare
    x, y, w = linear_data
    secure = make(tfe_estimator.TfeRunConfig(
        model_dir=str(tmp_path / "secure"), protocol=protocol, num_replicas=2, tf_random_seed=7))
    plain = make(_plaintext_config(str(tmp_path / "plain")))
    # Execute
    for est in (secure, plain):
        est.train(_input_fn(x, y), steps=150)
    s_metrics = _evaluate(secure, x, y)
    p_metrics = _evaluate(plain, x, y)
    # Assert: same variables, same metrics.
    s_vars, p_vars = _variables(secure), _variables(plain)
    assert s_vars.keys() == p_vars.keys()
    for name in s_vars:
        np.testing.assert_allclose(s_vars[name], p_vars[name], atol=WEIGHT_TOL, err_msg=name)
    assert s_metrics["global_step"] == p_metrics["global_step"] == 150
    for key in ("average_loss", "loss", "prediction/mean", "label/mean"):
        np.testing.assert_allclose(s_metrics[key], p_metrics[key], atol=WEIGHT_TOL, rtol=1e-2, err_msg=key)
    if make is _linear:  # and it learned the true weights
        np.testing.assert_allclose(s_vars["linear/linear_model/x/weights"].ravel(), w, atol=WEIGHT_TOL)


class _AuditHook(tf.estimator.SessionRunHook):
    """Audits the finished training graph, as a user can with their own hook."""

    def __init__(self, server_devices):
        self.server_devices = server_devices
        self.audited = None

    def begin(self):
        graph = tf.compat.v1.get_default_graph()
        self.audited = tfe_estimator.assert_no_plaintext_on_servers(graph, self.server_devices)


@pytest.mark.parametrize("protocol", ["pond", "aby3"])
def test_training_graph_keeps_plaintext_off_the_servers(protocol, tmp_path, linear_data):
    x, y, _ = linear_data
    config = tfe_estimator.TfeRunConfig(model_dir=str(tmp_path), protocol=protocol, num_replicas=2)
    hook = _AuditHook(config.train_distribute.secure_aggregation.server_devices)
    _linear(config).train(_input_fn(x, y), steps=2, hooks=[hook])
    assert hook.audited > 0


def test_nan_in_the_data_fails_loudly(tmp_path, linear_data):
    x, y, _ = linear_data
    y = y.copy()
    y[5] = np.nan
    est = _linear(tfe_estimator.TfeRunConfig(model_dir=str(tmp_path), num_replicas=2))
    with pytest.raises(tf.errors.InvalidArgumentError, match="NaN or infinite"):
        est.train(_input_fn(x, y), steps=20)


def test_huge_features_are_refused_instead_of_wrapping(tmp_path, linear_data):
    x, y, _ = linear_data
    est = _linear(tfe_estimator.TfeRunConfig(model_dir=str(tmp_path), num_replicas=2))
    with pytest.raises(tf.errors.InvalidArgumentError, match="largest magnitude"):
        est.train(_input_fn(x * 1e5, y), steps=20)


def test_checkpoints_move_between_secure_and_plain_configs(tmp_path, linear_data):
    x, y, _ = linear_data
    model_dir = str(tmp_path)
    # Secure training, then plain evaluation and training from the same model_dir.
    secure = _linear(tfe_estimator.TfeRunConfig(model_dir=model_dir, num_replicas=2))
    secure.train(_input_fn(x, y), steps=30)
    s_eval = _evaluate(secure, x, y)
    plain = _linear(tf.estimator.RunConfig(model_dir=model_dir))
    p_eval = _evaluate(plain, x, y)
    assert p_eval["global_step"] == s_eval["global_step"] == 30
    np.testing.assert_allclose(p_eval["average_loss"], s_eval["average_loss"], rtol=1e-3, atol=1e-6)
    plain.train(_input_fn(x, y), steps=20)
    # And back: the secure config continues from the plain checkpoint.
    secure.train(_input_fn(x, y), steps=20)
    final = _evaluate(secure, x, y)
    assert final["global_step"] == 70
    assert final["average_loss"] < s_eval["average_loss"]
