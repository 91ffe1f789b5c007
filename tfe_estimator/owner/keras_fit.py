"""Keras ``model.fit`` across organisations: the thin adapter between Keras and the owner's side of service mode.

Under a TF_CONFIG cluster in service mode (what `tfe-estimator launch`, ``k8s --party`` and the deployment
page give every data owner), ``tfe_estimator.TfeStrategy()`` builds this owner's `OwnerStrategy`
(`owner_strategy_from_environment`): a `ServiceStrategy` bound to the cluster's two aggregation servers,
exactly as `TfeRunConfig` builds it for Estimator. Keras then trains as under MultiWorkerMirroredStrategy:

- each owner reads only its own data; the batch its dataset carries is the global batch (with 2 owners and
  ``batch(16)`` each owner feeds 8 of its rows per step, in order: the strategy counts every owner's
  replicas in ``num_replicas_in_sync``, and Keras' distributed dataset splits by it);
- per step the update is the gradient of the mean loss over every owner's rows: each owner's gradients are
  one secure contribution per step to the service (`contribution`, with its integrity checks), keyed by the
  optimizer's ``iterations``;
- before the first step (when ``fit`` traces its ``train_function``) the owners agree on one model: the same
  handshake as Estimator's (`handshake.agree`) on the Keras model's record (`model_record.keras_record`:
  optimizer and its hyperparameters, loss, variables, initial weights, secure and DP settings), refusing
  owners that disagree by name ("learning rate of the optimizer (SGD learning_rate): 0.5 on worker:0, 0.1 on
  chief:0");
- at the end of every epoch (and of every ``evaluate``), at the first value Keras reads across owners, the
  owners compare their weights' fingerprints through server0 (`weight_check.check_weights`, as Estimator's
  `estimator.WeightCheckHook` does at checkpoint steps): owners holding different weights stop with
  `handshake.OwnersDisagreeError` naming them and the step;
- progress lines as Estimator's (`keras_progress.ProgressCallback`, added to that first ``fit``): every 100 steps
  and, when ``fit`` ends, the weights' fingerprint, equal on every owner;
- every owner starts from identical weights: the strategy seeds Keras (``tf.keras.utils.set_random_seed``)
  with the seed every owner derives alike from the cluster, as `TfeRunConfig` does for Estimator.

What Keras runs here is found in ``fit``'s replica function (Keras 2's ``run_step`` closes over its model;
Keras 3 runs ``model.train_step`` itself, and builds the model from shapes before step 1 inside the owner:
`keras_build`); on Keras 3 ``BackupAndRestore`` backs up at epoch ends only (`_check_backups`);
``strategy.run`` in another ``tf.function`` (a custom training loop) runs as `custom_loop` describes.
``model.evaluate`` (metrics of every owner's data, secure sums of the metrics' states) and ``model.predict``
(local) run as `keras_evaluation` describes.

Example (``train.py``, run by ``tfe-estimator launch --workers 1 -- python train.py``)::

    strategy = tfe_estimator.TfeStrategy()
    with strategy.scope():
        model = tf.keras.Sequential([tf.keras.layers.Dense(1, input_shape=(3,))])
        model.compile(tf.keras.optimizers.SGD(0.1), "mse")
    model.fit(own_rows.repeat().batch(16), steps_per_epoch=10, epochs=1)
"""
import functools
import inspect
import logging
import weakref
from typing import Callable, Optional

import tensorflow as tf
from tensorflow.python.framework import func_graph

from tfe_estimator.audit.owner_graph import audit_owner_graph
from tfe_estimator.cluster import spec as cluster_lib
from tfe_estimator.distribute.devices import cpus_needed, local_layout, validate_num_replicas
from tfe_estimator.distribute.logical_devices import check_logical_cpus, ensure_logical_cpus
from tfe_estimator.owner import (custom_loop, handshake, keras_build, keras_evaluation, keras_frames, keras_progress,
                                 model_record, service_strategy as service_lib, step_key, training_run, weight_check)
from tfe_estimator.owner.step_wait import DEFAULT_STEP_TIMEOUT_SECS

