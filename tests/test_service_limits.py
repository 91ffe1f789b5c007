"""The service's step rules and limits against one owner that holds a valid certificate (issue 32's acceptance).

In process, loopback: each property beside its mutation (the check disabled: the test's own check must fail).
- a channel is its name AND its settings: a 1-element first put fixes nothing for the others;
- a far-future step opens only its own step, and the owner's rewind clears it;
- a released step is replayed from the window (its payload never added, nothing released twice); older ones are
  refused naming the window's flag;
- a timed-out step is aborted for everyone: an abandoned contribution is never returned to anyone;
- memory: one owner cannot make a server hold more than its budget (RESOURCE_EXHAUSTED naming the flag), measured
  by the process's RSS too: one owner's puts on fresh channels of ever new sizes leave no spares beyond its budget;
- threads: 48 waiting puts of one owner on fresh channels leave the honest step under 2 s.
"""
import gc
import os
import threading
import time
import types

import grpc
import numpy as np
import pytest

from service_helpers import cert_dirs, in_threads, make_service, owner_names  # noqa: F401 (fixtures)
from tfe_estimator.service import ServiceError, ring, steps, wire
from tfe_estimator.service import budget as budget_module
from tfe_estimator.service import buffers
from tfe_estimator.service import server as server_module


def _mask(x):
    """share, key of int64 values at ring 64 (NumPy: the rules need no kernels)."""
    key = np.frombuffer(os.urandom(16), np.int32)
    share = (x.view(np.uint64) - ring.keystream_words(key, x.size)).view(np.int64)
    return share, key


def _put(client, step, x=None, n=8, channel="c"):
    x = np.arange(n, dtype=np.int64) if x is None else x
    share, key = _mask(x)
    return client.contribute(channel, step, 64, x.size, key, share)


def _reveal(result):
    blind, w = result
    return (w.view(np.uint64) + ring.keystream_words(blind, w.size)).view(np.int64)


def _later(seconds, call):
    return lambda: (time.sleep(seconds), call())[1]


# --------------------------------------------------------------- channels --

def test_a_put_with_other_settings_lands_on_another_channel_and_fixes_nothing(make_service):
    service = make_service(owner_names(2), step_timeout_secs=3.0)
    chief, worker = service.clients_of(2)
    results = in_threads([lambda: _put(worker, 0, n=1),  # a 1-element first put of "c": its own channel
                          _later(0.3, lambda: _put(chief, 0, n=8)), _later(0.3, lambda: _put(worker, 0, n=8))])
    np.testing.assert_array_equal(_reveal(results[1]), 2 * np.arange(8))
    assert isinstance(results[0], ServiceError) and results[0].code == grpc.StatusCode.ABORTED, results[0]
    assert "channel 'c' (ring 64, 1 elements): step 0 was aborted" in results[0].details
    assert "still missing chief:0 (no contribution yet)" in results[0].details


def test_a_far_future_step_opens_only_its_own_step_and_its_owners_rewind_clears_it(make_service):
    service = make_service(owner_names(2))
    chief, worker = service.clients_of(2)

    def worker_rewinds_then_puts():
        time.sleep(0.5)
        worker.rewind(0)
        return _put(worker, 0)

    results = in_threads([lambda: _put(worker, 10**15), _later(0.2, lambda: _put(chief, 0)),
                          worker_rewinds_then_puts])
    assert isinstance(results[0], ServiceError) and results[0].code == grpc.StatusCode.ABORTED, results[0]
    assert "worker:0's contribution to step 1000000000000000 was dropped by its own rewind" in results[0].details
    np.testing.assert_array_equal(_reveal(results[1]), 2 * np.arange(8))
    np.testing.assert_array_equal(_reveal(results[2]), _reveal(results[1]))


def _open_sum_after_a_rewind(remove_part, ring_bits):
    """Server0's rules: chief:0 and worker:0 put their keys to step 0 of 3 owners, worker:0 rewinds. Returns
    whether the open step's sum is exactly chief:0's keystream (a sum past one keystream block, 2**17 words)."""
    n = 70_001
    words = ring.ring_words(n, ring_bits)
    channel = steps.StepChannel("c", ring_bits, n, owner_names(3), None, remove_part, steps.ReplayLimits(),
                                budget_module.MemoryBudget(1 << 30, 1 << 30))
    keys = [os.urandom(16) for _ in range(2)]
    for owner, key in enumerate(keys):
        channel.put(owner, 0, key, ring.keystream_words(key, words))
    assert channel.rewind(1) == 1
    return np.array_equal(channel._open[0].acc, ring.keystream_words(keys[0], words))  # pylint: disable=W0212


def _server0_remove_part(acc, payload, ring_bits):
    server0 = types.SimpleNamespace(_role=0)
    server_module.AggregationServer._remove_part(server0, acc, payload, ring_bits)  # pylint: disable=W0212


