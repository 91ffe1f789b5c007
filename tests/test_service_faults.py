"""Faults in service mode: named, bounded, and a restarted aggregation server recovers.

A killed server is named by the launcher (without restarts; a killed owner's
death goes through the same loop and message, test_faults.py's [worker:0]). A server that is
restarted mid-training has lost every open step: the owners' calls fail with
UNAVAILABLE, Estimator recovers each owner's session from its own latest
checkpoint, the owners' handshake and rewind run again, and the run ends with
the weights of an undisturbed one. An owner restarted alone restores an older
checkpoint than the other owner's step and catches up from the servers' replay
window while the other owner waits for it.
"""
import io
import json
import re
import os
import sys

import numpy as np
import pytest
import tensorflow as tf

from tfe_estimator.cluster.launcher import Launcher
from launch_log import report
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


def _checkpoint_step(workdir, owner):
    """The step of `owner`'s latest checkpoint; -1 before the first."""
    checkpoint = tf.train.latest_checkpoint(os.path.join(workdir, owner, "model"))
    return int(checkpoint.rsplit("-", 1)[1]) if checkpoint else -1


def _checkpoint_after(workdir, before):
    """A predicate: both owners wrote a checkpoint later than `before` ({owner: checkpoint step})."""
    return lambda: all(_checkpoint_step(workdir, o) > before[o] for o in OWNERS)


def _trained_since(workdir, before, steps=5):
    """A predicate: both owners' processes trained `steps` steps more than `before` ({owner: progress})."""
    return lambda: all(_progress(workdir, o) >= before[o] + steps for o in OWNERS)


def _kill_mid_training(workdir, victim, steps, *flags, join_secs=180, then=(), **kwargs):
    """Launches 2 owners in service mode, kills `victim` (a task name or several) once both trained 5 steps, and
    each wave of `then` (a task name or several) once both wrote a checkpoint after the wave before it and trained
    5 steps past it; (status, log). With `then`, the owners save checkpoints more often than at the end
    (service_owner.py --checkpoint-steps)."""
    launcher = Launcher([sys.executable, SCRIPT, str(steps), str(LEARNING_RATE), "--step-seconds", "0.05", *flags],
                        workers=1, task_cwd=os.path.join(workdir, "{job}-{index}"), out=io.StringIO(),
                        grace_seconds=5, cluster_mode="service", **kwargs)
    runner, status = _start(launcher)
    try:
        _wait_for(lambda: all(_progress(workdir, o) >= 5 for o in OWNERS), launcher, runner, 120,
                  "both owners training")
        for name in (victim,) if isinstance(victim, str) else victim:
            _kill(launcher, name)
        for wave in then:
            # The wave before failed a step and the owners rewound to their checkpoint. Once both wrote a later
            # checkpoint (that wave's tasks are back and serving) and trained 5 steps past it, this wave is killed:
            # the owners rewind to that checkpoint, so the steps trained since the wave before stay in the weights.
            _wait_for(_checkpoint_after(workdir, {o: _checkpoint_step(workdir, o) for o in OWNERS}), launcher,
                      runner, 120, f"both owners' next checkpoint before killing {wave}")
            _wait_for(_trained_since(workdir, {o: _progress(workdir, o) for o in OWNERS}), launcher, runner, 120,
                      f"both owners training past their checkpoint before killing {wave}")
            for name in (wave,) if isinstance(wave, str) else wave:
                _kill(launcher, name)
    finally:
        runner.join(timeout=join_secs)
    log = launcher._out.getvalue()  # pylint: disable=protected-access
    assert not runner.is_alive(), report(log)
    _assert_all_gone(launcher)
    return status, log


#: Only a server: an owner killed without restarts is named by the same loop and message of the launcher
#: (`Launcher._supervise`: every task but the chief and the evaluators), which test_faults.py's [worker:0] runs;
#: the restart test below kills both owners. A [worker:0] case here ran that loop again (~17 s of CI).
@pytest.mark.parametrize("victim", ["tfe:1"])
def test_without_restarts_a_killed_owner_or_server_is_named_and_nothing_survives(victim, tmp_path):
    workdir = str(tmp_path)
    _owner_data(workdir, OWNERS)
    status, log = _kill_mid_training(workdir, victim, 400)
    assert status == [-9], report(log)
    assert re.search(rf"{victim} died with status -9 \(killed by SIGKILL\) while the chief was training{_CHIEF_TOO}; "
                     "stopping the cluster", log), report(log)


