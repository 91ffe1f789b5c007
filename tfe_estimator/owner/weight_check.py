"""Owners compare the fingerprint of their weights through server0 during training and at its end.

Every owner applies the same released update to its own copy of the model,
so after each step the copies are equal, unless something differs (a planted
change, a bug, a server that answered owners differently). `check_weights`
runs at agreed steps (Estimator's `estimator.WeightCheckHook`: every
``save_checkpoints_steps``-th step and when training ends; Keras' `keras_fit`:
at the end of every epoch of ``fit``): each owner hashes its trainable weights
(`model_record.weights_fingerprint`) and puts ``[step, fingerprint]`` on
server0's ``Handshake`` under a key of its own per model (`check_key`), then
polls until every other owner's row reached that step:

- a row at the same step with another fingerprint stops training with
  `OwnersDisagreeError` naming the owners, the step and both fingerprints;
- an owner already past the step (this owner replays released steps after a
  restart) is not compared;
- an owner that does not arrive within the step timeout (at the end: `end_wait_secs`)
  is logged at WARNING and training goes on (the next step's sum waits for
  it anyway).

Server0 learns the fingerprints (hashes of the weights), nothing else.

Example::

    check_weights(binding, service_client, model_id, step=100, values=[v.numpy() for v in variables])
"""
import logging
import time
from typing import Callable, Optional

from tfe_estimator.owner import model_record, step_wait
from tfe_estimator.owner.handshake import OwnersDisagreeError
from tfe_estimator.owner.contribution import tf_errors

__all__ = ["check_key", "compare", "check_weights", "end_wait_secs", "END_WAIT_SECS"]

log = logging.getLogger("tfe_estimator")

#: At most this long a check at the end of training (or of a Keras epoch) waits for the other owners.
END_WAIT_SECS = 60.0


def end_wait_secs(binding) -> float:
    """How long a check at the end of training (Estimator) or of an epoch (Keras) waits for the other owners:
    `END_WAIT_SECS`, or 0.9 of the step timeout when that is shorter (the step's own deadline comes first)."""
    return min(END_WAIT_SECS, 0.9 * binding.timeout_secs)


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


def check_weights(binding, client: Callable, model: int, step: int, values, wait_secs: Optional[float] = None):
    """Compares this owner's weights `values` (in one order on every owner) at `step` with every other owner's.

    Args:
      binding: this owner's `ServiceBinding`; client: ``client(binding)`` gives its `OwnerClient`.
      model: the model id the owners agreed on; step: the step every owner compares at.
      values: the trainable weights' values, sorted alike on every owner (by variable name).
      wait_secs: how long to wait for the other owners (default 0.9 of the step timeout).

    Raises:
      OwnersDisagreeError: an owner at the same step holds other weights (module docstring).
    """
    fingerprint = model_record.weights_fingerprint(values)
    key, client = check_key(model), client(binding)
    owners, me = list(binding.owners), binding.owner
    state = {"error": None, "waiting": owners}

    def arrived():
        with tf_errors():
            rows = client.handshake(step, [step, fingerprint], key)
        state["error"], state["waiting"] = compare(me, owners, step, fingerprint, rows, key)
        return bool(state["error"]) or not state["waiting"]

    started = time.monotonic()
    step_wait.poll(arrived, wait_secs or 0.9 * binding.timeout_secs, interval=step_wait.HANDSHAKE_POLL_SECONDS)
    if state["error"]:
        raise OwnersDisagreeError(state["error"])
    if state["waiting"]:
        log.warning("weight check at step %d: %s did not arrive within %.0f s; not compared", step,
                    ", ".join(state["waiting"]), time.monotonic() - started)
    else:
        log.info("weight check at step %d: every owner holds weights %s", step,
                 model_record.format_fingerprint(fingerprint))
