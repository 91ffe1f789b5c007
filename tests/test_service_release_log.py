"""Server0 killed between server1's release of a step and its own answers: the release log (`release_log`).

Server1 releases a step when server0's forwarded part arrives; server0 answers the owners with the step's blind
key after that. A server0 killed in between used to restart without the key: server1 replays the step, and no
owner could reveal it (the fault test's flake, `test_service_faults.py`). Server0 records each release's blind
key in its state directory before it forwards. Server1's answer now carries the blind key sealed for each owner
(`sealed_blind`), so the owners finish that step without server0; the record still answers an owner that restored
a checkpoint and replays the step with a fresh key (its seal does not open), and everything in the step with a
server0 that does not seal (``sealed=False``: an older server0). In process, loopback, one step of 8 elements.
"""
import json
import os
import threading
import time

import numpy as np
import pytest

from service_helpers import cert_dirs, in_threads, make_service, owner_names  # noqa: F401 (fixtures)
from tfe_estimator.service import AggregationServer, ServiceError, TlsFiles, ring
from tfe_estimator.service.release_log import FILE_NAME, ReleaseLog
from tfe_estimator.service.steps import StepChannel

X = np.arange(8, dtype=np.int64)


def _put(client, step, key):
    share = (X.view(np.uint64) - ring.keystream_words(key, 8)).view(np.int64)
    return client.contribute("c", step, 64, 8, key, share)


def _reveal(result):
    blind, w = result
    return (w.view(np.uint64) + ring.keystream_words(blind, 8)).view(np.int64)


def _server0(service, cert_dir, state_dir):
    server = AggregationServer(0, service.addresses[0], service.owners, TlsFiles.from_dir(cert_dir, "tfe", 0),
                               peer_address=service.addresses[1], step_timeout_secs=15.0,
                               data_address="localhost:0", state_dir=state_dir)
    server.start()
    service.servers.append(server)
    return server


def _kill(server):
    """As if SIGKILLed: its calls cut, no answer sent (`stop` would wake the waiting calls)."""
    plane = server._data_plane  # pylint: disable=protected-access
    server._server.stop(0)  # pylint: disable=protected-access
    plane.stop()


def _killed_after_server1_released(make_service, cert_dir, state_dir, monkeypatch, sealed=True):
    """Both owners put step 0; server0 forwards it, server1 releases it, and server0 dies right then, before it
    answers the owners; a new server0 starts at its address on the same state directory. Returns the service,
    the owners' clients and keys, and their results (without `sealed` blind keys in server1's answer, their
    clients put the same contributions again)."""
    if not sealed:
        monkeypatch.setattr(AggregationServer, "_seal", staticmethod(lambda *args: ()))
    service = make_service(owner_names(2), step_timeout_secs=15.0, state_dir=state_dir)
    old = service.servers[1]
    forwarded, killed = threading.Event(), threading.Event()
    send = old._send_forward  # pylint: disable=protected-access

    def send_then_die(*args):
        send(*args)  # server1 took the part and released the step
        forwarded.set()
        killed.wait(30)  # dead: what this thread does after the kill reaches nobody

    monkeypatch.setattr(old, "_send_forward", send_then_die)
    owners = [service.client("chief", 0, retry_secs=None, timeout_secs=15.0),
              service.client("worker", 0, retry_secs=None, timeout_secs=15.0)]
    keys = [np.frombuffer(os.urandom(16), np.int32) for _ in owners]

    def restart():
        assert forwarded.wait(30)
        _kill(old)
        killed.set()
        _server0(service, cert_dir, state_dir)

    results = in_threads([lambda: _put(owners[0], 0, keys[0]), lambda: _put(owners[1], 0, keys[1]), restart])
    return service, owners, keys, results[:2]


