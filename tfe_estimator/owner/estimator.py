"""Estimator on the owner's side of service mode: the adapter that puts the owners' hooks in every `EstimatorSpec`.

`EstimatorServiceStrategy` is the `ServiceStrategy` that `TfeRunConfig` builds for a data owner in service mode
(``train_distribute`` and, with ``evaluation=True``, ``eval_distribute``). It adds nothing to the sums (those are
the core's: `service_strategy`, `contribution`, `sum_check`); it wires the core's agreements into Estimator's
own mechanism, session-run hooks, on each ``model_fn`` result:

- training: `handshake.ServiceHandshakeHook` (the owners agree on the model record and weights before the first
  step), `weight_check.WeightCheckHook` (the owners' weight fingerprints at checkpoint steps and at the end), and
  the checkpoint saver after the handshake (`saver`: a save may sum on-read variables across owners); the
  training run's number (`training_run`, from ``model_dir``) and, under DP, its release ledger;
- evaluation: `handshake.ModelIdHook` (the evaluated training's model id names the evaluation's channels).

Keras' adapter (`keras_fit`) sits on the same core through Keras' own mechanisms instead.

Example::

    strategy = EstimatorServiceStrategy(binding, num_replicas=1)
    config = tf.estimator.RunConfig(train_distribute=strategy, tf_random_seed=7, model_dir="/data/chief")
"""
from typing import Callable, Mapping, Optional

import tensorflow as tf

from tfe_estimator import compat
from tfe_estimator.audit.owner_graph import audit_owner_graph
from tfe_estimator.owner import handshake, model_record, training_run, weight_check
from tfe_estimator.owner import saver as saver_lib
from tfe_estimator.owner.service_strategy import ServiceExtended, ServiceStrategy, model_of, service_client

__all__ = ["EstimatorServiceStrategy", "ServiceHandshakeHook", "ModelIdHook", "WeightCheckHook"]


class _EstimatorExtended(ServiceExtended):
    """`ServiceExtended` whose replica functions are ``model_fn`` calls: the owners' hooks in their results."""

    def _call_for_each_replica(self, fn, args, kwargs):
        def with_hooks(*fn_args, **fn_kwargs):
            result = fn(*fn_args, **fn_kwargs)
            mode = compat.estimator_spec_mode(result)  # never on TensorFlow without Estimator
            if mode in ("train", "eval"):
                config = next((a for a in (*fn_args, *fn_kwargs.values()) if isinstance(a, tf.estimator.RunConfig)),
                              None)
                result = self._with_owner_hooks(result, config)
            return result

        return super()._call_for_each_replica(with_hooks, args, kwargs)

    def _with_owner_hooks(self, result, config):
        """`result` (an `EstimatorSpec`) with the owners' training or evaluation hooks added."""
        agg = self._cross_device_ops
        settings = self._settings()
        model = model_of(tf.compat.v1.get_default_graph())
        model_dir = getattr(config, "model_dir", None)

        def on_model(model_id):
            model["model"] = model_id
            model["sessions"] = model.get("sessions", 0) + 1

        if result.mode != tf.estimator.ModeKeys.TRAIN:
            settings["training run"] = training_run.for_evaluation(model_dir)  # the evaluated training's
            hook = ModelIdHook(settings, len(agg.binding.owners), on_model)
            return result._replace(evaluation_hooks=(*(result.evaluation_hooks or ()), hook))
        if "run" not in model:  # once per graph: its replicas' model_fn calls share it
            model["run"] = training_run.for_training(model_dir)
            if agg.dp is not None:  # each step's noise released once (training_run.ReleaseLedger)
                model["ledger"] = training_run.ReleaseLedger(model_dir, model["run"].fresh,
                                                             agg.dp.count_repeated_releases)
        settings["training run"] = model["run"].number  # in the model id: one id per training run
        every = getattr(config, "save_checkpoints_steps", None)
        hooks = (ServiceHandshakeHook(agg.binding, settings, service_client, on_model),
                 WeightCheckHook(agg.binding, service_client, model, every))
        # The checkpoints after the handshake: a save may sum on-read variables across owners.
        saver_lib.check_saving(config, agg.dp)
        saver = saver_lib.saver_hook(config, result)
        hooks += (saver,) if saver is not None else ()
        return result._replace(training_hooks=(*result.training_hooks, *hooks))


