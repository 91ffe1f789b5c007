"""SecureAggregation against its plaintext twin (ReductionToOneDevice) and its reference path.

Tolerance: encoding truncates toward zero at 2**-32 per replica, and the sum is
decoded with one rounding to the output dtype, so float32 rounding dominates:
``atol = N * 2**-32``, ``rtol = 1e-6``.
"""
import numpy as np
import pytest
import tensorflow as tf

import tfe_estimator
from tfe_estimator import SecureAggregation, TfeStrategy
from tfe_estimator.distribute import aggregation
from tfe_estimator.secure.protocols import supported_combinations

MAX_REPLICAS = 4
DEVICES = [f"/job:localhost/replica:0/task:0/device:CPU:{i}" for i in range(MAX_REPLICAS + 4)]
SERVERS = DEVICES[MAX_REPLICAS:MAX_REPLICAS + 3]
ELSEWHERE = DEVICES[-1]  # neither a replica nor a party: a destination of its own
RTOL = 1e-6
COMBINATIONS = supported_combinations()  # (protocol, precision) pairs this TensorFlow runs
SUM, MEAN = tf.distribute.ReduceOp.SUM, tf.distribute.ReduceOp.MEAN


def _atol(n):
    return n * 2.0**-32


def _session_config():
    return tf.compat.v1.ConfigProto(allow_soft_placement=False, device_count={"CPU": len(DEVICES)})


def _secure(n=2, protocol="pond", precision="low", **kwargs):
    return lambda: TfeStrategy(devices=DEVICES[:n], protocol=protocol, precision=precision,
                               server_devices=SERVERS, **kwargs)


def _plain(n=2):
    return lambda: tf.compat.v1.distribute.MirroredStrategy(
        devices=DEVICES[:n], cross_device_ops=tf.distribute.ReductionToOneDevice())


def _reduce(make_strategy, per_replica_arrays, reduce_op, to=None, sparse=False):
    """Reduces `per_replica_arrays[k][r]` (tensor k of replica r); returns results and graph.

    `to` None reduces to the replicas (an all-reduce); a device string reduces there.
    """
    graph = tf.Graph()
    with graph.as_default():
        strategy = make_strategy()
        with strategy.scope():

            def replica_fn():
                rid = tf.distribute.get_replica_context().replica_id_in_sync_group
                out = []
                for arrays in per_replica_arrays:
                    value = tf.gather(tf.constant(np.stack(arrays)), rid)
                    if sparse:
                        value = tf.IndexedSlices(value, tf.constant([0, 2], tf.int64),
                                                 tf.constant([4, value.shape[1]], tf.int64))
                    out.append(value)
                return out

            values = strategy.extended.call_for_each_replica(replica_fn)
            pairs = [(v, to or v) for v in values]
            if isinstance(strategy, TfeStrategy):
                reduced = strategy.extended.batch_reduce_to(reduce_op, pairs)
            else:  # the twin itself: MirroredStrategy on TF 2.15 refuses int32 in a batch
                reduced = tf.distribute.ReductionToOneDevice().batch_reduce(reduce_op, pairs)
            fetches = [strategy.experimental_local_results(r) for r in reduced]
            fetches = [[tf.convert_to_tensor(x) for x in f] for f in fetches]
        with tf.compat.v1.Session(graph=graph, config=_session_config()) as sess:
            results = sess.run(fetches)
    return results, graph


def _random_values(rng, shape, dtype, n=2):
    if np.issubdtype(dtype, np.integer):
        return [rng.randint(-1000, 1000, size=shape).astype(dtype) for _ in range(n)]
    return [np.asarray(rng.randn(*shape) * 10).astype(dtype) for _ in range(n)]


def _assert_close(secure, plain, n):
    for s_per_replica, p_per_replica in zip(secure, plain):
        assert len(s_per_replica) == len(p_per_replica)
        for s, p in zip(s_per_replica, p_per_replica):
            assert np.asarray(s).dtype == np.asarray(p).dtype
            # The twin rounds each float32 partial sum (|x| < 64 here: half an
            # ulp is 4e-6 per addition); the secure sum is exact, then rounded once.
            atol = _atol(n) + (n - 1) * 4e-6 * (np.asarray(s).dtype == np.float32)
            np.testing.assert_allclose(s, p, rtol=RTOL, atol=atol)


