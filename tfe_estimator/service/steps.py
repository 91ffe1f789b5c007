"""The rules of one channel's steps on one aggregation server: who put what, when a step is released.

A channel is a sum's name AND its settings (ring_bits, num_elements): a put
with other settings lands on another channel (`server.py` keys its table so)
and never blocks or fixes anything for this one. The rules (``docs/operations.md``
tells them to users):

- an owner has at most one unreleased contribution per channel (a second one
  for the same step: ALREADY_EXISTS; for another step: FAILED_PRECONDITION);
  steps above the last released one may be open at once, each with its own
  accumulator, so a far-future put opens only its own step;
- a step is released once every participant put it (server1: the owners and
  server0's forwarded part); its answer stays in a replay window of the last
  ``window_steps`` released steps (and at most ``ReplayLimits.max_bytes`` on
  the server);
- a put for a released step inside the window gets the stored answer: its
  payload is never added and nothing is released again (an owner restored from
  an earlier checkpoint replays bit-identically; DP noise is released once);
  server0's forwarded part for a released step is refused, unless it is the
  release's own part (the same owners' key digests and blind-key digest: a
  restarted server0 that kept the step's blind key, `release_log`), which is
  answered like a replay;
  an older step is refused FAILED_PRECONDITION naming the window and its flag;
- a step not complete ``timeout_secs`` after it was opened, or whose caller's
  call ended, is aborted for everyone: the owners' contributions are dropped,
  every waiting call gets ABORTED naming the missing participants, and it is
  never released with those parts (the owners may put it again). Server0's
  forwarded part is a participant like the owners: its ``ForwardBlinded`` call
  waits for server1's release, so server0 keeps a step's answer only if
  server1 released it too (an abort on server1 fails server0's release, and the
  owners put the step again on both);
- memory: every byte held is reserved in a `budget.MemoryBudget` first; a
  step's accumulator comes from the server's `buffers.BufferPool` and goes back
  there when the step's answer is built or the step is aborted (answers are
  copies: a stored answer never changes when its buffer is reused);
- server1: an owner's share masked with another key than the one server0's
  part of the step was summed from (whichever came first) aborts the step: it
  is never summed, the owners put it again, server0 sums it again from the
  keys put then (an owner restarted after its key was summed);
- a rewind drops only its owner's unreleased contributions (on every step);
  a dropped contribution is never counted and its call never gets the step's
  answer (it gets the drop's error), while the same owner's later contribution
  to that step (its new session's) is counted and answered like any other:
  each put is its own contribution (`Ticket.token`).

Participants are numbered in the configured owner order; server1 has one more,
server0's forwarded part. Every refusal is a `StepRefused` carrying a gRPC
status code's name and a message naming the channel, the participants and the
steps, and the fix.

Example::

    channel = StepChannel("grads", 64, 8, ["chief:0", "worker:0"], None, remove_part, ReplayLimits(), budget)
    ticket = channel.put(0, step, payload, addend)   # ticket.released: set if this put completed the step
    if ticket.released is not None:
        channel.finish(ticket.released, reply_bytes)   # after computing the answer, outside the lock
    reply = channel.wait(0, ticket, alive=lambda: True)
"""
import threading
import time
from typing import Callable, Dict, List, NamedTuple, Optional, Sequence, Tuple

import numpy as np

from tfe_estimator.service import ring
from tfe_estimator.service.budget import BudgetExceeded, MemoryBudget
from tfe_estimator.service.buffers import BufferPool

__all__ = ["StepChannel", "StepRefused", "Released", "Ticket", "ReplayLimits", "WINDOW_STEPS_FLAG",
           "WINDOW_BYTES_FLAG", "TIMEOUT_FLAG"]

_POLL_SECS = 0.25  # how often a waiting put checks that its call is still alive
WINDOW_STEPS_FLAG, WINDOW_BYTES_FLAG = "--replay-window-steps", "--replay-window-bytes"
TIMEOUT_FLAG = "--step-timeout-secs"