__all__ = ["OwnerStrategy", "owner_strategy_from_environment", "in_function", "keras_function",
           "call_for_each_replica", "agree_on_model", "eager_sum", "repeated_releases", "backup_dir",
           "SEED_HINT"]

log = logging.getLogger("tfe_estimator")

#: How owners start from identical weights under Keras (the handshake's hint when their weights differ).
SEED_HINT = ("build the model after TfeStrategy() (it seeds Keras alike on every owner), or call "
             "tf.keras.utils.set_random_seed(<one seed>) on every owner before building it")

#: Per Keras model: {"model": its id once the owners agree, "run": its `TrainingRun`, "sessions": handshakes}.
_MODELS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
#: The model that trained last (its state and optimizer), and the eager sums made at its current step.
_LATEST = {"state": None, "optimizer": None, "variables": None, "binding": None, "step": None, "count": 0,
           "checked": None}


class _KerasExtended(service_lib.ServiceExtended):
    """`ServiceExtended` under Keras: its functions' steps (`call_for_each_replica`), and what an evaluation
    keeps inside the owner (`keras_evaluation`: its running metric reads and its datasets)."""

    def _call_for_each_replica(self, fn, args, kwargs):
        if in_function():  # a step of one of Keras' functions, or of a custom loop's tf.function
            return call_for_each_replica(self, fn, args, kwargs, super()._call_for_each_replica)
        if tf.executing_eagerly():  # strategy.run outside tf.function: a sum it builds is refused
            with custom_loop.eager_run():
                return super()._call_for_each_replica(fn, args, kwargs)
        return super()._call_for_each_replica(fn, args, kwargs)

    def _batch_reduce_to(self, reduce_op, value_destination_pairs, options):
        custom_loop.key_gradients(value_destination_pairs)  # a custom loop's first all-reduce keys its function
        return super()._batch_reduce_to(reduce_op, value_destination_pairs, options)

    def _reduce_to(self, reduce_op, value, destinations, options):
        if keras_build.answered_locally(value):  # Keras 3 building from shapes or resetting: inside this owner
            return keras_evaluation.local_reduce(reduce_op, value, destinations, len(self.worker_devices))
        return super()._reduce_to(reduce_op, value, destinations, options)

    def _local_reduce(self, reduce_op, value, destinations):
        if keras_evaluation.local_reads():  # a Keras evaluation's running metrics: this owner's replicas only
            return keras_evaluation.local_reduce(reduce_op, value, destinations, len(self.worker_devices))
        return None

    def _owner_local_dataset(self) -> bool:
        return keras_evaluation.evaluating_inputs()


class OwnerStrategy(service_lib.ServiceStrategy, tf.distribute.MirroredStrategy):
    """The `ServiceStrategy` that ``TfeStrategy()`` returns to a data owner under a service-mode cluster.

    Built by `owner_strategy_from_environment` (from ``TfeStrategy()``, its metaclass), which initialises it as a
    `ServiceStrategy`; its own ``__init__`` has nothing to do. It is also a
    ``tf.distribute.MirroredStrategy`` (TensorFlow 2's, after the V1 one `TfeStrategy` is: every method
    still resolves to the V1 class first) because Keras' ``BackupAndRestore`` accepts only TensorFlow 2's
    MirroredStrategy, MultiWorkerMirroredStrategy, TPUStrategy and ParameterServerStrategy (an instance
    check, Keras 2.15 ``callbacks.py``).
    """

    _EXTENDED = _KerasExtended

    def __init__(self, *args, **kwargs):  # pylint: disable=super-init-not-called
        del args, kwargs  # built by owner_strategy_from_environment


