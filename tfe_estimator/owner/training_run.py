"""Which training run of a model an owner's session belongs to: a setting of its model record, so of its model id.

Two Estimators with identical model records (the same columns, optimizer,
seed and settings: a script that trains a model, then a fresh copy in another
model_dir or on other data) would get one model id, so the second's first
steps would be answered from the first's replay window on the servers (the
first model's sums, silently). Each training run of a model is therefore
numbered, and the number is one of the settings the handshake compares
(``"training run"``):

- a fresh training (no checkpoint in its model_dir when its graph is built)
  takes this process's next number: the process numbers the service-mode
  trainings it starts or resumes, 0, 1, 2, ...; the number is written to
  ``<model_dir>/tfe_training_run`` before the session starts;
- a training that restores a checkpoint reads its number from that file (0
  without one: a model_dir from before the file), and the process's next fresh
  training is numbered after it; so does a fresh training whose model_dir
  already has the file (its process died before the first checkpoint).

Every owner runs the same script, so every owner numbers the same training
alike, and a restarted owner (alone or with all the others) reads its
training's number back from its model_dir: it finds its run's channels and
replays what it missed. Owners whose numbers differ (one owner's script trains
another model first; or a restarted script whose finished first training
Estimator skips, max_steps reached, before a second training that has neither
checkpoint nor file yet) are refused by the handshake, naming the setting.

What numbering cannot tell apart: a training of an identical model with the
same number in an earlier launch, against servers that kept running (their
replay window still holds its steps). A fresh training is never answered from
the window (nobody released any of its steps before its owners contributed),
so such an answer is refused (`check_answer`) instead of trained on.

Under DP each owner also keeps, in ``<model_dir>/tfe_released``, the highest
step whose first sum it received as a fresh release (`ReleaseLedger`). A
restored owner receives the steps it had before from the servers' replay
window; a fresh release of such a step (both servers restarted, so neither
kept its window) would release its noise again while epsilon counts the step
once: it is refused (`check_answer`), unless
``DistributedDP(count_repeated_releases=True)``: then the ledger counts it and
epsilon counts every release (`recorded_repeated_releases`).

Example::

    run = training_run.for_training(config.model_dir)    # 0 for the script's first training, then 1, ...
    settings["training run"] = run.number
"""
import dataclasses
import logging
import os
import threading
from typing import Optional

import tensorflow as tf

__all__ = ["TrainingRun", "ReleaseLedger", "for_training", "refused", "for_evaluation", "check_answer",
           "fresh_replay_error", "recorded_repeated_releases", "RUN_FILE", "RELEASED_FILE", "reset"]

log = logging.getLogger("tfe_estimator")

#: The file in model_dir that keeps the number of the training run that wrote its checkpoints.
RUN_FILE = "tfe_training_run"
#: Under DP, the file in model_dir that keeps the highest step this owner received as a fresh release.
RELEASED_FILE = "tfe_released"
#: The sum whose releases the ledger follows: a training graph's first, summed at every step.
_LEDGER_SUM = "/sum_0"

_LOCK = threading.Lock()
_NEXT = [0]  # the number of this process's next fresh training


@dataclasses.dataclass(frozen=True)
class TrainingRun:
    """A training's number, and whether it starts afresh (no checkpoint to restore)."""

    number: int
    fresh: bool


class ReleaseLedger:
    """The highest step whose first sum this owner received as a fresh release (under DP), kept in model_dir.

    The file holds ``"<highest step> <steps released again>"``.

    Args:
      model_dir: where ``tfe_released`` is kept (None: in memory only).
      fresh: a fresh training (no checkpoint): nothing was released for it yet, whatever the file says.
      count_repeats: count a step released again (`repeated`) instead of refusing it
        (``DistributedDP(count_repeated_releases=True)``).

    Example::

        ledger = ReleaseLedger("/data/model", fresh=False)
        ledger.released(owner, channel, step)   # raises if `step` was released to this owner before
    """

    def __init__(self, model_dir: Optional[str], fresh: bool, count_repeats: bool = False):
        self._path = os.path.join(model_dir, RELEASED_FILE) if model_dir else None
        self._count = bool(count_repeats)
        self._fd = None
        self.high, self.repeated = -1, 0
        if not fresh and self._path and tf.io.gfile.exists(self._path):
            self.high, self.repeated = _read_ledger(self._path)
        elif self._path:
            self._write()

    def _write(self) -> None:
        # A fixed-width record rewritten in place by one pwrite: a process killed at any moment leaves the old or
        # the new record (a new file and a rename per step cost milliseconds on some file systems).
        text = f"{self.high:20d} {self.repeated:20d}\n"
        if "://" in self._path:  # a remote model_dir (gs://, ...): through TensorFlow's file system
            tf.io.gfile.makedirs(os.path.dirname(self._path))
            with tf.io.gfile.GFile(self._path + ".tmp", "w") as f:
                f.write(text)
            tf.io.gfile.rename(self._path + ".tmp", self._path, overwrite=True)
            return
        if self._fd is None:
            os.makedirs(os.path.dirname(self._path) or ".", exist_ok=True)
            self._fd = os.open(self._path, os.O_WRONLY | os.O_CREAT, 0o644)
        os.pwrite(self._fd, text.encode(), 0)

    def __del__(self):
        if getattr(self, "_fd", None) is not None:
            os.close(self._fd)

    def released(self, owner: str, channel: str, step: int) -> None:
        """Records a fresh release of `step`; refuses one of a step this owner received before.

        Raises:
          ValueError: naming the step, the ledger and the fix.
        """
        if step <= self.high and self._count:  # released again: epsilon counts it once more
            self.repeated += 1
            log.warning("service mode under DP: step %d of %r was released again with fresh noise (the servers "
                        "no longer held it); epsilon counts it twice (%d repeated release(s) so far)", step,
                        channel, self.repeated)
            if self._path:
                self._write()
            return
        if step <= self.high:
            raise ValueError(
                f"Service mode under DP: {owner} received step {step} of {channel!r} as a fresh release, but it "
                f"received steps up to {self.high} before ({self._path or 'this process'}): the servers released "
                "the step again, with fresh noise, while epsilon counts each step once. Neither server still holds "
                "the step's answer (both were restarted, or their --replay-window-steps is shorter than the "
                "steps since the owners' checkpoint). Training stops instead of spending privacy silently. Keep "
                "the servers running while owners restart and checkpoint at least every --replay-window-steps "
                "steps. To go on from here: DistributedDP(count_repeated_releases=True) on every owner (epsilon "
                "then counts every release), or train a fresh model (a new model_dir on every owner).")
        self.high = step
        if self._path:
            self._write()


