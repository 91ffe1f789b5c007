"""Service mode end to end: owners that train alone and sum only through the aggregation service.

`tfe-estimator launch --cluster-mode service` runs each owner as a local
Estimator in its own directory (its own data file and model_dir) and the two
aggregation servers; the owners must end equal to each other and to the
plaintext twin (full-batch gradient descent on the mean of the owners' mean
squared errors), with no op of theirs placed anywhere but their own process,
only a fresh key and a masked share leaving the graph, and no listening
socket on any owner.
"""
import io
import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import tensorflow as tf

from owner_data import LEARNING_RATE, _owner_data, _plaintext_twin, _weights  # noqa: F401 (re-exported)
from tfe_estimator.cluster.launcher import Launcher
from launch_log import report

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]

SCRIPT = os.path.join(os.path.dirname(__file__), "scripts", "service_owner.py")
STEPS = 12


def _owners(workers):
    return ["chief-0"] + [f"worker-{i}" for i in range(workers)]


def _train(workdir, workers, *flags, steps=STEPS, mid_training=None):
    """Runs one launch; `mid_training(launcher)` is called once every owner wrote ./progress (--step-seconds)."""
    out = io.StringIO()
    launcher = Launcher([sys.executable, SCRIPT, str(steps), str(LEARNING_RATE), *flags], workers=workers,
                        task_cwd=os.path.join(workdir, "{job}-{index}"), out=out, cluster_mode="service",
                        down_timeout=120)
    if mid_training is None:
        status = launcher.run()
    else:
        result = {}
        runner = threading.Thread(target=lambda: result.setdefault("status", launcher.run()))
        runner.start()
        try:
            deadline = time.monotonic() + 240
            progress = [os.path.join(workdir, owner, "progress") for owner in _owners(workers)]
            while not all(os.path.exists(p) for p in progress) and time.monotonic() < deadline and runner.is_alive():
                time.sleep(0.2)
            assert all(os.path.exists(p) for p in progress), report(out.getvalue())
            mid_training(launcher)
        finally:
            runner.join(timeout=600)
        status = result.get("status")
    log = out.getvalue()
    assert not [t.name for t in launcher.tasks if t.process.poll() is None]
    return status, log


def test_two_owners_train_through_the_service_to_the_plaintext_twin_each_in_its_own_process(tmp_path):
    """One launch for every two-owner property: the twin's weights, a second model and a fresh copy, federated
    evaluation, each owner's graph audit, one round trip per step, and the listening sockets mid-training."""
    workdir = str(tmp_path)
    owners = _owners(1)
    data = _owner_data(workdir, owners)
    twin = _plaintext_twin(data, STEPS)
    ss = shutil.which("ss")
    status, log = _train(workdir, 1, "--second-model", "4", "--step-seconds", "0.2",
                         mid_training=_assert_listening_ports if ss else lambda launcher: None)
    assert status == 0, report(log)
    assert log.count(f"owner finished at step {STEPS}") == 2, report(log)
    weights = {owner: _weights(os.path.join(workdir, owner, "model"), STEPS) for owner in owners}
    np.testing.assert_allclose(weights["chief-0"], weights["worker-0"], atol=1e-5)
    # A second, larger model in the same launch trains too (its own model id: channels and handshake).
    assert log.count("second model finished at step 4") == 2, report(log)
    second = [tf.train.load_variable(os.path.join(workdir, owner, "model2"), "linear/linear_model/x/weights")
              for owner in owners]
    assert second[0].shape == (4, 1) and not np.allclose(second[0], 0.0)
    np.testing.assert_array_equal(second[0], second[1])
    # A fresh copy of the first model (the same model record) on labels doubled: its own training run and
    # channels, so its own sums (the first model's replay window would answer its steps with the first's sums).
    assert log.count("copy of the first model finished at step 4") == 2, report(log)
    doubled = {owner: np.column_stack([rows[:, :2], 2 * rows[:, 2]]) for owner, rows in data.items()}
    for owner in owners:
        np.testing.assert_allclose(_weights(os.path.join(workdir, owner, "model3"), 4), _plaintext_twin(doubled, 4),
                                   atol=1e-5)
    # Each owner's last lines name its weights' fingerprint, equal on both: they hold one model.
    ended = re.findall(r"training ended at step 4; weights fingerprint ([0-9a-f]{16})", log)  # model2, model3
    assert len(ended) == 4 and ended[0] == ended[1] and ended[2] == ended[3], report(log)
    np.testing.assert_allclose(weights["chief-0"], twin, atol=1e-5)
    assert not np.allclose(twin, 0.0, atol=0.1)  # it learned from the data
    # Federated evaluation: each owner evaluated its own rows; every owner reads the loss of the union.
    union = np.concatenate(list(data.values())).astype(np.float64)
    x = np.column_stack([union[:, :2], np.ones(len(union))])
    union_mse = float(np.mean((x @ weights["chief-0"].astype(np.float64) - union[:, 2]) ** 2))
    own_mse = float(np.mean((x[:64] @ weights["chief-0"].astype(np.float64) - union[:64, 2]) ** 2))
    for owner in owners:
        with open(os.path.join(workdir, owner, "eval_metrics.json")) as f:
            metrics = json.load(f)
        assert metrics["global_step"] == STEPS
        assert metrics["average_loss"] == pytest.approx(union_mse, rel=1e-5), (owner, metrics, union_mse)
    assert union_mse != pytest.approx(own_mse, rel=1e-2)  # the union's loss, not one owner's
    for owner in owners:
        with open(os.path.join(workdir, owner, "graph_audit.json")) as f:
            audit = json.load(f)
        # Every op in this owner's own process; no TensorFlow server, no other task.
        assert all(d == "" or d.startswith("/job:localhost/") or d.startswith("/device:") for d in audit["devices"]), \
            audit["devices"]
        # What leaves the graph: per contribution the step, a fresh key and a masked share (the mask op's outputs);
        # per answer op only its contribution's ticket; per key op (the contribution's key, put on server0 when the
        # step starts) the step and the key drawn for it; no other numpy_function.
        assert audit["contributions"] and not audit["others"], audit
        for inputs in audit["contributions"]:
            assert inputs[1:] == ["TfeMaskShare:1", "TfeMaskShare:0"], inputs
        assert audit["answers"] == [["PyFunc:0"]] * len(audit["contributions"]), audit
        assert audit["keys"] and all(inputs[1:] == ["TfeAesSeed:0"] for inputs in audit["keys"]), audit  # the host
        # One call per step: the reported loss rides in the gradients' contribution (`riders`), one round trip.
        with open(os.path.join(workdir, owner, "training_calls.json")) as f:
            calls = json.load(f)
        assert calls["steps"] == STEPS and calls["calls"] == STEPS and calls["steps_alone"] >= STEPS - 2, calls
        assert calls["waves_alone"] == calls["steps_alone"], calls
    if not ss:  # after every other assertion passed: only the sockets were not looked at
        pytest.skip("the listening-socket check needs `ss` (Debian's iproute2; scripts/system-deps.sh)")


