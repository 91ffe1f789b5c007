"""Between-graph cluster mode: each data owner runs only its own graph; sums meet on the TFE servers."""
import io
import json
import os
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


def test_between_graph_sessions_see_only_their_task_and_the_servers(monkeypatch, tmp_path):
    _as_task(monkeypatch, "worker")
    config = TfeRunConfig(cluster_mode="between-graph", tf_random_seed=1, model_dir=str(tmp_path))
    assert isinstance(config.train_distribute, BetweenGraphStrategy)
    assert type(config.train_distribute).__name__ == "CollectiveAllReduceStrategyV1"  # Estimator's per-owner path
    assert config.train_distribute.extended.experimental_between_graph
    assert config.train_distribute.extended.should_checkpoint  # every owner saves its own copy
    assert list(config.session_config.device_filters) == ["/job:worker/task:0", "/job:tfe"]
    assert config.train_distribute.num_replicas_in_sync == 2
    in_graph = TfeRunConfig(tf_random_seed=1, cluster_mode="in-graph", model_dir=str(tmp_path))
    assert isinstance(in_graph.train_distribute, TfeStrategy)


def test_between_graph_derives_one_seed_on_every_owner_and_an_explicit_seed_wins(monkeypatch, tmp_path, caplog):
    seeds = {}
    for job in ("chief", "worker"):
        _as_task(monkeypatch, job)
        with caplog.at_level("INFO", logger="tfe_estimator"):
            seeds[job] = TfeRunConfig(cluster_mode="between-graph", model_dir=str(tmp_path / job)).tf_random_seed
    assert seeds["chief"] == seeds["worker"] and 0 <= seeds["chief"] < 2**31
    assert f"tf_random_seed={seeds['chief']} derived from TF_CONFIG's cluster" in caplog.text
    assert TfeRunConfig(cluster_mode="between-graph", model_dir=str(tmp_path / "worker"), tf_random_seed=5).tf_random_seed == 5
    monkeypatch.setenv("TF_CONFIG", json.dumps({"cluster": dict(CLUSTER, worker=["localhost:9"]),
                                                "task": {"type": "worker", "index": 0}}))
    assert TfeRunConfig(cluster_mode="between-graph", model_dir=str(tmp_path / "other")).tf_random_seed != seeds["worker"]  # another cluster


def test_between_graph_refuses_another_protocol_and_a_bad_mode(monkeypatch):
    _as_task(monkeypatch, "chief")
    with pytest.raises(ValueError, match=r"protocol='aby3' is not available in between-graph cluster mode"):
        TfeRunConfig(cluster_mode="between-graph", protocol="aby3", tf_random_seed=1)
    with pytest.raises(ValueError, match=r"cluster_mode='mixed' is not a cluster mode"):
        TfeRunConfig(cluster_mode="mixed", tf_random_seed=1)


def test_a_task_follows_the_mode_it_was_launched_for_and_refuses_another(monkeypatch, tmp_path):
    _as_task(monkeypatch, "worker")
    monkeypatch.setenv("TFE_ESTIMATOR_CLUSTER_MODE", "in-graph")  # what `tfe-estimator launch` sets
    assert isinstance(TfeRunConfig(tf_random_seed=1, model_dir=str(tmp_path)).train_distribute, TfeStrategy)
    with pytest.raises(ValueError, match=r"cluster_mode='between-graph'.*launched for 'in-graph'.*--cluster-mode"):
        TfeRunConfig(tf_random_seed=1, cluster_mode="between-graph", model_dir=str(tmp_path))


def _owner_data(workdir, owners=OWNERS):
    """Each owner's own rows, in its own directory."""
    rng = np.random.RandomState(0)
    data = {}
    for owner in owners:
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


