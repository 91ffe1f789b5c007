"""The between-graph acceptance run through the command line a user types.

`tfe-estimator launch --cluster-mode between-graph --workers 1 --evaluator -- python train.py`
with a script that gives each
owner its own `TfeRunConfig(model_dir=...)` and data file; the evaluator
belongs to the chief's organisation and evaluates the chief's checkpoints on
the chief's data.
"""
import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest

from test_between_graph import LEARNING_RATE, OWNERS, SCRIPT, STEPS, _owner_data, _plaintext_twin, _weights
from test_launch import _alive  # a zombie does not count

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]


def _launch(workdir, *flags):
    """`tfe-estimator launch` as a user runs it; returns its output and the pids of every task it started."""
    command = [sys.executable, "-m", "tfe_estimator.tools.cli", "launch", "--cluster-mode", "between-graph",
               "--workers", "1", "--evaluator",
               "--task-cwd", os.path.join(workdir, "{job}-{index}"), "--final-eval-timeout", "120",
               "--", sys.executable, SCRIPT, str(STEPS), str(LEARNING_RATE), *flags]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=300, check=False)
    return proc.returncode, proc.stdout + proc.stderr


def _mse(rows, w):
    x = np.column_stack([rows[:, :2], np.ones(len(rows))]).astype(np.float64)
    return float(np.mean((x @ w - rows[:, 2]) ** 2))


def test_the_launcher_trains_each_owner_on_its_own_and_evaluates_the_chiefs_checkpoints(tmp_path):
    workdir = str(tmp_path)
    data = _owner_data(workdir)
    twin = _plaintext_twin(data, STEPS)
    status, log = _launch(workdir)
    assert status == 0, log[-5000:]
    assert "cluster_mode" not in log and log.count(f"owner finished at step {STEPS}") == 2, log[-5000:]
    for pid in _task_pids(log):
        assert not _alive(pid), f"task process {pid} is still alive"
    weights = {owner: _weights(os.path.join(workdir, owner, "model"), STEPS) for owner in OWNERS}
    np.testing.assert_allclose(weights["chief-0"], weights["worker-0"], atol=1e-5)
    np.testing.assert_allclose(weights["chief-0"], twin, atol=1e-5)
    # The evaluator ran in the chief's organisation: the final checkpoint's loss on the chief's data.
    with open(os.path.join(workdir, "chief-0", "eval_metrics.json")) as f:
        metrics = json.load(f)
    assert metrics["global_step"] == STEPS
    assert metrics["average_loss"] == pytest.approx(_mse(data["chief-0"], twin), rel=1e-4)
    assert metrics["average_loss"] != pytest.approx(_mse(data["worker-0"], twin), rel=1e-2)  # not the other's data
    assert not os.path.exists(os.path.join(workdir, "worker-0", "model", "eval"))


def _task_pids(log):
    """The pids the launcher printed for its tasks ("[launch] started chief:0 (pid 123): ...")."""
    pids = [int(p) for p in re.findall(r"^\[launch\] started \S+ \(pid (\d+)\)", log, re.MULTILINE)]
    assert len(pids) >= 6, log[-3000:]  # chief, worker, evaluator, three tfe tasks
    return pids


def test_clipped_updates_on_the_32_bit_ring_train_to_the_same_twin(tmp_path):
    # Gradients stay below the clipping bound (64) in these steps, so the twin need not clip;
    # random rounding to 2**-22 moves the weights by far less than the tolerance.
    workdir = str(tmp_path)
    data = _owner_data(workdir)
    twin = _plaintext_twin(data, STEPS)
    status, log = _launch(workdir, "--update-ring-bits-32")
    assert status == 0, log[-5000:]
    weights = {owner: _weights(os.path.join(workdir, owner, "model"), STEPS) for owner in OWNERS}
    np.testing.assert_allclose(weights["chief-0"], weights["worker-0"], atol=1e-6)
    np.testing.assert_allclose(weights["chief-0"], twin, atol=1e-5)


def test_owners_whose_models_diverge_are_stopped_naming_it(tmp_path):
    # A planted divergence: the worker changes its own copy of the bias after its first step.
    workdir = str(tmp_path)
    _owner_data(workdir)
    status, log = _launch(workdir, "--diverge-worker")
    assert status != 0, log[-5000:]
    assert "Between-graph: the models of the data owners differ at step" in log, log[-5000:]
    assert "owner finished" not in log
