"""DistributedDP across organisations: DP-SGD through the aggregation service (service mode).

Each owner (not each of its local replicas) adds its discrete Gaussian part to its local sum
before masking, sized against t colluding owners of N = the number of owners; epsilon is
accounted with N = owners. The unit tests check the numbers on a graph built without the service;
the cluster tests (`Launcher(cluster_mode="service")`) train 2 owners with Poisson-sampled batches
and compare the accuracy with tensorflow-privacy's central DP-SGD on the union of their data. One
launch serves them all: each owner trains the tests' runs one after the other (`dp_launch`).
"""
import io
import json
import math
import os
import sys

import numpy as np
import pytest
import tensorflow as tf
from tensorflow.python.distribute import values as value_lib

import tfe_estimator
from tfe_estimator.privacy import dp as dp_lib

pytest.importorskip("tensorflow_privacy")
pytest.importorskip("dp_accounting")

SCRIPT = os.path.join(os.path.dirname(__file__), "scripts", "service_dp_owner.py")
SUM = tf.distribute.ReduceOp.SUM


def _binding(owners=2):
    from tfe_estimator.owner.service_strategy import ServiceBinding  # pylint: disable=import-outside-toplevel

    names = tuple(["chief:0"] + [f"worker:{i}" for i in range(owners - 1)])
    return ServiceBinding(addresses=("127.0.0.1:1", "127.0.0.1:2"), tls_dir="/nonexistent", owner="chief:0",
                          owners=names)


def _noise_requests(dp, owners, local_replicas, num_elements, monkeypatch, groups=(0,)):
    """(num_elements, variance) of every noise part this owner's graph draws for one DP update per group."""
    from tfe_estimator.owner.estimator import EstimatorServiceStrategy  # pylint: disable=import-outside-toplevel
    from tfe_estimator.secure.kernels import ops  # pylint: disable=import-outside-toplevel

    requests = []
    real = ops.discrete_gaussian
    monkeypatch.setattr(ops, "discrete_gaussian", lambda n, v, **k: requests.append((n, v)) or real(n, v, **k))
    with tf.Graph().as_default():
        tf.compat.v1.train.get_or_create_global_step()
        devices = [f"/job:localhost/replica:0/task:0/device:CPU:{i}" for i in range(local_replicas)]
        strategy = EstimatorServiceStrategy(_binding(owners), devices=devices, dp=dp)
        with strategy.scope():
            for group in groups:
                parts = []
                for device in devices:
                    with tf.device(device):
                        parts.append(tf.zeros([num_elements]))
                dp_lib.mark_clipped_sums(parts, dp.l2_norm_clip, group=group)
                values = value_lib.PerReplica(parts)
                strategy.extended.reduce_to(SUM, values, values)
            assert dp_lib.noise_parties(strategy) == owners
            assert strategy.num_replicas_in_sync == owners * local_replicas
    return requests


@pytest.mark.parametrize("owners, local_replicas", [(2, 1), (2, 2), (3, 4)])
def test_each_owner_adds_one_part_sized_against_colluding_owners(owners, local_replicas, monkeypatch):
    dp = tfe_estimator.DistributedDP(l2_norm_clip=1.0, noise_multiplier=1.1)
    requests = _noise_requests(dp, owners, local_replicas, 1000, monkeypatch)
    # One part per owner (its local sum), not one per local replica: F = 32 on the 64-bit ring.
    assert requests == [(1000, dp_lib.replica_noise_variance(dp, owners, 32, 1000))]
    # = ceil((1.1 * (2**32 + sqrt(1000)))**2 / (N - t)), t = 1: the in-graph formula with N = owners.
    assert requests[0][1] == pytest.approx((1.1 * (2.0**32 + math.sqrt(1000))) ** 2 / (owners - 1), rel=1e-12)
    # Not the per-replica split of N = owners * local replicas (the outsiders' total stays N / (N - t) sigma^2).
    if local_replicas > 1:
        assert requests[0][1] > dp_lib.replica_noise_variance(dp, owners * local_replicas, 32, 1000)