@pytest.mark.parametrize("protocol, precision", COMBINATIONS)
@pytest.mark.parametrize("reduce_op", [SUM, MEAN])
@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.int32, np.int64])
def test_matches_reduction_to_one_device(reduce_op, dtype, protocol, precision):
    # Prepare: several shapes of one dtype, reduced as one batch.
    rng = np.random.RandomState(1)
    tensors = [_random_values(rng, shape, dtype) for shape in [(), (3,), (2, 3), (4, 1, 2)]]
    # Execute
    secure, _ = _reduce(_secure(2, protocol, precision), tensors, reduce_op)
    plain, _ = _reduce(_plain(2), tensors, reduce_op)
    # Assert: every replica receives the same sum as the plaintext twin, with its dtype.
    _assert_close(secure, plain, 2)


@pytest.mark.parametrize("n", [3, 4])
@pytest.mark.parametrize("reduce_op", [SUM, MEAN])
def test_more_replicas_and_a_destination_that_is_not_a_replica(n, reduce_op):
    rng = np.random.RandomState(n)
    tensors = [_random_values(rng, (5, 2), np.float32, n), _random_values(rng, (3,), np.float64, n)]
    secure, _ = _reduce(_secure(n), tensors, reduce_op, to=ELSEWHERE)
    plain, _ = _reduce(_plain(n), tensors, reduce_op, to=ELSEWHERE)
    _assert_close(secure, plain, n)
    assert len(secure[0]) == 1  # one destination, one result


@pytest.mark.parametrize("n", [2, 3, 4])
@pytest.mark.parametrize("reduce_op", [SUM, MEAN])
@pytest.mark.parametrize("dtype", [np.float64, np.int64])
def test_fused_kernels_reveal_exactly_what_tf_encrypted_reveals(n, reduce_op, dtype):
    # The masks cancel: both implementations reveal the same ring sum, and
    # decode it with the same single float64 rounding, so results are equal.
    rng = np.random.RandomState(10 + n)
    tensors = [_random_values(rng, (7, 3), dtype, n)]
    fused, fused_graph = _reduce(_secure(n), tensors, reduce_op)
    reference, reference_graph = _reduce(_secure(n, implementation="tf-encrypted"), tensors, reduce_op)
    for f, r in zip(fused[0], reference[0]):
        np.testing.assert_array_equal(f, r)
    assert any(op.type == "TfeMaskShare" for op in fused_graph.get_operations())
    assert not any(op.type == "TfeMaskShare" for op in reference_graph.get_operations())


def test_mixed_batch_of_many_tensors_keeps_order():
    rng = np.random.RandomState(2)
    tensors = [_random_values(rng, (k % 5 + 1, 3), np.float32 if k % 3 else np.int64) for k in range(40)]
    secure, _ = _reduce(_secure(), tensors, SUM)
    plain, _ = _reduce(_plain(), tensors, SUM)
    _assert_close(secure, plain, 2)


def test_indexed_slices_are_summed_dense():
    rng = np.random.RandomState(3)
    tensors = [_random_values(rng, (2, 3), np.float32)]
    secure, _ = _reduce(_secure(), tensors, SUM, sparse=True)
    expected = np.zeros((4, 3), np.float32)
    expected[[0, 2]] = tensors[0][0] + tensors[0][1]
    for s in secure[0]:
        assert np.asarray(s).shape == (4, 3)
        np.testing.assert_allclose(s, expected, rtol=RTOL, atol=_atol(2))


@pytest.mark.parametrize("protocol, precision", COMBINATIONS)
def test_resolution_and_range_hold_at_both_ends(protocol, precision):
    # Pond's default fixed point (resolution ~1.5e-4) would zero out the tiny ones.
    big = 0.99 * tfe_estimator.PRECISIONS[precision].max_magnitude
    values = [[np.array([3e-7, big, -big], np.float64), np.array([4e-7, big, -big], np.float64)]]
    secure, _ = _reduce(_secure(2, protocol, precision), values, SUM)
    np.testing.assert_allclose(secure[0][0], [7e-7, 2 * big, -2 * big], rtol=1e-9, atol=_atol(2))


