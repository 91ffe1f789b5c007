"""Between-graph cluster mode: each data owner runs only its own graph; sums meet on the TFE servers."""
import io
import json
import os
import re
import sys
import time

import numpy as np
import pytest
import tensorflow as tf

from tfe_estimator import TfeRunConfig, TfeStrategy
from tfe_estimator.cluster.launcher import Launcher
from tfe_estimator.distribute.between_graph import BetweenGraphStrategy
from test_launch import _alive  # a zombie does not count

SCRIPT = os.path.join(os.path.dirname(__file__), "scripts", "between_graph_owner.py")
OWNERS = ("chief-0", "worker-0")
STEPS, LEARNING_RATE = 4, 0.1
CLUSTER = {"chief": ["localhost:1"], "worker": ["localhost:2"],
           "tfe": ["localhost:3", "localhost:4", "localhost:5"]}


def _as_task(monkeypatch, job, index=0):
    monkeypatch.setenv("TF_CONFIG", json.dumps({"cluster": CLUSTER, "task": {"type": job, "index": index}}))
    monkeypatch.delenv("TFE_ESTIMATOR_PROTOCOL", raising=False)
    monkeypatch.delenv("TFE_ESTIMATOR_CLUSTER_MODE", raising=False)


def test_a_cluster_defaults_to_between_graph_whose_sessions_see_only_their_task_and_the_servers(monkeypatch):
    _as_task(monkeypatch, "worker")
    config = TfeRunConfig(tf_random_seed=1, model_dir="/tmp/unused-bg")
    assert isinstance(config.train_distribute, BetweenGraphStrategy)
    assert type(config.train_distribute).__name__ == "CollectiveAllReduceStrategyV1"  # Estimator's per-owner path
    assert config.train_distribute.extended.experimental_between_graph
    assert config.train_distribute.extended.should_checkpoint  # every owner saves its own copy
    assert list(config.session_config.device_filters) == ["/job:worker/task:0", "/job:tfe"]
    assert config.train_distribute.num_replicas_in_sync == 2
    in_graph = TfeRunConfig(tf_random_seed=1, cluster_mode="in-graph", model_dir="/tmp/unused-bg")
    assert isinstance(in_graph.train_distribute, TfeStrategy)


def test_between_graph_refuses_a_missing_seed_another_protocol_and_a_bad_mode(monkeypatch):
    _as_task(monkeypatch, "chief")
    with pytest.raises(ValueError, match=r"tf_random_seed=None.*Pass the same tf_random_seed=<int> on every owner"):
        TfeRunConfig(model_dir="/tmp/unused-bg")
    with pytest.raises(ValueError, match=r"protocol='aby3' is not available in between-graph cluster mode"):
        TfeRunConfig(protocol="aby3", tf_random_seed=1)
    with pytest.raises(ValueError, match=r"cluster_mode='mixed' is not a cluster mode"):
        TfeRunConfig(cluster_mode="mixed", tf_random_seed=1)


def test_a_task_follows_the_mode_it_was_launched_for_and_refuses_another(monkeypatch):
    _as_task(monkeypatch, "worker")
    monkeypatch.setenv("TFE_ESTIMATOR_CLUSTER_MODE", "in-graph")  # what `tfe-estimator launch` sets
    assert isinstance(TfeRunConfig(tf_random_seed=1, model_dir="/tmp/unused-bg").train_distribute, TfeStrategy)
    with pytest.raises(ValueError, match=r"cluster_mode='between-graph'.*launched for 'in-graph'.*--cluster-mode"):
        TfeRunConfig(tf_random_seed=1, cluster_mode="between-graph", model_dir="/tmp/unused-bg")


def _owner_data(workdir):
    """Each owner's own rows, in its own directory."""
    rng = np.random.RandomState(0)
    data = {}
    for owner in OWNERS:
        x = rng.randn(64, 2)
        y = x @ np.array([2.0, -3.0]) + 1.0 + 0.1 * rng.randn(64)
        data[owner] = np.column_stack([x, y]).astype(np.float32)
        os.makedirs(os.path.join(workdir, owner))
        np.savetxt(os.path.join(workdir, owner, "data.csv"), data[owner], delimiter=",", fmt="%.8g")
    return data