class ServiceHandshakeHook(tf.compat.v1.train.SessionRunHook):
    """Checks, before a session's first step, that every owner trains this model (`handshake.agree`).

    Args:
      binding: this owner's `ServiceBinding`.
      settings: the secure and DP settings, ``name -> value`` (equal on owners with the same settings).
      client: ``client(binding)`` returns the owner's `tfe_estimator.service.OwnerClient`.
      on_model: called with the model id once the owners agree (it prefixes the model's channels).

    Raises (from `after_create_session`):
      OwnersDisagreeError: naming the owners and what differs, or whom it waited for.
      check_seed.CheckSeedError: a handshake part that proves no owner, or a check seed that does not decrypt.
    """

    def __init__(self, binding, settings: Mapping[str, object], client: Callable,
                 on_model: Optional[Callable[[int], None]] = None):
        self._binding, self._settings, self._client = binding, dict(settings), client
        self._on_model = on_model
        self._record = None

    def begin(self):
        graph = tf.compat.v1.get_default_graph()
        # The training graph is complete: check what it lets out before it runs (`audit.owner_graph`).
        audit_owner_graph(graph)
        self._record = model_record.ModelRecord(graph, self._settings, len(self._binding.owners))

    def after_create_session(self, session, coord):
        del coord
        handshake.agree(self._binding, self._client, self._record.evaluate(session), self._on_model)


class ModelIdHook(tf.compat.v1.train.SessionRunHook):
    """For evaluation: names the model's channels by its record (no handshake).

    Every owner evaluates the same model, so the id is equal on all of them and differs from any other
    model's (and from the training's: an evaluation graph has no optimizer). The evaluated checkpoint's
    step keys each evaluation's sums, so the channels are reused from one evaluation to the next.

    Args:
      settings, num_owners: as `ServiceHandshakeHook`; on_model: called with the id.
    """

    def __init__(self, settings: Mapping[str, object], num_owners: int, on_model: Callable[[int], None]):
        self._settings, self._num_owners, self._on_model = dict(settings), num_owners, on_model
        self._record = None

    def begin(self):
        self._record = model_record.ModelRecord(tf.compat.v1.get_default_graph(), self._settings, self._num_owners)

    def after_create_session(self, session, coord):
        del coord
        _, _, fields = self._record.evaluate(session)
        self._on_model(model_record.model_id(fields))


class WeightCheckHook(tf.compat.v1.train.SessionRunHook):
    """Compares this owner's weights with every other owner's at checkpoint steps (`weight_check`).

    Args:
      binding: this owner's `ServiceBinding`; client: ``client(binding)`` gives its `OwnerClient`.
      model: the dict whose ``"model"`` the handshake sets to the model id.
      every_n_steps: compare after every this many steps (None: only at the end).
    """

    def __init__(self, binding, client: Callable, model: dict, every_n_steps: Optional[int]):
        self._binding, self._client, self._model = binding, client, model
        self._every = every_n_steps if every_n_steps and every_n_steps > 0 else None
        self._step = None  # the global step's read tensor (`begin`)
        self._variables = []
        self._checked = None

    def begin(self):
        step = tf.compat.v1.train.get_global_step()
        # its read tensor, resolved once: fetching the strategy's MirroredVariable itself makes every session run
        # resolve it again (~55 us of Python per step)
        self._step = None if step is None else tf.compat.v1.get_default_graph().as_graph_element(step)
        self._variables = sorted(tf.compat.v1.trainable_variables(), key=lambda v: v.name)

    def before_run(self, run_context):
        return None if self._every is None else tf.compat.v1.train.SessionRunArgs(self._step)

    def after_run(self, run_context, run_values):
        # The step fetched with the training op is read before or after that op's own increment (nothing orders
        # them), so it is only a hint, as in Estimator's CheckpointSaverHook: a check step decided from it would
        # differ between owners (one checking at step 39, the other at 40, each waiting out the other). The
        # hint covers both readings; the step read afresh decides.
        if self._every is None:
            return
        stale = int(run_values.results)
        if stale % self._every == 0 or (stale + 1) % self._every == 0:
            self._check(run_context.session, only_every=True)

    def end(self, session):
        self._check(session, wait_secs=weight_check.end_wait_secs(self._binding))

    def _check(self, session, wait_secs: Optional[float] = None, only_every: bool = False):
        if self._model.get("model") is None:
            return
        step = int(session.run(self._step))
        if step == self._checked or (only_every and step % self._every != 0):
            return
        self._checked = step
        values = session.run(self._variables)
        weight_check.check_weights(self._binding, self._client, self._model["model"], step, values, wait_secs)


class EstimatorServiceStrategy(ServiceStrategy):
    """The `ServiceStrategy` an Estimator trains and evaluates under across owners (module docstring); its
    arguments are `ServiceStrategy`'s."""

    _EXTENDED = _EstimatorExtended