def _train(workdir, *flags):
    out = io.StringIO()
    launcher = Launcher([sys.executable, SCRIPT, str(STEPS), str(LEARNING_RATE), *flags], workers=1,
                        task_cwd=os.path.join(workdir, "{job}-{index}"), out=out, cluster_mode="between-graph")
    status = launcher.run()
    log = out.getvalue()
    assert status == 0, log[-5000:]
    assert not [t.name for t in launcher.tasks if t.process.poll() is None or _alive(t.process.pid)]
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
    # Mutation: a reveal that doubles each sum must fail the comparison with the twin (or be stopped:
    # it also doubles the weight fingerprints' sums, which the owners' model check refuses).
    mutated = os.path.join(workdir, "mutated")
    os.makedirs(mutated)
    data = _owner_data(mutated)
    assert np.allclose(_plaintext_twin(data, STEPS), twin)
    with pytest.raises(AssertionError):
        bad = _train(mutated, "--mutate-reveal-x2")
        np.testing.assert_allclose(bad["chief-0"], twin, atol=1e-5)


def test_step_sum_adds_one_contribution_per_owner_and_step_and_refuses_duplicate_stale_and_out_of_step_ones():
    # Two owners' graphs in one process: devices stand for tasks, threads for the owners' sessions.
    from concurrent.futures import ThreadPoolExecutor

    from tfe_estimator.distribute.step_sum import step_sum
    from tfe_estimator.secure.fused_sum import Encoding
    from tfe_estimator.secure.kernels import ops

    devices = [f"/job:localhost/replica:0/task:0/device:CPU:{i}" for i in range(4)]
    names = ["chief:0", "worker:0"]
    with tf.Graph().as_default() as graph:
        step = tf.compat.v1.placeholder(tf.int64, [])
        values = [np.array([1.5, -2.0], np.float32), np.array([0.25, 4.0], np.float32)]
        totals = []
        for owner in range(2):
            with tf.device(devices[owner]):
                x = tf.constant(values[owner])
            totals.append(step_sum([x], "sum_0", step, owner, names, owner == 0, devices[owner], devices[2:],
                                   Encoding(64, 32, 2.0**24), tf.float32, "hint")[0])
        # Each owner's puts alone (both servers), as a restarted or duplicated owner would send them again.
        puts = [[op for op in graph.get_operations() if op.type == "TfeStepPut" and op.get_attr("owner") == owner]
                for owner in range(2)]
        assert [len(p) for p in puts] == [2, 2]
        shapes = [op.inputs[2] for op in puts[1]]
        with tf.device(devices[3]):  # a take and worker:0's rewind of server1's accumulator, outside a step
            take = ops.step_take(puts[1][1].inputs[0], step, 2, tf.int64, shapes[1].shape)
            rewind = ops.step_rewind(puts[1][1].inputs[0], step, 1)
            chief_rewind = ops.step_rewind(puts[1][1].inputs[0], step, 0)
        config = tf.compat.v1.ConfigProto(device_count={"CPU": 4}, operation_timeout_in_ms=20000)
        with tf.compat.v1.Session(config=config) as sess, ThreadPoolExecutor(2) as pool:
            for s in (3, 4):
                runs = [pool.submit(sess.run, t, {step: s}) for t in totals]
                for run in runs:
                    np.testing.assert_allclose(run.result(timeout=30), values[0] + values[1], atol=1e-6)
            # worker:0 contributes twice to step 5 (two processes as one owner): the servers refuse the second.
            sess.run(puts[1], {step: 5})
            with pytest.raises(tf.errors.AlreadyExistsError,
                               match=r"sum_0/server\d: worker:0 already contributed to step 5; a second "
                                     r"contribution is refused \(two processes run as worker:0\?"):
                sess.run(totals[1], {step: 5})
            np.testing.assert_allclose(sess.run(totals[0], {step: 5}), values[0] + values[1], atol=1e-6)
            # A stale step (at or below the last step released): refused, naming the owner and both steps.
            with pytest.raises(tf.errors.FailedPreconditionError,
                               match=r"chief:0 contributes to step 4, but this server already released step 5 "
                                     r"\(a stale step"):
                sess.run(puts[0][0], {step: 4})
            # A take cancelled by its deadline leaves no waiter behind; worker:0's contribution to another step
            # (left by a failed session) holds the step back until worker:0 rewinds to the restored step.
            sess.run(puts[0], {step: 6})
            sess.run(puts[1][1], {step: 7})
            started = time.monotonic()
            with pytest.raises(tf.errors.DeadlineExceededError):
                sess.run(take, {step: 6}, options=tf.compat.v1.RunOptions(timeout_in_ms=1000))
            assert time.monotonic() - started < 10
            with pytest.raises(tf.errors.FailedPreconditionError,
                               match=r"worker:0 contributes to step 6 while its contribution to step 7 was never "
                                     r"taken \(the owners are out of step\)\. Restart every task"):
                sess.run(puts[1][1], {step: 6})
            sess.run(rewind, {step: 6})
            sess.run(puts[1][1], {step: 6})
            taken = sess.run(take, {step: 6})
            assert [t.shape for t in taken] == [tuple(shapes[1].shape)] * 2
            # A rewind lets its owner, and only it, contribute to a released step again (every owner restored an
            # older checkpoint and rewinds in its handshake).
            sess.run(rewind, {step: 2})
            sess.run(puts[1][1], {step: 2})
            with pytest.raises(tf.errors.FailedPreconditionError, match=r"chief:0 contributes to step 2, but this "
                                                                        r"server already released step 6"):
                sess.run(puts[0][1], {step: 2})
            sess.run(chief_rewind, {step: 2})
            # While the chief waits for one step, a contribution to another is refused, naming both steps.
            waiting = pool.submit(sess.run, take, {step: 2})
            time.sleep(1.0)  # the take is waiting
            with pytest.raises(tf.errors.FailedPreconditionError,
                               match=r"chief:0 contributes to step 3 but the chief takes step 2"):
                sess.run(puts[0][1], {step: 3})
            sess.run(puts[0][1], {step: 2})
            assert len(waiting.result(timeout=30)) == 2