@pytest.mark.parametrize("ring_bits", [32, 64, 128])
def test_a_rewound_key_is_subtracted_exactly_from_server0s_open_sum(ring_bits):
    """Server0 subtracts a rewound owner's key by its keystream drawn a block at a time (no expansion of the sum's
    size, which the budget would not count); the other owner's part stays."""
    assert _open_sum_after_a_rewind(_server0_remove_part, ring_bits)


def test_mutation_a_rewind_that_leaves_its_part_in_the_sum_is_detected():
    assert not _open_sum_after_a_rewind(lambda acc, payload, ring_bits: None, 128)


def test_an_owner_contributing_again_after_its_rewind_is_counted_once_and_its_dropped_call_gets_no_answer():
    """Server1's rules, 3 owners, step 0: chief:0 and worker:0 put, worker:0's new session rewinds (its part is
    dropped while chief:0's keeps the step open) and puts the step again. The new contribution is answered with
    the sum of the three owners' parts; the dropped one is never counted and its call still gets the drop's error.
    (The dropped entry was once kept per participant and refused the new call too.)"""
    # Prepare: ring words as payloads (server1's), summed and subtracted as server1 does.
    channel = steps.StepChannel("c", 64, 8, owner_names(3), None, lambda acc, payload, bits: ring.sub_into(
        acc, np.frombuffer(payload, "<u8"), bits), steps.ReplayLimits(), budget_module.MemoryBudget(1 << 30, 1 << 30))

    def put(owner, value):
        payload = np.full(8, value, np.uint64).tobytes()
        return channel.put(owner, 0, payload, np.frombuffer(payload, "<u8"))

    put(0, 1)
    dropped = put(1, 100)
    assert channel.rewind(1) == 1
    again = put(1, 10)
    waiting, answers = threading.Event(), {}

    def wait_again():
        try:
            answers["again"] = channel.wait(1, again, alive=lambda: waiting.set() or True)
        except steps.StepRefused as e:
            answers["again"] = e

    # Execute: the new contribution's call waits on the open step (or returns at once, refused); the third owner
    # completes it.
    waiter = threading.Thread(target=wait_again)
    waiter.start()
    while waiter.is_alive() and not waiting.is_set():
        time.sleep(0.01)
    released = put(2, 1000).released
    channel.finish(released, released.acc.copy().tobytes())
    waiter.join(10)
    # Assert: the sum holds worker:0's new part only; its dropped call is refused, naming the rewind.
    assert not isinstance(answers["again"], Exception), answers["again"]
    np.testing.assert_array_equal(np.frombuffer(answers["again"], "<u8"), np.full(8, 1011, np.uint64))
    with pytest.raises(steps.StepRefused, match="worker:0's contribution to step 0 was dropped by its own rewind"):
        channel.wait(1, dropped, alive=lambda: True)


def test_one_unreleased_contribution_per_owner_and_channel(make_service):
    service = make_service(owner_names(2), step_timeout_secs=3.0)
    chief, worker = service.clients_of(2)
    results = in_threads([lambda: _put(chief, 0), _later(0.3, lambda: _put(chief, 0)),
                          _later(0.3, lambda: _put(chief, 1))])
    assert results[1].code == grpc.StatusCode.ALREADY_EXISTS and "chief:0 already contributed to step 0" in \
        results[1].details
    assert results[2].code == grpc.StatusCode.FAILED_PRECONDITION
    assert "chief:0 puts step 1 while its contribution to step 0 is not released" in results[2].details
    del worker


# ------------------------------------------------------------------ replay --

def _released_twice(service) -> bool:
    """Releases steps 0..2; the chief restored at step 0 puts 0 and 1 again with other values. True if anything
    was summed or released again (the replayed answers differ from the first ones)."""
    chief, worker = service.clients_of(2)
    first = {}
    for step in range(3):
        first[step] = in_threads([lambda s=step: _put(chief, s), lambda s=step: _put(worker, s)])
        np.testing.assert_array_equal(_reveal(first[step][0]), 2 * np.arange(8))
    again = {}
    for step in (1, 2):
        again[step] = in_threads([lambda s=step: _put(chief, s, x=np.full(8, 1000, np.int64)),
                                  lambda s=step: _put(worker, s, x=np.full(8, 1000, np.int64))])
    for step in (1, 2):
        for k in range(2):
            if isinstance(again[step][k], Exception):
                return True
            if any(not np.array_equal(a, b) for a, b in zip(again[step][k], first[step][k])):
                return True
    return False


