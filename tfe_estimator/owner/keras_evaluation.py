"""Keras ``model.evaluate`` and ``model.predict`` across organisations (service mode, `keras_fit`).

Under ``tfe_estimator.TfeStrategy()`` in service mode, once ``model.fit`` has trained the model (the owners
agreed on it and its sums are checked under their check seed):

- ``model.evaluate(own_data)`` (and ``fit(validation_data=own_data)``): each owner evaluates ALL of its own
  rows, each step one whole batch its dataset carries (an evaluation is not split over the owners' replicas as
  a training step is: `evaluating_inputs`). While it runs, the metrics stay inside the owner: every read of a
  metric's state in Keras' ``test_function`` sums only this owner's replicas (`local_reads`), so the progress
  bar and each ``on_test_batch_end`` logs are this owner's own running metrics. At the end Keras reads every
  metric once more, eagerly (``get_metrics_result``): those reads of the metrics' states (a ``Mean``'s total and
  count, an ``Accuracy``'s ...) are secure sums through the aggregation service, with the training sums'
  integrity checks, keyed by the optimizer's step (`keras_fit.eager_sum`). So ``evaluate`` returns the
  metrics of the union of every owner's evaluation data, exactly, and every owner gets the same numbers. Every
  owner must call ``evaluate`` (the same number of times, at the same step); owners may hold different numbers
  of rows.
- Each owner's own metrics: pass `OwnerMetrics` as a callback; after each evaluation its ``own`` holds this
  owner's metrics, ``all_owners`` the returned ones, and both are logged (INFO, logger ``tfe_estimator``)::

      tfe_estimator: evaluation at step 10, all owners' data: loss 0.81
      tfe_estimator: evaluation at step 10, this owner's data only: loss 0.74

- ``model.predict(own_rows)`` is local: it needs no other owner's data (the model is every owner's), so it
  sums nothing and predicts every row, in order.

Under ``TfeStrategy(dp=...)`` the metrics are not summed across owners (an un-noised value of the other owners'
data, as Estimator's federated evaluation under DP): ``evaluate`` is refused with the plain-copy recipe.

Example::

    own = tfe_estimator.OwnerMetrics()
    union = model.evaluate(own_rows.batch(16), callbacks=[own], return_dict=True)  # every owner's data
    mine = own.own                                                                 # this owner's data only
"""
import logging
from typing import Dict, Optional

import tensorflow as tf
from tensorflow.python.distribute import cross_device_ops as cross_device_ops_lib
from tensorflow.python.util import nest

from tfe_estimator.distribute.progress import metrics_line
from tfe_estimator.owner.keras_frames import KERAS_TRAINING, frames_in

__all__ = ["OwnerMetrics", "evaluating_inputs", "local_reads", "local_reduce", "check_evaluation",
           "PLAIN_COPY_RECIPE"]

log = logging.getLogger("tfe_estimator")

#: Where the federated evaluation cannot serve: each owner evaluates a plain copy of the model on its own data.
PLAIN_COPY_RECIPE = ("Evaluate each owner's own data with a plain copy of the model: "
                     "copy = tf.keras.models.clone_model(model); copy.set_weights(model.get_weights()); "
                     "copy.compile(loss=..., metrics=...); copy.evaluate(own_data).")


def _keras_graph_function() -> str:
    from tfe_estimator.owner import keras_fit  # pylint: disable=import-outside-toplevel

    if not keras_fit.in_function():
        return ""
    return keras_fit.keras_function(tf.compat.v1.get_default_graph())


def local_reads() -> bool:
    """Whether reads across replicas built now stay inside this owner: in Keras' ``test_function`` and
    ``predict_function`` (an evaluation's running metrics; only its final, eager read is summed across owners)."""
    return _keras_graph_function() in ("test_function", "predict_function")