def _plaintext_twin(data, steps):
    """Full-batch gradient descent on the mean over owners of each owner's mean squared error."""
    w = np.zeros(3)
    for _ in range(steps):
        grads = []
        for rows in data.values():
            rows = rows.astype(np.float64)
            x = np.column_stack([rows[:, :2], np.ones(len(rows))])
            grads.append(2 * x.T @ (x @ w - rows[:, 2]) / len(rows))
        w -= LEARNING_RATE * np.mean(grads, axis=0)
    return w


def _weights(model_dir, steps):
    checkpoint = tf.train.latest_checkpoint(model_dir)
    assert checkpoint and checkpoint.endswith(f"model.ckpt-{steps}"), checkpoint
    weights = tf.train.load_variable(checkpoint, "linear/linear_model/x/weights").ravel()
    return np.append(weights, tf.train.load_variable(checkpoint, "linear/linear_model/bias_weights"))


def _train(workdir, *flags, expect_status=0):
    out = io.StringIO()
    launcher = Launcher([sys.executable, SCRIPT, str(STEPS), str(LEARNING_RATE), *flags], workers=1,
                        task_cwd=os.path.join(workdir, "{job}-{index}"), out=out, cluster_mode="between-graph")
    status = launcher.run()
    log = out.getvalue()
    assert not [t.name for t in launcher.tasks if t.process.poll() is None or _alive(t.process.pid)]
    if expect_status is None:
        assert status != 0, log[-5000:]
        return log
    assert status == 0, log[-5000:]
    assert log.count(f"owner finished at step {STEPS}") == 2, log[-5000:]
    return {owner: _weights(os.path.join(workdir, owner, "model"), STEPS) for owner in OWNERS}


@pytest.mark.multiprocess
@pytest.mark.slow
def test_owners_train_in_their_own_graphs_to_the_plaintext_twin_each_with_its_own_checkpoints(tmp_path):
    workdir = str(tmp_path)
    twin = _plaintext_twin(_owner_data(workdir), STEPS)
    weights = _train(workdir)
    np.testing.assert_allclose(weights["chief-0"], weights["worker-0"], atol=1e-5)
    for owner, other in (("chief-0", "/job:worker/"), ("worker-0", "/job:chief/")):
        with open(os.path.join(workdir, owner, "partition_devices.json")) as f:
            devices = json.load(f)
        assert any("/job:tfe/" in d for d in devices) and any(owner.split("-")[0] in d for d in devices), devices
        assert not [d for d in devices if other in d], f"{owner} placed ops on another owner's task: {devices}"
    np.testing.assert_allclose(weights["chief-0"], twin, atol=1e-5)
    assert not np.allclose(twin, 0.0, atol=0.1)  # it learned from the data
    # Mutation: a reveal that doubles each sum must fail the comparison with the twin.
    mutated = os.path.join(workdir, "mutated")
    os.makedirs(mutated)
    data = _owner_data(mutated)
    assert np.allclose(_plaintext_twin(data, STEPS), twin)
    bad = _train(mutated, "--mutate-reveal-x2")
    with pytest.raises(AssertionError):
        np.testing.assert_allclose(bad["chief-0"], twin, atol=1e-5)


@pytest.mark.multiprocess
@pytest.mark.slow
def test_owners_whose_weights_diverge_stop_at_the_next_check_naming_the_owners(tmp_path):
    # The clean run (check at step 0) is the test above; here worker:0's bias moves after step 1.
    workdir = str(tmp_path)
    _owner_data(workdir)
    log = _train(workdir, "--check-every", "2", "--perturb-worker-after-step", "1", expect_status=None)
    assert "owner finished" not in log, log[-5000:]
    for owner, other in (("chief:0", "worker:0"), ("worker:0", "chief:0")):
        assert re.search(rf"(?s)Between-graph model check at step.*\[2\].*the weights of.*\[{other}\].*"
                         rf"differ from {owner}.{{1,2}}s.*weights diverged", log), log[-6000:]


