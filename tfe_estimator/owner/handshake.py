"""Owners of the aggregation service agree on one model before training (contract rule 7).

Once per training session (so also after every restore), after the session
is created and before its first step, each owner reads its model record
(`model_record.ModelRecord`: the variables, each optimizer and its
hyperparameters, the feature constants such as vocabularies and bucket
boundaries, the secure and DP settings, the number of owners) and the
fingerprint of its initial or restored weights, sends the row to server0's
``Handshake`` under its model id (a hash of the record) and polls until every
owner has a row for the same model:

- owners do not need to be at the same step (a restarted owner may be behind
  and replays what it missed); their weight fingerprints are compared only
  when they are at the same step (a different ``tf_random_seed`` shows there
  at step 0);
- an owner whose latest row is for another model and who keeps handshaking
  for it (its calls are fresh at this owner's polls over `ACTIVE_SECS`: it
  waits too, so it is not merely finishing a previous model of the script)
  would train a different model: refused with `OwnersDisagreeError` naming
  the owners and what differs, with values where they are numbers
  ("learning rate ... 0.05 on worker:0, 0.01 on chief:0", "the vocabulary of
  feature 'sex' ... differs");
- while it waits, the owner logs at WARNING every `WARN_EVERY_SECS` whom it
  waits for; after the timeout it stops naming them (and what differs, for
  an owner last seen with another model).

In the same calls the owners agree on the check seed of the sums' integrity
checks (`check_seed`: each row carries the owner's certificate, owners[0]'s
also the seed wrapped for every other owner); an owner is done when it holds
the seed too, and keeps it (`check_seed.remember`) for the model's sums
(`sum_check`): a sum a server altered stops every owner given it.

The server learns hashes, the step, fingerprints and hyperparameter values,
the owners' certificates and wrapped seeds it cannot unwrap, nothing of the
data. The model id also prefixes every channel of the model's
sums (`service_strategy`), so two models trained one after another in a
launch never meet on the servers.

Before that, when the training graph is complete, `audit.owner_graph`
checks that it lets out nothing but fresh keys and masked shares. Once the
owners agree, the owner rewinds its own state on both servers (``Rewind``).

Estimator runs `agree` from its `estimator.ServiceHandshakeHook` once a session
is created; Keras from `keras_fit` before the first step of ``fit``.

Example::

    model_id = agree(binding, service_client, (step, weights_fingerprint(values), fields))
"""
import logging
import time
from typing import Callable, Dict, List, Optional, Sequence, Set, Tuple

from tfe_estimator.owner import check_seed
from tfe_estimator.owner import model_record
from tfe_estimator.owner import step_wait
from tfe_estimator.owner.contribution import tf_errors

__all__ = ["OwnersDisagreeError", "agree", "verdict", "Polling", "ACTIVE_SECS",
           "FRESH_SECS", "WARN_EVERY_SECS"]

log = logging.getLogger("tfe_estimator")

#: An owner whose handshake calls stay fresh (younger than `FRESH_SECS`) over this long is waiting in its
#: handshake (it polls every `step_wait.HANDSHAKE_POLL_SECONDS`); one that agreed stops calling.
ACTIVE_SECS = 1.0
FRESH_SECS = 0.5
#: How often a waiting owner says whom it waits for.
WARN_EVERY_SECS = 10.0


class OwnersDisagreeError(ValueError):
    """Data owners of one service would train different models (or start from different weights)."""


def _row_step(row) -> int:
    return int(row[0])


class Polling:
    """Which owners keep handshaking for another model: fresh calls seen over `ACTIVE_SECS` of polls.

    Example::

        polling = Polling()
        waiting_too = polling.update(rows, model, now=time.monotonic())   # owners' names
    """

    def __init__(self):
        self._since: Dict[int, Tuple[int, float]] = {}

    def update(self, owners: Sequence[str], rows, model: int, now: float) -> Set[str]:
        """The owners whose calls for a model other than `model` have stayed fresh for `ACTIVE_SECS`."""
        found = set()
        for index, (which, row, age) in enumerate(rows):
            if row is None or which == model or age is None or age >= FRESH_SECS:
                self._since.pop(index, None)
                continue
            first = self._since.setdefault(index, (which, now))
            if first[0] != which:
                self._since[index] = (which, now)
            elif now - first[1] >= ACTIVE_SECS:
                found.add(owners[index])
        return found


