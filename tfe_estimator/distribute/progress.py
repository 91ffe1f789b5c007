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
adds the hook to the training `EstimatorSpec` of its first replica. Keras'
``fit`` prints the same lines through `step_line` / `end_line`
(`tfe_estimator.owner.keras_progress.ProgressCallback`).

Example::

    config = tfe_estimator.TfeRunConfig(log_step_count_steps=50)   # a line every 50 steps
"""
import sys
import time
from typing import Dict, Optional, Sequence, TextIO, Tuple

import numpy as np
import tensorflow as tf

from tfe_estimator import compat
from tfe_estimator.validation import check_int

__all__ = ["ProgressHook", "FIRST_REPLICA", "step_line", "end_line", "write_line", "rate_since", "metrics_line",
           "with_progress"]

#: Whose loss Estimator's line shows (read on the owner; nothing is summed for it).
FIRST_REPLICA = "this owner's first replica"


def step_line(step: int, loss: float, whose: str, rate: Optional[float] = None) -> str:
    """``"tfe_estimator: step <step>, loss <loss> (<whose>)[, <rate> steps/s]"``: the progress line of
    Estimator's `ProgressHook` and Keras' `tfe_estimator.owner.keras_progress.ProgressCallback`.

    Example::

        >>> step_line(100, 4932.2123, "this owner's first replica", 11.34)
        "tfe_estimator: step 100, loss 4932.21 (this owner's first replica), 11.3 steps/s"
    """
    speed = f", {rate:.3g} steps/s" if rate is not None else ""
    return f"tfe_estimator: step {int(step)}, loss {float(loss):.6g} ({whose}){speed}"


def end_line(step: int, values: Sequence) -> str:
    """``"tfe_estimator: training ended at step <step>; weights fingerprint <hex> (...)"``: the last line of a
    training, with the fingerprint (`model_record.weights_fingerprint`) of `values`, the trained weights in one
    order on every owner, so owners that trained together compare their last lines."""
    from tfe_estimator.owner.model_record import format_fingerprint, weights_fingerprint  # pylint: disable=import-outside-toplevel

    return (f"tfe_estimator: training ended at step {int(step)}; weights fingerprint "
            f"{format_fingerprint(weights_fingerprint(values))} (equal on every owner of one model)")


def write_line(line: str, stream: Optional[TextIO] = None) -> None:
    """Writes `line` to `stream` (default: standard error at write time) and flushes it."""
    stream = stream or sys.stderr
    stream.write(line + "\n")
    stream.flush()


def rate_since(last: Optional[Tuple[int, float]], step: int, now: float) -> Optional[float]:
    """Steps per second since `last` (``(step, time.monotonic())`` of the previous line), or None."""
    if last is None or step <= last[0] or now <= last[1]:
        return None
    return (step - last[0]) / (now - last[1])


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
        step, values = session.run([self._global_step, self._variables])
        write_line(end_line(step, values), self._stream)

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
        write_line(step_line(step, fetched["loss"], FIRST_REPLICA, rate_since(self._last, step, now)), self._stream)
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
