"""Custom training loops across organisations: ``strategy.run`` and ``strategy.reduce`` in service mode.

Under ``tfe_estimator.TfeStrategy()`` on a data owner of a service-mode cluster (`keras_fit`), the loop of
TensorFlow's distributed training guide runs as under MultiWorkerMirroredStrategy, with the guarantees
``model.fit`` has across owners, through the loop's own objects:

- ``strategy.experimental_distribute_dataset(ds)``: ``ds`` carries the global batch; each owner reads its own
  rows (with 2 owners and ``batch(16)`` each owner feeds 8 per step); ``tf.nn.compute_average_loss`` divides by
  every owner's rows, so ``optimizer.apply_gradients`` applies the gradient of the mean loss over all owners'
  rows of the step, and every owner ends with bit-identical weights.
- The step key is the ``iterations`` of the optimizer whose ``apply_gradients`` sums the gradients across
  owners (the innermost Keras optimizer on the replicas' stacks when the sum is built), read before it
  increments: the first sum across owners in a ``tf.function`` must be that all-reduce. Every later sum of the
  function (``strategy.reduce(SUM / MEAN, per_replica_loss)``, a replica context's ``all_reduce``) is keyed by
  the same step; a sum before any ``apply_gradients``, or a second optimizer in one function, is refused.
- Before the first step (once the step function is traced) the owners agree on one model:
  `handshake.agree` on `model_record.loop_record` (the optimizer's class and hyperparameters, the
  variables it trains, their initial weights, the secure and DP settings), refusing owners that disagree by
  name ("learning rate of the optimizer (SGD learning_rate): 0.5 on worker:0, 0.1 on chief:0").
- Every sum goes through the service with its integrity checks, each step released once
  (`training_run.check_answer`), as ``fit``'s.
- ``strategy.reduce`` outside a ``tf.function`` (eagerly, after a step) is keyed as Keras' eager reads are
  (`keras_fit.eager_sum`: the k-th eager sum at the optimizer's current ``iterations``). ``strategy.run``
  itself must be in a ``tf.function``: a sum built while it runs eagerly is refused.

Example (``train.py``, run by ``tfe-estimator launch --workers 1 -- python train.py``)::

    strategy = tfe_estimator.TfeStrategy()
    with strategy.scope():
        model = tf.keras.Sequential([tf.keras.layers.Dense(1, input_shape=(2,))])
        optimizer = tf.keras.optimizers.SGD(0.1)

    def step_fn(x, y):
        with tf.GradientTape() as tape:
            loss = tf.nn.compute_average_loss(tf.square(model(x) - y)[:, 0])
        optimizer.apply_gradients(zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables))
        return loss

    @tf.function
    def train_step(batch):
        return strategy.reduce("SUM", strategy.run(step_fn, args=batch), axis=None)   # all owners' mean loss

    batches = iter(strategy.experimental_distribute_dataset(own_rows.repeat().batch(16)))  # 16: the global batch
    for _ in range(10):
        train_step(next(batches))
"""
import contextlib
import functools
import sys
import threading
import weakref

import tensorflow as tf

from tfe_estimator.audit.owner_graph import audit_owner_graph
from tfe_estimator.owner import keras_frames, model_record, step_key
from tfe_estimator.owner import service_strategy as service_lib

__all__ = ["call_for_each_replica", "key_gradients", "unkeyed_sum_error", "eager_run", "check_eager_sum"]

#: Per traced graph of a custom loop: "threads" (the replica threads of the strategy.run being traced),
#: "optimizer" and "variables" (the all-reduce that keyed it), "state" (the model's, `keras_fit`).
_LOOPS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
#: Per optimizer of a custom loop: its model state (the model id once the owners agree, its training run).
_STATES: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
#: How many eager ``strategy.run`` calls are running (their sums have no step to key them).
_EAGER = threading.local()

_FIX = ("Sum across owners in the tf.function that calls strategy.run(step_fn), after the step's "
        "optimizer.apply_gradients (as TensorFlow's custom training loop guide does: "
        "strategy.reduce(SUM, strategy.run(step_fn, args=...), axis=None)), or eagerly after a step.")


def _optimizer_classes() -> tuple:
    """Keras' optimizer base classes on this stack (Keras 2: the optimizer and the legacy OptimizerV2)."""
    found = [getattr(tf.keras.optimizers, "Optimizer", None),
             getattr(getattr(tf.keras.optimizers, "legacy", None), "Optimizer", None)]
    return tuple(c for c in found if isinstance(c, type))


def _applying_optimizer(threads):
    """The innermost Keras optimizer on the stacks of `threads` (the replicas, waiting in its all-reduce's
    merge_call), and that frame's ``grads_and_vars``; ``(None, None)`` without one."""
    classes, frames, found = _optimizer_classes(), sys._current_frames(), {}  # pylint: disable=protected-access
    for ident in threads:
        for frame in keras_frames.frames(frames[ident]) if ident in frames else ():
            code = frame.f_code
            if code.co_argcount and code.co_varnames[0] == "self" and isinstance(frame.f_locals.get("self"), classes):
                found.setdefault(id(frame.f_locals["self"]), (frame.f_locals["self"],
                                                              frame.f_locals.get("grads_and_vars")))
                break
    if len(found) > 1:
        raise NotImplementedError("the replicas of one strategy.run apply different optimizers: every replica "
                                  "must run the same step function.")
    return next(iter(found.values()), (None, None))


