"""The README's cross-organisation example, run as written: its data split, its train.py, its launch command;
and docs/deployment.md's flow by hand with that train.py, for two hospitals and two server operators.

The blocks are read from README.md and docs/deployment.md themselves, so the
test fails when their code stops working (the docs test only compiles it).
"""
import glob
import os
import re
import shlex
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import tensorflow as tf

from launch_log import report

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]

#: Lines a 2-owner launch may print beside the progress and evaluation lines (the launcher's own, starts,
#: warnings): TensorFlow's INFO lines and deprecation blocks are hidden (`tfe_estimator.cluster.quiet`).
MAX_OTHER_LINES = 40
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = os.path.join(ROOT, "README.md")
DEPLOYMENT = os.path.join(ROOT, "docs", "deployment.md")


def _blocks(language, path=README):
    with open(path, encoding="utf-8") as f:
        return re.findall(rf"```{language}\n(.*?)```", f.read(), re.S)


def _weights(model_dir):
    checkpoint = tf.train.latest_checkpoint(model_dir)
    assert checkpoint and checkpoint.endswith("model.ckpt-300"), checkpoint
    return tf.train.load_variable(checkpoint, "linear/linear_model/bmi/weights").ravel()


def test_the_readme_train_py_trains_two_owners_with_the_launcher_as_written(tmp_path):
    python = _blocks("python")
    train = next(b for b in python if b.startswith('"""train.py:'))
    split = next(b for b in python if "load_diabetes" in b)
    launch = next(line for b in _blocks("sh") for line in b.splitlines() if line.startswith("tfe-estimator launch"))
    (tmp_path / "train.py").write_text(train)
    subprocess.run([sys.executable, "-c", split], cwd=tmp_path, check=True, timeout=120)
    argv = shlex.split(launch)  # tfe-estimator launch --workers 1 -- python train.py
    argv = [sys.executable, "-m", "tfe_estimator.tools.cli"] + argv[1:]
    argv[argv.index("python")] = sys.executable
    proc = subprocess.run(argv, cwd=tmp_path, capture_output=True, text=True, timeout=600, check=False)
    log = proc.stdout + proc.stderr
    (tmp_path / "launch.log").write_text(log)  # kept for a look after a failure
    assert proc.returncode == 0, report(log)
    chief, worker = (_weights(tmp_path / "model" / owner) for owner in ("chief-0", "worker-0"))
    np.testing.assert_allclose(chief, worker, atol=1e-5)
    assert abs(float(chief[0])) > 1.0  # bmi predicts the target: it learned
    # Federated evaluation: both owners evaluated step 300 and read the same loss, that of both test sets.
    losses = [_final_eval(tmp_path / "model" / owner) for owner in ("chief-0", "worker-0")]
    assert losses[0][0] == losses[1][0] == 300, losses
    assert losses[0][1] == pytest.approx(losses[1][1], rel=1e-5), losses
    # Each owner's own metrics (LocalMetricsExporter): its 40 test rows only, never summed. Both test sets
    # have 40 rows, so the federated loss is the mean of the two owners' own losses.
    own = [_final_eval(tmp_path / "model" / owner, "eval_local") for owner in ("chief-0", "worker-0")]
    assert own[0][0] == own[1][0] == 300, own
    assert abs(own[0][1] - own[1][1]) > 1e-3 * losses[0][1], (own, losses)  # not the federated loss
    assert (own[0][1] + own[1][1]) / 2 == pytest.approx(losses[0][1], rel=1e-5), (own, losses)
    for owner in ("chief:0", "worker:0"):  # each owner's terminal shows both
        assert f"[{owner}] tfe_estimator: evaluation at step 300, all owners' data: average_loss" in log, report(log)
        assert f"[{owner}] tfe_estimator: evaluation at step 300, this owner's data only: average_loss" in log
        assert f"[{owner}] tfe_estimator: step 200, loss" in log  # the progress line
    # A readable terminal (issue 35): beside the progress and evaluation lines, about what the README shows.
    other = [line for line in proc.stdout.splitlines()
             if "tfe_estimator: step " not in line and "tfe_estimator: evaluation at step " not in line]
    assert len(other) <= MAX_OTHER_LINES, f"{len(other)} lines:\n" + "\n".join(other)


def _final_eval(model_dir, subdir="eval"):
    """(global step, average_loss) of the last evaluation summary in model_dir/<subdir>."""
    last = None
    for path in sorted(glob.glob(os.path.join(model_dir, subdir, "events.*"))):
        for event in tf.compat.v1.train.summary_iterator(path):
            for value in event.summary.value:
                if value.tag == "average_loss":
                    last = (int(event.step), float(value.simple_value))
    assert last is not None, os.listdir(model_dir)
    return last