@pytest.mark.multiprocess
@pytest.mark.slow
def test_owners_with_different_models_stop_at_the_first_step_naming_the_field_and_owner(tmp_path):
    workdir = str(tmp_path)
    _owner_data(workdir)
    log = _train(workdir, "--worker-extra-feature", expect_status=None)
    assert "owner finished" not in log, log[-5000:]
    assert re.search(r"(?s)Between-graph model check at step.*\[0\].*the model \(variable names, shapes, dtypes\) "
                     r"of.*\[worker:0\].*differ from chief:0.{1,2}s.*same model script", log), log[-6000:]


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.parametrize("victim,restarts", [("worker:0", 0), ("tfe:1", 0), ("worker:0", 1)])
def test_a_task_killed_mid_training_stops_the_run_in_bounded_time_naming_it(victim, restarts, tmp_path):
    # With a restart, worker:0 resumes from its step-0 checkpoint while the chief is further on: its
    # replayed step is refused naming it (resuming every owner at one step is not built yet).
    import signal
    import threading

    from test_launch import _assert_all_gone

    workdir = str(tmp_path)
    _owner_data(workdir)
    out = io.StringIO()
    launcher = Launcher([sys.executable, SCRIPT, "400", str(LEARNING_RATE), "--step-seconds", "0.05",
                         "--step-timeout", "20"], workers=1, task_cwd=os.path.join(workdir, "{job}-{index}"),
                        out=out, cluster_mode="between-graph", grace_seconds=5, max_restarts=restarts)
    status = []
    runner = threading.Thread(target=lambda: status.append(launcher.run()), daemon=True)
    runner.start()
    try:
        deadline = time.monotonic() + 120  # training has started: the first checkpoint, then a few steps
        while not os.path.exists(os.path.join(workdir, "worker-0", "model", "model.ckpt-0.index")):
            assert runner.is_alive() and time.monotonic() < deadline, out.getvalue()[-5000:]
            time.sleep(0.1)
        time.sleep(1.0)
        job, index = victim.split(":")
        os.killpg(launcher.task(job, int(index)).process.pid, signal.SIGKILL)
    finally:
        runner.join(timeout=120)
    log = out.getvalue()
    assert not runner.is_alive(), log[-5000:]
    assert f"{victim} died with status -9 (killed by SIGKILL)" in log, log[-5000:]
    if restarts:
        assert status == [1], log[-5000:]
        assert re.search(r"worker:0 already contributed to step.*restarted from an\s+older checkpoint", log), log[-5000:]
        assert "worker:0 died with status 1 while the chief was training; stopping the cluster" in log, log[-5000:]
    else:
        assert status == [-9], log[-5000:]
    assert "owner finished" not in log
    _assert_all_gone(launcher)


OWNER_NAMES = ["chief:0", "worker:0"]


def _two_owners_in_one_process(timeout_secs=30.0):
    """Two owners' graphs in one process: devices stand for tasks, threads for the owners' sessions."""
    from tfe_estimator.distribute.step_sum import step_sum
    from tfe_estimator.secure.fused_sum import Encoding

    devices = [f"/job:localhost/replica:0/task:0/device:CPU:{i}" for i in range(4)]
    step = tf.compat.v1.placeholder(tf.int64, [])
    values = [np.array([1.5, -2.0], np.float32), np.array([0.25, 4.0], np.float32)]
    totals = []
    for owner in range(2):
        with tf.device(devices[owner]):
            x = tf.constant(values[owner])
        totals.append(step_sum([x], "sum_0", step, owner, 2, owner == 0, devices[owner], devices[2:],
                               Encoding(64, 32, 2.0**24), tf.float32, OWNER_NAMES, "hint",
                               timeout_secs=timeout_secs)[0])
    config = tf.compat.v1.ConfigProto(device_count={"CPU": 4}, operation_timeout_in_ms=60000,
                                      inter_op_parallelism_threads=16)
    return step, values, totals, devices, config