def owner_strategy_from_environment(num_replicas: Optional[int] = None, protocol: str = "pond",
                                    precision: str = "low", clip_norm: Optional[float] = None, dp=None,
                                    update_ring_bits: int = 64,
                                    step_timeout_secs: float = DEFAULT_STEP_TIMEOUT_SECS,
                                    **ignored) -> OwnerStrategy:
    """This owner's service-mode strategy; TF_CONFIG names a service-mode cluster (`strategy_mode.pick_mode`).

    Args:
      num_replicas: this owner's local replicas (default 1); protocol: must be "pond" (two servers);
      precision, clip_norm, dp, update_ring_bits: as `ServiceStrategy`; step_timeout_secs: as `TfeRunConfig`.
      ignored: `TfeStrategy`'s one-machine arguments (``implementation``, ``partial_batches``).

    Raises:
      ValueError: this task is an aggregation server, the protocol is not Pond, or TF_CONFIG / the
        certificates cannot run service mode (`service_strategy.service_binding`).
    """
    del ignored
    spec = cluster_lib.TfeCluster.from_environment()  # a chief or worker of a service-mode cluster (pick_mode)
    if spec.task_type == cluster_lib.TFE_JOB:
        raise ValueError(f"TF_CONFIG says this is task {spec.task_index} of the '{cluster_lib.TFE_JOB}' job: "
                         "aggregation servers run `tfe-estimator server`, not a training script.")
    if protocol != "pond":
        raise ValueError(f"TfeStrategy(protocol={protocol!r}) in service mode: the aggregation service runs "
                         "Pond's sum (two servers); use protocol='pond'.")
    from tfe_estimator.secure.protocols import load_backend  # pylint: disable=import-outside-toplevel

    load_backend()  # fails early without secure randomness
    binding = service_lib.service_binding(spec, step_timeout_secs, "TfeStrategy()")
    devices = _local_replicas(num_replicas)
    strategy = OwnerStrategy.__new__(OwnerStrategy)
    service_lib.ServiceStrategy.__init__(strategy, binding, devices=devices, precision=precision,
                                         clip_norm=clip_norm, update_ring_bits=update_ring_bits, dp=dp)
    ops = strategy.extended._cross_device_ops  # pylint: disable=protected-access
    ops.eager_channel, ops.check_unkeyed = _eager_channel, _check_unkeyed
    seed = service_lib.cluster_seed(spec)
    tf.keras.utils.set_random_seed(seed)
    log.info("Keras seeded with %d, derived from TF_CONFIG's cluster alike on every owner, so all owners start "
             "from identical weights; call tf.keras.utils.set_random_seed(<int>) after TfeStrategy() on every "
             "owner to choose another.", seed)
    return strategy


def _local_replicas(num_replicas: Optional[int]) -> list:
    """This owner's replica devices for `num_replicas` (default 1), with the logical CPU devices eager TensorFlow
    needs for them made as one-machine ``TfeStrategy()`` makes them (`logical_devices.ensure_logical_cpus`).

    Raises:
      RuntimeError: TensorFlow's runtime already started with several CPU devices, but fewer than the replicas
        need (`logical_devices.check_logical_cpus` names the numbers and the fix).
    """
    devices = list(local_layout(validate_num_replicas(1 if num_replicas is None else num_replicas), "pond")[0])
    if tf.executing_eagerly() and not ensure_logical_cpus(cpus_needed(devices)):
        check_logical_cpus(devices)
    return devices


def in_function() -> bool:
    """Whether ops are being built in a ``tf.function`` (Keras' ``train_function``), not Estimator's graph."""
    return isinstance(tf.compat.v1.get_default_graph(), func_graph.FuncGraph)


def _keras_model(fn) -> Optional["tf.keras.Model"]:
    """The Keras model a replica function of ``fit`` / ``evaluate`` / ``predict`` runs: its closure's (Keras 2's
    ``run_step``, Keras 3's ``predict``'s ``one_step_on_data``) or, on Keras 3, the model of ``model.train_step``
    / ``model.test_step`` (what Keras 3's ``fit`` and ``evaluate`` run)."""
    original = inspect.unwrap(fn)
    if _KERAS3_STEPS.get(getattr(original, "__name__", None)) and isinstance(getattr(original, "__self__", None),
                                                                             tf.keras.Model):
        return original.__self__
    code, cells = getattr(original, "__code__", None), getattr(original, "__closure__", None) or ()
    if code is None:
        return None
    for name, cell in zip(code.co_freevars, cells):
        if name in ("model", "self") and isinstance(cell.cell_contents, tf.keras.Model):
            return cell.cell_contents
    return None


#: Keras 3 names no graph after its functions: which one a replica function belongs to, by its name.
_KERAS3_STEPS = {"train_step": "train_function", "test_step": "test_function"}


