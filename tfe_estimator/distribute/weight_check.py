"""Owners compare the fingerprint of their weights through server0 at every checkpoint step and at the end.

Every owner applies the same released update to its own copy of the model,
so after each step the copies are equal, unless something differs (a planted
change, a bug, a server that answered owners differently). `WeightCheckHook`
runs after every ``save_checkpoints_steps``-th step and when training ends:
each owner reads its trainable weights, hashes them
(`model_record.weights_fingerprint`) and puts ``[step, fingerprint]`` on
server0's ``Handshake`` under a key of its own per model (`check_key`), then
polls until every other owner's row reached that step:

- a row at the same step with another fingerprint stops training with
  `OwnersDisagreeError` naming the owners, the step and both fingerprints;
- an owner already past the step (this owner replays released steps after a
  restart) is not compared;
- an owner that does not arrive within the step timeout (at the end: 60 s)
  is logged at WARNING and training goes on (the next step's sum waits for
  it anyway).

Server0 learns the fingerprints (hashes of the weights), nothing else.

Example::

    hook = WeightCheckHook(binding, service_client, model_holder, every_n_steps=100)
    estimator_spec = estimator_spec._replace(training_hooks=(*estimator_spec.training_hooks, hook))
"""
import logging
import time
from typing import Callable, Optional

import tensorflow as tf

from tfe_estimator.distribute import model_record, step_wait
from tfe_estimator.distribute.service_handshake import OwnersDisagreeError
from tfe_estimator.distribute.service_sum import tf_errors

__all__ = ["WeightCheckHook", "check_key", "compare"]

log = logging.getLogger("tfe_estimator")


def check_key(model: int) -> int:
    """The handshake key of `model`'s weight checks (never a model id: another hash of it)."""
    return model_record.label_hash(f"weights of {model:016x}")


def compare(me: str, owners, step: int, fingerprint: int, rows, key: int):
    """``(error, waiting)`` for this owner's `fingerprint` at `step` and server0's `rows` under `key`."""
    waiting, differ = [], []
    for owner, (which, row, _) in zip(owners, rows):
        if owner == me:
            continue
        if row is None or which != key or int(row[0]) < step:
            waiting.append(owner)
        elif int(row[0]) == step and int(row[1]) != fingerprint:
            differ.append(f"{model_record.format_fingerprint(int(row[1]))} on {owner}")
    if differ:
        return (f"Weight check at step {step}: the owners' weights differ after training together: "
                f"{', '.join(differ)}, {model_record.format_fingerprint(fingerprint)} on {me}. Something altered "
                "one owner's model or one owner's sums (an owner's code or checkpoint, a server answering "
                "owners differently): restore every owner from the last checkpoint where their fingerprints "
                "agreed and check the owners named."), waiting
    return None, waiting


class WeightCheckHook(tf.compat.v1.train.SessionRunHook):
    """Compares this owner's weights with every other owner's at checkpoint steps (module docstring).

    Args:
      binding: this owner's `ServiceBinding`; client: ``client(binding)`` gives its `OwnerClient`.
      model: the dict whose ``"model"`` the handshake sets to the model id.
      every_n_steps: compare after every this many steps (None: only at the end).
    """

    def __init__(self, binding, client: Callable, model: dict, every_n_steps: Optional[int]):
        self._binding, self._client, self._model = binding, client, model
        self._every = every_n_steps if every_n_steps and every_n_steps > 0 else None
        self._step = None
        self._variables = []
        self._checked = None

    def begin(self):
        self._step = tf.compat.v1.train.get_global_step()
        self._variables = sorted(tf.compat.v1.trainable_variables(), key=lambda v: v.name)

    def before_run(self, run_context):
        return None if self._every is None else tf.compat.v1.train.SessionRunArgs(self._step)

    def after_run(self, run_context, run_values):
        if self._every is not None and (int(run_values.results) + 1) % self._every == 0:
            self._check(run_context.session)

    def end(self, session):
        self._check(session, wait_secs=min(60.0, 0.9 * self._binding.timeout_secs))

    def _check(self, session, wait_secs: Optional[float] = None):
        if self._model.get("model") is None:
            return
        step, values = session.run([self._step, self._variables])
        step = int(step)
        if step == self._checked:
            return
        self._checked = step
        fingerprint = model_record.weights_fingerprint(values)
        key, client = check_key(self._model["model"]), self._client(self._binding)
        owners, me = list(self._binding.owners), self._binding.owner
        state = {"error": None, "waiting": owners}

        def arrived():
            with tf_errors():
                rows = client.handshake(step, [step, fingerprint], key)
            state["error"], state["waiting"] = compare(me, owners, step, fingerprint, rows, key)
            return bool(state["error"]) or not state["waiting"]

        started = time.monotonic()
        step_wait.poll(arrived, wait_secs or 0.9 * self._binding.timeout_secs,
                       interval=step_wait.HANDSHAKE_POLL_SECONDS)
        if state["error"]:
            raise OwnersDisagreeError(state["error"])
        if state["waiting"]:
            log.warning("weight check at step %d: %s did not arrive within %.0f s; not compared", step,
                        ", ".join(state["waiting"]), time.monotonic() - started)
        else:
            log.info("weight check at step %d: every owner holds weights %s", step,
                     model_record.format_fingerprint(fingerprint))
