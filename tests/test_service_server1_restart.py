"""Server1 killed after it released a step and before it answered the owners (`test_service_faults.py`'s flake).

Server1 releases a step when the owners' shares and server0's blinded part are in; server0 answers the owners with
the step's blind key once server1 took its part. A server1 killed right after that took the release with it: the
owners put their same shares on the new server1, whose step then waited for server0's part, which server0, having
answered the step, never sent again (the owners' calls ran into their deadline). Now the owner puts its same key on
server0 again too; server0 asks server1 whether it holds the release and, if not, forwards the same part (the
release's own keys and blind key) again. In process, loopback, one step of 8 elements (a part of 200000 too):
1-3 s per test.
"""
import os
import threading

import numpy as np
import pytest

from service_helpers import cert_dirs, in_threads, make_service, owner_names  # noqa: F401 (fixtures)
from test_service_release_log import _kill
from tfe_estimator.service import AggregationServer, ServiceError, TlsFiles, ring


def _put(client, step, key, x):
    share = (x.view(np.uint64) - ring.keystream_words(key, x.size)).view(np.int64)
    return client.contribute("c", step, 64, x.size, key, share)


def _reveal(result):
    blind, w = result
    return (w.view(np.uint64) + ring.keystream_words(blind, w.size)).view(np.int64)


def _server1_killed_after_it_released(service, cert_dir, monkeypatch, keys, x, server0_answers_late=False):
    """Both owners put step 0 (`keys`); server1 releases it and takes server0's part, and dies before it answers
    the owners; a new server1 starts at its address. `server0_answers_late`: server0's answer to each owner leaves
    only once that owner put its share on the new server1 (server1 failed before server0 answered). Returns the
    owners' clients and results."""
    old, server0 = service.servers
    forwarded, killed = threading.Event(), threading.Event()
    contribute, send = old._contribute, server0._send_forward  # pylint: disable=protected-access
    on_fresh = {name: threading.Event() for name in service.owners}  # the owner put on the new server1
    if server0_answers_late:
        answer0, held = server0._contribute, set()  # pylint: disable=protected-access

        def answer_after_the_owner_put_on_the_new_server1(identity, *args):
            answer = answer0(identity, *args)
            if identity not in held:  # its first answer only; the same key put again is answered at once
                held.add(identity)
                assert on_fresh[identity].wait(30)
            return answer

        monkeypatch.setattr(server0, "_contribute", answer_after_the_owner_put_on_the_new_server1)

    def answer_never_sent(*args):  # the step's answer is there; the process dies before it is sent
        answer = contribute(*args)
        killed.wait(30)
        return answer

    service.forwards = []  # each part server0 forwards: (step, its bytes)

    def send_then_note(channel, released, *args):
        service.forwards.append((released.step, released.acc.tobytes()))
        send(channel, released, *args)  # server1 took the part: it released the step
        forwarded.set()

    monkeypatch.setattr(old, "_contribute", answer_never_sent)
    monkeypatch.setattr(server0, "_send_forward", send_then_note)
    owners = [service.client("chief", 0, retry_secs=None, timeout_secs=8.0),
              service.client("worker", 0, retry_secs=None, timeout_secs=8.0)]

    def restart():
        assert forwarded.wait(30)
        _kill(old)
        killed.set()
        fresh = AggregationServer(1, service.addresses[1], service.owners, TlsFiles.from_dir(cert_dir, "tfe", 1),
                                  step_timeout_secs=8.0, data_address="localhost:0")
        taken = fresh._contribute  # pylint: disable=protected-access
        monkeypatch.setattr(fresh, "_contribute",
                            lambda identity, *args: (on_fresh[identity].set(), taken(identity, *args))[1])
        fresh.start()
        service.servers.append(fresh)

    results = in_threads([lambda: _put(owners[0], 0, keys[0], x), lambda: _put(owners[1], 0, keys[1], x), restart])
    return owners, results[:2]


@pytest.mark.parametrize("elements", [8, 200_000])  # 1.6 MB: server0's part travels on the data plane only
def test_server1_killed_after_it_released_gets_server0s_same_part_again(make_service, cert_dirs, monkeypatch,
                                                                         elements):
    service = make_service(owner_names(2), step_timeout_secs=8.0)
    keys = [np.frombuffer(os.urandom(16), np.int32) for _ in range(2)]
    x = np.arange(elements, dtype=np.int64)
    owners, results = _server1_killed_after_it_released(service, cert_dirs[0], monkeypatch, keys, x)
    for result in results:
        assert isinstance(result, tuple), result
        np.testing.assert_array_equal(_reveal(result), 2 * x)
    assert bytes(results[0][0]) == bytes(results[1][0])  # one blind key: the release server0 answered
    assert [o.answers["c"] for o in owners] == [[1, 0], [1, 0]]  # each owner got the step once, fresh
    assert [step for step, _ in service.forwards] == [0, 0] and service.forwards[0] == service.forwards[1]


