"""Faults in service mode: named, bounded, and a restarted aggregation server recovers.

A killed task is named by the launcher (without restarts). A server that is
restarted mid-training has lost every open step: the owners' calls fail with
UNAVAILABLE, Estimator recovers each owner's session from its own latest
checkpoint, the owners' handshake and rewind run again, and the run ends with
the weights of an undisturbed one. An owner restarted alone restores an older
checkpoint than the other owner's step and catches up from the servers' replay
window while the other owner waits for it.
"""
import io
import re
import os
import sys

import numpy as np
import pytest

from tfe_estimator.cluster.launcher import Launcher
from test_faults import _CHIEF_TOO, _kill, _start, _wait_for
from test_launch import _assert_all_gone
from test_service_mode import LEARNING_RATE, SCRIPT, _owner_data, _owners, _plaintext_twin, _weights

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]

OWNERS = _owners(1)


def _progress(workdir, owner):
    try:
        with open(os.path.join(workdir, owner, "progress")) as f:
            return int(f.read() or 0)
    except (OSError, ValueError):
        return 0


def _kill_mid_training(workdir, victim, steps, *flags, join_secs=180, **kwargs):
    """Launches 2 owners in service mode, kills `victim` (a task name or several) once both trained 5 steps;
    (status, log)."""
    launcher = Launcher([sys.executable, SCRIPT, str(steps), str(LEARNING_RATE), "--step-seconds", "0.05", *flags],
                        workers=1, task_cwd=os.path.join(workdir, "{job}-{index}"), out=io.StringIO(),
                        grace_seconds=5, cluster_mode="service", **kwargs)
    runner, status = _start(launcher)
    try:
        _wait_for(lambda: all(_progress(workdir, o) >= 5 for o in OWNERS), launcher, runner, 120, "both owners training")
        for name in (victim,) if isinstance(victim, str) else victim:
            _kill(launcher, name)
    finally:
        runner.join(timeout=join_secs)
    log = launcher._out.getvalue()  # pylint: disable=protected-access
    assert not runner.is_alive(), log[-5000:]
    _assert_all_gone(launcher)
    return status, log


@pytest.mark.parametrize("victim", ["worker:0", "tfe:1"])
def test_without_restarts_a_killed_owner_or_server_is_named_and_nothing_survives(victim, tmp_path):
    workdir = str(tmp_path)
    _owner_data(workdir, OWNERS)
    status, log = _kill_mid_training(workdir, victim, 400)
    assert status == [-9], log[-5000:]
    assert re.search(rf"{victim} died with status -9 \(killed by SIGKILL\) while the chief was training{_CHIEF_TOO}; "
                     "stopping the cluster", log), log[-5000:]


@pytest.mark.parametrize("victim", ["tfe:0", "tfe:1"])
def test_a_server_restarted_mid_training_recovers_to_the_undisturbed_weights(victim, tmp_path):
    workdir = str(tmp_path)
    data = _owner_data(workdir, OWNERS)
    status, log = _kill_mid_training(workdir, victim, 40, "--step-timeout-secs", "30", max_restarts=1,
                                     down_timeout=60)
    assert f"{victim} died with status -9 (killed by SIGKILL); restarting it" in log, log[-5000:]
    assert status == [0], log[-5000:]
    assert log.count("owner finished at step 40") == 2, log[-5000:]
    weights = {owner: _weights(os.path.join(workdir, owner, "model"), 40) for owner in OWNERS}
    np.testing.assert_allclose(weights["chief-0"], weights["worker-0"], atol=1e-5)
    np.testing.assert_allclose(weights["chief-0"], _plaintext_twin(data, 40), atol=1e-5)


@pytest.mark.parametrize("victims", [("worker:0",), ("chief:0", "worker:0")])
def test_restarted_owners_catch_up_from_the_replay_window(victims, tmp_path):
    # After 5 steps the worker (alone, or every owner) dies and restarts from its step-0 checkpoint: it replays
    # the released steps from the servers' window (nothing summed or released again) and joins the step the
    # others wait in; the owners end with the same weights, those of an undisturbed run. Alone, the chief never
    # restarts.
    workdir = str(tmp_path)
    data = _owner_data(workdir, OWNERS)
    status, log = _kill_mid_training(workdir, victims, 40, "--step-timeout-secs", "120", join_secs=240,
                                     max_restarts=1, down_timeout=120)
    for victim in victims:
        assert f"{victim} died with status -9 (killed by SIGKILL); restarting it" in log, log[-5000:]
    if "chief:0" not in victims:
        assert "chief:0 died" not in log, log[-5000:]
    assert status == [0], log[-5000:]
    assert log.count("owner finished at step 40") == 2, log[-5000:]
    weights = {owner: _weights(os.path.join(workdir, owner, "model"), 40) for owner in OWNERS}
    np.testing.assert_array_equal(weights["chief-0"], weights["worker-0"])  # bit-identical
    np.testing.assert_allclose(weights["chief-0"], _plaintext_twin(data, 40), atol=1e-5)