def test_owners_with_different_learning_rates_are_refused_before_the_first_step(tmp_path):
    workdir = str(tmp_path)
    _owner_data(workdir, _owners(1))
    status, log = _train(workdir, 1, "--learning-rate-in", "worker-0", "0.5")
    assert status != 0, report(log)
    assert "refused before the first step" in log and "0.5 on worker:0, 0.1 on chief:0" in log, report(log)
    assert "tfe_estimator: step 0, loss" not in log and "owner finished" not in log, report(log)


@pytest.mark.parametrize("workers, replicas, runs", [(1, 2, (1, 4)), (7, 1, (2,))])
def test_eight_owners_and_two_owners_with_two_local_replicas_equal_the_twin_also_when_resumed(
        workers, replicas, runs, tmp_path):
    # 2 owners x 2 local replicas (summed in plaintext inside each owner, one secure contribution per owner and
    # step): trained to step 1, then resumed from it to step 4 (a new launch: fresh servers, every owner restores
    # its checkpoint). N = 8 owners with one replica each (ten processes on this machine): two steps.
    # A 4-owner case (one replica each, 1 then 4 steps; 73 s of CI) was dropped: N = 8 checks more than two
    # owners summing to the twin (with more owners), and the resume it held is the 2 x 2 case's now (about 20 s
    # more there); no other property was its own.
    workdir = str(tmp_path)
    owners = _owners(workers)
    data = _owner_data(workdir, owners)
    for steps in runs:
        status, log = _train(workdir, workers, "--num-replicas", str(replicas), steps=steps)
        assert status == 0, report(log)
        twin = _plaintext_twin(data, steps)
        for owner in owners:
            np.testing.assert_allclose(_weights(os.path.join(workdir, owner, "model"), steps), twin, atol=1e-5)


@pytest.mark.skipif(len(tf.config.list_physical_devices("GPU")) < 2,
                    reason="needs 2 GPUs (an owner's local replicas on its GPUs); this machine has "
                           f"{len(tf.config.list_physical_devices('GPU'))}")
def test_two_owners_with_their_replicas_on_two_gpus_each_equal_the_twin(tmp_path):
    workdir = str(tmp_path)
    owners = _owners(1)
    data = _owner_data(workdir, owners)
    status, log = _train(workdir, 1, "--num-replicas", "2", steps=4)
    assert status == 0, report(log)
    for owner in owners:
        np.testing.assert_allclose(_weights(os.path.join(workdir, owner, "model"), 4), _plaintext_twin(data, 4),
                                   atol=1e-5)


def _listening_sockets(pid):
    """The TCP sockets process `pid` listens on, IPv4 and IPv6 (`ss`, from iproute2)."""
    out = subprocess.run(["ss", "-Hltnp"], capture_output=True, text=True, check=True).stdout
    return [line for line in out.splitlines() if f"pid={pid}," in line]


def _assert_listening_ports(launcher):
    """Mid-training: the owners listen on nothing; each server only on its service, data and metrics ports."""
    for task in launcher.tasks:
        sockets = _listening_sockets(task.process.pid)
        if task.job == "tfe":  # its service port, its data plane's and its metrics' (launch opens them), no other
            ports = {launcher.cluster.jobs["tfe"][task.index].rsplit(":", 1)[1],
                     str(launcher.data_ports[task.index]), str(launcher.metrics_ports[task.index])}
            assert sockets and all(any(f":{port} " in line for port in ports) for line in sockets), \
                (task.name, sockets)
            assert all(any(f":{port} " in line for line in sockets) for port in ports), (task.name, sockets)
        else:
            assert sockets == [], f"{task.name} listens: {sockets}"