def test_a_released_step_is_replayed_bit_identically_and_an_older_one_is_refused_naming_the_flag(make_service):
    service = make_service(owner_names(2), replay_window_steps=2)
    assert not _released_twice(service)
    # Each owner's client tells the releases from the replays (the servers' trailing metadata): 3 and 2.
    assert [client.answers["c"] for client in service.clients] == [[3, 2], [3, 2]]
    chief = service.clients[0]
    with pytest.raises(ServiceError) as e:
        _put(chief, 0)
    assert e.value.code == grpc.StatusCode.FAILED_PRECONDITION
    assert "chief:0 puts step 0, which this server released and no longer keeps" in e.value.details
    assert "--replay-window-steps" in e.value.details and "now steps 1-2" in e.value.details


def test_mutation_without_the_window_a_restored_owner_releases_steps_again(make_service, monkeypatch):
    real = steps.StepChannel._put

    def forgetful(self, *args, **kwargs):
        self._window.clear()  # pylint: disable=protected-access
        self._last_released = None  # pylint: disable=protected-access
        return real(self, *args, **kwargs)

    monkeypatch.setattr(steps.StepChannel, "_put", forgetful)
    assert _released_twice(make_service(owner_names(2), replay_window_steps=2))


# ------------------------------------------------------------------- abort --

def _abandoned_vector_returned(service) -> bool:
    """The chief's put times out; the worker then puts zeros. True if the worker receives the chief's vector."""
    chief, worker = service.clients_of(2)
    secret = np.arange(100, 108, dtype=np.int64)
    first = in_threads([lambda: _put(chief, 0, x=secret)])[0]
    assert isinstance(first, ServiceError), first
    assert "still missing worker:0 (no contribution yet)" in first.details, first.details
    after = in_threads([lambda: _put(worker, 0, x=np.zeros(8, np.int64))])[0]
    return not isinstance(after, Exception) and np.array_equal(_reveal(after), secret)


def test_a_timed_out_step_is_aborted_for_everyone_and_never_released_later(make_service):
    service = make_service(owner_names(2), step_timeout_secs=1.0)
    assert not _abandoned_vector_returned(service)
    deadline = time.monotonic() + 3.0  # server1 sees the worker's cancelled call within its poll
    def held():  # beside the spare buffers the servers keep for the next steps (charged to themselves)
        return [s._budget.total - s._pool.held for s in service.servers]  # pylint: disable=W0212

    while any(held()) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert held() == [0, 0]  # nothing held for an owner


def test_mutation_without_the_abort_the_abandoned_vector_comes_back(make_service, monkeypatch):
    def keep(self, current, why):
        return steps.StepRefused("DEADLINE_EXCEEDED", f"step {current.step}: still missing "
                                 f"{self._missing(current)}")  # pylint: disable=protected-access

    monkeypatch.setattr(steps.StepChannel, "_abort", keep)
    real_wait = steps.StepChannel.wait

    def wait(self, participant, ticket, alive):
        if ticket.open is not None and ticket.open.result is None:
            ticket.open.deadline = time.monotonic() + 1.0  # the old rule: each call waits alone
        return real_wait(self, participant, ticket, alive)

    monkeypatch.setattr(steps.StepChannel, "wait", wait)
    assert _abandoned_vector_returned(make_service(owner_names(2), step_timeout_secs=1.0))


def _an_owner_with_two_keys(make_service):
    """One owner (it puts an aborted step again), x, two masks of x ``(share, key)``, its gRPC Contribute stub on
    server0, and a put of the first key alone (server0 releases it and forwards its part at once)."""
    service = make_service(owner_names(1), step_timeout_secs=10.0)
    chief = service.client("chief", 0, retry_secs=None)
    x = np.arange(8, dtype=np.int64)
    first, second = _mask(x), _mask(x)
    key_only = wire.encode("ContributeRequest", np.asarray(first[1], "<i4"), channel="c", step=0, ring_bits=64,
                           num_elements=8)
    return chief, x, first, second, chief._stubs[0]["Contribute"], key_only  # pylint: disable=protected-access


def test_a_share_masked_with_another_key_than_server0_summed_aborts_the_step_and_it_is_summed_again(make_service):
    # Server0 released step 0 with the chief's key k1 (its share not on server1 yet: the key was put when the
    # step started, then the owner restarted); a fresh share of key k2 is never summed with server0's part of k1:
    # server1 aborts the step, server0's release fails, and the step is summed again from k2. A late put of k1
    # gets that release's answer (a replay), the same sum.
    chief, x, (share1, key1), (share2, key2), stub, key_only = _an_owner_with_two_keys(make_service)
    results = in_threads([lambda: stub(key_only, timeout=20),  # server0 alone: released, forwarded, waits
                          _later(0.5, lambda: chief.contribute("c", 0, 64, 8, key2, share2)),
                          _later(1.0, lambda: chief.contribute("c", 0, 64, 8, key1, share1))])
    assert isinstance(results[0], grpc.RpcError) and results[0].code() == grpc.StatusCode.ABORTED, results[0]
    assert "masked with another key than the one server0 summed" in results[0].details()
    np.testing.assert_array_equal(_reveal(results[1]), x)  # summed again from k2
    np.testing.assert_array_equal(_reveal(results[2]), x)  # k1's late put: that release's answer
    assert results[1][0].tobytes() == results[2][0].tobytes()  # one blind key: released once