def test_restarted_owners_then_each_server_in_turn_recover_to_the_undisturbed_weights(tmp_path):
    """Without DP, restarted owners catch up from the replay window, and each restarted server recovers.

    In one launch: after 5 steps both owners are killed and restart from their step-0 checkpoint, replaying the
    released steps from the servers' window; once both wrote their step-10 checkpoint and trained 5 steps more,
    tfe:0 is killed and restarted while tfe:1 keeps its state; at step 20's checkpoint and 5 steps more, tfe:1
    while the restarted tfe:0 keeps its own. Every restart is named, and the owners end bit-identical with the
    undisturbed run's (the plaintext twin's) weights, to which the steps after each restart contribute (each
    server restart rewinds the owners to the checkpoint written after the restart before it, not to step 0).
    One launch for what were the replay window's both-owners case without DP and the server-restart [tfe:0] and
    [tfe:1] cases (~39, 27 and 26 s of CI).
    """
    workdir, steps = str(tmp_path), 40
    data = _owner_data(workdir, OWNERS)
    status, log = _kill_mid_training(workdir, ("chief:0", "worker:0"), steps, "--step-timeout-secs", "120",
                                     "--checkpoint-steps", "10", then=("tfe:0", "tfe:1"), join_secs=240,
                                     max_restarts=1, down_timeout=120)
    for victim in ("chief:0", "worker:0", "tfe:0", "tfe:1"):
        assert f"{victim} died with status -9 (killed by SIGKILL); restarting it" in log, report(log)
    assert status == [0], _why(log)  # the owners' error lines first: one CI run in two saw a bare traceback
    assert log.count(f"owner finished at step {steps}") == 2, _why(log)
    weights = {owner: _weights(os.path.join(workdir, owner, "model"), steps) for owner in OWNERS}
    np.testing.assert_array_equal(weights["chief-0"], weights["worker-0"])  # bit-identical
    np.testing.assert_allclose(weights["chief-0"], _plaintext_twin(data, steps), atol=1e-5)


def _why(log):
    """The log's error lines (a restarted owner's traceback is long), then its tail."""
    errors = [line for line in log.splitlines() if "Error: " in line or "Error " in line[:60]]
    return "\n".join(errors[-20:]) + "\n...\n" + log[-4000:]


def _released_once(workdir, owner, steps):
    """Per training channel of `owner`: the fresh releases its processes received, and each process's replays.

    Each process writes how many answers of each channel were fresh releases and how many came from the servers'
    replay window (``answers-<pid>.json``, after every step; the servers flag a replay). A killed process may die
    between a step's answers and its write: its last step may be missing from its count (then replayed).
    """
    counts = []
    for name in sorted(os.listdir(os.path.join(workdir, owner)), key=lambda n: os.path.getmtime(
            os.path.join(workdir, owner, n))):
        if name.startswith("answers-"):
            with open(os.path.join(workdir, owner, name)) as f:
                counts.append({k: v for k, v in json.load(f).items() if k.split("/", 1)[1].startswith("sum_")})
    assert counts and counts[-1], (owner, counts)
    fresh = {channel: sum(c.get(channel, [0, 0])[0] for c in counts) for channel in counts[-1]}
    return fresh, [{channel: replayed for channel, (_, replayed) in c.items()} for c in counts], len(counts)


def _checkpoint(model_dir, steps):
    checkpoint = tf.train.latest_checkpoint(model_dir)
    assert checkpoint and checkpoint.endswith(f"model.ckpt-{steps}"), checkpoint
    return {name: tf.train.load_variable(checkpoint, name) for name, _ in tf.train.list_variables(checkpoint)}


