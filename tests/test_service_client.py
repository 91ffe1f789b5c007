"""An owner's client: it names a missing or mismatched server within seconds, and waits out another owner.

In process, loopback. The messages are the ones an owner's terminal shows (WARNING).
"""
import logging
import os
import time

import numpy as np
import portpicker

from service_helpers import cert_dirs, in_threads, make_service, owner_names  # noqa: F401 (fixtures)
from tfe_estimator.service import ServiceError, client as client_module, ring


def _put(client, step, channel="c"):
    x = np.arange(8, dtype=np.int64)
    key = np.frombuffer(os.urandom(16), np.int32)
    share = (x.view(np.uint64) - ring.keystream_words(key, 8)).view(np.int64)
    return client.contribute(channel, step, 64, 8, key, share)


def _warnings(caplog, needle):
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING and needle in r.getMessage()]


def test_a_missing_server_is_named_within_seconds_and_again_while_it_is_missing(make_service, caplog, monkeypatch):
    monkeypatch.setattr(client_module, "_NOTICE_SECS", 1.0)
    caplog.set_level(logging.WARNING, logger="tfe_estimator")
    service = make_service(owner_names(1))
    nobody = f"localhost:{portpicker.pick_unused_port()}"
    chief = service.client("chief", 0, addresses=(nobody, service.addresses[1]), timeout_secs=6.0)
    start = time.monotonic()
    result = in_threads([lambda: _put(chief, 0)])[0]
    assert isinstance(result, ServiceError), result
    named = _warnings(caplog, f"waits for aggregation server0 at {nobody}: connection refused")
    assert len(named) >= 2, [r.getMessage() for r in caplog.records]
    assert named[0].startswith("service mode: Contribute of step 0 of 'c'") and named[0].endswith("(3 s)"), named
    assert time.monotonic() - start < 10


def test_swapped_server_addresses_are_named_with_the_expected_and_presented_identity(make_service, caplog):
    caplog.set_level(logging.WARNING, logger="tfe_estimator")
    service = make_service(owner_names(1))
    chief = service.client("chief", 0, addresses=service.addresses[::-1], timeout_secs=5.0)
    result = in_threads([lambda: _put(chief, 0)])[0]
    assert isinstance(result, ServiceError), result
    named = _warnings(caplog, "waits for aggregation server")
    assert named and all("TLS:" in m and "expects" in m for m in named), [r.getMessage() for r in caplog.records]


def test_an_owner_waits_out_an_aborted_step_and_the_late_owner_catches_up(make_service, caplog):
    # The worker is late (restarting): the chief's step is aborted on the servers and put again with the same
    # contribution, naming whom it waits for, until the worker joins; both get the sum of both.
    caplog.set_level(logging.WARNING, logger="tfe_estimator")
    service = make_service(owner_names(2), step_timeout_secs=1.0)
    chief = service.client("chief", 0, retry_secs=20.0)
    worker = service.client("worker", 0)
    results = in_threads([lambda: _put(chief, 0), lambda: (time.sleep(2.5), _put(worker, 0))[1]])
    for result in results:
        blind, w = result
        np.testing.assert_array_equal((w.view(np.uint64) + ring.keystream_words(blind, 8)).view(np.int64),
                                      2 * np.arange(8))
    waited = _warnings(caplog, "putting the same contribution again")
    assert waited and any("still missing worker:0" in m for m in waited), [r.getMessage() for r in caplog.records]


def test_without_patience_the_aborted_step_fails_at_once(make_service):
    # The mutation of the test above: no retries (patience 0), the chief's call fails naming the worker.
    service = make_service(owner_names(2), step_timeout_secs=1.0)
    chief = service.client("chief", 0, retry_secs=0.0)
    result = in_threads([lambda: _put(chief, 0)])[0]
    assert isinstance(result, ServiceError) and "still missing worker:0" in result.details