def test_server1_killed_before_server0_answered_gets_server0s_part_again_once_server0_answers(
        make_service, cert_dirs, monkeypatch):
    # Server1 fails before server0 answers the step: the owner puts its same share on the new server1 (which waits
    # for server0's part) and must act on server0's answer while that put still waits, putting its same key on
    # server0 again so that server0 forwards the part again (`OwnerClient.contribute`'s `any_of=(0,)`). Waiting
    # for both answers instead, the put on the new server1 waits out the owner's deadline: ServiceError
    # DEADLINE_EXCEEDED after 8 s, nothing forwarded again.
    service = make_service(owner_names(2), step_timeout_secs=8.0)
    keys = [np.frombuffer(os.urandom(16), np.int32) for _ in range(2)]
    x = np.arange(8, dtype=np.int64)
    owners, results = _server1_killed_after_it_released(service, cert_dirs[0], monkeypatch, keys, x,
                                                        server0_answers_late=True)
    for result in results:
        assert isinstance(result, tuple), result
        np.testing.assert_array_equal(_reveal(result), 2 * x)
    assert bytes(results[0][0]) == bytes(results[1][0])
    assert [o.answers["c"] for o in owners] == [[1, 0], [1, 0]]
    assert [step for step, _ in service.forwards] == [0, 0] and service.forwards[0] == service.forwards[1]


def test_server0_forwards_a_step_again_only_for_the_same_key_and_only_to_a_server1_without_it(
        make_service, cert_dirs, monkeypatch):
    service = make_service(owner_names(2), step_timeout_secs=8.0)
    keys = [np.frombuffer(os.urandom(16), np.int32) for _ in range(2)]
    x = np.arange(8, dtype=np.int64)
    owners, results = _server1_killed_after_it_released(service, cert_dirs[0], monkeypatch, keys, x)
    assert all(isinstance(r, tuple) for r in results), results
    forwarded = len(service.forwards)
    # The new server1 holds the release now: the same key put again is answered by both, nothing forwarded again.
    # (The owner returns on server1's answer, which carries the blind key; server0's answer comes after it asked
    # server1 whether it holds the release: waited for here, before server1 is killed again.)
    server0, answered = service.servers[1], threading.Event()
    answer0 = server0._contribute  # pylint: disable=protected-access
    monkeypatch.setattr(server0, "_contribute", lambda *args: (answer0(*args), answered.set())[0])
    again = _put(owners[0], 0, keys[0], x)
    assert bytes(again[0]) == bytes(results[0][0]) and bytes(again[1]) == bytes(results[0][1])
    assert answered.wait(8) and len(service.forwards) == forwarded
    # Server1 restarts again (it lost the release); an owner restored from a checkpoint puts step 0 with a fresh
    # key: server0 answers it from its window and forwards nothing (the part is the release's keys', not this
    # put's), so server1's step waits for the other owners and is aborted, naming server0's part as missing.
    _kill(service.servers[-1])
    fresh = AggregationServer(1, service.addresses[1], service.owners, TlsFiles.from_dir(cert_dirs[0], "tfe", 1),
                              step_timeout_secs=2.0, data_address="localhost:0")
    fresh.start()
    service.servers.append(fresh)
    late = service.client("worker", 0, retry_secs=0.0, timeout_secs=8.0)
    with pytest.raises(ServiceError, match=r"still missing chief:0 .*, tfe:0 \(server0's part\)"):
        _put(late, 0, np.frombuffer(os.urandom(16), np.int32), x)
    assert len(service.forwards) == forwarded


def test_an_answer_lost_on_the_way_from_a_server1_that_kept_it_counts_as_fresh(make_service, monkeypatch):
    # Server1 released the step and keeps it, but each owner's connection broke before its answer arrived: the
    # owners put it again on both servers and get it from their windows; it is still each owner's first answer
    # of that release (counted fresh: a fresh training refuses answers from the window), and nothing is forwarded
    # again.
    service = make_service(owner_names(2), step_timeout_secs=8.0)
    server1, server0 = service.servers
    contribute, send = server1._contribute, server0._send_forward  # pylint: disable=protected-access
    cut, forwards = set(), []

    def answer_lost(identity, *args):
        answer = contribute(identity, *args)
        if identity not in cut:
            cut.add(identity)
            raise ConnectionError("the connection broke before the answer left")
        return answer

    monkeypatch.setattr(server1, "_contribute", answer_lost)
    monkeypatch.setattr(server0, "_send_forward", lambda *args: (forwards.append(args[1].step), send(*args)))
    owners = [service.client("chief", 0, retry_secs=None, timeout_secs=8.0),
              service.client("worker", 0, retry_secs=None, timeout_secs=8.0)]
    keys = [np.frombuffer(os.urandom(16), np.int32) for _ in range(2)]
    x = np.arange(8, dtype=np.int64)
    results = in_threads([lambda: _put(owners[0], 0, keys[0], x), lambda: _put(owners[1], 0, keys[1], x)])
    for result in results:
        assert isinstance(result, tuple), result
        np.testing.assert_array_equal(_reveal(result), 2 * x)
    assert cut == {"chief:0", "worker:0"} and forwards == [0]
    assert [o.answers["c"] for o in owners] == [[1, 0], [1, 0]]