def test_mutation_without_the_abort_a_share_is_summed_with_a_part_of_another_key(make_service, monkeypatch):
    monkeypatch.setattr(steps.StepChannel, "_mismatch", lambda *args: None)
    chief, x, _, (share2, key2), stub, key_only = _an_owner_with_two_keys(make_service)
    results = in_threads([lambda: stub(key_only, timeout=20),
                          _later(0.5, lambda: chief.contribute("c", 0, 64, 8, key2, share2))])
    assert isinstance(results[1], tuple), results[1]
    assert not np.array_equal(_reveal(results[1]), x)  # share of k2 + part of k1: garbage


def test_server0s_part_of_another_key_than_a_share_aborts_the_step(make_service):
    # The share (key k2) reached server1 first, server0's part of the owner's earlier key k1 after it: the part is
    # refused ABORTED (server0's release fails), the share's call is aborted too; the owner's contribution of k2
    # then completes the step.
    service = make_service(owner_names(1), step_timeout_secs=10.0)
    chief = service.client("chief", 0, retry_secs=None)
    x = np.arange(8, dtype=np.int64)
    _, key1 = _mask(x)
    share2, key2 = _mask(x)
    stubs = chief._stubs  # pylint: disable=protected-access
    fields = dict(channel="c", step=0, ring_bits=64, num_elements=8)
    share_only = wire.encode("ContributeRequest", np.asarray(share2, "<i8"), **fields)
    key_only = wire.encode("ContributeRequest", np.asarray(key1, "<i4"), **fields)
    digest = ((ring.KEY_METADATA, ring.key_digest(np.asarray(key2, "<i4").tobytes()).hex()),)
    results = in_threads([lambda: stubs[1]["Contribute"](share_only, timeout=20, metadata=digest),
                          _later(0.5, lambda: stubs[0]["Contribute"](key_only, timeout=20))])
    for result in results:
        assert isinstance(result, grpc.RpcError) and result.code() == grpc.StatusCode.ABORTED, result
    assert "summed from another key of chief:0" in results[0].details()
    np.testing.assert_array_equal(_reveal(chief.contribute("c", 0, 64, 8, key2, share2)), x)


def _step_after_an_abort_on_server1(service) -> bool:
    """The worker's key reaches server0 (server0 releases step 0) but its share never reaches server1, which
    aborts the step. True if the owners, putting step 0 again with fresh contributions, get their new sum."""
    chief, worker = service.clients_of(2)
    key_only = wire.encode("ContributeRequest", np.frombuffer(os.urandom(16), "<i4"), channel="c", step=0,
                           ring_bits=64, num_elements=8)
    first = in_threads([lambda: _put(chief, 0),
                        lambda: worker._stubs[0]["Contribute"](key_only, timeout=10)])  # pylint: disable=W0212
    if not all(isinstance(r, Exception) for r in first):
        return False  # server0 answered a step server1 never released
    again = in_threads([lambda: _put(chief, 0, x=np.full(8, 5, np.int64)),
                        lambda: _put(worker, 0, x=np.full(8, 7, np.int64))])
    return all(isinstance(r, tuple) and np.array_equal(_reveal(r), np.full(8, 12)) for r in again)


def test_server0_keeps_a_step_only_if_server1_released_it_so_an_aborted_step_can_be_put_again(make_service):
    assert _step_after_an_abort_on_server1(make_service(owner_names(2), step_timeout_secs=1.0))


def test_mutation_a_forward_that_does_not_wait_leaves_server0_with_a_step_server1_never_released(
        make_service, monkeypatch):
    from tfe_estimator.service import server as server_module  # pylint: disable=import-outside-toplevel

    def forwarded_without_waiting(self, identity, request, context, reply):
        del identity
        _, channel = self._channel(None, request)  # pylint: disable=protected-access
        ticket = channel.put(len(self._owners), request.step, request.payload,  # pylint: disable=protected-access
                             np.frombuffer(request.payload, "<u8"), None)
        if ticket.released is not None:
            self._finish(channel, ticket.released)  # pylint: disable=protected-access
        return reply()

    monkeypatch.setattr(server_module.AggregationServer, "_forwarded", forwarded_without_waiting)
    assert not _step_after_an_abort_on_server1(make_service(owner_names(2), step_timeout_secs=1.0))


# ------------------------------------------------------------------ memory --