@pytest.mark.parametrize("sealed", [True, False])
def test_server0_killed_after_server1_released_answers_the_step_with_its_recorded_blind_key(
        make_service, cert_dirs, tmp_path, monkeypatch, sealed):
    state = str(tmp_path / "state")
    service, owners, _, results = _killed_after_server1_released(make_service, cert_dirs[0], state, monkeypatch,
                                                                 sealed)
    for result in results:
        assert isinstance(result, tuple), result
        np.testing.assert_array_equal(_reveal(result), 2 * X)
    log = os.path.join(state, FILE_NAME)
    assert os.stat(log).st_mode & 0o777 == 0o600 and os.stat(state).st_mode & 0o777 == 0o700
    # Server0 dies again; the worker, restored from a checkpoint (a fresh mask), replays step 0 alone while the
    # chief is past it: server1 confirms the recorded release and server0 answers it from the record,
    # bit-identical, as a replay (nothing summed or released again).
    _kill(service.servers[-1])
    _server0(service, cert_dirs[0], state)
    again = _put(owners[1], 0, np.frombuffer(os.urandom(16), np.int32))
    np.testing.assert_array_equal(again[0], results[1][0])
    np.testing.assert_array_equal(again[1], results[1][1])
    assert [o.answers["c"] for o in owners] == [[1, 0], [1, 1]]  # first answers fresh (the same keys put again)


def test_mutation_without_the_record_the_owners_cannot_finish_the_step(make_service, cert_dirs, tmp_path,
                                                                         monkeypatch):
    monkeypatch.setattr(ReleaseLog, "write", lambda *args: None)
    _, _, _, results = _killed_after_server1_released(make_service, cert_dirs[0], str(tmp_path / "s"), monkeypatch,
                                                      sealed=False)
    for result in results:
        assert isinstance(result, ServiceError) and "lost its replay window" in result.details, result


def test_mutation_without_the_record_a_restored_owner_cannot_replay_the_step(make_service, cert_dirs, tmp_path,
                                                                            monkeypatch):
    # The owners finish the step from server1's answer (the sealed blind key) without server0; a worker restored
    # from a checkpoint replays it with a fresh key (its seal does not open), and a server0 that kept no record
    # has no answer for it: the worker waits out its deadline.
    monkeypatch.setattr(ReleaseLog, "write", lambda *args: None)
    service, owners, _, results = _killed_after_server1_released(make_service, cert_dirs[0], str(tmp_path / "s"),
                                                                 monkeypatch)
    for result in results:
        assert isinstance(result, tuple), result
        np.testing.assert_array_equal(_reveal(result), 2 * X)
    # An owner whose call to the dead server0 failed may have put its key on the new one before server1's answer
    # ended the call, which then cancelled that put: close the owners' clients (nothing of them in flight after)
    # and wait until the new server0 has held no open step for a second (it drops a cancelled put in 0.25 s).
    for owner in owners:
        owner.close()
    channels = service.servers[-1]._channels  # pylint: disable=protected-access
    deadline, quiet = time.monotonic() + 15.0, time.monotonic()
    while time.monotonic() < deadline and time.monotonic() - quiet < 1.0:
        if any(c._open for c in list(channels.values())):  # pylint: disable=protected-access
            quiet = time.monotonic()
        time.sleep(0.05)
    late = service.client("worker", 0, retry_secs=0.0, timeout_secs=3.0)
    with pytest.raises(ServiceError, match="DEADLINE_EXCEEDED"):
        _put(late, 0, np.frombuffer(os.urandom(16), np.int32))


def test_mutation_server1_taking_a_part_of_another_blind_key_again_gives_the_owners_a_wrong_sum(
        make_service, cert_dirs, tmp_path, monkeypatch):
    # Server1 takes a released step's part again only if its blind key's digest is the release's: without that
    # check, a server0 that lost the record blinds the step anew and the owners pair its key with server1's old w.
    monkeypatch.setattr(ReleaseLog, "write", lambda *args: None)
    monkeypatch.setattr(StepChannel, "_same_release", staticmethod(
        lambda stored, digests, blind: [bytes(d) for d in digests] == [bytes(d) for d in stored.expected]))
    _, _, _, results = _killed_after_server1_released(make_service, cert_dirs[0], str(tmp_path / "s"), monkeypatch,
                                                      sealed=False)
    assert all(isinstance(r, tuple) for r in results), results
    assert not any(np.array_equal(_reveal(r), 2 * X) for r in results)