def test_a_second_contribution_of_an_owner_to_one_step_is_refused_naming_the_owner():
    # The sums themselves are checked across processes (the launcher test above).
    from concurrent.futures import ThreadPoolExecutor

    with tf.Graph().as_default():
        step, values, totals, devices, config = _two_owners_in_one_process(timeout_secs=5.0)
        pending = []  # how many steps wait for contributions on each server
        for k, dtype, shape in ((0, tf.int32, totals[0].graph.get_operation_by_name(
                "between_graph_mask_share/TfeMaskShare").outputs[1].shape), (1, tf.int64, [2])):
            with tf.device(devices[2 + k]):
                barrier = tf.raw_ops.Barrier(component_types=[dtype] * 2, shapes=[shape] * 2,
                                             shared_name=f"tfe_between_graph/sum_0/server{k}")
                pending.append(tf.raw_ops.BarrierIncompleteSize(handle=barrier))
        with tf.compat.v1.Session(config=config) as sess, ThreadPoolExecutor(1) as pool:
            # worker:0 contributes twice to step 5 (a replayed step, or a second process as worker:0).
            waiting = pool.submit(sess.run, totals[1], {step: 5})
            deadline = time.monotonic() + 30
            while sess.run(pending) != [1, 1]:  # its first contribution has arrived
                assert time.monotonic() < deadline
                time.sleep(0.05)
            with pytest.raises(tf.errors.InvalidArgumentError,
                               match=r"sum_0.*: worker:0 already contributed to step.*5.*one process per owner"):
                sess.run(totals[1], {step: 5})
            with pytest.raises(tf.errors.InvalidArgumentError, match=r"worker:0 waited 5 s"):
                waiting.result(timeout=60)  # the chief never came: bounded too


def test_an_owner_whose_peer_never_contributes_stops_in_bounded_time_naming_the_peer():
    with tf.Graph().as_default():
        step, values, totals, _, config = _two_owners_in_one_process(timeout_secs=1.0)
        with tf.compat.v1.Session(config=config) as sess:
            start = time.monotonic()
            # The chief (owner 0) at step 7; worker:0 never contributes (dead).
            with pytest.raises(tf.errors.InvalidArgumentError,
                               match=r"(?s)sum_0.*: chief:0 \(the chief\) waited 1 s for every owner.{1,2}s contribution "
                                     r"to step.*7.*not contributed:.*worker:0 \(last contributed at step -1\).*"
                                     r"restart it from the same checkpoint"):
                sess.run(totals[0], {step: 7})
            assert time.monotonic() - start < 20
            # The worker at step 7 now finds the chief's contribution but nobody hands out the sum:
            # its own wait is bounded too and names no missing owner.
            start = time.monotonic()
            with pytest.raises(tf.errors.InvalidArgumentError,
                               match=r"(?s)worker:0 waited 1 s for server0.{1,2}s partial sum of step.*7.*"
                                     r"none \(every owner contributed\).*the chief did not hand out the sum"):
                sess.run(totals[1], {step: 7})
            assert time.monotonic() - start < 20


def test_step_timeout_is_validated_where_it_is_set(monkeypatch):
    _as_task(monkeypatch, "worker")
    for bad, error in ((0, ValueError), (float("inf"), ValueError), ("300", TypeError), (True, TypeError)):
        with pytest.raises(error, match=r"step_timeout_secs.*step_timeout_secs=300"):
            TfeRunConfig(tf_random_seed=1, model_dir="/tmp/unused-bg", step_timeout_secs=bad)
    config = TfeRunConfig(tf_random_seed=1, model_dir="/tmp/unused-bg", step_timeout_secs=5)
    assert config.train_distribute.extended._step_timeout_secs == 5.0
