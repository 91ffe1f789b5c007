"""The fault matrix: kill each role of a loopback cluster mid-training.

Without restarts, every kill ends the run with a message naming the task
(an evaluator's death never stops training: the model is finished and the run
fails naming the evaluator); the worker stands for every task that is neither
the chief nor an evaluator, the ``tfe`` servers too (the launcher watches them
all in one loop, with one message: the restart run below kills each ``tfe``
task and asserts it is named, and test_service_faults.py kills ``tfe:1``
without restarts); only the evaluator's kill starts an evaluator.
With restarts, one cluster loses every role in turn (each ``tfe`` task, the
worker, the evaluator, the chief), each restarted after a 2 s delay, and still
finishes with the model an uninterrupted run reaches. No process survives any
run. Cheap launcher policies (a task that never comes back, a port taken
meanwhile, an evaluator that outlives the chief) run with stand-in tasks.

Cost: 3 short clusters that stop at their first checkpoint (the evaluator's
finishes its 200 steps) plus one of 400 slowed-down steps, about 4 minutes of
CI on 2 cores.
"""
import io
import re
import os
import signal
import sys
import threading
import time

import numpy as np
import pytest

from tfe_estimator.tools.demo_cluster import COLUMNS
from tfe_estimator.cluster.launcher import Launcher
from launch_log import report

sys.path.insert(0, os.path.dirname(__file__))
from test_launch import _assert_all_gone, _owner_data, _true_weights, _weights  # noqa: E402

pytestmark = pytest.mark.multiprocess

FEATURES = COLUMNS[:-1]


def _cluster(workdir, steps, step_seconds, evaluator=True, **kwargs):
    command = [sys.executable, "-m", "tfe_estimator.tools.demo_cluster", "--mode", "secure",
               "--model-dir", os.path.join(workdir, "model"), "--steps", str(steps), "--learning-rate", "0.1",
               "--save-checkpoints-steps", "50", "--step-seconds", str(step_seconds)]
    return Launcher(command, workers=1, evaluator=evaluator, task_cwd=os.path.join(workdir, "{job}-{index}"),
                    out=io.StringIO(), grace_seconds=5, cluster_mode="in-graph", **kwargs)


def _checkpoint(model_dir, step):
    return os.path.exists(os.path.join(model_dir, f"model.ckpt-{step}.index"))


def _wait_for(predicate, launcher, runner, seconds, what):
    deadline = time.monotonic() + seconds
    while not predicate():
        assert runner.is_alive(), f"the run ended before {what}:\n" + report(launcher._out.getvalue(), 6000)
        assert time.monotonic() < deadline, f"timed out waiting for {what}:\n" + report(launcher._out.getvalue(), 6000)
        time.sleep(0.1)


def _start(launcher):
    status = []
    runner = threading.Thread(target=lambda: status.append(launcher.run()), daemon=True)
    runner.start()
    return runner, status


def _kill(launcher, name):
    job, index = name.split(":")
    os.killpg(launcher.task(job, int(index)).process.pid, signal.SIGKILL)


#: The launcher's three policies without restarts: the chief's death, an evaluator's, and any other task's (one
#: loop and one message for the worker and the tfe servers, `Launcher._supervise`; a killed tfe:1 is named by it
#: in test_service_faults.py, and the restart test below kills tfe:0, tfe:1 and tfe:2). A [tfe:1] case here ran
#: that same loop again (~27-35 s of CI).
ROLES = ["chief:0", "worker:0", "evaluator:0"]


