"""Rough edges a new user hits first: a blank TF_CONFIG, many local replicas."""
import json
import logging

import pytest

from tfe_estimator import TfeRunConfig


def test_blank_tf_config_is_a_clear_error_from_tfe_run_config(monkeypatch, tmp_path):
    monkeypatch.setenv("TF_CONFIG", "")
    with pytest.raises(ValueError, match=r"TF_CONFIG is set but empty \(''\).*unset TF_CONFIG") as info:
        TfeRunConfig(model_dir=str(tmp_path))
    assert not isinstance(info.value, json.JSONDecodeError)


def test_many_local_replicas_are_warned_about_with_the_reason(monkeypatch, tmp_path, caplog):
    monkeypatch.delenv("TF_CONFIG", raising=False)
    with caplog.at_level(logging.WARNING, logger="tfe_estimator"):
        TfeRunConfig(model_dir=str(tmp_path), num_replicas=20)
    assert "num_replicas=20 local replicas: every replica is a CPU device of this one process" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="tfe_estimator"):
        TfeRunConfig(model_dir=str(tmp_path), num_replicas=2)
    assert "local replicas" not in caplog.text


@pytest.mark.slow
def test_more_replicas_in_a_used_model_dir_is_an_error_that_says_replicas(monkeypatch, tmp_path):
    # Canned LinearRegressor's default Ftrl keeps an accumulator per replica in the checkpoint.
    import numpy as np
    import tensorflow as tf

    monkeypatch.delenv("TF_CONFIG", raising=False)
    x = np.random.RandomState(0).randn(32, 3).astype(np.float32)
    cols = [tf.feature_column.numeric_column("x", shape=[3])]
    est = tf.estimator.LinearRegressor(cols, config=TfeRunConfig(model_dir=str(tmp_path), num_replicas=2))
    est.train(lambda: tf.data.Dataset.from_tensor_slices(({"x": x}, x.sum(1))).repeat().batch(8), steps=2)

    with pytest.raises(ValueError, match=r"written by 2 replicas, but this TfeRunConfig trains 3 replicas "
                                         r"\(num_replicas\).*Train with 2 replicas in this model_dir"):
        TfeRunConfig(model_dir=str(tmp_path), num_replicas=3)
    with pytest.raises(ValueError, match="written by 2 replicas"):
        TfeRunConfig(num_replicas=2).replace(model_dir=str(tmp_path), num_replicas=3)
    TfeRunConfig(model_dir=str(tmp_path), num_replicas=2)  # the same count is fine
    TfeRunConfig(model_dir=str(tmp_path / "fresh"), num_replicas=3)
