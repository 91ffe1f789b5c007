"""Contributions in flight: a service sum's contribution op starts its call, its answer op collects it.

A training step makes several sums (Estimator's gradients, then the reported
loss). Each used to be one op that put and then waited for its answer, the
next sum's op waiting for the previous one's answer: every sum cost the step a
round trip of its own (owner, server0's forward, server1, owner). Now each sum
is two ops: ``service_contribute`` starts the call and returns a ticket at
once, ``service_answer`` waits for that ticket's answer; the next sum's
contribution waits only for the previous contribution's *ticket*. So the
owners still put the sums of a step in the order the graph built them, and all
of a step's calls are on the wire together: one round trip per step, whatever
the number of sums.

At most `MAX_IN_FLIGHT` calls of this process run at once (the servers let
an owner keep ``--max-waiting-puts``, at least that many, waiting); the others
wait their turn in the order the contributions started. Why this cannot
deadlock, with any number of the session's inter-op threads (each owner runs
the same graph): a contribution op never waits for another owner (it only
queues its call), an answer op waits for a call this owner already started,
and calls run in the order they started. Take the earliest (step, sum) call
any owner has not finished: every owner that started it runs it (all its
earlier calls are done), and every other owner starts it without waiting for
anything (everything before it is done), so it is released.

Each channel has one worker thread, which runs its calls one at a time (one
call per channel, as with one op) and lives while calls come (it ends after
`IDLE_SECS` without one): the per-thread buffers of the sums' checks
(`sum_check.SumCheck`) are reused from step to step instead of being page-faulted
in again. A call's own timeouts (the client's) bound it. A failed call fails
its answer op only after every call in flight has ended, as a failed session
run used to wait for its running ops: the owner's next session (Estimator's
recovery) never finds its earlier calls still waiting on the servers. A ticket
no answer op collects (its session run failed in another op) is dropped when
the next call of its channel starts.

`waves` counts the calls that started while none ran: the sequential round
trips (the bench reads it beside the calls for its prediction at a distance).

Example::

    ticket = TICKETS.begin("sum_0", lambda: client.contribute("sum_0", step, 64, n, key, share))
    blind_key, w = TICKETS.finish(ticket)     # waits; re-raises the call's error
"""
import collections
import itertools
import logging
import queue
import threading
from typing import Callable, Dict, Optional

from tfe_estimator.service.thread_pool import next_job

__all__ = ["Tickets", "TICKETS", "IDLE_SECS", "MAX_IN_FLIGHT"]

#: A channel's worker thread ends after this long without a call.
IDLE_SECS = 60.0
#: How often an answer that keeps waiting says so (the client names the server a running call waits for).
_NOTICE_SECS = 30.0
_LOG = logging.getLogger("tfe_estimator")
#: Calls of one process running at once: a training step's two sums (the gradients, the reported loss).
MAX_IN_FLIGHT = 2


class _Call:
    """One call: its channel and work, then its result or exception."""

    def __init__(self, channel: str, work: Callable[[], object]):
        self.channel, self.work = channel, work
        self.result: object = None
        self.error: Optional[BaseException] = None
        self.done = threading.Event()


class Tickets:
    """The calls in flight of this process, by ticket (module docstring)."""

    def __init__(self, idle_secs: float = IDLE_SECS, max_in_flight: int = MAX_IN_FLIGHT):
        self._idle_secs, self._max = idle_secs, max_in_flight
        self._lock = threading.Lock()
        self._ended = threading.Condition(self._lock)
        self._ids = itertools.count(1)
        self._calls: Dict[int, _Call] = {}
        self._latest: Dict[str, int] = {}  # channel -> its latest ticket not collected
        self._workers: Dict[str, "queue.SimpleQueue[_Call]"] = {}
        self._waiting: "collections.deque[_Call]" = collections.deque()  # started, not yet running
        self._running = 0
        #: calls started while none ran: the sequential round trips so far
        self.waves = 0

    def begin(self, channel: str, work: Callable[[], object]) -> int:
        """Queues `work` (one call of `channel`) behind the calls started before it; returns its ticket."""
        call = _Call(channel, work)
        with self._lock:
            self._calls.pop(self._latest.pop(channel, 0), None)  # never collected: its answer is dropped
            ticket = next(self._ids)
            self._calls[ticket] = call
            self._latest[channel] = ticket
            self._waiting.append(call)
            self._admit()
        return ticket

    def _admit(self) -> None:
        """Hands the calls waiting their turn to their channels' workers, in order (under the lock)."""
        while self._waiting and self._running < self._max:
            call = self._waiting.popleft()
            if self._running == 0:
                self.waves += 1
            self._running += 1
            calls = self._workers.get(call.channel)
            if calls is None:
                calls = self._workers[call.channel] = queue.SimpleQueue()
                threading.Thread(target=self._work, args=(call.channel, calls), name=f"tfe-contribute-{call.channel}",
                                 daemon=True).start()
            calls.put(call)

    def _work(self, channel: str, calls: "queue.SimpleQueue[_Call]") -> None:
        while True:
            call = next_job(calls, self._idle_secs, self._lock, lambda: self._workers.pop(channel))
            if call is None:  # none for `IDLE_SECS`: this worker ends (a call handed over meanwhile keeps it)
                return
            try:
                call.result = call.work()
            except BaseException as e:  # pylint: disable=broad-except  # re-raised by `finish`
                call.error = e
            finally:
                call.work = None
                with self._lock:
                    self._running -= 1
                    self._admit()
                    self._ended.notify_all()
                call.done.set()

    def finish(self, ticket: int):
        """Waits for `ticket`'s call; returns its result, or raises its exception once no call is in flight.

        Raises:
          KeyError: naming the ticket, if it was never started here or was already collected.
        """
        with self._lock:
            call = self._calls.pop(ticket, None)
            if call is not None and self._latest.get(call.channel) == ticket:
                del self._latest[call.channel]
        if call is None:
            raise KeyError(f"contribution ticket {ticket} is not in flight in this process (collected already, or "
                           "dropped when a later call of its channel started).")
        waited = 0.0
        while not call.done.wait(timeout=_NOTICE_SECS):  # a call that never ends is named, not silent
            waited += _NOTICE_SECS
            with self._lock:
                running, queued = self._running, [c.channel for c in self._waiting]
            _LOG.info("service mode: the answer of %s waits (%.0f s; %d calls of this process running, waiting "
                      "their turn: %s)", call.channel, waited, running, queued or "none")
        if call.error is not None:
            with self._lock:
                self._ended.wait_for(lambda: self._running == 0 and not self._waiting)
            raise call.error
        return call.result

    def in_flight(self) -> int:
        """How many calls have not ended (running or waiting their turn)."""
        with self._lock:
            return self._running + len(self._waiting)


#: This process's calls in flight (the contribution ops of every graph).
TICKETS = Tickets()