class StepRefused(Exception):
    """A refusal: `code` is a ``grpc.StatusCode`` name, `message` says what, why and the fix."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code, self.message = code, message


def _fresh(error: StepRefused) -> StepRefused:
    """A copy of a refusal kept for several callers, to raise: the kept one never gets a traceback, whose frames
    (a caller's received payload among them) it would keep alive after the call ends, in a reference cycle only
    the garbage collector breaks (RSS seen above the budget)."""
    return StepRefused(error.code, error.message)


class ReplayLimits:
    """The replay window's bounds, shared by a server's channels: steps per channel, bytes per server."""

    def __init__(self, window_steps: int = 64, max_bytes: int = 1 << 30):
        self.window_steps, self.max_bytes = int(window_steps), int(max_bytes)
        self._lock = threading.Lock()
        self.held = 0

    def add(self, nbytes: int) -> bool:
        """Counts a stored answer; True while the server's stored answers are within `max_bytes`."""
        with self._lock:
            self.held += nbytes
            return self.held <= self.max_bytes

    def remove(self, nbytes: int) -> bool:
        with self._lock:
            self.held -= nbytes
            return self.held <= self.max_bytes


class _Result:
    """A released step's answer (a serialized reply, shared by the owners' calls and replays)."""

    def __init__(self, step: int):
        self.step = step
        self.reply: Optional[bytes] = None
        self.error: Optional[StepRefused] = None
        self.expected: Optional[Sequence[bytes]] = None  # server1: the digests of the owners' keys server0 summed
        self.blind_digest: Optional[bytes] = None  # server1: the digest of the key server0 blinded its part with
        self.sealed: Optional[Sequence[bytes]] = None  # server1: server0's blind key sealed for each owner
        # server0: the owners' keys it summed (owner order) and its blind key, to forward the same part again to
        # a server1 that lost the release (restarted before it answered the owners); in memory only, with the step
        self.keys: Optional[Tuple[Sequence[bytes], bytes]] = None

    @property
    def done(self) -> bool:
        return self.reply is not None or self.error is not None


class _Open:
    """A step being summed: its ring accumulator, who put what, who pays for which bytes.

    ``acc`` is a reused buffer: until ``filled``, its contents are stale and the first put copies into it.
    ``blind``: server0, the key of ``-AES(blind)`` the accumulator was prepared with (None: not prepared).
    """

    def __init__(self, step: int, acc: np.ndarray, deadline: float, blind: Optional[bytes] = None):
        self.step, self.acc, self.deadline = step, acc, deadline
        self.blind, self.filled = blind, blind is not None
        self.opener: Optional[str] = None  # the owner charged for the accumulator (None: server0's forward)
        self.parts: Dict[int, bytes] = {}  # participant -> its payload (a key or ring words)
        self.tokens: Dict[int, int] = {}  # participant -> the token of its contribution in parts (Ticket.token)
        self.charges: Dict[int, int] = {}  # participant -> bytes reserved for it (its payload, the accumulator)
        self.result: Optional[_Result] = None  # set when released
        self.aborted: Optional[StepRefused] = None  # set when aborted
        # participant -> why its latest dropped contribution was dropped (a rewind, a mismatched key): the error
        # that contribution's call gets. Kept after the participant contributes again, for a dropped call still
        # waiting (whether a call's contribution was dropped is its token's business, not this entry's); bounded
        # by the participants, gone with the step.
        self.dropped: Dict[int, StepRefused] = {}
        self.digests: Dict[int, bytes] = {}  # server1: owner -> the digest of the key its share was masked with
        self.expected: Optional[Sequence[bytes]] = None  # server1: per owner, the digest of the key server0 summed
        self.blind_digest: Optional[bytes] = None  # server1: the digest of server0's blind key (its forward says)
        self.sealed: Optional[Sequence[bytes]] = None  # server1: server0's blind key sealed per owner (its forward)


class Released(NamedTuple):
    """A step every participant put: its ring sum (uint64 words), settings, and where its answer goes."""
    step: int
    acc: np.ndarray
    ring_bits: int
    num_elements: int
    result: _Result
    parts: Dict[int, bytes]
    blind: Optional[bytes] = None  # server0: acc already holds -AES(blind) (a prepared accumulator)


class Ticket(NamedTuple):
    """What a put gives its caller to wait on: the step it joined, or a stored answer (a replay).

    ``token`` names this put's contribution to the open step (unique per channel): the call is answered only
    while that contribution is the one counted for its participant (a rewind may drop it, and the same
    participant may contribute again to the same step).
    """
    step: int
    open: Optional[_Open]
    replay: Optional[_Result]
    released: Optional[Released]
    token: Optional[int] = None


class StepChannel:
    """One channel's state on one server; thread-safe (one condition variable).

    Args:
      name: the channel's name; ring_bits, num_elements: its settings (part of its key on the server).
      owners: the owners' identities in configured order (participants 0..N-1).
      forwarder: server1 only: the name of server0's forwarded part (participant N); None on server0.
      remove_part: ``(acc, payload, ring_bits)`` subtracts what a payload added to the sum from `acc` (a rewind
        drops a contribution), in place and without a vector-sized buffer of its own (server0 draws a key's
        keystream a block at a time: `ring.keystream_apply`).
      replay: the server's `ReplayLimits`; budget: its `MemoryBudget`.
      timeout_secs: how long an open step may wait for its participants before it is aborted.
      pool: the server's `BufferPool` (accumulators reused across steps; server0's prepared ones); default:
        a pool of this channel's own.
    """

    def __init__(self, name: str, ring_bits: int, num_elements: int, owners: Sequence[str], forwarder: Optional[str],
                 remove_part: Callable[[np.ndarray, bytes, int], None], replay: ReplayLimits, budget: MemoryBudget,
                 timeout_secs: float = 300.0, pool: Optional[BufferPool] = None):
        self.name, self.ring_bits, self.num_elements = name, ring_bits, num_elements
        self.words = ring.ring_words(num_elements, ring_bits)
        #: puts between finding this channel in the server's table and registering in it (the server's lock
        #: guards it): a channel in use is never forgotten as idle
        self.users = 0
        self._owners, self._remove_part, self._replay, self._budget = list(owners), remove_part, replay, budget
        self._names = self._owners + ([forwarder] if forwarder else [])
        self._timeout = float(timeout_secs)
        self._pool = pool if pool is not None else BufferPool(budget)
        self._cond = threading.Condition()
        self._open: Dict[int, _Open] = {}
        self._pending: Dict[int, int] = {}  # participant -> the step of its unreleased contribution
        self._window: Dict[int, _Result] = {}  # released step -> its answer (insertion order = release order)
        self._last_released: Optional[int] = None
        self._evicted_through: Optional[int] = None  # the newest step that left the window
        self._evicted_for_bytes = False
        self._last_step: List[Optional[int]] = [None] * len(self._names)
        self._tokens = 0  # contributions counted so far (the last Ticket.token)
        self.ever_released = False

    @property
    def last_released(self) -> Optional[int]:
        """The newest step released on this channel (None: none yet)."""
        return self._last_released

    @property
    def label(self) -> str:
        return f"channel {self.name!r} (ring {self.ring_bits}, {self.num_elements} elements)"

    def _refuse(self, code: str, message: str) -> StepRefused:
        return StepRefused(code, f"Service mode, {self.label}: {message}")

    def _payer(self, participant: int) -> Optional[str]:
        return self._owners[participant] if participant < len(self._owners) else None

    def idle(self) -> bool:
        """True when the channel holds nothing (no open step, no stored answer): the server may forget it."""
        with self._cond:
            return not self._open and not self._window

    # ----------------------------------------------------------------- put --

    def put(self, participant: int, step: int, payload: bytes, addend: np.ndarray,
            digests: Optional[Sequence[bytes]] = None, blind_digest: Optional[bytes] = None,
            sealed: Optional[Sequence[bytes]] = None) -> Ticket:
        """Adds `participant`'s contribution to `step` (or finds its stored answer); see the module docstring.

        Args:
          digests: server1 only: an owner's share: ``[digest of its key]`` (the owner's client sends it);
            server0's forwarded part: the digest of every owner's key it summed, in owner order. A share and a
            part of different keys abort the step (the sum would be garbage: e.g. a restarted owner's fresh
            share for a step server0 summed before its crash); the share that finds the mismatch opens the step
            again, the part that finds it is refused ABORTED (server0's release fails, it sums again).
          blind_digest: server1 only, server0's forwarded part: the digest of the key it is blinded with. A
            forwarded part for a step already released is answered as a replay (nothing added) only when
            both its digests and this one are the release's: the same part (server0 restarted, `release_log`).
          sealed: server1 only, server0's forwarded part: its blind key sealed for each owner (`sealed_blind`);
            the step's answer carries them.
        """
        with self._cond:
            return self._put(participant, step, payload, addend, digests, blind_digest, sealed)

    def _mismatch(self, current: _Open, participant: int, digest: Optional[bytes]) -> Optional[str]:
        if current is None or current.expected is None or digest is None or \
                current.expected[participant] == digest:
            return None
        return (f"{self._names[participant]}'s masked share for step {current.step} was masked with another key "
                "than the one server0 summed for that step (the owner restarted after server0 summed its key, "
                "e.g. a key put when the step started); server0 sums the step again from the keys put now")

    def _put(self, participant, step, payload, addend, digests=None, blind_digest=None, sealed=None):
        me = self._names[participant]
        stored = self._window.get(step)
        if stored is not None:
            if participant >= len(self._owners):
                if self._same_release(stored, digests, blind_digest):
                    # server0 restarted and forwards the step again from the same keys, blinded with the key it
                    # recorded (`release_log`): the part it sent before. Nothing is added or released again.
                    return Ticket(step, None, stored, None)
                raise self._refuse("FAILED_PRECONDITION",
                                   f"{me} forwards step {step}, which this server already released: server0 was "
                                   "restarted and lost its replay window while this server kept it (it runs "
                                   "without a state directory, TFE_ESTIMATOR_STATE_DIR, or lost its release log). "
                                   "Restart both servers (and the owners from one checkpoint).")
            return Ticket(step, None, stored, None)  # a replay: the payload is never added
        if self._last_released is not None and step <= self._last_released:
            raise self._refuse("FAILED_PRECONDITION", self._stale(me, step))
        if participant in self._pending:
            held = self._pending[participant]
            if held == step:
                raise self._refuse("ALREADY_EXISTS",
                                   f"{me} already contributed to step {step}; a second contribution is refused (two "
                                   f"processes run as {me}? Give every owner its own certificate).")
            raise self._refuse("FAILED_PRECONDITION",
                               f"{me} puts step {step} while its contribution to step {held} is not released; an "
                               "owner has one unreleased contribution per channel. The owner's handshake drops it "
                               "(Rewind) when it restarts; otherwise wait for step "
                               f"{held} (or its abort after {self._timeout:g} s, {TIMEOUT_FLAG}).")
        current = self._open.get(step)
        mine = digests[0] if digests and participant < len(self._owners) else None
        wrong = self._mismatch(current, participant, mine)
        if wrong:  # never summed with server0's part of the other key: the step starts again, with this share
            self._abort(current, wrong)
            current = None
        if participant >= len(self._owners) and current is not None and digests and \
                len(digests) == len(self._owners):
            wrong = next((w for w in (self._mismatch_of(current, digests, owner, digest)
                                      for owner, digest in current.digests.items()) if w), None)
            if wrong:  # server0's part of keys an owner no longer masks with: both sum the step again
                raise _fresh(self._abort(current, wrong))
        charge = len(payload) + (0 if current is not None else 8 * self.words)
        try:
            self._budget.reserve(self._payer(participant), charge,
                                 f"step {step} of {self.label}")
        except BudgetExceeded as e:
            raise StepRefused(e.code, e.message) from None
        if current is None:
            ready = self._pool.take_ready(self, self.words)
            acc, blind = ready if ready is not None else (self._pool.take(self.words), None)
            current = self._open[step] = _Open(step, acc, time.monotonic() + self._timeout, blind)
            current.opener = self._payer(participant)
        if current.filled:
            ring.add_into(current.acc, addend, self.ring_bits)
        else:
            ring.copy_into(current.acc, addend)
            current.filled = True
        current.parts[participant] = payload
        self._tokens += 1
        current.tokens[participant] = token = self._tokens
        current.charges[participant] = charge
        self._pending[participant] = step
        self._last_step[participant] = step
        if mine is not None:
            current.digests[participant] = mine
        if participant >= len(self._owners):
            current.blind_digest, current.sealed = blind_digest, sealed
        if participant >= len(self._owners) and digests and len(digests) == len(self._owners):
            current.expected = list(digests)
        if len(current.parts) < len(self._names):
            return Ticket(step, current, None, None, token)
        return Ticket(step, current, None, self._release(current), token)

    def _mismatch_of(self, current: _Open, digests: Sequence[bytes], owner: int, digest: bytes) -> Optional[str]:
        """`_mismatch` of an owner's share already in `current` against server0's part of `digests` (arriving)."""
        if digests[owner] == digest:
            return None
        return (f"server0's part of step {current.step} was summed from another key of {self._names[owner]} than "
                "the one its share is masked with (the owner restarted after server0 summed its key); server0 sums "
                "the step again from the keys put now")

    def _stale(self, me: str, step: int) -> str:
        kept = sorted(self._window)
        window = (f"it keeps the answers of the last {self._replay.window_steps} released steps per channel "
                  f"({WINDOW_STEPS_FLAG}) and at most {self._replay.max_bytes} bytes of answers "
                  f"({WINDOW_BYTES_FLAG}); now steps {kept[0]}-{kept[-1]}" if kept else
                  f"it keeps the last {self._replay.window_steps} released steps ({WINDOW_STEPS_FLAG})")
        if self._evicted_through is not None and step <= self._evicted_through:
            flag = WINDOW_BYTES_FLAG if self._evicted_for_bytes else WINDOW_STEPS_FLAG
            return (f"{me} puts step {step}, which this server released and no longer keeps: the step is older than "
                    f"its replay window ({window}). The owner restored a checkpoint older than the window: "
                    f"restore a newer one (checkpoint at least every {self._replay.window_steps} steps), or start "
                    f"the servers with a larger {flag}.")
        return (f"{me} puts step {step}, which this server has no answer for while it released step "
                f"{self._last_released}: the step was aborted and the owners moved past it, or it was released "
                "before this server restarted (a restarted server has no replay window). Restore every owner's "
                "latest checkpoint.")

    def _release(self, current: _Open) -> Released:
        del self._open[current.step]
        for participant, charge in current.charges.items():
            self._budget.free(self._payer(participant), charge)
            self._pending.pop(participant, None)
        current.charges.clear()
        result = current.result = self._window[current.step] = _Result(current.step)
        result.expected, result.blind_digest, result.sealed = current.expected, current.blind_digest, current.sealed
        self._last_released = current.step if self._last_released is None else max(self._last_released,
                                                                                   current.step)
        self.ever_released = True
        for step in [s for s in self._open if s < current.step]:  # left only with a forwarded part
            self._abort(self._open[step], f"step {current.step} was released after it")
        self._cond.notify_all()
        return Released(current.step, current.acc, self.ring_bits, self.num_elements, result, dict(current.parts),
                        current.blind)

    def finish(self, released: Released, reply: Optional[bytes], error: Optional[StepRefused] = None) -> None:
        """Sets a released step's answer (or the error every owner's call gets) and wakes the owners.

        A failed step (server0 could not forward it) leaves the window: the owners may put it again. The
        step's accumulator goes back to the pool: `reply` must not be a view of it (`wire.encode` copies).
        """
        self._pool.give(released.acc)  # the server's own spare: every participant's put released it
        with self._cond:
            result = released.result
            result.reply, result.error = reply, error
            if error is not None:
                self._window.pop(result.step, None)
                known = list(self._window) + ([self._evicted_through] if self._evicted_through is not None else [])
                self._last_released = max(known) if known else None
            else:
                self._store(reply)
            self._cond.notify_all()

    def _store(self, reply: bytes) -> None:
        """Counts a stored answer and evicts the oldest beyond the window (the caller holds the lock)."""
        within = self._replay.add(len(reply))
        while self._window:
            too_many = len(self._window) > max(self._replay.window_steps, 1)
            if not too_many and (within or len(self._window) <= 1):
                break
            oldest = min(self._window)
            self._evicted_for_bytes = not too_many
            evicted = self._window.pop(oldest)
            self._evicted_through = max(self._evicted_through or oldest, oldest)
            within = self._replay.remove(len(evicted.reply or b""))

    @staticmethod
    def _same_release(stored: _Result, digests, blind_digest) -> bool:
        return digests is not None and blind_digest is not None and stored.expected is not None and \
            stored.blind_digest is not None and bytes(blind_digest) == bytes(stored.blind_digest) and \
            [bytes(d) for d in digests] == [bytes(d) for d in stored.expected]

    def released(self, step: int, digests: Sequence[bytes], blind_digest: bytes) -> bool:
        """Server1: whether `step` is in the window, released from owners' keys of `digests` and server0's part
        blinded with a key of `blind_digest` (server0 confirms a release it recorded before it restarted,
        `release_log`)."""
        with self._cond:
            stored = self._window.get(step)
            return stored is not None and stored.reply is not None and \
                self._same_release(stored, digests, blind_digest)

    def restore(self, step: int, reply: bytes, digests: Sequence[bytes]) -> bool:
        """Server0 after a restart: puts the answer of a step server1 confirmed it released (`release_log`) into
        the window, so puts of it are answered from there; False if the step is open or known here already.
        `digests`: of the owners' keys it summed (`first_answer`)."""
        with self._cond:
            if step in self._window or step in self._open:
                return False
            result = self._window[step] = _Result(step)
            result.reply, result.expected = reply, list(digests)
            self._last_released = step if self._last_released is None else max(self._last_released, step)
            self.ever_released = True
            self._store(reply)
            self._cond.notify_all()
            return True

    @staticmethod
    def first_answer(ticket: Ticket, participant: int, digest: bytes) -> bool:
        """Whether a put answered from the window is the participant's same contribution put again (its key's
        `digest` is the one summed): the answer it never received, not a replay of one it received. Server1 knows
        the digests of every release (server0's forward names them): an owner whose answer was lost on the way
        puts again. Server0 knows them for a release restored from its log (`restore`) only: its owners put
        the same key again, and their first answer is server1's (it carries the blind key, `sealed_blind`)."""
        expected = ticket.replay.expected if ticket.replay is not None else None
        return expected is not None and participant < len(expected) and bytes(expected[participant]) == digest

    # ---------------------------------------------------------------- wait --

    def wait(self, participant: int, ticket: Ticket, alive: Callable[[], bool]) -> bytes:
        """Blocks until `ticket`'s answer is there; the step is aborted at its deadline or when `alive()` fails."""
        with self._cond:
            while True:
                current = ticket.open
                if current is not None and current.tokens.get(participant) != ticket.token:
                    # this call's contribution was dropped (and maybe the participant contributed again since):
                    # it was never counted in the step's answer, which is not this call's to get
                    raise _fresh(current.dropped[participant])
                result = ticket.replay if ticket.replay is not None else current.result
                if result is not None and result.done:
                    if result.error is not None:
                        raise _fresh(result.error)
                    return result.reply
                if current is not None and result is None:
                    if current.aborted is not None:
                        raise _fresh(current.aborted)
                    if time.monotonic() >= current.deadline:
                        raise _fresh(self._abort(current, f"it was not complete {self._timeout:g} s after it was "
                                                          f"opened ({TIMEOUT_FLAG})"))
                    if not alive():
                        self._abort(current, f"{self._names[participant]}'s call ended (its process stopped or "
                                             "its client gave up) before the step was complete")
                        raise StepRefused("CANCELLED",
                                          f"Service mode, {self.label}: {self._names[participant]}'s call for step "
                                          f"{ticket.step} ended; the step was aborted.")
                elif not alive():
                    raise StepRefused("CANCELLED", f"Service mode, {self.label}: {self._names[participant]}'s call "
                                                   f"for step {ticket.step} ended.")
                self._cond.wait(_POLL_SECS)

    def _missing(self, current: _Open) -> str:
        missing = []
        for p, name in enumerate(self._names):
            if p not in current.parts:
                last = self._last_step[p]
                missing.append(f"{name} (" + ("no contribution yet" if last is None else
                                              f"last contributed step {last}") + ")")
        return ", ".join(missing)

    def _abort(self, current: _Open, why: str) -> StepRefused:
        """Aborts an open step for everyone (the caller holds the lock); returns the error its waiters get."""
        if current.aborted is not None or current.result is not None:
            return current.aborted
        owners = [self._names[p] for p in sorted(current.parts) if p < len(self._owners)]
        error = self._refuse(
            "ABORTED", f"step {current.step} was aborted: {why}, still missing {self._missing(current) or 'nobody'}. "
                       f"The contributions of {owners or 'no owner'} were dropped and nothing was released; the "
                       "owners put the step again. Check that the missing tasks run and reach this server.")
        current.aborted = error
        self._open.pop(current.step, None)
        for participant, charge in current.charges.items():
            self._budget.free(self._payer(participant), charge)
            if self._pending.get(participant) == current.step:
                del self._pending[participant]
        current.charges.clear()
        self._recycle(current)  # after the charges: the spare is charged to the step's opener again
        self._cond.notify_all()
        return error

    # -------------------------------------------------------------- rewind --

    def rewind(self, owner: int) -> int:
        """Drops `owner`'s unreleased contribution (if any); returns how many it dropped (0 or 1)."""
        with self._cond:
            step = self._pending.pop(owner, None)
            current = self._open.get(step) if step is not None else None
            if current is None or owner not in current.parts:
                return 0
            self._drop(current, owner, self._refuse(
                "ABORTED", f"{self._owners[owner]}'s contribution to step {step} was dropped by its own rewind "
                           "(a new session of this owner restored a checkpoint)."))
            return 1

    def _drop(self, current: _Open, participant: int, error: StepRefused) -> None:
        """Subtracts one participant's part from an open step (the caller holds the lock); its call gets `error`."""
        self._remove_part(current.acc, current.parts.pop(participant), self.ring_bits)
        del current.tokens[participant]
        self._budget.free(self._payer(participant), current.charges.pop(participant, 0))
        current.digests.pop(participant, None)
        if self._pending.get(participant) == current.step:
            del self._pending[participant]
        current.dropped[participant] = error
        if not current.parts:
            del self._open[current.step]
            self._recycle(current)
        self._cond.notify_all()

    def _recycle(self, current: _Open) -> None:
        """An abandoned open step's accumulator back to the pool, charged to the owner that opened the step (its
        prepared blind key, if any, forgotten): an owner opening steps that are never released pays for the
        spares they leave."""
        if current.acc is not None:
            self._pool.give(current.acc, current.opener)
        current.acc, current.blind = None, None

    def wake(self) -> None:
        """Wakes every waiting call (the server is stopping: they see their `alive()` false)."""
        with self._cond:
            self._cond.notify_all()