def test_the_headroom_counts_the_owners_local_replicas(monkeypatch):
    calls = []
    real = dp_lib.check_noise_headroom
    monkeypatch.setattr(dp_lib, "check_noise_headroom", lambda *a: calls.append(a[1:]) or real(*a))
    dp = tfe_estimator.DistributedDP(l2_norm_clip=1.0, noise_multiplier=1.0)
    _noise_requests(dp, 2, 4, 10, monkeypatch)
    # N = 2 owners, each contributing the sum of 4 replicas' values, each below the 2**24 bound.
    assert calls == [(2, 64, 32, 4 * 2.0**24, 10)]


def test_two_clipping_groups_or_one_shared_twice_in_a_step_are_refused_through_the_service(monkeypatch):
    dp = tfe_estimator.DistributedDP(l2_norm_clip=1.0, noise_multiplier=1.0)
    with pytest.raises(ValueError, match=r"2 clipping groups"):
        _noise_requests(dp, 2, 1, 10, monkeypatch, groups=(0, 1))
    with pytest.raises(ValueError, match=r"one clipping group twice.*accounting \(epsilon\) counts one release"):
        _noise_requests(dp, 2, 1, 10, monkeypatch, groups=(0, 0))


def test_epsilon_counts_owners_not_local_replicas():
    dp = tfe_estimator.DistributedDP(l2_norm_clip=1.0, noise_multiplier=1.0, num_examples=800, expected_batch_size=40)
    outsiders, colluders = dp.epsilons(40, 50, 2)  # 2 owners x 2 local replicas: N = 2
    assert colluders == tfe_estimator.dp_epsilon(1.0, 40, 800, 50, 1e-5)
    assert outsiders == tfe_estimator.dp_epsilon(math.sqrt(2), 40, 800, 50, 1e-5)
    assert dp.epsilons(40, 50, 4)[0] > outsiders  # what N = num_replicas_in_sync = 4 would wrongly report


def _gradients_under_service(dp, batch_dim):
    """make_dp_optimizer's gradients of a per-example loss with batch dimension `batch_dim`, in service mode."""
    from tfe_estimator.owner.estimator import EstimatorServiceStrategy  # pylint: disable=import-outside-toplevel

    with tf.Graph().as_default():
        tf.compat.v1.train.get_or_create_global_step()
        strategy = EstimatorServiceStrategy(_binding(2), dp=dp)
        w = tf.Variable(tf.zeros([3]))
        x = tf.compat.v1.placeholder(tf.float32, [batch_dim, 3])
        with strategy.scope():
            optimizer = dp_lib.make_dp_optimizer(tf.keras.optimizers.legacy.SGD(0.1), dp.l2_norm_clip,
                                                 dp.expected_batch_size)
            return optimizer.get_gradients(tf.reduce_sum(x * w, axis=1), [w])


def test_poisson_batches_without_expected_batch_size_are_refused_in_service_mode():
    dp = tfe_estimator.DistributedDP(l2_norm_clip=1.0, noise_multiplier=1.0)
    with pytest.raises(ValueError, match=r"service mode.*not static.*expected_batch_size=q \* num_examples"):
        _gradients_under_service(dp, None)
    assert _gradients_under_service(dp, 8)  # batches of one static size: nothing crosses but the noisy sum
    # With expected_batch_size (even q * num_examples not an integer) Poisson batches are fine ...
    assert _gradients_under_service(tfe_estimator.DistributedDP(1.0, 1.0, expected_batch_size=12.5), None)


def test_the_accounted_sampling_rate_is_exactly_the_users():
    dp = tfe_estimator.DistributedDP(l2_norm_clip=1.0, noise_multiplier=1.0, num_examples=1000,
                                     expected_batch_size=0.0137 * 1000)
    import dp_accounting  # pylint: disable=import-outside-toplevel

    event = dp_accounting.SelfComposedDpEvent(dp_accounting.PoissonSampledDpEvent(
        0.0137, dp_accounting.GaussianDpEvent(1.0)), 30)
    assert dp.epsilons(999, 30, 2)[1] == pytest.approx(
        dp_accounting.rdp.RdpAccountant().compose(event).get_epsilon(1e-5), rel=1e-12)