def _keras3_function(fn) -> str:
    """Which of Keras 3's functions runs `fn` ("train_function", "test_function", "predict_function"; "" if
    none): ``model.train_step`` / ``model.test_step``, or ``make_predict_function``'s ``one_step_on_data``."""
    original = inspect.unwrap(fn)
    if isinstance(getattr(original, "__self__", None), tf.keras.Model):
        return _KERAS3_STEPS.get(getattr(original, "__name__", None), "")
    if getattr(original, "__qualname__", "").endswith("make_predict_function.<locals>.one_step_on_data"):
        return "predict_function"
    return ""


def call_for_each_replica(extended, fn, args, kwargs, call: Callable):
    """Builds one step of a Keras function under `extended` (a `_KerasExtended`): its sums keyed by the
    optimizer's ``iterations``, and, when it trained, the owners' handshake before its first step runs."""
    model = _keras_model(fn)
    graph = tf.compat.v1.get_default_graph()
    function = keras_function(graph) or (_keras3_function(fn) if model is not None else "")
    if not function:  # strategy.run in the user's own tf.function: a custom training loop
        return custom_loop.call_for_each_replica(extended, fn, args, kwargs, call)
    if model is not None and function == "predict_function":
        return call(fn, args, kwargs)  # local: each owner predicts its own rows, nothing is summed
    optimizer = getattr(model, "optimizer", None)
    if model is None or optimizer is None:
        raise NotImplementedError(
            f"Keras' {function} runs {getattr(fn, '__name__', fn)!r} under TfeStrategy in service mode, but "
            "names no compiled Keras model: its sums would have no optimizer.iterations to key them. Compile the "
            "model (model.compile(optimizer, loss)) before model.fit.")
    if function == "test_function":
        # evaluate: the metrics' running reads stay inside the owner (keras_evaluation.local_reads); only
        # Keras' final eager read of them is summed across owners (eager_sum), under the agreed model.
        latest = _LATEST["optimizer"]() if _LATEST["optimizer"] is not None else None
        keras_evaluation.check_evaluation(model, latest, extended._cross_device_ops.dp)  # pylint: disable=protected-access
        return call(fn, args, kwargs)
    if function != "train_function":
        raise NotImplementedError(
            f"Keras' {function or graph.name} under TfeStrategy in service mode: only model.fit, "
            f"model.evaluate and model.predict run across owners. {keras_evaluation.PLAIN_COPY_RECIPE}")
    state = _MODELS.setdefault(model, {"model": None, "sessions": 0})
    with tf.init_scope():  # a legacy optimizer (make_dp_optimizer's) makes `iterations` at first use: eagerly, so
        iterations = optimizer.iterations  # it holds 0 when the handshake reads it (made in the step, it is empty)
    service_lib.register_graph(graph, step_key.read_step(iterations, name="service_step"), state)
    result = call(fn, args, kwargs)
    if service_lib.sums_built(graph):
        audit_owner_graph(graph)  # what the step lets out: fresh keys and masked shares only
        with tf.init_scope():  # eager: the model's initial (or restored) weights, before any step runs
            agree_on_model(extended, optimizer, state, functools.partial(model_record.keras_record, model),
                           variables=lambda: model.trainable_weights, model=model)
            _show_progress(model)
    return result


def keras_function(graph) -> str:
    """Which of Keras' functions `graph` belongs to ("train_function", "test_function", ...; "" if none)."""
    while isinstance(graph, func_graph.FuncGraph):
        if graph.name.split("_function")[0] in ("train", "test", "predict"):
            return graph.name.split("_function")[0] + "_function"
        graph = graph.outer_graph
    return ""