def _restart_server0_mid_step(service, cert_dir, retry_secs):
    """The chief waits in step 0 when server0 dies (its calls cut) and a new server0 starts at its address; the
    worker puts step 0 then. Returns both owners' results."""
    from tfe_estimator.service import AggregationServer, TlsFiles  # pylint: disable=import-outside-toplevel

    chief = service.client("chief", 0, retry_secs=retry_secs, timeout_secs=15.0)
    worker = service.client("worker", 0, retry_secs=retry_secs, timeout_secs=15.0)
    server0 = service.servers[1]

    def restart():
        time.sleep(1.0)
        plane = server0._data_plane  # pylint: disable=protected-access
        server0._server.stop(0)  # pylint: disable=protected-access  # as if killed: no goodbye to the calls
        if plane is not None:
            plane.stop()  # its connections cut as well
        time.sleep(0.5)
        fresh = AggregationServer(0, service.addresses[0], service.owners, TlsFiles.from_dir(cert_dir, "tfe", 0),
                                  peer_address=service.addresses[1], step_timeout_secs=15.0,
                                  data_address="localhost:0" if plane is not None else None)
        fresh.start()
        service.servers.append(fresh)
        return _put(worker, 0)

    return in_threads([lambda: _put(chief, 0), restart])


def test_a_server_restarted_mid_step_is_waited_out_with_the_same_contribution(make_service, cert_dirs):
    service = make_service(owner_names(2), step_timeout_secs=15.0)
    for result in _restart_server0_mid_step(service, cert_dirs[0], retry_secs=None):
        blind, w = result
        np.testing.assert_array_equal((w.view(np.uint64) + ring.keystream_words(blind, 8)).view(np.int64),
                                      2 * np.arange(8))


def test_without_patience_a_restarted_server_fails_the_waiting_owner(make_service, cert_dirs):
    service = make_service(owner_names(2), step_timeout_secs=15.0)
    assert isinstance(_restart_server0_mid_step(service, cert_dirs[0], retry_secs=0.0)[0], ServiceError)


def _awaiting(calls, any_of=()):
    """Runs `OwnerClient._await` on `calls` (futures) in a thread; returns an Event set once it returned."""
    import concurrent.futures  # pylint: disable=import-outside-toplevel
    import threading  # pylint: disable=import-outside-toplevel
    import types  # pylint: disable=import-outside-toplevel

    assert all(isinstance(c, concurrent.futures.Future) for c in calls.values())
    owner = types.SimpleNamespace(unreachable=lambda server: None, _addresses={0: "s0", 1: "s1"})
    returned = threading.Event()

    def wait():
        client_module.OwnerClient._await(owner, "Contribute", "step 0 of 'c'", calls, time.monotonic(),  # noqa: SLF001
                                         any_of=any_of)
        returned.set()

    threading.Thread(target=wait, daemon=True).start()
    return returned


def test_an_owner_waits_for_both_answers_and_acts_at_once_on_a_failure_or_on_server0_while_rechecking():
    """The owner's call thread wakes once per call: when both servers answered, when one call failed (it is put
    again at once), or, while a server1 failure is rechecked, when server0 answered (`any_of`); not before."""
    from concurrent.futures import Future  # pylint: disable=import-outside-toplevel

    # both answers: not after the first alone
    calls = {0: Future(), 1: Future()}
    returned = _awaiting(calls)
    calls[0].set_result("answer 0")
    assert not returned.wait(0.5)
    calls[1].set_result("answer 1")
    assert returned.wait(5)
    # a failure ends the wait while the other call is pending
    calls = {0: Future(), 1: Future()}
    returned = _awaiting(calls)
    calls[1].set_exception(RuntimeError("server1 restarted"))
    assert returned.wait(5)
    # while rechecking, server0's answer ends it; server1's alone does not
    calls = {0: Future(), 1: Future()}
    returned = _awaiting(calls, any_of=(0,))
    assert not returned.wait(0.3)
    calls[0].set_result("answer 0")
    assert returned.wait(5)
    calls = {0: Future(), 1: Future()}
    returned = _awaiting(calls, any_of=(0,))
    calls[1].set_result("answer 1")
    assert not returned.wait(0.5)
    calls[0].set_result("answer 0")
    assert returned.wait(5)
    # already done (a callback added to a done call runs at once)
    done = Future()
    done.set_result("answer")
    assert _awaiting({0: done}).wait(5)