def _trained_variables(pairs, grads_and_vars):
    """The variables an all-reduce of gradients updates: its destinations (``merge_call`` path), else the
    optimizer's ``grads_and_vars``."""
    variables = [destination for _, destination in pairs]
    if not all(isinstance(v, tf.Variable) for v in variables):
        variables = [v for g, v in (grads_and_vars or ()) if g is not None]
    if not variables or not all(isinstance(v, tf.Variable) for v in variables):
        raise NotImplementedError("an optimizer's all-reduce in a custom training loop names no variables: "
                                  "TfeStrategy cannot read the model record the owners compare.")
    return variables


def key_gradients(pairs) -> None:
    """At the first sum of a custom loop's ``tf.function``, keys the function's sums by the applying
    optimizer's ``iterations`` (read before ``apply_gradients`` increments it). Called by the owner's strategy
    for every ``batch_reduce_to`` (`pairs`: its value-destination pairs); does nothing outside custom loops.

    Raises:
      NotImplementedError: a second optimizer applies gradients in a function keyed by another.
    """
    graph = tf.compat.v1.get_default_graph()
    loop = _LOOPS.get(graph)
    if loop is None or not loop["threads"]:
        return  # not a custom loop's strategy.run being traced
    optimizer, grads_and_vars = _applying_optimizer(loop["threads"])
    if optimizer is None:
        return  # an all-reduce of the step function's own: keyed if an optimizer applied before (_next_channel)
    if loop["optimizer"] is None:
        state = _STATES.setdefault(optimizer, {"model": None, "sessions": 0})
        with tf.init_scope():  # a legacy optimizer makes `iterations` at first use: eagerly (the handshake reads it)
            iterations = optimizer.iterations
        with graph.control_dependencies(None):  # not under the replicas' captured control dependencies
            step = step_key.read_step(iterations, name="service_step")
        service_lib.register_graph(graph, step, state)
        loop.update(optimizer=optimizer, variables=_trained_variables(pairs, grads_and_vars), state=state)
    elif optimizer is not loop["optimizer"]:
        raise NotImplementedError(
            f"two optimizers ({type(loop['optimizer']).__name__} and {type(optimizer).__name__}) apply gradients "
            "in one tf.function of a custom training loop: TfeStrategy in service mode keys each step's sums by "
            "one optimizer's iterations. Apply each optimizer in a tf.function of its own.")


def call_for_each_replica(extended, fn, args, kwargs, call):
    """Traces ``strategy.run(fn)`` in a custom loop's ``tf.function`` under `extended` (a `ServiceExtended`);
    once its optimizer's all-reduce keyed the function (`key_gradients`), the owners' handshake on the loop's
    model, before its first step runs."""
    from tfe_estimator.owner import keras_fit  # pylint: disable=import-outside-toplevel

    graph = tf.compat.v1.get_default_graph()
    loop = _LOOPS.setdefault(graph, {"threads": set(), "optimizer": None})
    threads = loop["threads"] = set()

    def replica_fn(*fn_args, **fn_kwargs):
        threads.add(threading.get_ident())
        return fn(*fn_args, **fn_kwargs)

    try:
        result = call(replica_fn, args, kwargs)
    finally:
        loop["threads"] = set()
    optimizer = loop["optimizer"]
    if optimizer is not None:
        audit_owner_graph(graph)  # what the step lets out: fresh keys and masked shares only
        read = functools.partial(model_record.loop_record, optimizer, loop["variables"])
        with tf.init_scope():  # eager: the initial (or restored) weights, before any step runs
            keras_fit.agree_on_model(extended, optimizer, loop["state"], read, variables=lambda: loop["variables"])
    return result


def unkeyed_sum_error(graph) -> NotImplementedError:
    """The refusal of a sum across owners in a ``tf.function`` that no optimizer's all-reduce keyed."""
    return NotImplementedError(
        f"a sum across owners in tf.function {graph.name!r} before any optimizer.apply_gradients in it (or in a "
        "function with none): TfeStrategy in service mode keys each step's sums across owners by the "
        "iterations of the optimizer that applies the step's gradients, and the owners agree on that "
        f"optimizer's model before its first step. {_FIX}")


@contextlib.contextmanager
def eager_run():
    """Marks an eager ``strategy.run`` (outside ``tf.function``): a sum it builds is refused (`check_eager_sum`)."""
    _EAGER.depth = getattr(_EAGER, "depth", 0) + 1
    try:
        yield
    finally:
        _EAGER.depth -= 1


def check_eager_sum() -> None:
    """Refuses a sum across owners built while ``strategy.run`` runs eagerly.

    Raises:
      NotImplementedError: naming the fix (``tf.function``).
    """
    if getattr(_EAGER, "depth", 0):
        raise NotImplementedError(
            "strategy.run summed across owners eagerly (outside tf.function): TfeStrategy in service mode keys a "
            "step's sums by the optimizer's iterations when the step function is traced, and the owners agree on "
            "the model then. Wrap the step in tf.function: @tf.function def train_step(batch): return "
            "strategy.run(step_fn, args=(batch,)) (model.fit: leave run_eagerly off).")