def _read_ledger(path: str):
    with tf.io.gfile.GFile(path) as f:
        parts = f.read().split()
    numbers = [int(p) for p in parts if p.lstrip("-").isdigit()]
    if len(numbers) != len(parts) or not 1 <= len(numbers) <= 2:
        raise ValueError(f"{path} holds {' '.join(parts)[:40]!r}, not '<highest step> <steps released again>': it "
                         "is written by tfe_estimator under DP; restore it from a backup of this model_dir.")
    return numbers[0], (numbers[1] if len(numbers) > 1 else 0)


def recorded_repeated_releases(model_dir: Optional[str]) -> int:
    """How many steps of the training in `model_dir` were released again and counted, as its ledger file
    records them (0 without one); `service_strategy.repeated_releases` reads a running graph's ledger."""
    path = os.path.join(model_dir, RELEASED_FILE) if model_dir else None
    return _read_ledger(path)[1] if path and tf.io.gfile.exists(path) else 0


def _path(model_dir: str) -> str:
    return os.path.join(model_dir, RUN_FILE)


def _read(model_dir: Optional[str]) -> Optional[int]:
    if not model_dir or not tf.io.gfile.exists(_path(model_dir)):
        return None
    with tf.io.gfile.GFile(_path(model_dir)) as f:
        text = f.read().strip()
    if not text.isdigit():
        raise ValueError(f"{_path(model_dir)} holds {text[:40]!r}, not a training run's number: it is written by "
                         "tfe_estimator when a training starts; restore it from a backup of this model_dir or "
                         "delete the model_dir to train afresh.")
    return int(text)


def for_training(model_dir: Optional[str]) -> TrainingRun:
    """The training run of a training graph built now for `model_dir` (module docstring); records a fresh one."""
    fresh = not model_dir or tf.train.latest_checkpoint(model_dir) is None
    with _LOCK:
        if fresh:
            # A file without a checkpoint: this training was numbered, then its process died before the first
            # checkpoint (the other owners may be waiting in its step 0 under that number).
            recorded = _read(model_dir)
            number = _NEXT[0] if recorded is None else recorded
            if model_dir:
                tf.io.gfile.makedirs(model_dir)
                with tf.io.gfile.GFile(_path(model_dir), "w") as f:
                    f.write(f"{number}\n")
        else:
            number = _read(model_dir) or 0
        _NEXT[0] = max(_NEXT[0], number + 1)
    log.debug("service mode: training run %d of this process's models (%s)", number,
             "afresh" if fresh else f"resumed from {model_dir}")
    return TrainingRun(number, fresh)


def refused(run: TrainingRun) -> None:
    """Gives back the number of a fresh training without a model_dir (Keras) whose handshake was refused before
    its first step, if no training was numbered since: it never trained, so the corrected training that follows
    in this process takes its number, as it would in a fresh process (what an owner that did not retry has)."""
    with _LOCK:
        if run.fresh and _NEXT[0] == run.number + 1:
            _NEXT[0] = run.number


def for_evaluation(model_dir: Optional[str]) -> int:
    """The number of the training run whose checkpoints `model_dir` holds (0 without a record)."""
    return _read(model_dir) or 0


def check_answer(model: dict, owner: str, channel: str, step: int, replayed: bool) -> None:
    """Refuses an answer from the replay window in a fresh training's first session, and under DP a second
    fresh release of a step (module docstring).

    Args:
      model: the graph's model state: ``"model"`` its id, ``"run"`` its `TrainingRun`, ``"sessions"`` how many
        sessions agreed on it so far (a later session restored a checkpoint: replays are its catch-up), under DP
        ``"ledger"`` its `ReleaseLedger`.
      owner, channel, step: the answer's; replayed: whether the servers answered it from their window.

    Raises:
      ValueError: `fresh_replay_error`.
    """
    run = model.get("run")
    if replayed and run is not None and run.fresh and model.get("sessions") == 1:
        raise fresh_replay_error(owner, model["model"], channel, step)
    ledger = model.get("ledger")
    if ledger is not None and not replayed and channel.endswith(_LEDGER_SUM):
        ledger.released(owner, channel, step)


def fresh_replay_error(owner: str, model: int, channel: str, step: int) -> ValueError:
    """The error for a replayed answer in a fresh training: the servers released that step for another training."""
    return ValueError(
        f"Service mode: {owner} trains model {model:016x} afresh (no checkpoint in its model_dir), but the "
        f"aggregation servers answered step {step} of {channel!r} from their replay window: they released that "
        "step before, for another training of an identical model (the same model record and training run "
        "number), e.g. in an earlier launch while the servers kept running. Those sums are not this training's. "
        "Restart the aggregation servers (they forget every earlier training), or resume that earlier "
        "training from its model_dir.")


def reset() -> None:
    """Forgets this process's numbering (tests)."""
    with _LOCK:
        _NEXT[0] = 0
