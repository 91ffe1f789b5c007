"""The rules of one channel's steps on one aggregation server: who put what, when a step is released.

Kept apart from the gRPC server (`server.py` only wires requests to it), like
the step accumulators of the TF-runtime version (``step_accumulator_ops.cc``),
whose rules these are:

- the first put fixes the channel's ``ring_bits`` and ``num_elements``;
- one contribution per participant and step (ALREADY_EXISTS);
- a stale step, at or below the last released step, is refused unless its
  owner rewound to it (server0's forwarded part: unless every owner did);
- a put for another step than the open one is refused (owners out of step);
- a step is released once every participant put it (server1: the owners and
  server0's forwarded part); its answer is kept until each owner took it;
- a rewind drops only its owner's unreleased contribution (subtracting it
  from the sum) and lets that owner put from its step again.

Participants are numbered in the configured owner order; server1 has one more,
server0's forwarded part. Every refusal is a `StepRefused` carrying a gRPC
status code's name and a message naming the channel, the participants and the
steps, and the fix.

Example::

    channel = StepChannel("grads", ["chief:0", "worker:0"], forwarder=None)
    released = channel.put(0, step, 64, n, payload, addend)   # None until the step is complete
    if released is not None:
        channel.finish(released, reply_bytes)                 # after computing the answer, outside the lock
    reply = channel.wait(0, step, timeout_secs=300.0, alive=lambda: True)
"""
import threading
import time
from typing import Callable, Dict, List, NamedTuple, Optional, Sequence

import numpy as np

from tfe_estimator.service import ring

__all__ = ["StepChannel", "StepRefused", "Released"]

_POLL_SECS = 0.25  # how often a waiting put checks that its call is still alive
_RESTART = (" Rewind every owner to the same checkpoint step (the owners' handshake does) or restart the "
            "cluster's tasks from one checkpoint.")