def _rss() -> int:
    with open("/proc/self/status", encoding="ascii") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def _held(service) -> int:
    """What the servers hold in open steps, counted from their channels (not from the budget)."""
    total = 0
    for server in service.servers:
        for channel in list(server._channels.values()):  # pylint: disable=protected-access
            for current in list(channel._open.values()):  # pylint: disable=protected-access
                acc = current.acc  # None once the step is aborted (its buffer back in the pool)
                total += (0 if acc is None else acc.nbytes) + sum(len(p) for p in current.parts.values())
    return total


def _flood(service, owner_client, channels, n):
    """Puts one waiting step on each fresh channel at once; returns the refusals and the peak bytes held."""
    peak = [0]
    stop = threading.Event()

    def watch():
        while not stop.is_set():
            peak[0] = max(peak[0], _held(service))
            time.sleep(0.05)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        results = in_threads([lambda c=c: _put(owner_client, 0, x=np.zeros(n, np.int64), channel=f"flood-{c}")
                              for c in range(channels)])
    finally:
        stop.set()
        watcher.join()
    return [r for r in results if isinstance(r, ServiceError)], peak[0]


def test_one_owner_cannot_make_a_server_hold_more_than_its_budget(make_service):
    budget = 16 << 20
    service = make_service(owner_names(2), step_timeout_secs=2.0, owner_memory_budget_bytes=budget,
                           max_waiting_puts=64)
    chief, _ = service.clients_of(2)
    before = _rss()
    refused, peak = _flood(service, chief, 12, 1 << 19)  # 12 channels x (4 MiB share + 4 MiB sum) asked for
    assert peak <= 2 * budget, peak  # server0 and server1 each within the budget
    exhausted = [e for e in refused if e.code == grpc.StatusCode.RESOURCE_EXHAUSTED]
    assert exhausted and all("--owner-memory-budget-bytes=16777216" in e.details for e in exhausted)
    assert _rss() - before < 1 << 30
    # The request: one 16-byte key at ring 128 and 2**27 elements asks server0 for 4 GiB of expansion.
    big = make_service(owner_names(2))
    chief = big.client("chief", 0)
    before = _rss()
    request = wire.encode("ContributeRequest", np.zeros(2, "<i8"), channel="big", step=0, ring_bits=128,
                          num_elements=2**27)
    with pytest.raises(grpc.RpcError) as e:
        chief._stubs[0]["Contribute"](request, timeout=10)  # pylint: disable=protected-access
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "per-owner memory budget" in e.value.details() and "--owner-memory-budget-bytes" in e.value.details()
    assert _rss() - before < 1 << 30


def test_mutation_without_the_budget_one_owner_makes_the_server_hold_more(make_service, monkeypatch):
    monkeypatch.setattr(budget_module.MemoryBudget, "reserve", lambda self, owner, nbytes, what, reclaim=True: None)
    budget = 16 << 20
    service = make_service(owner_names(2), step_timeout_secs=2.0, owner_memory_budget_bytes=budget,
                           max_waiting_puts=64)
    chief, _ = service.clients_of(2)
    _, peak = _flood(service, chief, 12, 1 << 19)
    assert peak > 2 * budget, peak


def _fresh_channel_puts(service, sizes, deadline_secs=0.4):
    """The issue's attack, scaled down: chief:0 alone puts a 16-byte key on server0 for step 0 of a fresh channel
    at ring 128 of each size in `sizes` (every other owner silent: each put waits until its deadline ends it, and
    its step is aborted), 3 at a time, with Python's garbage collector off. Returns how much server0's process
    (this one) grew, by RSS: its peak during the puts and after them, minus before."""
    chief = service.client("chief", 0)
    stub = chief._stubs[0]["Contribute"]  # pylint: disable=protected-access
    before, peak, stop = _rss(), [0], threading.Event()

    def watch():
        while not stop.is_set():
            peak[0] = max(peak[0], _rss())
            time.sleep(0.01)

    def put(n):
        request = wire.encode("ContributeRequest", np.zeros(2, "<i8"), channel=f"fresh-{n}", step=0, ring_bits=128,
                              num_elements=n)
        try:
            stub(request, timeout=deadline_secs)
        except grpc.RpcError as e:
            assert e.code() in (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.RESOURCE_EXHAUSTED), e
        time.sleep(0.3)  # the server sees the call ended (it polls every 0.25 s) and aborts the step

    watcher = threading.Thread(target=watch)
    watcher.start()
    gc.disable()  # what the server holds must be freed when its calls end, not whenever the collector runs
    try:
        for start in range(0, len(sizes), 3):
            in_threads([lambda n=n: put(n) for n in sizes[start:start + 3]])
        after = _rss() - before
    finally:
        gc.enable()
        stop.set()
        watcher.join()
    return peak[0] - before, after


_FRESH_BUDGET = 128 << 20
#: Ring 128 sums of 32 MiB and a bit, each a new size: above glibc's largest mmap threshold (32 MiB), so each
#: buffer is its own mapping and RSS shows exactly the buffers the server holds.
_FRESH_SIZES = [(1 << 21) + 4096 * k for k in range(1, 13)]


