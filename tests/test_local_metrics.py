"""An owner's own metrics (evaluate_locally, LocalMetricsExporter): its data only, on a plain local session.

The federated half (every owner's own loss beside the summed one on a service
cluster) is checked by the README's train.py test.
"""
import io
import json
import os

import numpy as np
import pytest
import tensorflow as tf

import tfe_estimator
from tfe_estimator import TfeRunConfig

pytestmark = pytest.mark.slow

COLS = [tf.feature_column.numeric_column("x", shape=[3])]


@pytest.fixture(autouse=True)
def _no_tf_config(monkeypatch):
    monkeypatch.delenv("TF_CONFIG", raising=False)


def _input_fn(x, y, repeat):
    def input_fn():
        dataset = tf.data.Dataset.from_tensor_slices(({"x": x}, y))
        return dataset.repeat().batch(16) if repeat else dataset.batch(16)

    return input_fn


def _mse(est, x, y):
    w = est.get_variable_value("linear/linear_model/x/weights").ravel()
    b = est.get_variable_value("linear/linear_model/bias_weights")[0]
    return float(np.mean((x @ w + b - y) ** 2))


def _trained(tmp_path, linear_data, steps=5):
    x, y, _ = linear_data
    est = tf.estimator.LinearRegressor(COLS, config=TfeRunConfig(model_dir=str(tmp_path), tf_random_seed=1))
    est.train(_input_fn(x, y, True), steps=steps)
    return est


def test_evaluate_locally_reports_this_owners_data_and_writes_eval_local(tmp_path, linear_data):
    x, y, _ = linear_data
    est = _trained(tmp_path, linear_data)
    own_x, own_y = x[:100], y[:100] + 1.0  # "this owner's" evaluation data
    metrics = tfe_estimator.evaluate_locally(est, _input_fn(own_x, own_y, False))
    assert metrics["global_step"] == 5
    assert metrics["average_loss"] == pytest.approx(_mse(est, own_x, own_y), rel=1e-5)
    assert os.listdir(os.path.join(str(tmp_path), "eval_local"))


def test_evaluate_locally_on_an_owner_of_a_tf_config_cluster_leaves_tf_config_as_it_was(tmp_path, linear_data,
                                                                                    monkeypatch):
    x, y, _ = linear_data
    est = _trained(tmp_path, linear_data)
    # A data owner's TF_CONFIG (its addresses unreachable: the evaluation must not need them).
    tf_config = json.dumps({"cluster": {"chief": ["127.0.0.1:1"], "worker": ["127.0.0.1:2"]},
                            "task": {"type": "worker", "index": 0}})
    monkeypatch.setenv("TF_CONFIG", tf_config)
    metrics = tfe_estimator.evaluate_locally(est, _input_fn(x, y, False), name="mine")
    assert metrics["average_loss"] == pytest.approx(_mse(est, x, y), rel=1e-5)
    assert os.environ["TF_CONFIG"] == tf_config
    assert os.listdir(os.path.join(str(tmp_path), "eval_mine"))


def test_the_exporter_evaluates_each_checkpoint_train_and_evaluate_evaluated(tmp_path, linear_data):
    x, y, _ = linear_data
    est = tf.estimator.LinearRegressor(COLS, config=TfeRunConfig(model_dir=str(tmp_path), tf_random_seed=1,
                                                                 save_checkpoints_steps=4))
    own_x, own_y = x[:64], y[:64] - 2.0
    out = io.StringIO()
    exporter = tfe_estimator.LocalMetricsExporter(_input_fn(own_x, own_y, False), stream=out)
    tf.estimator.train_and_evaluate(
        est, tf.estimator.TrainSpec(_input_fn(x, y, True), max_steps=8),
        tf.estimator.EvalSpec(_input_fn(x, y, False), steps=None, throttle_secs=0, exporters=[exporter]))
    assert exporter.last_metrics["global_step"] == 8
    assert exporter.last_metrics["average_loss"] == pytest.approx(_mse(est, own_x, own_y), rel=1e-5)
    assert not os.path.exists(os.path.join(str(tmp_path), "export"))  # exports no model
    # One line per evaluation (steps 4 and 8), and no "all owners" line: evaluation here is not federated.
    lines = out.getvalue().splitlines()
    assert [line.split(",")[0] for line in lines] == [f"tfe_estimator: evaluation at step {s}" for s in (4, 8)]
    assert lines[-1].startswith("tfe_estimator: evaluation at step 8, this owner's data only: average_loss ")
    assert float(lines[-1].split("average_loss ")[1].split(",")[0]) == pytest.approx(
        exporter.last_metrics["average_loss"], rel=1e-5)


def test_under_dp_the_own_line_carries_the_checkpoints_epsilon(tmp_path, linear_data):
    # Under DP the local evaluation (a plain RunConfig) has no epsilon: the line takes the evaluation's.
    x, y, _ = linear_data
    est = _trained(tmp_path, linear_data)
    out = io.StringIO()
    exporter = tfe_estimator.LocalMetricsExporter(_input_fn(x, y, False), stream=out)
    exporter.export(est, None, tf.train.latest_checkpoint(str(tmp_path)),
                    {"global_step": 5, "average_loss": 9.0, "dp_epsilon": 1.25, "dp_epsilon_outsiders": 0.75}, False)
    line = out.getvalue()
    assert line.startswith("tfe_estimator: evaluation at step 5, this owner's data only: average_loss "), line
    assert ", dp_epsilon 1.25, dp_epsilon_outsiders 0.75, " in line, line
    assert float(line.split("average_loss ")[1].split(",")[0]) == pytest.approx(_mse(est, x, y), rel=1e-5)


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(input_fn="data.csv"), TypeError, r"input_fn='data.csv' is not callable: pass the owner's evaluation"),
    (dict(input_fn=lambda: None, name=""), ValueError, r"name='': give a non-empty string"),
])
def test_bad_exporter_arguments_are_named(kwargs, error, match):
    with pytest.raises(error, match=match):
        tfe_estimator.LocalMetricsExporter(**kwargs)
