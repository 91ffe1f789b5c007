"""Keras 3's reads across replicas that only build a model or reset a variable: answered inside the owner.

Under a `tf.distribute` strategy Keras 3 (``keras/src/backend/tensorflow/trainer.py``, ``_maybe_symbolic_build``)
builds the model's, metrics' and loss's variables from the first training batch before ``fit`` traces its
``train_function``, in two places that reduce across replicas:

- eagerly, ``strategy.reduce("MEAN", first_batch, axis=None)`` of the first batch of RAW training rows, when
  the batch is a ``DistributedValues`` (more than one local replica). Only the result's shapes are used;
- in ``backend.compute_output_spec``'s scratch graph (``keras/src/backend/tensorflow/core.py``): Keras calls
  ``compute_metrics`` there, which reads each metric's on-read variables across replicas. The scratch graph is
  never run; only its outputs' shapes are kept.

And one more, whenever Keras 3 assigns an on-read variable (a metric's ``total`` / ``count``, reset by
``reset_metrics`` before each epoch and evaluation): its ``_direct_assign`` calls TensorFlow's ``assign`` with
``read_value=True``, so TensorFlow reads the variable back across replicas (``values_util.assign_on_each_device``)
and Keras throws the value away.

Across owners the first would be a secure sum of raw rows outside any agreed step (no step key, no model the
owners agreed on), and the second a sum in a graph nobody runs. Both are answered inside this owner instead
(its own replicas only, plaintext, never sent anywhere): same shapes, nothing leaves. The detection is
narrow and fails closed: the first needs Keras 3's ``_maybe_symbolic_build`` frame reducing this very value
(its local ``maybe_distributed_data_batch``) eagerly; the second needs the default graph to be the scratch
graph ``compute_output_spec`` made (its frame's ``graph_name``); the third needs TensorFlow's
``assign_on_each_device`` reading back this very variable for Keras 3's ``_direct_assign``, which discards it.
Anything else goes on to the owners' sum, whose
own checks refuse a sum outside a step (`keras_fit.eager_sum`).

Example (what `keras_fit._KerasExtended._reduce_to` does)::

    if keras_build.answered_locally(value):
        return keras_evaluation.local_reduce(reduce_op, value, destinations, local_replicas)
"""
import tensorflow as tf
from tensorflow.python.framework import func_graph

from tfe_estimator.owner.keras_frames import KERAS3_TRAINER as _TRAINER
from tfe_estimator.owner.keras_frames import frames_in as _frames_in

__all__ = ["answered_locally"]

_CORE = "keras/src/backend/tensorflow/core.py"
_VALUES_UTIL = "tensorflow/python/distribute/values_util.py"


def _first_batch_mean(value) -> bool:
    """Eager ``strategy.reduce("MEAN", first_batch)`` of Keras 3's ``_maybe_symbolic_build``, of this value."""
    if not tf.executing_eagerly():
        return False
    # The innermost Keras backend frame must be that reduce: a callback or metric reading across owners inside
    # fit is not it (its nearest Keras frame is another function).
    frame, name = next(_frames_in(_TRAINER, _CORE), (None, None))
    return (name == _TRAINER and frame.f_code.co_name == "_maybe_symbolic_build"
            and frame.f_locals.get("maybe_distributed_data_batch", None) is value)


def _scratch_graph() -> bool:
    """Whether the default graph is the never-run scratch graph of Keras 3's ``compute_output_spec``."""
    graph = tf.compat.v1.get_default_graph()
    if not isinstance(graph, func_graph.FuncGraph) or not graph.name.startswith("scratch_graph"):
        return False
    return any(frame.f_code.co_name == "compute_output_spec" and frame.f_locals.get("graph_name") == graph.name
               for frame, _ in _frames_in(_CORE))


def _discarded_read_back(value) -> bool:
    """TensorFlow reading back `value` (an on-read variable) for Keras 3's ``_direct_assign``, which discards it."""
    frames = _frames_in(_VALUES_UTIL, _CORE, _TRAINER)
    frame, name = next(frames, (None, None))
    if name != _VALUES_UTIL or frame.f_code.co_name != "assign_on_each_device":
        return False
    if frame.f_locals.get("var", None) is not value or frame.f_locals.get("read_value") is not True:
        return False
    frame, name = next(((f, n) for f, n in frames if n != _VALUES_UTIL), (None, None))  # the next Keras frame
    return name == _CORE and frame.f_code.co_name == "_direct_assign"


def answered_locally(value) -> bool:
    """Whether a reduce of `value` across replicas, asked now, is one of Keras 3's reads that only build a
    model or reset a variable (module docstring): to be answered inside this owner, over its own replicas.

    Args:
      value: what the strategy is asked to reduce (before any wrapping).
    """
    return _first_batch_mean(value) or _scratch_graph() or _discarded_read_back(value)