def test_epsilon_is_printed_on_the_terminal_beside_the_progress_line():
    dp = tfe_estimator.DistributedDP(l2_norm_clip=1.0, noise_multiplier=1.0, num_examples=800, expected_batch_size=40)
    out = io.StringIO()
    with tf.Graph().as_default():
        step = tf.compat.v1.train.get_or_create_global_step()
        hook = dp_lib.EpsilonLoggingHook(dp, tf.constant(40, tf.int64), 2, every_n_steps=2, stream=out)
        train_op = tf.compat.v1.assign_add(step, 1)
        with tf.compat.v1.train.MonitoredSession(hooks=[hook]) as session:
            for _ in range(3):
                session.run(train_op)
    lines = out.getvalue().splitlines()
    outsiders, colluders = dp.epsilons(40, 3, 2)
    assert [line.split(",")[0] for line in lines] == ["tfe_estimator: step 1", "tfe_estimator: step 3",
                                                      "tfe_estimator: step 3"], lines
    assert lines[-1] == (f"tfe_estimator: step 3, DP epsilon {colluders:.4g} at delta 1e-05 (against 1 colluding "
                         f"owner(s) of 2; {outsiders:.4g} against outsiders)")


def test_with_count_repeated_releases_epsilon_counts_every_release_on_the_terminal():
    # Steps the servers released twice (both restarted, windows lost) count twice when the user allows them.
    dp = tfe_estimator.DistributedDP(l2_norm_clip=1.0, noise_multiplier=1.0, num_examples=800, expected_batch_size=40,
                                     count_repeated_releases=True)
    out = io.StringIO()
    with tf.Graph().as_default():
        step = tf.compat.v1.train.get_or_create_global_step()
        hook = dp_lib.EpsilonLoggingHook(dp, tf.constant(40, tf.int64), 2, every_n_steps=100, stream=out,
                                         repeated_releases=lambda: 2)
        train_op = tf.compat.v1.assign_add(step, 1)
        with tf.compat.v1.train.MonitoredSession(hooks=[hook]) as session:
            for _ in range(3):
                session.run(train_op)
    outsiders, colluders = dp.epsilons(40, 3 + 2, 2)
    assert out.getvalue().splitlines()[-1] == (
        f"tfe_estimator: step 3, DP epsilon {colluders:.4g} at delta 1e-05 (against 1 colluding owner(s) of 2; "
        f"{outsiders:.4g} against outsiders; 2 step(s) released twice, counted twice)")
    with pytest.raises(TypeError, match=r"count_repeated_releases must be True or False, got 'yes'"):
        tfe_estimator.DistributedDP(l2_norm_clip=1.0, noise_multiplier=1.0, count_repeated_releases="yes")


def test_clipped_sum_marks_are_not_a_graph_collection_so_the_meta_graph_serializes_cleanly():
    with tf.Graph().as_default() as graph:
        t = tf.zeros([2])
        dp_lib.mark_clipped_sums([t], 1.0, group=("a",))
        assert dp_lib.clipped_sum_group(t) == (1.0, ("a",))
        assert not [k for k in graph.get_all_collection_keys() if "dp_clipped" in k]
        tf.compat.v1.train.export_meta_graph(graph=graph)  # TensorFlow warned "Issue encountered when serializing"


# ------------------------------------------------------------ cluster runs --

OWNER_ROWS, TEST_ROWS, DIMS = 400, 2000, 5
STEPS, LEARNING_RATE, CLIP, MULTIPLIER, Q = 60, 2.0, 1.0, 1.0, 0.05
TRUE_W = np.array([1.5, -1.0, 0.5, 1.0, -0.5])


def _rows(rng, n):
    x = rng.randn(n, DIMS)
    y = (x @ TRUE_W > 0).astype(np.float64)
    flip = rng.rand(n) < 0.05
    y[flip] = 1 - y[flip]
    return np.column_stack([x, y]).astype(np.float32)


def _write_data(workdir, owners, run):
    rng = np.random.RandomState(0)
    test = _rows(rng, TEST_ROWS)
    data = {}
    for owner in owners:
        data[owner] = _rows(rng, OWNER_ROWS)
        os.makedirs(os.path.join(workdir, owner, run))
        np.savetxt(os.path.join(workdir, owner, run, "train.csv"), data[owner], delimiter=",", fmt="%.8g")
        np.savetxt(os.path.join(workdir, owner, run, "test.csv"), test, delimiter=",", fmt="%.8g")
    return np.concatenate(list(data.values())), test