def agree_on_model(extended, optimizer, state: dict, read_record: Callable, variables: Callable[[], list],
                   model=None) -> None:
    """The owners' handshake (`handshake.agree`) on the model `optimizer` trains, once per traced
    training function (``fit``'s, or a custom loop's: `custom_loop`).

    Args:
      extended: the owner's `_KerasExtended`; optimizer: the model's (its ``iterations`` keys the sums).
      state: the model's state (``"model"``: its id once agreed, ``"run"``, ``"sessions"``).
      read_record: ``read_record(settings, num_owners)`` reads the model record eagerly
        (`model_record.keras_record` of a compiled model, `model_record.loop_record` of a custom loop's).
      variables: ``variables()`` gives the trained variables, in one order on every owner (the weight checks').
      model: the compiled Keras model (``fit``), whose ``BackupAndRestore`` directory keeps the DP ledger.

    Raises:
      handshake.OwnersDisagreeError: naming what differs; check_seed.CheckSeedError.
    """
    binding = extended._cross_device_ops.binding  # pylint: disable=protected-access
    step = int(optimizer.iterations.numpy())
    if "run" not in state:  # a model restored (BackupAndRestore) resumes its run: replays are its catch-up
        run = training_run.for_training(None)
        state["run"] = training_run.TrainingRun(run.number, fresh=step == 0)
        dp = extended._cross_device_ops.dp  # pylint: disable=protected-access
        if dp is not None:  # each step's noise released once (training_run.check_answer), kept with the backup
            ledger_dir = backup_dir(model) if model is not None else None
            if ledger_dir is None and step > 0:
                log.warning("DP across owners: model restored at step %d without Keras' BackupAndRestore; the "
                            "release ledger starts empty in this process, so a step the servers release again "
                            "with fresh noise cannot be told from a replay here. Train with "
                            "tf.keras.callbacks.BackupAndRestore(backup_dir) to keep the ledger across restarts.",
                            step)
            state["ledger"] = training_run.ReleaseLedger(ledger_dir, step == 0, dp.count_repeated_releases)
    settings = extended._settings()  # pylint: disable=protected-access
    settings["training run"] = state["run"].number

    def on_model(model_id):
        state["model"] = model_id
        state["sessions"] += 1

    _check_backups()
    record = read_record(settings, len(binding.owners))
    step, weights, fields = record
    agreed = (model_record.model_id(fields), step, weights)
    if state.get("agreed") == agreed:
        # tf.function traces fit's step twice when its first trace creates variables (Keras' metrics); nothing
        # ran in between: the owners agreed on this very record already.
        return
    try:
        handshake.agree(binding, service_lib.service_client, record, on_model, seed_hint=SEED_HINT)
    except ValueError as e:  # OwnersDisagreeError, CheckSeedError: raised as they are, not as AutoGraph's
        e.ag_pass_through = True  # StagingError ("in user code: ...") that fit's tracing would make of them
        if "agreed" not in state:  # refused before its first step: a corrected model takes its run's number
            training_run.refused(state.pop("run"))
        raise
    state["agreed"] = agreed
    _LATEST.update(state=state, optimizer=weakref.ref(optimizer), variables=variables, binding=binding,
                   step=None, count=0, checked=None)


def backup_dir(model) -> Optional[str]:
    """Where Keras' ``BackupAndRestore`` keeps `model`'s training state during ``fit`` (Keras 2: the directory
    its restore reads, ``<backup_dir>/chief`` on a single worker), or None without one: under DP the owner's
    release ledger (`training_run.ReleaseLedger`) is kept there, so a restarted owner still refuses (or
    counts) a step the servers release to it again with fresh noise."""
    manager = getattr(getattr(model, "_training_state", None), "read_checkpoint_manager", None)
    return getattr(manager, "directory", None)


def _check_backups() -> None:
    """Refuses Keras 3's ``BackupAndRestore`` that backs up within an epoch (an integer ``save_freq``).

    Keras 3.15 restores the weights, ``optimizer.iterations`` and the epoch, but not the step within the epoch
    (``keras/src/callbacks/backup_and_restore.py:152`` sets only ``model._initial_epoch``; ``fit`` then runs
    every step of that epoch again, ``keras/src/backend/tensorflow/trainer.py:392``): a restarted owner would
    train past the other owners' last step and wait for them forever. Keras 2 restores the step too.

    Raises:
      NotImplementedError: Keras 3's ``fit`` runs a ``BackupAndRestore`` whose ``save_freq`` is not "epoch".
    """
    callbacks = _fit_callbacks(keras_frames.KERAS3_TRAINER)
    for callback in getattr(callbacks, "callbacks", callbacks) or ():
        if isinstance(callback, tf.keras.callbacks.BackupAndRestore) and callback.save_freq != "epoch":
            error = NotImplementedError(
                f"tf.keras.callbacks.BackupAndRestore(save_freq={callback.save_freq!r}) across owners on Keras 3: "
                "Keras 3 restores the epoch but not the step within it (keras/src/callbacks/backup_and_restore.py"
                ", _load_model), so a restarted owner would run that epoch's steps again and train past the "
                "other owners. Use BackupAndRestore(backup_dir) with save_freq='epoch' (the default) and "
                "fit(..., steps_per_epoch=<steps between backups>, epochs=<total steps / that>).")
            error.ag_pass_through = True  # raised as it is from fit's tracing, not as AutoGraph's StagingError
            raise error


