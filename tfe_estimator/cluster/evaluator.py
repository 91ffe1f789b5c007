"""An evaluator task that survives checkpoint rotation.

Estimator's evaluator (`train_and_evaluate` in the ``evaluator`` task) reads
`latest_checkpoint()`, builds its evaluation graph and only then restores that
checkpoint, with no retry. A secure evaluation graph takes seconds to build;
meanwhile a fast chief with ``keep_checkpoint_max=5`` may have written five
newer checkpoints and deleted the one chosen, and the evaluator dies with
``ValueError: The passed save_path is not a valid checkpoint``.

`install_checkpoint_retry` makes the evaluator of this process do what
TensorFlow's `SidecarEvaluator` does: when the checkpoint it chose is gone by
the time it restores it, log what was skipped and evaluate the newest one
instead. Any other error, or a failure on a checkpoint that still exists,
propagates unchanged. `TfeRunConfig` installs it in the evaluator task of a
TF_CONFIG cluster; with a plain `RunConfig` and `TfeStrategy` call it yourself.

Everything this module knows about `tensorflow_estimator`'s internals
(`_TrainingExecutor`, `_EvalResult`, `_EvalStatus`) stays here; it follows
`_TrainingExecutor._start_continuous_evaluation` and `_Evaluator` of
tensorflow_estimator 2.9 and 2.15, which are identical in what it uses.

Example::

    from tfe_estimator.cluster.evaluator import install_checkpoint_retry

    install_checkpoint_retry()          # in the evaluator task, before:
    tf.estimator.train_and_evaluate(estimator, train_spec, eval_spec)
"""
import functools
import logging
import time

__all__ = ["install_checkpoint_retry", "checkpoint_exists", "MAX_SKIPS", "POLL_SECS"]

log = logging.getLogger("tfe_estimator")

#: How many vanished checkpoints in a row one evaluation pass may skip before it gives up.
MAX_SKIPS = 50


def checkpoint_exists(path: str) -> bool:
    """True if the checkpoint prefix `path` (e.g. ``.../model.ckpt-100``) is on disk."""
    import tensorflow as tf  # pylint: disable=import-outside-toplevel

    return bool(tf.io.gfile.glob(path + ".index")) or bool(tf.io.gfile.glob(path))


def _training_module():
    from tensorflow_estimator.python.estimator import training  # pylint: disable=import-outside-toplevel

    return training


def _evaluator_base():
    return _training_module()._TrainingExecutor._Evaluator  # pylint: disable=protected-access


@functools.lru_cache(maxsize=None)
def _evaluator_class():
    """`_TrainingExecutor._Evaluator` that retries with the newest checkpoint (built on first use)."""
    import tensorflow as tf  # pylint: disable=import-outside-toplevel

    training = _training_module()
    vanished_errors = (ValueError, tf.errors.NotFoundError, tf.errors.DataLossError)

    class _CheckpointRetryEvaluator(_evaluator_base()):
        """Evaluates the newest checkpoint; skips (and logs) checkpoints deleted meanwhile."""

        skipped = ()  # the checkpoint paths skipped so far, oldest first

        def evaluate_and_export(self):
            skips = 0
            path = self._estimator.latest_checkpoint()
            while True:
                if not path:
                    self._log_err_msg("Estimator is not trained yet. Will start an evaluation "
                                      "when a checkpoint is ready.")
                    return training._EvalResult(status=training._EvalStatus.MISSING_CHECKPOINT), []
                if path == self._previous_ckpt_path:
                    self._log_err_msg("No new checkpoint ready for evaluation. Skip the current "
                                      "evaluation pass as evaluation results are expected to be same "
                                      "for the same checkpoint.")
                    return training._EvalResult(status=training._EvalStatus.NO_NEW_CHECKPOINT), []
                try:
                    metrics = self._estimator.evaluate(
                        input_fn=self._eval_spec.input_fn, steps=self._eval_spec.steps,
                        name=self._eval_spec.name, checkpoint_path=path, hooks=self._eval_spec.hooks)
                except vanished_errors as e:
                    if checkpoint_exists(path) or skips >= MAX_SKIPS:
                        raise
                    skips += 1
                    self.skipped = self.skipped + (path,)
                    newest = self._estimator.latest_checkpoint()
                    log.warning(
                        "evaluator: skipped checkpoint %s: it was deleted before it could be restored "
                        "(the chief keeps only the newest keep_checkpoint_max=%s checkpoints and saved "
                        "newer ones while this evaluation was being built; %s: %s). Evaluating the "
                        "newest, %s, instead. To evaluate more checkpoints, raise keep_checkpoint_max "
                        "or save_checkpoints_steps.",
                        path, self._estimator.config.keep_checkpoint_max, type(e).__name__,
                        str(e).splitlines()[0][:200], newest)
                    path = newest
                    continue
                eval_result = training._EvalResult(
                    status=training._EvalStatus.EVALUATED, metrics=metrics, checkpoint_path=path)
                is_final = bool(self._max_training_steps) and (
                    eval_result.metrics[tf.compat.v1.GraphKeys.GLOBAL_STEP] >= self._max_training_steps)
                export_results = self._export_eval_result(eval_result, is_final)
                if is_final:
                    self._is_final_export_triggered = True
                self._last_warning_time = 0
                self._previous_ckpt_path = path
                return eval_result, export_results

    return _CheckpointRetryEvaluator