def local_reduce(reduce_op, value, destinations, local_replicas: int):
    """`value` reduced over this owner's replicas only (plaintext, inside the owner), as `local_reads` wants."""
    def reduce(v):
        if not isinstance(v, tf.distribute.DistributedValues):
            return cross_device_ops_lib.reduce_non_distributed_value(reduce_op, v, destinations, local_replicas)
        return cross_device_ops_lib.ReductionToOneDevice().reduce(reduce_op, v, destinations)

    return nest.map_structure(reduce, value)


def evaluating_inputs() -> bool:
    """Whether Keras is distributing a dataset for ``evaluate``, ``predict`` or ``fit``'s validation data.

    Those datasets are not split over every owner's replicas (each owner evaluates its own batches whole):
    Keras counts an evaluation's steps by the dataset's batches, so a split would evaluate half the rows. Told
    by Keras' own frames (``Model.evaluate`` / ``Model.predict``, or ``Model.fit`` once its training data
    handler exists: the validation data's handler is made after it; Keras 3: its ``epoch_iterator``).
    """
    for frame, _ in frames_in(*KERAS_TRAINING):
        if frame.f_code.co_name in ("evaluate", "predict"):
            return True
        if frame.f_code.co_name == "fit":
            return "data_handler" in frame.f_locals or "epoch_iterator" in frame.f_locals
    return False


def check_evaluation(model, latest_optimizer, dp) -> None:
    """Refuses an evaluation across owners that cannot be federated, with the plain-copy recipe.

    Raises:
      NotImplementedError: `model` has not trained through ``fit`` under this strategy (the owners agreed on
        no model, so no sum could be checked), or it is not the model that trained last, or `dp` is set.
    """
    optimizer = getattr(model, "optimizer", None)
    if dp is not None:
        raise NotImplementedError(
            "model.evaluate under TfeStrategy(dp=...) in service mode: the metrics of the other owners' data "
            f"would be released without noise, so they are not summed across owners. {PLAIN_COPY_RECIPE}")
    if optimizer is None or latest_optimizer is None or optimizer is not latest_optimizer:
        raise NotImplementedError(
            "model.evaluate across owners sums the metrics under the model the owners agreed on in model.fit: "
            f"call model.fit on this model first (on every owner), then evaluate. {PLAIN_COPY_RECIPE}")


class OwnerMetrics(tf.keras.callbacks.Callback):
    """A Keras callback: after each ``evaluate`` across owners, this owner's own metrics beside everyone's.

    Attributes:
      own: this owner's metrics of its own evaluation data only (they never left it), or None before an
        evaluation ran.
      all_owners: the metrics of every owner's data (what ``evaluate`` returns).

    Both are logged at INFO on the ``tfe_estimator`` logger, with the optimizer's step.

    Example::

        own = tfe_estimator.OwnerMetrics()
        model.evaluate(own_rows.batch(16), callbacks=[own])
        print(own.own["loss"], own.all_owners["loss"])
    """

    def __init__(self) -> None:
        super().__init__()
        self.own: Optional[Dict[str, float]] = None
        self.all_owners: Optional[Dict[str, float]] = None
        self._running: Optional[Dict[str, float]] = None

    def on_test_begin(self, logs=None):
        self._running = None

    def on_test_batch_end(self, batch, logs=None):
        self._running = dict(logs or {})  # the in-graph reads: this owner's replicas only (local_reads)

    def on_test_end(self, logs=None):
        self.own = {k: float(v) for k, v in (self._running or {}).items()}
        self.all_owners = {k: float(v) for k, v in (logs or {}).items()}
        optimizer = getattr(self.model, "optimizer", None)
        step = int(optimizer.iterations.numpy()) if optimizer is not None else None
        step_key = tf.compat.v1.GraphKeys.GLOBAL_STEP
        log.info(metrics_line("all owners' data", {**self.all_owners, step_key: step}))
        log.info(metrics_line("this owner's data only", {**self.own, step_key: step}))
