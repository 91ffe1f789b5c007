"""A progress line while an Estimator trains under a `TfeStrategy`: step, this owner's loss, steps per second.

Estimator logs its loss and ``global_step/sec`` at INFO, which TensorFlow's
logger hides by default; `ProgressHook` prints one line to standard error at a
session's first step and then every `RunConfig.log_step_count_steps` steps
(default 100; ``None`` turns it off, with Estimator's own INFO lines)::

    tfe_estimator: step 0, loss 25573.7 (this owner's first replica)
    tfe_estimator: step 100, loss 4932.21 (this owner's first replica), 11.3 steps/s

The loss is that of this process's first replica on its own batch, read on the
owner: nothing is summed across owners for it (under DP no un-noised value
leaves an owner). When the session ends, a last line names the fingerprint of
the trainable weights (`model_record.weights_fingerprint`: a hash of every
value), so owners that trained together can confirm they hold one model by
comparing their last lines::

    tfe_estimator: training ended at step 300; weights fingerprint 1f3a5c0e9d7b2a41 (equal on every owner ...)

Every `TfeStrategy` (and the cluster strategies built on it)
adds the hook to the training `EstimatorSpec` of its first replica.

Example::

    config = tfe_estimator.TfeRunConfig(log_step_count_steps=50)   # a line every 50 steps
"""
import sys
import time
from typing import Dict, Optional, TextIO

import numpy as np
import tensorflow as tf

from tfe_estimator import compat
from tfe_estimator.validation import check_int

__all__ = ["ProgressHook", "metrics_line", "with_progress"]


class ProgressHook(tf.compat.v1.train.SessionRunHook):
    """Prints ``step, loss, steps/s`` at a training session's first run and every `every_n_steps` runs.

    Args:
      loss: the loss tensor to read (a replica's own).
      every_n_steps: print after every this many session runs (a positive int).
      stream: where to print (default: standard error at print time).

    Example::

        hook = ProgressHook(spec.loss, every_n_steps=100)
    """

    def __init__(self, loss: tf.Tensor, every_n_steps: int, stream: Optional[TextIO] = None) -> None:
        check_int(every_n_steps, f"every_n_steps={every_n_steps!r}: give a positive int (RunConfig's "
                  "log_step_count_steps), or None there for no progress line.", minimum=1)
        self._loss, self._every, self._stream = loss, every_n_steps, stream
        self._global_step = None
        self._variables = []
        self._runs = 0
        self._last = None  # (step, time) of the previous fetch

    def begin(self):
        self._global_step = tf.compat.v1.train.get_global_step()
        self._variables = sorted(tf.compat.v1.trainable_variables(), key=lambda v: v.name)
        self._runs = 0
        self._last = None

    def end(self, session):
        if self._global_step is None:
            return
        from tfe_estimator.owner.model_record import format_fingerprint, weights_fingerprint  # pylint: disable=import-outside-toplevel

        step, values = session.run([self._global_step, self._variables])
        stream = self._stream or sys.stderr
        stream.write(f"tfe_estimator: training ended at step {int(step)}; weights fingerprint "
                     f"{format_fingerprint(weights_fingerprint(values))} (equal on every owner of one model)\n")
        stream.flush()

    def before_run(self, run_context):
        if self._global_step is None or self._runs % self._every:
            return None
        return tf.compat.v1.train.SessionRunArgs({"step": self._global_step, "loss": self._loss})

    def after_run(self, run_context, run_values):
        fetched, now = run_values.results, time.monotonic()
        self._runs += 1
        if not fetched:
            return
        step = int(fetched["step"])  # read in the run, before its update (as Estimator's own "step =" lines)
        rate = ""
        if self._last is not None and step > self._last[0] and now > self._last[1]:
            rate = f", {(step - self._last[0]) / (now - self._last[1]):.3g} steps/s"
        stream = self._stream or sys.stderr
        stream.write(f"tfe_estimator: step {step}, loss {float(fetched['loss']):.6g} (this owner's first replica)"
                     f"{rate}\n")
        stream.flush()
        self._last = (step, now)


def with_progress(estimator_spec, args) -> "tf.estimator.EstimatorSpec":
    """`estimator_spec` with a `ProgressHook` when it trains and the model_fn's config asks for a log interval.

    `args` are the model_fn's positional arguments as Estimator passes them to
    ``call_for_each_replica`` (features, labels, mode, config).
    """
    if compat.estimator_spec_mode(estimator_spec) != "train" or estimator_spec.loss is None:
        return estimator_spec
    config = next((a for a in args if isinstance(a, tf.estimator.RunConfig)), None)
    every = getattr(config, "log_step_count_steps", None)
    if every is None:
        return estimator_spec
    hook = ProgressHook(estimator_spec.loss, every)
    return estimator_spec._replace(training_hooks=(*estimator_spec.training_hooks, hook))


def metrics_line(whose: str, metrics: Dict) -> str:
    """``"evaluation at step <global_step>, <whose>: <name> <value>, ..."``: one line of an evaluation's metrics
    (Estimator's `LocalMetricsExporter`, Keras' `keras_evaluation.OwnerMetrics`)."""
    step = tf.compat.v1.GraphKeys.GLOBAL_STEP
    values = ", ".join(f"{k} {v:.6g}" if isinstance(v, (float, np.floating)) else f"{k} {v}"
                       for k, v in sorted(metrics.items()) if k != step)
    return f"evaluation at step {metrics.get(step)}, {whose}: {values}"
