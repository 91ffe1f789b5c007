"""A service sum's calls in flight (`in_flight.Tickets`): in order, at most two at once, errors after the others.

Plain threads stand in for the service calls (each waits for an event the test sets), so every ordering is
forced, not timed.
"""
import threading
import time

import pytest

from tfe_estimator.owner.in_flight import Tickets

WAIT = 10.0


def _call(log, name, release=None, error=None):
    def work():
        log.append(("start", name))
        if release is not None:
            assert release.wait(WAIT)
        log.append(("end", name))
        if error is not None:
            raise error
        return name

    return work


def test_calls_run_in_the_order_they_started_at_most_two_at_once_and_count_their_waves():
    tickets, log = Tickets(), []
    gates = {name: threading.Event() for name in "abc"}
    a = tickets.begin("sum_0", _call(log, "a", gates["a"]))
    b = tickets.begin("sum_1", _call(log, "b", gates["b"]))
    c = tickets.begin("sum_2", _call(log, "c", gates["c"]))  # waits its turn: two run
    deadline = time.monotonic() + WAIT
    while len(log) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.05)
    assert sorted(log) == [("start", "a"), ("start", "b")] and tickets.in_flight() == 3
    gates["a"].set()
    assert tickets.finish(a) == "a"
    gates["b"].set()
    gates["c"].set()
    assert (tickets.finish(b), tickets.finish(c)) == ("b", "c")
    assert log.index(("start", "c")) > log.index(("end", "a"))
    assert tickets.waves == 1 and tickets.in_flight() == 0  # a, b and c overlapped: one round trip
    d = tickets.begin("sum_0", _call(log, "d"))
    assert tickets.finish(d) == "d" and tickets.waves == 2


def test_a_failed_call_is_raised_only_after_every_call_in_flight_ended():
    # As a failed session run used to wait for its running ops: the next session never finds them still waiting.
    tickets, log, gate = Tickets(), [], threading.Event()
    failed = tickets.begin("sum_0", _call(log, "grads", error=RuntimeError("server0 refused")))
    slow = tickets.begin("sum_1", _call(log, "loss", gate))
    threading.Timer(0.3, gate.set).start()
    with pytest.raises(RuntimeError, match="server0 refused"):
        tickets.finish(failed)
    assert ("end", "loss") in log and tickets.in_flight() == 0
    assert tickets.finish(slow) == "loss"


def test_a_ticket_is_collected_once_and_an_uncollected_one_is_dropped_by_its_channels_next_call():
    tickets, log = Tickets(), []
    first = tickets.begin("sum_0", _call(log, "first"))
    second = tickets.begin("sum_0", _call(log, "second"))  # the first's session run failed elsewhere
    assert tickets.finish(second) == "second"
    with pytest.raises(KeyError, match=f"contribution ticket {first} is not in flight in this process"):
        tickets.finish(first)
    with pytest.raises(KeyError, match=f"ticket {second} is not in flight"):
        tickets.finish(second)
    assert log.index(("end", "first")) < log.index(("start", "second"))  # one call per channel at a time


def test_a_channels_worker_ends_when_idle_and_a_new_one_takes_its_next_call():
    tickets = Tickets(idle_secs=0.1)
    assert tickets.finish(tickets.begin("idle_sum", lambda: 1)) == 1
    deadline = time.monotonic() + WAIT
    while any(t.name == "tfe-contribute-idle_sum" for t in threading.enumerate()) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not any(t.name == "tfe-contribute-idle_sum" for t in threading.enumerate())
    assert tickets.finish(tickets.begin("idle_sum", lambda: 2)) == 2