def verdict(me: str, owners: Sequence[str], mine: Tuple[int, int, List[model_record.Field]], model: int,
            rows: Sequence[Tuple[int, Optional[Sequence[int]], Optional[float]]],
            final: bool = False, polling: Optional[Set[str]] = None,
            seed_hint: Optional[str] = None) -> Tuple[Optional[str], List[str]]:
    """``(error, waiting)`` for this owner's record `mine` = (step, weights, fields) and the server's `rows`.

    `rows[o]` is owner o's ``(model id, row, seconds since its last call)`` (`OwnerClient.handshake`).
    `error` is the refusal's message (None: no disagreement); `waiting` says, per owner not there yet,
    why. An owner last seen with another model is a disagreement when it is in `polling` (`Polling`:
    it waits in its handshake too; None: when its last call is younger than `FRESH_SECS`), or with
    `final` (the wait timed out). `seed_hint` says how to give every owner the same initial weights
    (default: TfeRunConfig's ``tf_random_seed``).
    """
    step, weights, fields = mine
    problems, waiting = [], []
    for owner, (which, row, age) in zip(owners, rows):
        if owner == me:
            continue
        if row is None:
            waiting.append(f"{owner}: no handshake yet")
            continue
        if which == model:
            if _row_step(row) == step and int(row[1]) != weights:
                hint = ((seed_hint or "give every owner the same tf_random_seed (TfeRunConfig(tf_random_seed=...)) "
                         "and no checkpoint in its model_dir") if step == 0 else
                        "restore every owner from the same checkpoint (the same step of one training)")
                problems.append(
                    f"the {'initial' if step == 0 else 'restored'} weights differ at step {step}: fingerprint "
                    f"{model_record.format_fingerprint(int(row[1]))} on {owner}, "
                    f"{model_record.format_fingerprint(weights)} on {me}; {hint}")
            continue
        differ = model_record.differences(fields, me, row, owner)
        active = (age is not None and age < FRESH_SECS) if polling is None else owner in polling
        if final or active:
            problems.append("; ".join(differ) or f"{owner} runs another model")
        else:
            waiting.append(f"{owner}: its last handshake ({age:.0f} s ago, at step {_row_step(row)}) was for "
                           f"another model ({'; '.join(differ[:1])})")
    if problems:
        return (f"Service handshake at step {step}: the owners would not train the same model, refused before "
                f"the first step: {'; '.join(problems)}. Every owner must run the same model script (optimizer, "
                "hyperparameters, feature columns and their vocabularies in the same order) with the same "
                "TfeRunConfig: fix the owner named."), waiting
    return None, waiting


def agree(binding, client: Callable, mine: Tuple[int, int, List[model_record.Field]],
          on_model: Optional[Callable[[int], None]] = None, seed_hint: Optional[str] = None) -> int:
    """This owner's handshake for its record `mine` = (step, weights fingerprint, fields); returns the model id.

    What Estimator's `ServiceHandshakeHook` (after a session is created) and Keras' `keras_fit` (before
    the first step of ``fit``) both call: polls server0 until every owner has a row for this model and the
    owners agree on the check seed (module docstring), remembers the seed (`check_seed.remember`), calls
    `on_model` with the id, and rewinds this owner's state on both servers.

    Args:
      binding: this owner's `ServiceBinding`; client: ``client(binding)`` returns its `OwnerClient`.
      mine: from `model_record.ModelRecord.evaluate` (Estimator) or `model_record.keras_record` (Keras).
      on_model: called with the model id once the owners agree.
      seed_hint: how to give every owner the same initial weights (the default names TfeRunConfig's seed).

    Raises:
      OwnersDisagreeError: naming the owners and what differs, or whom it waited for.
      check_seed.CheckSeedError: a handshake part that proves no owner, or a check seed that does not decrypt.

    Example::

        model = agree(binding, service_client, (0, weights_fingerprint(values), fields))
    """
    step, weights, fields = mine
    model = model_record.model_id(fields)
    row = model_record.make_row(step, weights, fields)
    client = client(binding)
    owners, me = list(binding.owners), binding.owner
    state = {"error": None, "waiting": [], "warned": time.monotonic()}
    started = time.monotonic()
    polling = Polling()
    agreement = check_seed.SeedAgreement(_tls_files(binding), owners, me, model)

    def agreed():
        sent = agreement.part
        with tf_errors():
            rows, parts = client.handshake_parts(step, row, model, sent)
        now = time.monotonic()
        state["error"], state["waiting"] = verdict(me, owners, mine, model, rows, seed_hint=seed_hint,
                                                   polling=polling.update(owners, rows, model, now))
        if not state["error"] and not state["waiting"]:
            seed_wait = agreement.update([which for which, _, _ in rows], parts, sent)
            state["seed_wait"] = seed_wait
            if seed_wait:
                state["waiting"] = [seed_wait]
        if state["waiting"] and not state["error"] and now - state["warned"] >= WARN_EVERY_SECS:
            state["warned"] = now
            log.warning("service handshake at step %d: waiting for %s (%.0f s)", step,
                        "; ".join(state["waiting"]), now - started)
        return bool(state["error"]) or not state["waiting"]

    timeout = 0.9 * binding.timeout_secs
    arrived = step_wait.poll(agreed, timeout, interval=step_wait.HANDSHAKE_POLL_SECONDS)
    if not arrived and not state["error"]:
        with tf_errors():
            rows = client.handshake(step, row, model)
        state["error"], state["waiting"] = verdict(me, owners, mine, model, rows, final=True, seed_hint=seed_hint)
        if not state["waiting"] and state.get("seed_wait"):
            state["waiting"] = [state["seed_wait"]]
        if not state["error"]:
            state["error"] = (f"Service handshake: {me} at step {step} waited {timeout:g} s for "
                              f"{'; '.join(state['waiting'])}. Start every owner (each restores its own "
                              "latest checkpoint), or raise the step timeout (TfeRunConfig(step_timeout_secs=...), "
                              "TfeStrategy(step_timeout_secs=...)) if one is only slow.")
    if state["error"]:
        raise OwnersDisagreeError(state["error"])
    check = agreement.check()
    check_seed.remember(me, model, check)
    log.info("service handshake at step %d: every owner trains model %016x; weights %s; sums checked "
             "(check seed %s)", step, model, model_record.format_fingerprint(weights), check.fingerprint)
    if on_model is not None:
        on_model(model)
    with tf_errors():
        client.rewind(int(step))
    return model


def _tls_files(binding):
    """The owner's TLS files (its certificate and key, the federation) for the check-seed agreement."""
    from tfe_estimator.service import TlsFiles  # pylint: disable=import-outside-toplevel

    job, index = binding.owner.split(":")
    return TlsFiles.from_dir(binding.tls_dir, job, int(index))