def test_one_owners_puts_on_fresh_channels_raise_rss_by_at_most_its_budget(make_service):
    """RSS, not the budget's counter: the key expansions and the aborted steps' accumulators the server keeps as
    spares count against the owner whose puts left them, so 12 fresh sizes x 2 buffers of 32 MiB (768 MiB, what
    server0 kept before) stay within the owner's 128 MiB budget (and a little of everything else)."""
    service = make_service(owner_names(2), owner_memory_budget_bytes=_FRESH_BUDGET)
    check_fresh_channel_puts_stay_within_the_owner_budget(service)


def check_fresh_channel_puts_stay_within_the_owner_budget(service):
    peak, after = _fresh_channel_puts(service, _FRESH_SIZES)
    assert peak <= _FRESH_BUDGET + (32 << 20), f"RSS grew by {peak / 2**20:.0f} MiB at its peak"
    assert after <= _FRESH_BUDGET + (32 << 20), f"RSS grew by {after / 2**20:.0f} MiB and stayed"


def _handler_keeping_the_refusal(self, method):
    """The leak: the handler keeps the refusal in its frame (its traceback holds the call's frames, a refused key's
    expansion among them, in a reference cycle until the garbage collector runs)."""
    work = {"Contribute": self._contribute, "Handshake": self._handshake, "Rewind": self._rewind,
            "ForwardBlinded": self._forwarded, "DataPlane": self._data_port,
            "Status": self._status}[method.name]
    reply = wire.messages()[method.reply]

    def handle(request, context):
        try:
            return work(self._authorize(method, context), request, context, reply)
        except (steps.StepRefused, server_module._Abort) as e:  # pylint: disable=protected-access
            refusal = e
        context.abort(self._refused(refusal), refusal.message)

    return handle


def test_mutation_refusals_kept_with_their_frames_grow_rss_past_the_budget(make_service, monkeypatch):
    monkeypatch.setattr(server_module.AggregationServer, "_handler", _handler_keeping_the_refusal)
    service = make_service(owner_names(2), owner_memory_budget_bytes=_FRESH_BUDGET)
    with pytest.raises(AssertionError, match="at its peak"):
        check_fresh_channel_puts_stay_within_the_owner_budget(service)


def test_mutation_spares_charged_to_the_server_let_one_owner_grow_rss_past_its_budget(make_service, monkeypatch):
    real = buffers.BufferPool.give
    monkeypatch.setattr(buffers.BufferPool, "give", lambda self, array, owner=None: real(self, array, None))
    service = make_service(owner_names(2), owner_memory_budget_bytes=_FRESH_BUDGET)
    _, after = _fresh_channel_puts(service, _FRESH_SIZES)
    assert after > _FRESH_BUDGET + (32 << 20), f"RSS grew by {after / 2**20:.0f} MiB only"


#: One owner's attack on the gRPC ports, from a process of its own (its messages' copies are not in this process's
#: RSS): `calls` concurrent Contributes of `nbytes` bytes each with its valid certificate, to server1 then server0.
_GRPC_FLOOD = """
import json, sys
import grpc
from tfe_estimator.service import TlsFiles, wire
from tfe_estimator.service.tls import server_name_option
certs, calls, nbytes, addresses = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4:]
tls = TlsFiles.from_dir(certs, "chief", 0)
message = wire.encode("ContributeRequest", bytes(nbytes), channel="flood", step=0, ring_bits=64,
                      num_elements=nbytes // 8)
refusals = []
for server in (1, 0):
    options = [("grpc.max_send_message_length", -1), server_name_option(tls, server)]
    with grpc.secure_channel(addresses[server], tls.channel_credentials(server), options=options) as channel:
        stub = channel.unary_unary(wire.method_path("Contribute"))
        for call in [stub.future(message, timeout=60) for _ in range(calls)]:
            try:
                call.result()
                refusals.append(["OK", ""])
            except grpc.RpcError as e:
                refusals.append([e.code().name, e.details()])
print(json.dumps(refusals))
"""


def check_grpc_flood_stays_within_the_owner_budget(service, cert_dir, calls=5, nbytes=64 << 20):
    """chief:0 sends `calls` concurrent `nbytes` shares on each server's gRPC port (`_GRPC_FLOOD`): this process's
    RSS (both servers) stays within the owner's budget, and every call is refused RESOURCE_EXHAUSTED by the
    receive limit (`wire.CONTROL_MESSAGE_BYTES`: the server read none of it)."""
    import json  # pylint: disable=import-outside-toplevel
    import subprocess  # pylint: disable=import-outside-toplevel
    import sys  # pylint: disable=import-outside-toplevel

    gc.collect()
    before, peak, stop = _rss(), [0], threading.Event()

    def watch():
        while not stop.is_set():
            peak[0] = max(peak[0], _rss())
            time.sleep(0.01)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        out = subprocess.run([sys.executable, "-c", _GRPC_FLOOD, cert_dir, str(calls), str(nbytes),
                              *service.addresses], capture_output=True, text=True, timeout=120, check=True).stdout
    finally:
        stop.set()
        watcher.join()
    refusals = json.loads(out)
    assert len(refusals) == 2 * calls
    grown = peak[0] - before
    assert grown <= _FRESH_BUDGET + (32 << 20), f"RSS grew by {grown / 2**20:.0f} MiB at its peak"
    for code, details in refusals:
        assert code == "RESOURCE_EXHAUSTED" and str(wire.CONTROL_MESSAGE_BYTES) in details, (code, details)