def _central_dp_sgd_accuracy(train, test, batch):
    """tensorflow-privacy's central DP-SGD (one trusted party, noise_multiplier MULTIPLIER) on the union."""
    import tensorflow_privacy  # pylint: disable=import-outside-toplevel

    tf.keras.utils.set_random_seed(0)
    model = tf.keras.Sequential([tf.keras.layers.Dense(1, kernel_initializer="zeros", input_shape=(DIMS,))])
    optimizer = tensorflow_privacy.VectorizedDPKerasSGDOptimizer(
        l2_norm_clip=CLIP, noise_multiplier=MULTIPLIER, num_microbatches=batch, learning_rate=LEARNING_RATE)
    model.compile(optimizer=optimizer, loss=tf.keras.losses.BinaryCrossentropy(
        from_logits=True, reduction=tf.keras.losses.Reduction.NONE), metrics=["accuracy"])
    x, y = train[:, :DIMS], train[:, DIMS:]
    idx = np.random.RandomState(1).randint(0, len(train), (STEPS, batch))  # STEPS steps of `batch` rows
    for rows in idx:
        model.train_on_batch(x[rows], y[rows])
    return model.evaluate(test[:, :DIMS], test[:, DIMS:], verbose=0)[1]


#: The runs of the one launch the cluster tests share, each owner training them one after the other in its
#: process (name, steps, learning rate, local replicas): DP-SGD near central DP-SGD, the same with 2 local replicas
#: per owner, and one step on all-zero features (the noise's scale).
RUNS = (("central", STEPS, LEARNING_RATE, 1), ("replicas", STEPS, LEARNING_RATE, 2), ("noise", 1, 1.0, 1))
OWNERS = ("chief-0", "worker-0")
NOISE_DIMS = 3000


@pytest.fixture(scope="module")
def dp_launch(tmp_path_factory):
    """One service-mode launch of 2 owners for every cluster test: {run: (data, results, that run's log lines)}.

    A launch per test cost ~25 s of CI each (4 processes importing TensorFlow, servers, handshakes).
    """
    from tfe_estimator.cluster.launcher import Launcher  # pylint: disable=import-outside-toplevel

    workdir = str(tmp_path_factory.mktemp("service_dp"))
    data = {run: _write_data(workdir, OWNERS, run) for run in ("central", "replicas")}
    # All-zero features, label 1: only the noise moves the kernel.
    rows = np.column_stack([np.zeros((OWNER_ROWS, NOISE_DIMS)), np.ones(OWNER_ROWS)])
    for owner in OWNERS:
        os.makedirs(os.path.join(workdir, owner, "noise"))
        for name in ("train.csv", "test.csv"):
            np.savetxt(os.path.join(workdir, owner, "noise", name), rows[:40] if name == "test.csv" else rows,
                       delimiter=",", fmt="%g")
    out = io.StringIO()
    num_examples = 2 * OWNER_ROWS
    launcher = Launcher([sys.executable, SCRIPT, str(CLIP), str(MULTIPLIER), str(Q), str(num_examples),
                         *(":".join(map(str, run)) for run in RUNS)], workers=1,
                        task_cwd=os.path.join(workdir, "{job}-{index}"), out=out, cluster_mode="service",
                        down_timeout=120)
    status = launcher.run()
    log = out.getvalue()
    assert status == 0, log[-6000:]
    runs = {}
    for name, *_ in RUNS:
        results = [json.loads(line.split(f"RESULT {name} ", 1)[1]) for line in log.splitlines()
                   if f"RESULT {name} {{" in line]
        assert len(results) == 2, log[-6000:]
        runs[name] = (data.get(name), results, _run_lines(log, name))
    return runs


def _run_lines(log, name):
    """The owners' lines of run `name`: each owner's lines after its previous run's RESULT, up to this one's."""
    lines = []
    for task in ("chief:0", "worker:0"):
        own = [line for line in log.splitlines() if line.startswith(f"[{task}] ")]
        end = next(i for i, line in enumerate(own) if f"RESULT {name} {{" in line)
        begin = max([i + 1 for i, line in enumerate(own[:end]) if "RESULT " in line], default=0)
        lines += own[begin:end + 1]
    return "\n".join(lines)


