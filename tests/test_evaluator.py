"""The evaluator task skips checkpoints that rotation deleted, and only those."""
import logging
import types

import pytest
import tensorflow as tf

from tfe_estimator.cluster import evaluator


class _FakeEstimator:
    """Plays the chief's rotation: the first `vanish` checkpoints it names are gone when restored."""

    def __init__(self, tmp_path, names, vanish, error=None):
        self.model_dir = str(tmp_path)
        self.config = types.SimpleNamespace(keep_checkpoint_max=5)
        self._names = list(names)
        self._vanish = set(names[:vanish])
        self._error = error
        self.evaluated = []
        for name in names:
            if name not in self._vanish:
                (tmp_path / f"{name}.index").write_text("")

    def latest_checkpoint(self):
        return f"{self.model_dir}/{self._names.pop(0) if len(self._names) > 1 else self._names[0]}"

    def evaluate(self, input_fn, steps, name, checkpoint_path, hooks):
        del input_fn, steps, name, hooks
        if self._error is not None:
            raise self._error
        if not evaluator.checkpoint_exists(checkpoint_path):
            raise ValueError(f"The passed save_path is not a valid checkpoint: {checkpoint_path}")
        self.evaluated.append(checkpoint_path)
        return {"global_step": int(checkpoint_path.rsplit("-", 1)[1]), "loss": 1.0}


def _spec():
    return tf.estimator.EvalSpec(lambda: None, steps=None, start_delay_secs=0, throttle_secs=0)


def test_a_rotated_away_checkpoint_is_skipped_logged_and_the_newest_evaluated(tmp_path, caplog):
    est = _FakeEstimator(tmp_path, ["model.ckpt-0", "model.ckpt-50", "model.ckpt-250"], vanish=2)
    ev = evaluator._evaluator_class()(est, _spec(), 300)

    with caplog.at_level(logging.WARNING, logger="tfe_estimator"):
        result, _ = ev.evaluate_and_export()

    assert result.metrics["global_step"] == 250
    assert est.evaluated == [f"{tmp_path}/model.ckpt-250"]
    assert ev.skipped == (f"{tmp_path}/model.ckpt-0", f"{tmp_path}/model.ckpt-50")
    text = caplog.text
    assert "skipped checkpoint" in text and "model.ckpt-0" in text and "keep_checkpoint_max=5" in text
    assert "Evaluating the newest" in text


def test_an_error_on_a_checkpoint_that_still_exists_propagates(tmp_path):
    # A real failure (e.g. a bad input_fn) must not be mistaken for rotation.
    est = _FakeEstimator(tmp_path, ["model.ckpt-100"], vanish=0, error=ValueError("bad input_fn"))
    ev = evaluator._evaluator_class()(est, _spec(), 300)
    with pytest.raises(ValueError, match="bad input_fn"):
        ev.evaluate_and_export()


def test_install_replaces_only_the_continuous_evaluation_and_is_idempotent():
    from tensorflow_estimator.python.estimator import training

    # Whatever this process installed before (a TfeRunConfig built for an evaluator task installs it: another
    # test in the same pytest worker may have), the test starts from an unpatched method of its own.
    def unpatched(self):
        del self

    original = training._TrainingExecutor._start_continuous_evaluation
    training._TrainingExecutor._start_continuous_evaluation = unpatched
    try:
        evaluator.install_checkpoint_retry()
        patched = training._TrainingExecutor._start_continuous_evaluation
        evaluator.install_checkpoint_retry()
        assert training._TrainingExecutor._start_continuous_evaluation is patched is not unpatched
        assert training._TrainingExecutor.run_local is not patched
    finally:
        training._TrainingExecutor._start_continuous_evaluation = original


class _LateChief(_FakeEstimator):
    """No checkpoint for the first `late` looks (the chief has not saved yet), then the final one."""

    def __init__(self, tmp_path, late):
        super().__init__(tmp_path, ["model.ckpt-300"], vanish=0)
        self.looks, self._late = 0, late

    def latest_checkpoint(self):
        self.looks += 1
        return None if self.looks <= self._late else super().latest_checkpoint()


def test_an_evaluator_with_nothing_to_evaluate_says_so_once_waits_quietly_and_ends_with_training(
        tmp_path, caplog, monkeypatch):
    """Issue 35: with throttle_secs=0 Estimator's loop spun and warned millions of times before a checkpoint."""
    from tensorflow_estimator.python.estimator import training

    monkeypatch.setattr(evaluator, "POLL_SECS", 0.01)
    est = _LateChief(tmp_path, late=20)
    executor = types.SimpleNamespace(
        estimator=est, _eval_spec=_spec(), _train_spec=tf.estimator.TrainSpec(lambda: None, max_steps=300),
        _continuous_eval_listener=training._ContinuousEvalListener())
    executor._execute_evaluator_once = types.MethodType(training._TrainingExecutor._execute_evaluator_once, executor)
    with caplog.at_level(logging.INFO):
        evaluator._continuous_evaluation(executor)  # returns: it evaluated the final checkpoint
    assert est.evaluated == [f"{tmp_path}/model.ckpt-300"] and est.looks == 21
    assert caplog.text.count(f"evaluator: no checkpoint in {tmp_path} yet") == 1, caplog.text
    assert "throttle_secs is set as 0" not in caplog.text  # Estimator's per-look warning
    assert "evaluator: done, global_step=300" in caplog.text