def test_one_owners_concurrent_large_grpc_calls_are_refused_unread(make_service, cert_dirs):
    """gRPC reads a whole message before any handler knows its sender: the old receive limit (the owner's budget
    + 1 MiB) let 6 concurrent 256 MiB shares of one owner grow server1 by 1.8 GiB at the default budgets. Servers
    with a data plane (and server0 always) now read at most `wire.CONTROL_MESSAGE_BYTES` per gRPC message."""
    service = make_service(owner_names(2), owner_memory_budget_bytes=_FRESH_BUDGET, step_timeout_secs=2.0)
    check_grpc_flood_stays_within_the_owner_budget(service, cert_dirs[0])


def test_mutation_the_old_grpc_receive_limit_lets_one_owner_grow_rss_past_its_budget(make_service, cert_dirs,
                                                                                      monkeypatch):
    monkeypatch.setattr(wire, "CONTROL_MESSAGE_BYTES", _FRESH_BUDGET + (1 << 20))
    service = make_service(owner_names(2), owner_memory_budget_bytes=_FRESH_BUDGET, step_timeout_secs=2.0)
    with pytest.raises(AssertionError, match="at its peak"):
        check_grpc_flood_stays_within_the_owner_budget(service, cert_dirs[0])


def _steps_with_reused_buffers(service, ring_bits):
    """Five steps of two owners at `ring_bits`, then step 1 again (a replay); returns (answers right, replay
    bit-identical). The servers reuse accumulators and key expansions across the steps (`buffers.BufferPool`)."""
    chief, worker = service.clients_of(2)
    rng = np.random.default_rng(ring_bits)
    n = 6  # ring 32: 3 words (two lanes each); ring 128: 12 words
    words = ring.ring_words(n, ring_bits)

    def put(client, step, x):
        key = np.frombuffer(os.urandom(16), np.int32)
        share = x.copy()
        ring.sub_into(share.view(np.uint64), ring.keystream_words(key, words), ring_bits)
        return client.contribute("reused", step, ring_bits, n, key, share)

    right, first = True, {}
    for step in range(5):
        xs = [rng.integers(-2**62, 2**62, words, dtype=np.int64) for _ in range(2)]
        results = in_threads([lambda c=c, x=x: put(c, step, x) for c, x in zip((chief, worker), xs)])
        for blind, w in results:
            total = w.copy().view(np.uint64)
            ring.add_into(total, ring.keystream_words(blind, words), ring_bits)
            expected = xs[0].copy().view(np.uint64)
            ring.add_into(expected, xs[1], ring_bits)
            right = right and np.array_equal(total, expected)
        first[step] = [(b.copy(), w.copy()) for b, w in results]
    again = put(chief, 1, np.zeros(words, np.int64))  # a replay: the stored answer, after four later steps
    identical = np.array_equal(again[0], first[1][0][0]) and np.array_equal(again[1], first[1][0][1])
    return right, identical


@pytest.mark.parametrize("ring_bits", [32, 64, 128])
def test_buffers_reused_across_steps_keep_every_answer_exact_and_stored_answers_unchanged(make_service, ring_bits):
    service = make_service(owner_names(2))
    assert _steps_with_reused_buffers(service, ring_bits) == (True, True)
    server1, server0 = service.servers
    for server in (server0, server1):
        # The spares are counted in the budget (the server's own, or the owner's whose put left them).
        assert server._pool.held > 0 and server._budget.total == server._pool.held  # pylint: disable=W0212
    assert server0._pool._ready  # server0 prepared the next step's blinded accumulator  # pylint: disable=W0212


def test_mutation_a_reused_accumulator_summed_onto_its_stale_contents_gives_wrong_answers(make_service, monkeypatch):
    monkeypatch.setattr(ring, "copy_into", lambda acc, other: ring.add_into(acc, other, 64))
    assert _steps_with_reused_buffers(make_service(owner_names(2)), 64)[0] is False