def test_a_step_accumulator_refuses_other_settings_an_unknown_owner_and_a_misshapen_contribution():
    from tfe_estimator.secure.kernels import ops

    with tf.Graph().as_default():
        step = tf.constant(1, tf.int64)
        handle = ops.step_accumulator(["chief:0", "worker:0"], tf.int64, [3], "tfe_between_graph/sum_0/server1")
        other = ops.step_accumulator(["chief:0", "worker:0"], tf.int64, [4], "tfe_between_graph/sum_0/server1")
        unknown_owner = ops.step_put(handle, step, tf.zeros([3], tf.int64), owner=2)
        misshapen = ops.step_put(handle, step, tf.zeros([2], tf.int64), owner=1)
        with tf.compat.v1.Session() as sess:
            sess.run(handle)
            with pytest.raises(tf.errors.InvalidArgumentError,
                               match=r"sum_0/server1: this owner's graph expects owners \[chief:0, worker:0\] and "
                                     r"int64\[4\] contributions, but the server's accumulator holds owners "
                                     r"\[chief:0, worker:0\] and int64\[3\] contributions\. Every owner must run "
                                     r"the same model"):
                sess.run(other)
            with pytest.raises(tf.errors.InvalidArgumentError,
                               match=r"owner index 2 is not one of the 2 owners \[chief:0, worker:0\]"):
                sess.run(unknown_owner)
            with pytest.raises(tf.errors.InvalidArgumentError,
                               match=r"worker:0 contributes int64\[2\] to step 1, but every contribution "
                                     r"is int64\[3\]"):
                sess.run(misshapen)


def test_a_step_waits_at_most_step_timeout_secs_and_a_bad_timeout_is_refused(monkeypatch, tmp_path):
    _as_task(monkeypatch, "chief")
    config = TfeRunConfig(cluster_mode="between-graph", tf_random_seed=1, model_dir=str(tmp_path))
    assert config.session_config.operation_timeout_in_ms == 300_000  # never forever
    assert TfeRunConfig(cluster_mode="between-graph", tf_random_seed=1, model_dir=str(tmp_path),
                        step_timeout_secs=15).session_config.operation_timeout_in_ms == 15_000
    own = tf.compat.v1.ConfigProto(operation_timeout_in_ms=1234)
    assert TfeRunConfig(cluster_mode="between-graph", tf_random_seed=1, model_dir=str(tmp_path),
                        session_config=own).session_config.operation_timeout_in_ms == 1234
    for bad in (0, -1, "60", True, float("inf")):
        with pytest.raises(ValueError, match=rf"step_timeout_secs={bad!r} must be a number of seconds > 0"):
            TfeRunConfig(cluster_mode="between-graph", tf_random_seed=1, model_dir=str(tmp_path), step_timeout_secs=bad)