def _fit_callbacks(*trainers: str):
    """The callbacks of the Keras ``fit`` running on this thread (its ``CallbackList`` once made, else the list it
    was given), if its file is one of `trainers` (default: any Keras'); else None."""
    frame, trainer = keras_frames.running_fit()
    if frame is None or (trainers and trainer not in trainers):
        return None
    return frame.f_locals.get("callbacks")


def _show_progress(model) -> None:
    """Adds Estimator's progress lines to the running ``fit`` of `model` (`keras_progress.attach`): the owners
    agreed on the model, its first step is about to run."""
    if not keras_progress.attach(_fit_callbacks(), model):
        log.info("no progress lines for this fit: Keras' fit callbacks were not found on the stack; pass "
                 "callbacks=[tfe_estimator.ProgressCallback()] to model.fit for them.")


def repeated_releases(model) -> int:
    """How many steps of `model`'s training the servers released again under
    ``DistributedDP(count_repeated_releases=True)`` (counted by its `training_run.ReleaseLedger`); else 0."""
    ledger = _MODELS.get(model, {}).get("ledger")
    return ledger.repeated if ledger is not None else 0


def _check_weights(step: int) -> None:
    """The owners compare their weights at `step` (`weight_check.check_weights`), once per step: at the first
    value read across owners there, i.e. at the end of every epoch of ``fit`` and of every ``evaluate``, when
    every owner has run the same steps."""
    state, variables = _LATEST["state"], _LATEST["variables"]
    if variables is None or state is None or state.get("model") is None or _LATEST["checked"] == step:
        return
    _LATEST["checked"] = step
    binding = _LATEST["binding"]
    weight_check.check_weights(binding, service_lib.service_client, state["model"], step,
                               [v.numpy() for v in variables()], wait_secs=weight_check.end_wait_secs(binding))


def _eager_channel():
    """`eager_sum`'s channel, refused while ``strategy.run`` runs eagerly (no traced step keys its sums)."""
    custom_loop.check_eager_sum()
    return eager_sum()


def _check_unkeyed(graph) -> None:
    """Refuses a sum across owners in a ``tf.function`` that no optimizer's all-reduce keyed (`custom_loop`)."""
    if in_function() and tf.compat.v1.executing_eagerly_outside_functions():
        raise custom_loop.unkeyed_sum_error(graph)


def eager_sum():
    """``(name, step, model state)`` of a sum made eagerly: Keras reads a metric's variables across owners
    (the epoch's ``loss`` in ``fit``'s logs, as under MultiWorkerMirroredStrategy) after the steps ran.

    Every owner reads the same metrics in the same order at the same step: the k-th eager sum at the
    optimizer's current ``iterations`` is ``eager_sum_<k>`` of that step, for the model that trained last.

    Raises:
      ValueError: no Keras model trained through this strategy yet (nothing names the sum's model).
    """
    optimizer = _LATEST["optimizer"]() if _LATEST["optimizer"] is not None else None
    if optimizer is None:
        raise ValueError("a sum across owners outside a Keras model.fit step (read eagerly): in service mode "
                         "TfeStrategy sums a model's values across owners once model.fit (or a custom training "
                         "loop's first step) has agreed on the model with the other owners; call fit, or run a "
                         "step of the loop, first.")
    step = int(optimizer.iterations.numpy())
    if _LATEST["step"] != step:
        _LATEST.update(step=step, count=0)
        _check_weights(step)
    _LATEST["count"] += 1
    return f"eager_sum_{_LATEST['count'] - 1}", tf.constant(step, tf.int64), _LATEST["state"]