@pytest.mark.parametrize("precision, limit", [("low", 2**62), ("high", 2**63)])
def test_integers_are_exact_across_the_documented_range(precision, limit):
    # Beyond 2**53, where a float64 detour would lose the low bits.
    a = np.array([limit // 2 - 1, -(limit // 2 - 1), 2**53 + 1], np.int64)
    b = np.array([limit // 2 - 2, -(limit // 2 - 3), 2**53 + 2], np.int64)
    secure, _ = _reduce(_secure(2, "pond", precision), [[a, b]], SUM)
    assert secure[0][0].tolist() == [int(x) + int(y) for x, y in zip(a, b)]


def test_integers_beyond_the_ring_are_refused_not_wrapped():
    a = np.array([2**62], np.int64)
    with pytest.raises(tf.errors.InvalidArgumentError, match="replica 0.*fixed-point limit"):
        _reduce(_secure(2, "pond", "low"), [[a, a]], SUM)


@pytest.mark.parametrize("implementation", ["auto", "tf-encrypted"])
def test_an_int32_sum_that_does_not_fit_is_an_error_not_wrapped(implementation):
    top = np.array([2**31 - 1], np.int32)
    with pytest.raises(tf.errors.InvalidArgumentError, match="a sum of int32 values does not fit int32"):
        _reduce(_secure(2, implementation=implementation), [[top, top]], SUM)
    low = np.array([-2**31], np.int32)
    with pytest.raises(tf.errors.InvalidArgumentError, match="does not fit int32"):
        _reduce(_secure(2, implementation=implementation), [[low, np.array([-1], np.int32)]], SUM)


def test_an_int32_sum_that_fits_is_exact():
    a, b = np.array([2**30, -2**30, 7], np.int32), np.array([2**30 - 1, -2**30, -7], np.int32)
    secure, _ = _reduce(_secure(2), [[a, b]], SUM)
    assert secure[0][0].dtype == np.int32
    assert secure[0][0].tolist() == [2**31 - 1, -2**31, 0]


def test_the_int32_check_catches_a_wrap(monkeypatch):
    """Mutation: the cast without the check wraps 2 * (2**31 - 1) to -2, and the test above must see it."""
    monkeypatch.setattr(aggregation, "_finish", lambda part, dtype, *args: tf.cast(part, dtype))
    with pytest.raises(pytest.fail.Exception):
        test_an_int32_sum_that_does_not_fit_is_an_error_not_wrapped("auto")


def test_unsigned_integers_are_refused():
    values = [[np.array([1], np.uint32), np.array([2], np.uint32)]]
    with pytest.raises(NotImplementedError, match="unsigned integers.*uint32.*int64"):
        _reduce(_secure(), values, SUM)


def test_reported_values_of_any_float32_training_magnitude_are_summed():
    # An unscaled regression loss (house prices: MSE ~1e11) is far beyond the
    # gradient range of precision="low", but reads go through a wider ring.
    values = [[np.array(2.5e11, np.float32), np.array(1.5e11, np.float32)]]
    secure, _ = _reduce(_secure(), values, SUM, to=DEVICES[0])
    assert secure[0][0] == pytest.approx(4e11, rel=1e-6)


def test_a_reported_value_too_large_even_for_the_wide_ring_says_so():
    values = [[np.array(1e30, np.float32), np.array(1.0, np.float32)]]
    with pytest.raises(tf.errors.InvalidArgumentError, match="replica 0.*the loss or a metric.*scale the labels"):
        _reduce(_secure(), values, SUM, to=DEVICES[0])


@pytest.mark.parametrize("bad, message", [(np.nan, "NaN or infinite"), (np.inf, "NaN or infinite"),
                                          (3e7, "fixed-point limit 16777216")])
@pytest.mark.parametrize("implementation", ["auto", "tf-encrypted"])
def test_non_finite_or_out_of_range_values_are_refused(bad, message, implementation):
    values = [[np.array([1.0, 2.0], np.float32), np.array([1.0, bad], np.float32)]]
    with pytest.raises(tf.errors.InvalidArgumentError, match=message) as info:
        _reduce(_secure(implementation=implementation), values, SUM)
    assert "replica 1" in str(info.value)


@pytest.mark.parametrize("implementation", ["auto", "tf-encrypted"])
def test_refusal_names_the_limit_and_the_fixes_but_no_value_of_the_owner(implementation):
    # On a cluster the message travels from the owner's host to the chief:
    # it must not carry anything computed from the owner's data.
    values = [[np.array([1.0], np.float32), np.array([-2.5e7], np.float32)]]
    with pytest.raises(tf.errors.InvalidArgumentError) as info:
        _reduce(_secure(implementation=implementation), values, SUM)
    text = info.value.message
    assert "16777216" in text and "learning rate" in text and "clip" in text and "precision=" in text and "high" in text
    for leak in ("2.5e+07", "25000000", "2.5e7", "-25000000"):
        assert leak not in text


def test_without_the_kernels_nothing_runs(monkeypatch):
    # No silent fallback to anything insecure: a missing kernel library is an error.
    from tfe_estimator.secure import kernels

    def broken():
        raise kernels.KernelBuildError("no compiler")

    monkeypatch.setattr(kernels, "load", broken)
    values = [[np.array([1.0], np.float32), np.array([2.0], np.float32)]]
    with pytest.raises(kernels.KernelBuildError, match="no compiler"):
        _reduce(_secure(), values, SUM)


def test_gather_is_refused():
    graph = tf.Graph()
    with graph.as_default():
        strategy = _secure()()
        with strategy.scope():
            v = strategy.extended.call_for_each_replica(lambda: tf.constant([1.0]))
            with pytest.raises(NotImplementedError, match="only sums"):
                strategy.extended._gather_to(v, destinations=DEVICES[0], axis=0)  # pylint: disable=protected-access


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(protocol="spdz"), "Unknown protocol 'spdz'"),
        (dict(precision="medium"), "Unknown precision 'medium'"),
        (dict(implementation="fast"), "implementation must be one of"),
        (dict(server_devices=None), "needs 3 server devices, got None"),
        (dict(server_devices=["/cpu:1", "/cpu:2"]), "needs 3 server devices, got 2"),
        (dict(server_devices=["/cpu:2", "/cpu:2", "/cpu:3"]), "must be distinct"),
        (dict(server_devices=["/job:tfe/task:0/device:CPU:0", "/job:tfe/task:0/device:CPU:1",
                              "/job:tfe/task:1"]), "distinct tasks"),
    ],
)
def test_bad_arguments_are_refused(kwargs, match):
    kwargs = {"server_devices": SERVERS, **kwargs}
    with pytest.raises(ValueError, match=match):
        SecureAggregation(**kwargs)


@pytest.mark.parametrize("servers, replicas", [
    ([DEVICES[0], SERVERS[1], SERVERS[2]], DEVICES[:2]),  # a party on a replica's device
    (["/job:worker/task:0/device:CPU:1", "/job:tfe/task:1", "/job:tfe/task:2"],  # on an owner's task
     ["/job:chief/task:0/device:CPU:0", "/job:worker/task:0/device:CPU:0"]),
])
def test_parties_on_a_replicas_device_or_task_are_refused(servers, replicas):
    with pytest.raises(ValueError, match="same task as\\) the replica or destination"):
        with tf.Graph().as_default():
            TfeStrategy(devices=replicas, server_devices=servers)


def test_a_destination_on_a_party_is_refused():
    values = [[np.array([1.0], np.float32), np.array([2.0], np.float32)]]
    with pytest.raises(ValueError, match="replica or destination device .*CPU:%d" % (MAX_REPLICAS + 1)):
        _reduce(_secure(), values, SUM, to=SERVERS[1])


def test_clip_norm_bounds_each_replicas_update_instead_of_refusing():
    # An all-reduce (what optimizers do with gradients) is clipped per replica.
    values = [[np.array([3e7, 4e7], np.float32), np.array([0.3, 0.4], np.float32)]]
    secure, _ = _reduce(_secure(clip_norm=1.0), values, SUM)
    # Replica 0 is clipped to norm 1, replica 1 (norm 0.5) is left alone.
    np.testing.assert_allclose(secure[0][0], [0.6 + 0.3, 0.8 + 0.4], rtol=1e-6)


def test_clip_norm_leaves_reductions_to_one_device_alone():
    # The reported loss and metric reads go to one device and are not clipped.
    values = [[np.array(5.0, np.float32), np.array(5.0, np.float32)]]
    secure, _ = _reduce(_secure(clip_norm=1.0), values, SUM, to=DEVICES[0])
    assert secure[0][0] == 10.0


@pytest.mark.parametrize("clip_norm, error", [(0, ValueError), (-1.0, ValueError), (float("nan"), ValueError),
                                               ("1", TypeError), (True, TypeError)])
def test_bad_clip_norm_is_refused(clip_norm, error):
    with pytest.raises(error, match="clip_norm must be"):
        SecureAggregation(server_devices=SERVERS, clip_norm=clip_norm)


@pytest.mark.parametrize("implementation", ["auto", "tf-encrypted"])
def test_integers_just_below_the_limit_are_accepted(implementation):
    # 2**62 - 1 is valid on "low" with 2 replicas; in float64 it rounds up to the limit.
    a = np.array([2**62 - 1, -(2**62 - 1)], np.int64)
    b = np.array([0, 0], np.int64)
    secure, _ = _reduce(_secure(implementation=implementation), [[a, b]], SUM)
    assert secure[0][0].tolist() == [2**62 - 1, -(2**62 - 1)]


def _only_first_replica_update(strategy):
    graph = tf.Graph()
    with graph.as_default(), strategy.scope():
        counter = tf.Variable(0.0, aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA)
        # Each replica adds a value of its own (here its id; in a model, something computed from its data).
        strategy.extended.call_for_each_replica(lambda: counter.assign_add(
            tf.cast(tf.distribute.get_replica_context().replica_id_in_sync_group, tf.float32)))


def test_an_only_first_replica_update_is_refused_with_the_fix():
    with pytest.raises(NotImplementedError, match="ONLY_FIRST_REPLICA.*in plaintext.*aggregation=SUM or MEAN"):
        _only_first_replica_update(_secure(2)())


def test_the_broadcast_refusal_is_what_stops_the_plaintext_copy(monkeypatch):
    """Mutation: the inherited broadcast (a plaintext copy from replica 0) goes through."""
    monkeypatch.setattr(SecureAggregation, "broadcast_implementation",
                        tf.distribute.ReductionToOneDevice.broadcast_implementation)
    _only_first_replica_update(_secure(2)())  # no error: replica 0's value is copied in the clear


@pytest.mark.parametrize("update, refused", [
    (lambda counter, other: counter + 1.0, False),  # Keras 3's optimizer step: iterations.assign(iterations + 1)
    (lambda counter, other: counter + other, True),  # another variable: not the destination's own copies
    (lambda counter, other: counter + tf.random.uniform([]), True),  # a random draw of replica 0's
], ids=["own-copy-plus-constant", "another-variable", "random"])
def test_only_a_value_every_replica_already_has_is_broadcast_from_replica_0(update, refused):
    # Prepare
    strategy = _secure(2)()
    graph = tf.Graph()
    with graph.as_default(), strategy.scope():
        counter = tf.Variable(0.0, aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA)
        other = tf.Variable(5.0, aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA)

        def step():
            return counter.assign(update(counter.read_value(), other.read_value()))

        if refused:
            # Execute / Assert
            with pytest.raises(NotImplementedError, match="ONLY_FIRST_REPLICA.*in plaintext"):
                strategy.extended.call_for_each_replica(step)
            return
        # Execute
        assigned = strategy.experimental_local_results(strategy.extended.call_for_each_replica(step))
        init = tf.compat.v1.global_variables_initializer()
    with tf.compat.v1.Session(graph=graph, config=_session_config()) as session:
        session.run(init)
        session.run(assigned)
        # Assert: both replicas' copies moved alike
        assert list(session.run(strategy.experimental_local_results(counter))) == [1.0, 1.0]


def test_a_value_from_cross_replica_context_is_still_broadcast():
    strategy = _secure(2)()
    graph = tf.Graph()
    with graph.as_default(), strategy.scope():
        on_replicas = strategy.extended.call_for_each_replica(lambda: tf.zeros([2]))
        mirrored = strategy.extended.broadcast_to(tf.constant([3.0, 6.0]), destinations=on_replicas)
        values = strategy.experimental_local_results(mirrored)
    with tf.compat.v1.Session(graph=graph, config=_session_config()) as session:
        assert [v.tolist() for v in session.run(values)] == [[3.0, 6.0], [3.0, 6.0]]