def test_the_handshake_names_the_first_field_that_differs_and_the_owners():
    from tfe_estimator.distribute.weight_check_handshake import FIELDS, mismatch

    names = ["chief:0", "worker:0", "worker:1"]
    agree = np.array([[4, 11, 3, 99]] * 3, np.int64)
    assert mismatch(agree, 1, names, 10.0, arrived=True) is None
    for field in range(1, len(FIELDS)):
        rows = agree.copy()
        rows[2, field] = 7
        rows[1, 3] = 7  # the model differs too: only the first field that differs is named
        message = mismatch(rows, 0, names, 10.0, arrived=True)
        differ = "worker:1" if field < 3 else "worker:0, worker:1"
        assert f"at step [4]: the {FIELDS[field]} of [{differ}] differ" in message, message
        assert "differ from chief:0's" in message and "fix the owner named" in message
    late = agree.copy()
    late[1, 0], late[2, 0] = 2, -1  # worker:0 restored an older checkpoint; worker:1 never came
    message = mismatch(late, 0, names, 10.0, arrived=False)
    assert ("chief:0 starts at step [4] but after 10 s these owners had not started there (-1: not yet at all): "
            "worker:0 (at step 2), worker:1 (at step -1)") in message, message
    assert "same checkpoint step" in message and "step_timeout_secs" in message


def test_the_weight_fingerprint_check_passes_equal_copies_and_stops_different_ones():
    from tfe_estimator.distribute import weight_check

    weights = [np.arange(12, dtype=np.float32).reshape(3, 4) / 7, np.array([0.25], np.float32)]
    nudged = [weights[0].copy(), weights[1]]
    nudged[0][1, 2] = np.nextafter(nudged[0][1, 2], np.float32(1))  # one ulp
    with tf.Graph().as_default(), tf.compat.v1.Session() as sess:
        f = [sess.run(weight_check.fingerprint([tf.constant(w) for w in ws])) for ws in (weights, nudged)]
        assert f[0] != f[1] and 0 <= min(f) and max(f) < weight_check.FINGERPRINT_MODULUS
        step = tf.constant(3, tf.int64)
        for fs, ok in (([f[0], f[0], f[0]], True), ([f[0], f[1], f[0]], False)):
            pairs = [weight_check.fingerprint_pair(tf.constant(x, tf.int64), tf.float32) for x in fs]
            mean = tf.add_n(pairs) / 3.0  # a MEAN reveal: scale 1/3
            check = weight_check.assert_identical(mean, 3, 1.0 / 3, step, "worker:1")
            if ok:
                sess.run(check)
            else:
                with pytest.raises(tf.errors.InvalidArgumentError, match="models of the data owners differ"):
                    sess.run(check)


@pytest.mark.multiprocess
@pytest.mark.slow
def test_owners_with_different_models_stop_at_the_first_step_naming_the_field_and_owner(tmp_path):
    import re

    workdir = str(tmp_path)
    _owner_data(workdir)
    out = io.StringIO()
    launcher = Launcher([sys.executable, SCRIPT, str(STEPS), str(LEARNING_RATE), "--worker-extra-feature"],
                        workers=1, task_cwd=os.path.join(workdir, "{job}-{index}"), out=out,
                        cluster_mode="between-graph")
    status = launcher.run()
    log = out.getvalue()
    assert status != 0 and "owner finished" not in log, log[-5000:]
    assert not [t.name for t in launcher.tasks if t.process.poll() is None or _alive(t.process.pid)]
    # Both owners name the other and the field, instead of a shape error of a server accumulator.
    for owner, other in (("chief:0", "worker:0"), ("worker:0", "chief:0")):
        assert re.search(rf"(?s)Between-graph handshake at step.*\[0\].*the model \(variable names, shapes, "
                         rf"dtypes\) of.*\[{other}\].*differ from {owner}.{{1,2}}s", log), log[-6000:]
