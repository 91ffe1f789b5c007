"""The README's cross-organisation example, run as written: its data split, its train.py, its launch command.

The blocks are read from README.md itself, so the test fails when the README's
code stops working (the docs test only compiles it).
"""
import glob
import os
import re
import shlex
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]

#: Lines a 2-owner launch may print beside the progress and evaluation lines (the launcher's own, starts,
#: warnings): TensorFlow's INFO lines and deprecation blocks are hidden (`tfe_estimator.cluster.quiet`).
MAX_OTHER_LINES = 40
README = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "README.md")


def _blocks(language):
    with open(README, encoding="utf-8") as f:
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
    assert proc.returncode == 0, log[-5000:]
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
        assert f"[{owner}] tfe_estimator: evaluation at step 300, all owners' data: average_loss" in log, log[-5000:]
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
