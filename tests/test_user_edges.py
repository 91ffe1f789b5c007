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