@pytest.mark.parametrize("victim", ROLES)
def test_without_restarts_a_killed_task_is_named_and_nothing_survives(victim, tmp_path):
    # Prepare: a cluster slowed to ~1 s per checkpoint, so the kill lands mid-training. An evaluator only where
    # it is the victim: the launcher's policy for the other roles does not look at it (one TF process less).
    workdir = str(tmp_path)
    _owner_data(workdir)
    launcher = _cluster(workdir, steps=200, step_seconds=0.02, evaluator=victim == "evaluator:0",
                        evaluator_restarts=0)
    model_dir = os.path.join(workdir, "model")
    runner, status = _start(launcher)
    try:
        # Execute: kill the victim once the first checkpoint after step 0 exists.
        _wait_for(lambda: _checkpoint(model_dir, 50), launcher, runner, 240, "model.ckpt-50")
        _kill(launcher, victim)
    finally:
        runner.join(timeout=300)
    log = launcher._out.getvalue()
    # Assert: the run stopped (or, for the evaluator, finished training) naming the task.
    assert not runner.is_alive(), report(log)
    if victim == "evaluator:0":
        assert status == [-9], report(log)
        assert "evaluator:0 died with status -9 (killed by SIGKILL) and has used its 0 restarts" in log
        assert "the chief finished, but evaluator:0 failed with status -9" in log
        assert _checkpoint(model_dir, 200), "an evaluator's death stopped training"
        np.testing.assert_allclose(_weights(model_dir), _true_weights(), atol=0.05)
    elif victim == "chief:0":
        assert status == [-9], report(log)
        assert "chief:0 died with status -9 (killed by SIGKILL); stopping the cluster" in log
    else:
        assert status == [-9], report(log)
        assert re.search(rf"{victim} died with status -9 \(killed by SIGKILL\) while the chief was training"
                         rf"{_CHIEF_TOO}; stopping", log), report(log)
    _assert_all_gone(launcher)


def test_with_restarts_every_role_can_die_and_the_model_is_an_uninterrupted_runs(tmp_path):
    """Each role killed in turn is restarted after the launcher's restart delay, and training resumes from the last
    checkpoint to the model an uninterrupted run reaches (including a data owner restarted after a delay)."""
    # Prepare: one cluster; every task may be restarted once, 2 s after its death (the launcher's restart
    # delay: the chief recovers its session while a data owner or a server is still down; this run stands
    # for the data owner's delayed restart test_launch.py once ran in a launch of its own).
    workdir = str(tmp_path)
    _owner_data(workdir)
    launcher = _cluster(workdir, steps=400, step_seconds=0.02, max_restarts=1, evaluator_restarts=1,
                        restart_delay=2)
    model_dir = os.path.join(workdir, "model")
    runner, status = _start(launcher)
    killed = []
    try:
        # Execute: after each new checkpoint, kill the next role (the previous one has recovered by then).
        for step, victim in zip((50, 100, 150, 200, 250, 300), ("tfe:0", "worker:0", "tfe:2", "evaluator:0",
                                                               "chief:0", "tfe:1")):
            _wait_for(lambda: _checkpoint(model_dir, step), launcher, runner, 300, f"model.ckpt-{step}")
            _kill(launcher, victim)
            killed.append(victim)
    finally:
        runner.join(timeout=600)
    log = launcher._out.getvalue()
    # Assert: every victim was restarted, training finished, and the model is the converged one.
    assert status == [0], report(log, 8000)
    for victim in killed:
        goes_on = "training goes on; " if victim == "evaluator:0" else ""
        assert re.search(rf"{victim} died with status -9 \(killed by SIGKILL\); {goes_on}restarting it at "
                         r"\S+ in 2 s \(1/1\)", log), victim
    assert len(killed) == 6
    assert _checkpoint(model_dir, 400)
    np.testing.assert_allclose(_weights(model_dir), _true_weights(), atol=0.05)
    assert "Saving dict for global step 400" in log  # the restarted evaluator evaluated the final model
    _assert_all_gone(launcher)


#: What the launcher adds when the chief fails of the same cause right after the task it names first.
_CHIEF_TOO = r"(; chief:0 died too, after it, with [^;\n]+)?"


def _fake(script):
    """A stand-in task: Python that reads TF_CONFIG; `serve()` listens on the task's own port."""
    prelude = ("import json, os, socket, sys, time\n"
               "t = json.loads(os.environ['TF_CONFIG'])\n"
               "me = t['cluster'][t['task']['type']][t['task']['index']]\n"
               "def serve():\n"
               "    s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\n"
               "    s.bind(('127.0.0.1', int(me.rsplit(':', 1)[1]))); s.listen(); return s\n")
    return [sys.executable, "-c", prelude + script]


def test_a_task_that_never_comes_back_ends_the_run_in_bounded_time():
    # The worker serves, dies at 2 s, and its restart would come only after 600 s.
    out = io.StringIO()
    launcher = Launcher(_fake("s = serve()\ntime.sleep(2 if t['task']['type'] == 'worker' else 600)\nsys.exit(1)"),
                        workers=1, out=out, server_command=_fake("s = serve(); time.sleep(600)"),
                        max_restarts=1, restart_delay=600, down_timeout=3, cluster_mode="in-graph")
    start = time.monotonic()
    status = launcher.run()
    assert status == 1 and time.monotonic() - start < 30, out.getvalue()
    assert "worker:0 has been down for 3 s" in out.getvalue() and "--down-timeout" in out.getvalue()
    _assert_all_gone(launcher)


