"""Faults in between-graph mode: no deadlock, no divergence; resume from the owners' own checkpoints.

Every owner waits in each step for the others' contributions on the
servers. A task that dies must not leave the others waiting forever: the
launcher names it (without restarts), and each owner's session run is
bounded by `TfeRunConfig(step_timeout_secs=...)`. With restarts: an owner
restarted alone restores an older checkpoint and the servers' step
accumulators refuse its step while the chief waits for a later one, naming
both; a restarted server makes every owner recover from the same checkpoint,
and the owners continue (each rewinds its own state on the servers first). Relaunching every
owner resumes each from its own latest checkpoint (the owners save at the
same steps) and ends with the weights of an uninterrupted run.
"""
import io
import os
import re
import sys

import numpy as np
import pytest

from tfe_estimator.cluster.launcher import Launcher
from test_between_graph import LEARNING_RATE, OWNERS, SCRIPT, _owner_data, _plaintext_twin, _weights
from test_faults import _CHIEF_TOO, _kill, _start, _wait_for
from test_launch import _assert_all_gone

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]


def _launcher(workdir, steps, *flags, **kwargs):
    return Launcher([sys.executable, SCRIPT, str(steps), str(LEARNING_RATE), *flags], workers=1,
                    task_cwd=os.path.join(workdir, "{job}-{index}"), out=io.StringIO(), grace_seconds=5,
                    cluster_mode="between-graph", **kwargs)


def _started_training(workdir, steps=10):
    """Both owners have run `steps` steps (their SlowSteps hook counts them)."""
    def done(owner):
        try:
            with open(os.path.join(workdir, owner, "progress")) as f:
                return int(f.read() or 0)
        except (OSError, ValueError):
            return 0
    return all(done(owner) >= steps for owner in OWNERS)


def _kill_mid_training(workdir, victim, steps, *flags, join_secs=120, **kwargs):
    """Launches the owners, kills `victim` once both have trained 10 steps; (status, log), the run ended."""
    launcher = _launcher(workdir, steps, "--step-seconds", "0.05", *flags, **kwargs)
    runner, status = _start(launcher)
    try:
        _wait_for(lambda: _started_training(workdir), launcher, runner, 120, "both owners training")
        _kill(launcher, victim)
    finally:
        runner.join(timeout=join_secs)
    log = launcher._out.getvalue()  # pylint: disable=protected-access
    assert not runner.is_alive(), log[-5000:]
    _assert_all_gone(launcher)
    return status, log


@pytest.mark.parametrize("victim", ["chief:0", "worker:0", "tfe:0", "tfe:1"])
def test_without_restarts_a_killed_owner_or_server_is_named_and_nothing_survives(victim, tmp_path):
    workdir = str(tmp_path)
    _owner_data(workdir)
    status, log = _kill_mid_training(workdir, victim, 400)
    assert status == [-9], log[-5000:]
    during = "" if victim == "chief:0" else " while the chief was training"
    too = _CHIEF_TOO if during else ""
    assert re.search(rf"{victim} died with status -9 \(killed by SIGKILL\){during}{too}; stopping the cluster", log), \
        log[-5000:]


@pytest.mark.parametrize("victim", ["worker:0", "chief:0"])
def test_an_owner_restarted_alone_is_refused_or_times_out_and_cannot_hang_the_others(victim, tmp_path):
    # The owner is restarted and restores its step-0 checkpoint while the other waits at a later step. A
    # restarted worker: the servers' accumulators refuse its step while the chief waits for a later one,
    # naming both steps. A restarted chief: its take waits for the worker, which waits for the chief's
    # partial sums of the later step; both waits end after step_timeout_secs. The run stops, bounded.
    workdir = str(tmp_path)
    _owner_data(workdir)
    status, log = _kill_mid_training(workdir, victim, 400, "--step-timeout-secs", "15", join_secs=240,
                                     max_restarts=1, down_timeout=60)
    assert status and status[0] != 0, log[-5000:]
    assert f"{victim} died with status -9 (killed by SIGKILL); restarting it" in log
    assert "stopping the cluster" in log, log[-5000:]
    refused = re.search(r"worker:0 contributes to step 0 but the chief takes step \d+ \(the owners are out of step\)"
                        r"\. Restart every task of the cluster \(servers and owners\)", log)
    assert refused or "DeadlineExceededError: Operation timed out" in log, log[-5000:]


@pytest.mark.parametrize("victim", ["tfe:0", "tfe:1"])
def test_a_server_restarted_mid_training_recovers_to_the_undisturbed_weights(victim, tmp_path):
    # A restarted server has lost the step's contributions: every owner's session fails and recovers from its
    # own checkpoint (here step 0, saved by both), rewinds its own state on the servers in the handshake, and
    # the run completes with the weights of an undisturbed run.
    workdir = str(tmp_path)
    data = _owner_data(workdir)
    status, log = _kill_mid_training(workdir, victim, 60, "--step-timeout-secs", "15", join_secs=240,
                                     max_restarts=1, down_timeout=60)
    assert f"{victim} died with status -9 (killed by SIGKILL); restarting it" in log, log[-5000:]
    assert status == [0], log[-5000:]
    assert log.count("owner finished at step 60") == 2, log[-5000:]
    weights = {owner: _weights(os.path.join(workdir, owner, "model"), 60) for owner in OWNERS}
    np.testing.assert_allclose(weights["chief-0"], weights["worker-0"], atol=1e-5)
    np.testing.assert_allclose(weights["chief-0"], _plaintext_twin(data, 60), atol=1e-5)


def test_relaunching_every_owner_resumes_from_their_checkpoints_to_the_uninterrupted_weights(tmp_path):
    workdir = str(tmp_path)
    data = _owner_data(workdir)
    first = _launcher(workdir, 4)  # saves model.ckpt-4 in each owner's own directory, then stops
    assert first.run() == 0, first._out.getvalue()[-5000:]  # pylint: disable=protected-access
    second = _launcher(workdir, 8)  # every owner restores step 4 and trains on to 8
    assert second.run() == 0, second._out.getvalue()[-5000:]  # pylint: disable=protected-access
    log = second._out.getvalue()  # pylint: disable=protected-access
    assert log.count("owner finished at step 8") == 2, log[-5000:]
    weights = {owner: _weights(os.path.join(workdir, owner, "model"), 8) for owner in OWNERS}
    np.testing.assert_allclose(weights["chief-0"], weights["worker-0"], atol=1e-5)
    np.testing.assert_allclose(weights["chief-0"], _plaintext_twin(data, 8), atol=1e-5)
    _assert_all_gone(second)