def _commands(block):
    """The shell commands of `block`: continuation lines joined, comments dropped."""
    return [c.strip() for c in block.replace("\\\n", " ").splitlines() if c.strip() and not c.startswith("#")]


def _two_hospitals(command):
    """`command` without Hospital C (its party in `certs federation`); None for Hospital C's own commands."""
    if "certs federation" in command:
        return re.sub(r"--party worker:1=hospital-c/\S+ ", "", command)
    if "CLUSTER=" in command:
        return command.replace(', "hospital-c.invalid:1"', "")
    return None if "hospital-c" in command else command


def test_the_deployment_page_for_two_hospitals_leaves_each_checkpoint_where_its_command_names(tmp_path, monkeypatch):
    """Issue 41: `python train.py --model-dir hospital-a/model` was ignored; both owners trained into /tmp/tmpXXXX."""
    from tfe_estimator.cluster.launcher import free_ports
    from tfe_estimator.tools import cli

    # Prepare: the README's train.py, the page's data split and its commands (steps 1 to 4) without Hospital C,
    # on free ports instead of the page's 7000-7003 (other clusters may run on this machine).
    ports = dict(zip(("7000", "7001", "7002", "7003"), map(str, free_ports(4))))
    sh = [re.sub(r"\b700[0-3]\b", lambda m: ports[m.group()], b) for b in _blocks("sh", DEPLOYMENT)]
    certs = [c for b in sh if all(c.startswith("tfe-estimator certs ") for c in _commands(b)) for c in _commands(b)]
    start = _commands(next(b for b in sh if b.startswith("CLUSTER=")))
    (tmp_path / "train.py").write_text(next(b for b in _blocks("python") if b.startswith('"""train.py:')))
    split = next(b for b in _blocks("python", DEPLOYMENT) if "load_diabetes" in b)
    subprocess.run([sys.executable, "-c", split], cwd=tmp_path, check=True, timeout=120)
    monkeypatch.chdir(tmp_path)
    for command in filter(None, map(_two_hospitals, certs)):
        assert cli.main(shlex.split(command)[1:]) == 0, command
    script = ["set -u", "OWNERS="]
    for command in filter(None, map(_two_hospitals, start)):
        command = command.replace(" tfe-estimator server", f" {sys.executable} -m tfe_estimator.tools.cli server")
        if " python train.py" in command:  # an owner: started in the background, its exit status awaited
            command = command.rstrip(" &").replace(" python train.py", f" {sys.executable} train.py")
            command += ' & OWNERS="$OWNERS $!"'
        script.append(command)
    script.append("status=0; for owner in $OWNERS; do wait $owner || status=1; done; exit $status")
    assert sum("train.py --model-dir hospital-" in line for line in script) == 2, script
    env = {k: v for k, v in os.environ.items() if k != "TF_CONFIG" and not k.startswith("TFE_ESTIMATOR_")}
    # Execute: the servers and the two hospitals, as the page starts them.
    with open(tmp_path / "run.log", "w") as log:
        proc = subprocess.Popen(["bash", "-c", "\n".join(script)], cwd=tmp_path, env=env, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)
        try:
            returncode = proc.wait(timeout=600)
        finally:
            _stop_group(proc)  # the servers (and the owners, if they are still running)
    output = (tmp_path / "run.log").read_text()
    # Assert: each hospital's checkpoint is in the directory its command names, equal on both, and it learned.
    assert returncode == 0, report(output)
    weights = [_weights(tmp_path / hospital / "model") for hospital in ("hospital-a", "hospital-b")]
    np.testing.assert_array_equal(weights[0], weights[1])
    assert abs(float(weights[0][0])) > 1.0, weights
    assert not (tmp_path / "model").exists()


def _stop_group(proc):
    """Stops every process of `proc`'s process group (bash's background jobs stay in it): TERM, then KILL after
    2 s (polled: no fixed wait once the group is gone)."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            break
        deadline = time.monotonic() + 2
        while time.monotonic() < deadline and _group_alive(proc):
            time.sleep(0.05)
    proc.wait()


def _group_alive(proc):
    """Whether a process of `proc`'s group (other than `proc` itself, reaped by `proc.wait`) is still running."""
    proc.poll()  # reap the bash process if it has exited: a zombie still counts for killpg
    try:
        os.killpg(proc.pid, 0)
    except ProcessLookupError:
        return False
    return True