class StepRefused(Exception):
    """A refusal: `code` is a ``grpc.StatusCode`` name, `message` says what, why and the fix."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code, self.message = code, message


class _Result:
    """A released step's answer (a serialized reply, shared by the owners' calls), kept until every owner took it."""

    def __init__(self, step: int, owners: int):
        self.step, self.pending = step, set(range(owners))
        self.reply: Optional[bytes] = None
        self.error: Optional[StepRefused] = None

    @property
    def done(self) -> bool:
        return self.reply is not None or self.error is not None


class _Open:
    """The step being summed: its ring accumulator and who put what (to subtract it again on a rewind)."""

    def __init__(self, step: int, words: int):
        self.step, self.acc = step, np.zeros(words, np.uint64)
        self.parts: Dict[int, bytes] = {}  # participant -> its payload (a key or ring words)


class Released(NamedTuple):
    """A step every participant put: its ring sum (uint64 words), settings, and where its answer goes."""
    step: int
    acc: np.ndarray
    ring_bits: int
    num_elements: int
    result: _Result


class StepChannel:
    """One channel's state on one server; thread-safe (one condition variable).

    Args:
      name: the channel (for messages).
      owners: the owners' identities in configured order (participants 0..N-1).
      forwarder: server1 only: the name of server0's forwarded part (participant N); None on server0.
      addend_of: ``(payload, words) -> uint64 words`` a payload adds to the sum (to subtract it on a rewind).
    """

    def __init__(self, name: str, owners: Sequence[str], forwarder: Optional[str],
                 addend_of: Callable[[bytes, int], np.ndarray]):
        self.name, self._owners, self._addend_of = name, list(owners), addend_of
        self._names = self._owners + ([forwarder] if forwarder else [])
        self._cond = threading.Condition()
        self._settings = None  # (ring_bits, num_elements), fixed by the first put
        self._open: Optional[_Open] = None
        self._released: Optional[int] = None
        self._rewound: List[Optional[int]] = [None] * len(self._owners)  # since the last release
        self._last_step: List[Optional[int]] = [None] * len(self._names)
        self._results: Dict[int, _Result] = {}

    def _refuse(self, code: str, message: str) -> StepRefused:
        return StepRefused(code, f"Channel {self.name!r}: {message}")

    def put(self, participant: int, step: int, ring_bits: int, num_elements: int, payload: bytes,
            addend: np.ndarray) -> Optional[Released]:
        """Adds `participant`'s contribution to `step`; returns the `Released` step if it completed it."""
        with self._cond:
            return self._put(participant, step, (ring_bits, num_elements), payload, addend)

    def _put(self, participant, step, settings, payload, addend):
        me = self._names[participant]
        if self._settings is None:
            self._settings = settings
        elif self._settings != settings:
            raise self._refuse("FAILED_PRECONDITION",
                               f"{me} puts ring_bits={settings[0]}, num_elements={settings[1]} to step {step}, but "
                               f"the channel was set up with ring_bits={self._settings[0]}, num_elements="
                               f"{self._settings[1]} by its first put. Every owner must run the same model with the "
                               "same settings.")
        if participant < len(self._owners):
            rewound = self._rewound[participant]
        else:  # server0 re-releases a stale step only once every owner rewound to it (its own rule per owner)
            rewound = None if None in self._rewound else max(self._rewound)
        if self._released is not None and step <= self._released and (rewound is None or step < rewound):
            raise self._refuse("FAILED_PRECONDITION",
                               f"{me} puts step {step}, but this server already released step {self._released} "
                               "(a stale step: a replay, or an owner restored without rewinding)." + _RESTART)
        current = self._open
        if current is not None and participant in current.parts:
            if current.step == step:
                raise self._refuse("ALREADY_EXISTS",
                                   f"{me} already contributed to step {step}; a second contribution is refused (two "
                                   f"processes run as {me}? Give every owner its own certificate).")
            raise self._refuse("FAILED_PRECONDITION",
                               f"{me} puts step {step} while its contribution to step {current.step} was never "
                               "released (the owners are out of step)." + _RESTART)
        if current is not None and current.step != step:
            raise self._refuse("FAILED_PRECONDITION",
                               f"{me} puts step {step}, but step {current.step} is open with contributions of "
                               f"{[self._names[p] for p in sorted(current.parts)]} (the owners are out of step)."
                               + _RESTART)
        if current is None:
            current = self._open = _Open(step, ring.ring_words(settings[1], settings[0]))
        ring.add_into(current.acc, addend, settings[0])
        current.parts[participant] = payload
        self._last_step[participant] = step
        for result in list(self._results.values()):  # an answer this owner gave up on (a timeout)
            if result.step != step:
                self._taken(result, participant)
        if len(current.parts) < len(self._names):
            return None
        self._open, self._released = None, step
        self._rewound = [None] * len(self._rewound)  # a replay of a released step is stale again
        result = self._results[step] = _Result(step, len(self._owners))
        return Released(step, current.acc, settings[0], settings[1], result)

    def _taken(self, result: _Result, participant: int) -> None:
        result.pending.discard(participant)
        if not result.pending and self._results.get(result.step) is result:
            del self._results[result.step]

    def finish(self, released: Released, reply: Optional[bytes], error: Optional[StepRefused] = None) -> None:
        """Sets a released step's answer (or the error every owner's call gets) and wakes the owners."""
        with self._cond:
            released.result.reply, released.result.error = reply, error
            self._cond.notify_all()

    def wait(self, owner: int, step: int, timeout_secs: float, alive: Callable[[], bool]) -> bytes:
        """Blocks until `step`'s answer for `owner` is there; at most `timeout_secs`, and while `alive()`."""
        deadline = time.monotonic() + timeout_secs
        with self._cond:
            while True:
                result = self._results.get(step)
                if result is not None and result.done and owner in result.pending:
                    self._taken(result, owner)
                    if result.error is not None:
                        raise result.error
                    return result.reply
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise StepRefused("DEADLINE_EXCEEDED", self._missing(step, timeout_secs))
                if not alive():
                    raise StepRefused("CANCELLED", f"{self._owners[owner]}'s call for step {step} ended.")
                self._cond.wait(min(_POLL_SECS, remaining))

    def _missing(self, step: int, timeout_secs: float) -> str:
        if self._open is None or self._open.step != step:
            return (f"Channel {self.name!r}: step {step} was not answered within {timeout_secs:g} s (server0's "
                    "forward to server1 is late, or the caller's contribution was dropped by a rewind).")
        missing = []
        for p, name in enumerate(self._names):
            if p not in self._open.parts:
                last = self._last_step[p]
                missing.append(f"{name} (" + ("no contribution yet" if last is None else
                                              f"last contributed step {last}") + ")")
        return (f"Channel {self.name!r}: step {step} is still missing {', '.join(missing)} after {timeout_secs:g} s "
                "(step_timeout_secs). Check that those tasks run and reach this server.")

    def rewind(self, owner: int, step: int) -> None:
        """Drops `owner`'s unreleased contribution and its untaken answers; it may put from `step` again."""
        with self._cond:
            current = self._open
            if current is not None and owner in current.parts:
                part = self._addend_of(current.parts.pop(owner), current.acc.size)
                ring.sub_into(current.acc, part, self._settings[0])
                if not any(p < len(self._owners) for p in current.parts):
                    self._open = None  # nothing of any owner left (a forwarded part goes with it)
            self._rewound[owner] = step
            for result in list(self._results.values()):
                self._taken(result, owner)
            self._cond.notify_all()

    def wake(self) -> None:
        """Wakes every waiting call (the server is stopping: they see their `alive()` false)."""
        with self._cond:
            self._cond.notify_all()