def test_a_recorded_step_server1_never_released_is_summed_again_with_the_recorded_key(make_service, cert_dirs,
                                                                                     tmp_path):
    # Server0 recorded step 0 and died before its part reached server1: after the restart the step is summed
    # from the same keys with the recorded blind key (the same part, never a second mask).
    state = str(tmp_path / "state")
    service = make_service(owner_names(2), step_timeout_secs=15.0, state_dir=state)
    channel_key = ("c", 64, 8)
    keys = [np.frombuffer(os.urandom(16), np.int32) for _ in range(2)]
    blind = os.urandom(16)
    service.servers[1].stop(0)
    log = ReleaseLog(state, service.owners, service.addresses[1])
    log.write(channel_key, 0, blind, [ring.key_digest(k) for k in keys])
    log.close()
    _server0(service, cert_dirs[0], state)
    owners = [service.client("chief", 0), service.client("worker", 0)]
    results = in_threads([lambda: _put(owners[0], 0, keys[0]), lambda: _put(owners[1], 0, keys[1])])
    for result in results:
        assert bytes(result[0]) == blind, result
        np.testing.assert_array_equal(_reveal(result), 2 * X)


# ------------------------------------------------------------------ the file --

def _log(tmp_path, owners=("chief:0", "worker:0"), server1="s1:1"):
    return ReleaseLog(str(tmp_path / "state"), list(owners), server1, keep=3)


def test_the_log_keeps_the_window_and_reads_back_after_a_restart(tmp_path):
    log = _log(tmp_path)
    for step in range(5):
        log.write(("c", 64, 8), step, bytes([step]) * 16, [b"a" * 16, b"b" * 16])
    log.close()
    again = _log(tmp_path)
    assert sorted(step for _, step in again.recorded()) == [2, 3, 4]
    assert again.get(("c", 64, 8), 4).blind == bytes([4]) * 16 and again.get(("c", 64, 8), 1) is None


def test_another_runs_log_is_removed(tmp_path, caplog):
    _log(tmp_path).write(("c", 64, 8), 0, b"k" * 16, [b"a" * 16, b"b" * 16])
    caplog.set_level("INFO", logger="tfe_estimator")
    assert _log(tmp_path, server1="elsewhere:1").recorded() == []
    assert any("belongs to another run" in r.getMessage() for r in caplog.records)


def test_a_corrupt_or_readable_log_is_refused_naming_the_fix(tmp_path):
    _log(tmp_path).write(("c", 64, 8), 0, b"k" * 16, [b"a" * 16, b"b" * 16])
    path = str(tmp_path / "state" / FILE_NAME)
    os.chmod(path, 0o644)
    with pytest.raises(ValueError, match="mode 0o644.*nobody else may read.*Delete it and restart both"):
        _log(tmp_path)
    os.chmod(path, 0o600)
    with open(path, "a") as f:
        f.write(json.dumps({"c": "c", "r": 64, "n": 8, "t": 1, "b": "00"})[:30] + "\n")
    with pytest.raises(ValueError, match=f"{FILE_NAME} line 3 does not parse"):
        _log(tmp_path)


def test_recording_costs_little(tmp_path):
    log = _log(tmp_path)
    start = time.perf_counter()
    for step in range(2000):
        log.write(("c", 64, 8), step, b"k" * 16, [b"a" * 16, b"b" * 16])
    assert (time.perf_counter() - start) / 2000 < 1e-3  # well under a step's cost (tens of microseconds here)
    assert sum(1 for _ in open(log.path)) <= 1024 + 1


def test_the_launcher_gives_each_server_a_private_state_directory_of_its_run():
    # Inside the server's own TLS directory: private (its own mount under --isolate), removed at the run's end.
    from tfe_estimator.cluster.launcher import Launcher  # pylint: disable=import-outside-toplevel
    from tfe_estimator.cluster.spec import STATE_DIR_ENV  # pylint: disable=import-outside-toplevel

    launcher = Launcher(["true"], workers=1, cluster_mode="service")
    dirs = {(task.job, task.index): task.env.get(STATE_DIR_ENV) for task in launcher.tasks}
    assert dirs[("tfe", 0)] == os.path.join(launcher.task_tls_dir("tfe", 0), "state")
    assert dirs[("chief", 0)] is None and dirs[("worker", 0)] is None
