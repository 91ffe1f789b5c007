"""`ProgressCallback`: Estimator's progress lines for Keras ``model.fit``, and its last line (a weights fingerprint).

Estimator's owners get `tfe_estimator.distribute.progress.ProgressHook`; Keras' owners get the same lines,
through the same functions (`progress.step_line`, `progress.end_line`), from a Keras callback: one line to
standard error at ``fit``'s first step and every `every_n_steps` steps after it, and one when ``fit`` ends::

    tfe_estimator: step 0, loss 2.0731 (this epoch's mean so far, every owner's rows: a secure sum)
    tfe_estimator: step 100, loss 0.4127 (this epoch's mean so far, every owner's rows: a secure sum), 8.21 steps/s
    tfe_estimator: training ended at step 300; weights fingerprint 1f3a5c0e9d7b2a41 (equal on every owner ...)

``step N`` is the optimizer's step the loss was computed at (``iterations`` before its update, as Estimator's
global step). The loss is the one Keras already has in ``fit``'s logs (its progress bar's): the running mean
of this epoch. What it covers depends on Keras (`loss_source`): Keras 2 reads the loss metric across replicas
(its ``result()`` runs in a ``merge_call``), so in service mode it is every owner's rows, summed securely
through the aggregation service; Keras 3 averages this owner's replicas' own results (its ``train_function``'s
``reduce_per_replica``), so it is this owner's rows. Under DP it is always this owner's own: an un-noised value
is never summed across owners (`SecureAggregation`), and nothing here sends anything anywhere.

The last line's fingerprint (`model_record.weights_fingerprint` of ``model.trainable_weights``, in that order:
the order `keras_fit`'s weight checks compare) is equal on every owner of one model: owners compare their last
lines.

In service mode ``TfeStrategy()`` adds the callback to ``fit`` itself (`attach`, called by `keras_fit` once the
owners agreed on the model, before its first step: the user changes only the strategy line). That is the ``fit``
that first trains the model in this process (Keras traces its step once per model; later ``fit`` calls of the
same model reuse it and get no line added); pass your own ``ProgressCallback(every_n_steps=...)`` in
``callbacks=`` for those, or for another interval (it is then not added again).

Example::

    model.fit(rows.repeat().batch(16), steps_per_epoch=500,
              callbacks=[tfe_estimator.ProgressCallback(every_n_steps=50)])
"""
import logging
import sys
import time
from typing import Optional, TextIO

import tensorflow as tf

from tfe_estimator.distribute import progress
from tfe_estimator.validation import check_int

__all__ = ["ProgressCallback", "loss_source", "attach", "DEFAULT_EVERY_N_STEPS"]

log = logging.getLogger("tfe_estimator")

#: Estimator's default ``log_step_count_steps``: the interval of the line `attach` adds.
DEFAULT_EVERY_N_STEPS = 100


def _keras_major() -> int:
    """The major version of the Keras behind ``tf.keras`` (2 on TensorFlow 2.15, 3 on 2.16 and later)."""
    package = sys.modules[tf.keras.Model.__module__.split(".")[0]]
    return int(str(getattr(package, "__version__", "3")).split(".")[0])


def loss_source(strategy) -> str:
    """Whose rows the loss in Keras ``fit``'s logs covers under `strategy` (module docstring)."""
    ops = getattr(strategy, "secure_aggregation", None)
    if getattr(ops, "binding", None) is None:  # one machine, or no TfeStrategy: every local replica's rows
        return "this epoch's mean so far"
    if _keras_major() < 3 and ops.dp is None:
        return "this epoch's mean so far, every owner's rows: a secure sum"
    return "this epoch's mean so far, this owner's rows"


class ProgressCallback(tf.keras.callbacks.Callback):
    """Prints ``step, loss, steps/s`` at ``fit``'s first step and every `every_n_steps` steps, and the weights'
    fingerprint when ``fit`` ends (module docstring).

    Args:
      every_n_steps: a line every this many steps (a positive int; Estimator's ``log_step_count_steps``).
      stream: where to print (default: standard error at print time).

    Raises:
      ValueError: `every_n_steps` is not a positive int.
    """

    def __init__(self, every_n_steps: int = DEFAULT_EVERY_N_STEPS, stream: Optional[TextIO] = None) -> None:
        super().__init__()
        self._every = check_int(every_n_steps, f"ProgressCallback(every_n_steps={every_n_steps!r}): give a positive "
                                               "int, how many steps apart the progress line shows.", minimum=1)
        self._stream = stream
        self._runs, self._last = 0, None

    def on_train_begin(self, logs=None):
        self._runs, self._last = 0, None

    def on_train_batch_end(self, batch, logs=None):
        runs, now = self._runs, time.monotonic()
        self._runs += 1
        loss = (logs or {}).get("loss")
        if runs % self._every or loss is None:
            return
        step = int(self.model.optimizer.iterations.numpy()) - 1  # the step the loss was computed at
        line = progress.step_line(step, float(loss), loss_source(self.model.distribute_strategy),
                                  progress.rate_since(self._last, step, now))
        progress.write_line(line, self._stream)
        self._last = (step, now)

    def on_train_end(self, logs=None):
        values = [v.numpy() for v in self.model.trainable_weights]
        progress.write_line(progress.end_line(int(self.model.optimizer.iterations.numpy()), values), self._stream)


def attach(callbacks, model) -> bool:
    """Adds a `ProgressCallback` to the `callbacks` of a running ``fit`` (Keras' ``CallbackList``), unless one is
    there; True when one is there now.

    Called before ``fit``'s first step runs (inside its first trace, after ``on_train_begin``): the callback
    is set up as that list would have set it up had it been passed to ``fit``: its model and parameters, and
    the list calls its batch hooks (Keras 2 calls them only if some callback had them when the list was made;
    Keras 3 dispatches them in a thread unless a callback has them: here, in order, on this thread).
    """
    listed = getattr(callbacks, "callbacks", None)
    if not isinstance(listed, list):
        return False
    if any(isinstance(c, ProgressCallback) for c in listed):
        return True
    callback = ProgressCallback()
    callback.set_model(model)
    callback.set_params(getattr(callbacks, "params", None) or {})
    listed.append(callback)
    if hasattr(callbacks, "_should_call_train_batch_hooks"):  # Keras 2
        callbacks._should_call_train_batch_hooks = True  # pylint: disable=protected-access
        if getattr(callbacks, "_batch_start_time", 0) is None:  # its timing check reads the begin hook's time
            callbacks._batch_start_time = time.time()  # pylint: disable=protected-access
    if hasattr(callbacks, "_async_train"):  # Keras 3
        callbacks._async_train = False  # pylint: disable=protected-access
    return True