@pytest.mark.multiprocess
@pytest.mark.slow
def test_two_owners_train_dp_sgd_through_the_service_near_central_dp_sgd(dp_launch):
    (train, test), results, log = dp_launch["central"]
    num_examples, batch = len(train), round(Q * len(train))
    colluders = tfe_estimator.dp_epsilon(MULTIPLIER, batch, num_examples, STEPS, 1e-5)
    outsiders = tfe_estimator.dp_epsilon(MULTIPLIER * math.sqrt(2), batch, num_examples, STEPS, 1e-5)
    central = _central_dp_sgd_accuracy(train, test, batch)
    print(f"service DP-SGD accuracy {[r['accuracy'] for r in results]}, central DP-SGD {central:.4f}, "
          f"epsilon {colluders:.4g} (outsiders {outsiders:.4g})")
    for result in results:
        assert result["step"] == STEPS and result["finite"]
        # Epsilon with N = 2 owners: against the other owner (t = 1) and against outsiders.
        assert result["dp_epsilon"] == pytest.approx(colluders, rel=1e-12)
        assert result["dp_epsilon_outsiders"] == pytest.approx(outsiders, rel=1e-12)
        assert abs(result["accuracy"] - central) < 0.05, (result["accuracy"], central)
    # Both owners applied the same noisy sum: equal weights.
    np.testing.assert_allclose(results[0]["weights"], results[1]["weights"], atol=1e-6)
    # Logged through TensorFlow's logger by both owners.
    assert log.count(f"epsilon = {colluders:.4g} at delta = 1e-05 against 1 colluding owner(s) of 2") == 2, log[-6000:]
    assert log.count(f"epsilon = {outsiders:.4g} against outsiders") == 2


@pytest.mark.multiprocess
@pytest.mark.slow
def test_two_owners_with_two_local_replicas_each_train_dp_sgd(dp_launch):
    (train, _), results, log = dp_launch["replicas"]
    colluders = tfe_estimator.dp_epsilon(MULTIPLIER, round(Q * len(train)), len(train), STEPS, 1e-5)
    for result in results:
        assert result["step"] == STEPS and result["finite"]
        assert result["dp_epsilon"] == pytest.approx(colluders, rel=1e-12)  # N = 2 owners, not 4 replicas
        assert result["accuracy"] > 0.8
    np.testing.assert_allclose(results[0]["weights"], results[1]["weights"], atol=1e-6)
    # The end-of-training line through TensorFlow's logger, once per owner; the terminal lines beside the
    # progress line (every 100 steps and at the end) name the same N = 2 owners.
    assert log.count("against 1 colluding owner(s) of 2 (noise_multiplier") == 2, log[-6000:]
    assert log.count("against 1 colluding owner(s) of 2; ") >= 2, log[-6000:]


@pytest.mark.multiprocess
@pytest.mark.slow
def test_one_step_through_the_service_carries_each_owners_noise_at_the_stated_scale(dp_launch):
    # All-zero features: the kernel's clipped gradients are 0, so after one SGD step (learning rate 1)
    # from zero weights the kernel is the summed noise / expected_batch_size: two owners' parts of
    # sigma^2 / (N - t) = sigma^2 each (N = 2 owners, t = 1), std sqrt(2) sigma / 40.
    _, results, _ = dp_launch["noise"]
    weights = np.array(results[0]["weights"])
    assert weights.shape == (NOISE_DIMS,)
    np.testing.assert_array_equal(weights, results[1]["weights"])
    expected = math.sqrt(2) * MULTIPLIER * CLIP / round(Q * 2 * OWNER_ROWS)
    # Standard error of the sample std: expected / sqrt(2n), 1.3 % at n = 3000; tolerance 4.5 (alpha < 1e-5).
    assert abs(weights.std() - expected) < 4.5 * expected / math.sqrt(2 * NOISE_DIMS), (weights.std(), expected)
    assert abs(weights.mean()) < 4.5 * expected / math.sqrt(NOISE_DIMS)