def _small_budget_steps(service) -> list:
    """Two steps of 4096 elements leave server0 spares (2-3 x 32 KiB); a step of 5000 elements then needs the
    room. Returns the last step's errors."""
    clients = service.clients_of(2)
    for step in range(2):
        for result in in_threads([lambda c=c: _put(c, step, n=4096) for c in clients]):
            assert not isinstance(result, Exception), result
    pool, deadline = service.servers[1]._pool, time.monotonic() + 5.0  # pylint: disable=protected-access
    while not pool._ready and time.monotonic() < deadline:  # the next step's accumulator, prepared in the background
        time.sleep(0.01)
    assert pool.held >= 2 * 32768, pool.held  # the prepared accumulator and at least one spare
    results = in_threads([lambda c=c: _put(c, 0, n=5000, channel="other") for c in clients])
    return [r for r in results if isinstance(r, Exception)]


def test_spare_buffers_give_way_to_a_put_that_needs_the_room(make_service):
    # 160 KiB: a 5000-element step on server0 (keys, its sum, two key expansions: 117 KiB) fits only once the
    # 4096-element channel's spares (64-96 KiB) are dropped.
    assert _small_budget_steps(make_service(owner_names(2), memory_budget_bytes=5 * 32768)) == []


def test_mutation_spares_kept_under_pressure_refuse_a_put_that_would_fit(make_service, monkeypatch):
    monkeypatch.setattr(buffers.BufferPool, "reclaim", lambda self, owner=None: 0)
    errors = _small_budget_steps(make_service(owner_names(2), memory_budget_bytes=5 * 32768, step_timeout_secs=1.0))
    assert any(isinstance(e, ServiceError) and e.code == grpc.StatusCode.RESOURCE_EXHAUSTED and
               "--memory-budget-bytes" in e.details for e in errors), errors


# ----------------------------------------------------------------- threads --

def _honest_step_secs(service) -> float:
    """worker:1 waits in the honest step, then puts 48 waiting calls on fresh channels; returns how long the
    chief's and worker:0's puts of the honest step take."""
    chief, worker0, worker1 = service.clients_of(3)
    honest = threading.Thread(target=lambda: _put(worker1, 0, channel="honest"))
    honest.start()
    time.sleep(0.3)
    flood = threading.Thread(target=lambda: in_threads(
        [lambda c=c: _put(worker1, 0, channel=f"flood-{c}") for c in range(48)]))
    flood.start()
    time.sleep(1.0)
    start = time.monotonic()
    results = in_threads([lambda: _put(chief, 0, channel="honest"), lambda: _put(worker0, 0, channel="honest")])
    took = time.monotonic() - start
    flood.join()
    honest.join()
    return took if all(isinstance(r, tuple) for r in results) else float("inf")


@pytest.mark.parametrize("data_plane", [True, False], ids=["data-plane", "grpc"])
def test_48_waiting_puts_of_one_owner_leave_the_honest_step_under_2_s(make_service, data_plane):
    assert _honest_step_secs(make_service(owner_names(3), step_timeout_secs=3.0, data_plane=data_plane)) < 2.0


def test_mutation_unbounded_waiting_puts_hold_the_honest_owners_threads(make_service):
    # The old server: no bound per owner, 16 + 8 threads per owner (gRPC's handler pool; the data plane's
    # connections each have a thread of their own, capped per caller at --max-waiting-puts + 1).
    service = make_service(owner_names(3), step_timeout_secs=4.0, max_waiting_puts=1000, max_workers=40,
                           data_plane=False)
    assert _honest_step_secs(service) > 2.0


def test_a_channel_made_for_a_put_is_not_forgotten_before_the_put_registers_in_it(make_service):
    """Two new channels made at once (a step's gradients and loss from two owners): making the second forgets
    idle channels, and the first had no put registered yet (server0 was expanding its key). Its put must not
    land in a forgotten channel while the other owners' go to a new one: that step stalled until its timeout."""
    service = make_service(owner_names(2), step_timeout_secs=6.0)
    chief, worker = service.clients_of(2)
    server0 = service.servers[1]
    expanding, go = threading.Event(), threading.Event()
    real = server0._addend  # pylint: disable=protected-access

    def addend(payload, out):  # the chief's first key of channel "a" waits between table and put
        if out.size == 8 and not expanding.is_set():
            expanding.set()
            assert go.wait(10.0)
        return real(payload, out)

    server0._addend = addend  # pylint: disable=protected-access

    def late_put():
        assert expanding.wait(10.0)
        result = in_threads([lambda: _put(worker, 0, n=16, channel="b"), lambda: (time.sleep(0.3), go.set())])
        return result[0]

    results = in_threads([lambda: _put(chief, 0, n=8, channel="a"), late_put,
                          lambda: (expanding.wait(10.0), time.sleep(0.5), _put(worker, 0, n=8, channel="a"))[2],
                          lambda: (expanding.wait(10.0), time.sleep(0.5), _put(chief, 0, n=16, channel="b"))[2]])
    assert not [r for r in results if isinstance(r, Exception)], results