def test_restarted_owners_catch_up_from_the_replay_window_under_dp(tmp_path):
    """Under DP, a restarted owner catches up from the servers' replay window, alone and with every owner restarted.

    In one launch: after 5 steps the worker alone dies and restarts from its step-0 checkpoint: it replays the
    released steps from the servers' window (nothing summed or released again) and joins the step the chief waits
    in (the chief never restarts meanwhile: it IS the undisturbed run). Once both wrote their step-10 checkpoint
    and trained 5 steps more, every owner dies and restarts from it: the replayed steps are the first processes'
    releases (their noise, from the window) and the later steps are released once with fresh noise. The owners
    end bit-identical (a worker that caught up wrongly alone would have gone on from other weights than the
    chief's), every step was released once (the owners' clients count fresh releases and replays), and epsilon
    counts each step once, as dp-accounting does. One launch for what were the [victims0] (the worker alone) and
    [victims1] (every owner) cases (~44-50 s of CI each). (Without DP, every owner restarted:
    test_restarted_owners_then_each_server_in_turn_recover_to_the_undisturbed_weights.)
    """
    workdir, steps, multiplier = str(tmp_path), 40, 4.0
    restarts = {"chief:0": 1, "worker:0": 2}
    _owner_data(workdir, OWNERS)
    status, log = _kill_mid_training(workdir, "worker:0", steps, "--step-timeout-secs", "120", "--dp", str(multiplier),
                                     "--checkpoint-steps", "10", then=(("chief:0", "worker:0"),), join_secs=240,
                                     max_restarts=2, down_timeout=120)
    for victim, count in restarts.items():
        assert log.count(f"{victim} died with status -9 (killed by SIGKILL); restarting it") == count, _why(log)
    # The worker's first death came before the chief's: it caught up alone while the chief waited.
    assert log.index("worker:0 died") < log.index("chief:0 died"), _why(log)
    assert status == [0], _why(log)
    assert log.count(f"owner finished at step {steps}") == 2, report(log)
    # Bit-identical owners: a run in which every step was released once, not a copy of some other run (the noise
    # comes from each owner's own RAND_bytes, never from a seed another party could know, so no two runs draw the
    # same noise).
    chief, worker = (_checkpoint(os.path.join(workdir, owner, "model"), steps) for owner in OWNERS)
    assert sorted(chief) == sorted(worker)
    for name, value in chief.items():
        np.testing.assert_array_equal(value, worker[name], err_msg=name)
    assert np.all(np.isfinite(chief["linear/kernel"])) and np.any(chief["linear/kernel"] != 0)
    # No (channel, step) released twice: each owner received at most `steps` fresh releases per training channel
    # over its processes (a killed process may die between a step's answers and its count: one fewer per restart);
    # each restarted process replayed the steps released since its checkpoint, and the chief's first process,
    # which waited while the worker caught up alone, was answered by no replay.
    for owner in OWNERS:
        fresh, replayed, processes = _released_once(workdir, owner, steps)
        restarted = restarts[owner.replace("-", ":")]
        assert processes == 1 + restarted, (owner, processes)
        for channel, count in fresh.items():
            assert steps - restarted <= count <= steps, (owner, channel, fresh, replayed)
            assert all(r.get(channel, 0) >= 5 for r in replayed[1:]), (owner, channel, replayed)
    assert not any(_released_once(workdir, "chief-0", steps)[1][0].values()), "the waiting chief got a replay"
    # Epsilon counts every step once: dp-accounting's RDP for `steps` full-batch steps (q = 128 / 128) with the
    # other owner's noise known (t = 1 of N = 2: noise_multiplier as given); on each owner's terminal and in its
    # evaluation.
    import dp_accounting  # pylint: disable=import-outside-toplevel

    event = dp_accounting.SelfComposedDpEvent(dp_accounting.PoissonSampledDpEvent(
        1.0, dp_accounting.GaussianDpEvent(multiplier)), steps)
    epsilon = dp_accounting.rdp.RdpAccountant().compose(event).get_epsilon(1e-5)
    for owner in OWNERS:
        with open(os.path.join(workdir, owner, "eval_metrics.json")) as f:
            assert json.load(f)["dp_epsilon"] == pytest.approx(epsilon, rel=1e-12)
        task = owner.replace("-", ":")
        assert f"[{task}] tfe_estimator: step {steps}, DP epsilon {epsilon:.4g} at delta 1e-05 (against 1 " \
               "colluding owner(s) of 2;" in log, report(log)
        evaluation = re.search(rf"\[{task}\] tfe_estimator: evaluation at step {steps}, this owner's data only: .*",
                               log)
        assert evaluation and f"dp_epsilon {epsilon:.6g}, " in evaluation.group(0), report(log)