#: How long the evaluator sleeps between two looks for a new checkpoint (it never spins).
POLL_SECS = 1.0
#: What `EvalSpec(throttle_secs=0)` becomes: no wait after an evaluation, and no warning per look.
_NO_THROTTLE = 1e-9


class _Waiting:
    """The evaluator's wait for a (new) checkpoint: says once that it waits, then sleeps `POLL_SECS` per look.

    Estimator's own loop with ``EvalSpec(throttle_secs=0)`` looks again at once and warns on every look
    (millions of lines while a chief has not saved yet, or when the evaluator reads a directory no owner
    writes); this one logs one line when it starts waiting for the first checkpoint, naming the
    directory, and nothing while it waits for the next.
    """

    def __init__(self, model_dir: str):
        self._model_dir, self._said = model_dir, False

    def wait(self, has_checkpoint: bool) -> None:
        if not has_checkpoint and not self._said:
            self._said = True
            log.info("evaluator: no checkpoint in %s yet; waiting for the first one (a look every %g s; if "
                     "it never comes, that directory is not the one the chief writes: give the evaluator the "
                     "chief's model_dir)", self._model_dir, POLL_SECS)
        time.sleep(POLL_SECS)


def _continuous_evaluation(executor) -> None:
    """`_TrainingExecutor._start_continuous_evaluation` over the retrying evaluator (the same loop otherwise)."""
    import tensorflow as tf  # pylint: disable=import-outside-toplevel

    training = _training_module()
    eval_spec, train_spec = executor._eval_spec, executor._train_spec  # pylint: disable=protected-access
    training._assert_eval_spec(eval_spec)  # pylint: disable=protected-access
    if eval_spec.start_delay_secs:
        log.info("evaluator: waiting %s s before the first evaluation (EvalSpec.start_delay_secs)",
                 eval_spec.start_delay_secs)
        time.sleep(eval_spec.start_delay_secs)
    evaluator = _evaluator_class()(executor.estimator, eval_spec, train_spec.max_steps)
    listener = executor._continuous_eval_listener  # pylint: disable=protected-access
    latest = None
    waiting = _Waiting(executor.estimator.model_dir)
    while True:
        if latest is not None and latest.status == training._EvalStatus.EVALUATED:
            step = latest.metrics.get(tf.compat.v1.GraphKeys.GLOBAL_STEP)
            if step and train_spec.max_steps and step >= train_spec.max_steps:
                log.info("evaluator: done, global_step=%s >= train max_steps=%s%s", step, train_spec.max_steps,
                         f"; skipped {len(evaluator.skipped)} rotated-away checkpoint(s)" if evaluator.skipped else "")
                return None
        # throttle_secs=0 would make Estimator warn on every look that found nothing new: we wait instead.
        latest, stop = executor._execute_evaluator_once(  # pylint: disable=protected-access
            evaluator, listener, eval_spec.throttle_secs or _NO_THROTTLE)
        if stop:
            return None
        if latest is not None and latest.status != training._EvalStatus.EVALUATED:
            waiting.wait(latest.status == training._EvalStatus.NO_NEW_CHECKPOINT)  # quietly, not in a tight loop


def install_checkpoint_retry() -> None:
    """Makes `train_and_evaluate`'s evaluator task in this process retry rotated-away checkpoints.

    Replaces `_TrainingExecutor._start_continuous_evaluation` of
    tensorflow_estimator, which only the evaluator task runs (directly, or
    through the distribute coordinator that a `RunConfig` with a strategy and a
    TF_CONFIG cluster uses), with the same loop over an evaluator that, when the
    checkpoint it chose was deleted before the restore, logs it and evaluates
    the newest. Idempotent; chief, worker and local training are unaffected.
    """
    executor_class = _training_module()._TrainingExecutor  # pylint: disable=protected-access
    if getattr(executor_class._start_continuous_evaluation, "_tfe_checkpoint_retry", False):
        return
    _continuous_evaluation._tfe_checkpoint_retry = True  # pylint: disable=protected-access
    executor_class._start_continuous_evaluation = _continuous_evaluation
    log.info("evaluator: checkpoints deleted by rotation before they are restored are skipped "
             "(logged), and the newest checkpoint is evaluated instead")
