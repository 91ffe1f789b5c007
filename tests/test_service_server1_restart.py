"""Server1 killed after it released a step and before it answered the owners (`test_service_faults.py`'s flake).

Server1 releases a step when the owners' shares and server0's blinded part are in; server0 answers the owners with
the step's blind key once server1 took its part. A server1 killed right after that took the release with it: the
owners put their same shares on the new server1, whose step then waited for server0's part, which server0, having
answered the step, never sent again (the owners' calls ran into their deadline). Now the owner puts its same key on
server0 again too; server0 asks server1 whether it holds the release and, if not, forwards the same part (the
release's own keys and blind key) again. In process, loopback, one step of 8 elements: ~2 s.
"""
import os
import threading

import numpy as np

from service_helpers import cert_dirs, in_threads, make_service, owner_names  # noqa: F401 (fixtures)
from test_service_release_log import X, _kill, _put, _reveal
from tfe_estimator.service import AggregationServer, ServiceError, TlsFiles


def _server1_killed_after_it_released(service, cert_dir, monkeypatch, keys):
    """Both owners put step 0 (`keys`); server1 releases it and takes server0's part, and dies before it answers
    the owners; a new server1 starts at its address. Returns the owners' clients and results."""
    old, server0 = service.servers
    forwarded, killed = threading.Event(), threading.Event()
    contribute, send = old._contribute, server0._send_forward  # pylint: disable=protected-access

    def answer_never_sent(*args):  # the step's answer is there; the process dies before it is sent
        answer = contribute(*args)
        killed.wait(30)
        return answer

    def send_then_note(*args):
        send(*args)  # server1 took the part: it released the step
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
        fresh.start()
        service.servers.append(fresh)

    results = in_threads([lambda: _put(owners[0], 0, keys[0]), lambda: _put(owners[1], 0, keys[1]), restart])
    return owners, results[:2]


def test_server1_killed_after_it_released_gets_server0s_same_part_again(make_service, cert_dirs, monkeypatch):
    service = make_service(owner_names(2), step_timeout_secs=8.0)
    keys = [np.frombuffer(os.urandom(16), np.int32) for _ in range(2)]
    owners, results = _server1_killed_after_it_released(service, cert_dirs[0], monkeypatch, keys)
    for result in results:
        assert isinstance(result, tuple), result
        np.testing.assert_array_equal(_reveal(result), 2 * X)
    assert bytes(results[0][0]) == bytes(results[1][0])  # one blind key: the release server0 answered
    assert [o.answers["c"] for o in owners] == [[1, 0], [1, 0]]  # each owner got the step once, fresh