def test_a_task_that_never_starts_serving_ends_the_run():
    out = io.StringIO()
    launcher = Launcher(_fake("time.sleep(600)"), workers=0, out=out,
                        server_command=_fake("s = serve() if t['task']['index'] != 2 else None; time.sleep(600)"),
                        down_timeout=4, cluster_mode="in-graph")
    assert launcher.run() == 1
    assert "tfe:2 has been down for 4 s (not serving at 127.0.0.1:" in out.getvalue()
    _assert_all_gone(launcher)


def test_a_port_taken_meanwhile_replans_the_cluster(tmp_path):
    # tfe:1 fails to bind the first time, as a TensorFlow server does when its port was taken.
    marker = tmp_path / "first"
    server = _fake(f"import pathlib\nm = pathlib.Path({str(marker)!r})\n"
                   "if t['task']['index'] == 1 and not m.exists():\n"
                   "    m.write_text('x'); print('UNKNOWN: Could not start gRPC server'); sys.exit(1)\n"
                   "s = serve(); time.sleep(600)")
    out = io.StringIO()
    launcher = Launcher(_fake("time.sleep(1)"), workers=0, out=out, server_command=server)
    first = dict(launcher.cluster.jobs)
    assert launcher.run() == 0, out.getvalue()
    text = out.getvalue()
    assert "tfe:1 could not bind" in text and "re-planning all ports and starting again (1/3)" in text
    assert launcher.cluster.jobs != first and text.count("cluster (pond):") == 2
    _assert_all_gone(launcher)


def test_an_evaluator_never_stops_training_and_is_restarted():
    out = io.StringIO()
    launcher = Launcher(_fake("if t['task']['type'] == 'evaluator': sys.exit(7)\n"
                              "time.sleep(4 if t['task']['type'] == 'chief' else 600)"),
                        workers=0, evaluator=True, out=out, server_command=_fake("s = serve(); time.sleep(600)"),
                        evaluator_restarts=2)
    assert launcher.run() == 7
    text = out.getvalue()
    assert "evaluator:0 died with status 7; training goes on; restarting it" in text
    assert "(2/2)" in text and "chief finished with status 0" in text
    assert "the chief finished, but evaluator:0 failed with status 7" in text
    _assert_all_gone(launcher)


def test_an_evaluator_that_outlives_the_chief_is_bounded():
    out = io.StringIO()
    launcher = Launcher(_fake("time.sleep(1 if t['task']['type'] == 'chief' else 600)"),
                        workers=0, evaluator=True, out=out, server_command=_fake("s = serve(); time.sleep(600)"),
                        final_eval_timeout=2)
    start = time.monotonic()
    assert launcher.run() == 1
    assert time.monotonic() - start < 30
    assert "evaluator:0 did not finish within 2 s after the chief (--final-eval-timeout)" in out.getvalue()
    _assert_all_gone(launcher)


def test_task_logs_go_to_files_and_their_paths_are_printed(tmp_path):
    out = io.StringIO()
    launcher = Launcher(_fake("print('hello from', t['task']['type'])"), workers=1, out=out, server_command=_fake("s = serve(); time.sleep(600)"),
                        log_dir=str(tmp_path / "logs"))
    assert launcher.run() == 0
    text = out.getvalue()
    assert "[chief:0] hello from" not in text and "[worker:0] hello from" not in text
    assert f"task logs: {tmp_path / 'logs'}" in text
    assert "hello from chief" in (tmp_path / "logs" / "chief-0.log").read_text()
    assert "hello from worker" in (tmp_path / "logs" / "worker-0.log").read_text()
    _assert_all_gone(launcher)


def test_a_failing_task_log_tail_is_shown(tmp_path):
    out = io.StringIO()
    launcher = Launcher(_fake("if t['task']['type'] == 'worker': print('the real cause'); sys.exit(3)\n"
                              "time.sleep(60)"),
                        workers=1, out=out, server_command=_fake("s = serve(); time.sleep(600)"),
                        log_dir=str(tmp_path))
    assert launcher.run() == 3
    assert "[worker:0] the real cause" in out.getvalue()
    _assert_all_gone(launcher)

