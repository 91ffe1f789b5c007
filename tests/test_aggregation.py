"""SecureAggregation against its plaintext twin, ReductionToOneDevice, on the same values."""
import numpy as np
import pytest
import tensorflow as tf

import tfe_estimator
from tfe_estimator import InsecureRandomnessError, SecureAggregation

N = 2
DEVICES = [f"/job:localhost/replica:0/task:0/device:CPU:{i}" for i in range(N + 3)]
REPLICAS, SERVERS = DEVICES[:N], DEVICES[N:]
# Stated tolerance: encoding truncates toward zero at 2**-32 per replica; the
# sum is then decoded in float64 and cast back, so float32 rounding dominates.
ATOL, RTOL = N * 2.0**-32, 1e-6


def _session_config():
    return tf.compat.v1.ConfigProto(allow_soft_placement=False, device_count={"CPU": len(DEVICES)})


def _reduce(cross_device_ops, per_replica_arrays, reduce_op, sparse=False):
    """Reduces `per_replica_arrays[k][r]` (tensor k of replica r) under a MirroredStrategy."""
    graph = tf.Graph()
    with graph.as_default():
        strategy = tf.compat.v1.distribute.MirroredStrategy(devices=REPLICAS, cross_device_ops=cross_device_ops)
        with strategy.scope():

            def replica_fn():
                rid = tf.distribute.get_replica_context().replica_id_in_sync_group
                out = []
                for arrays in per_replica_arrays:
                    value = tf.gather(tf.constant(np.stack(arrays)), rid)
                    if sparse:
                        value = tf.IndexedSlices(value, tf.constant([0, 2], tf.int64), tf.constant([4, value.shape[1]], tf.int64))
                    out.append(value)
                return out

            values = strategy.extended.call_for_each_replica(replica_fn)
            reduced = strategy.extended.batch_reduce_to(reduce_op, [(v, v) for v in values])
            fetches = [strategy.experimental_local_results(r) for r in reduced]
        with tf.compat.v1.Session(graph=graph, config=_session_config()) as sess:
            results = sess.run(fetches)
    if sparse:  # ReductionToOneDevice keeps IndexedSlices; we return dense sums
        results = [[tf.compat.v1.Session().run(tf.convert_to_tensor(v)) if hasattr(v, "indices") else v for v in r] for r in results]
    return results, graph


def _secure(protocol="pond", precision="low"):
    return SecureAggregation(protocol=protocol, precision=precision, server_devices=SERVERS)


PROTOCOL_PRECISIONS = [("pond", "low"), ("pond", "high"), ("aby3", "low"), ("aby3", "high")]


def _random_values(rng, shape, dtype):
    if np.issubdtype(dtype, np.integer):
        return [rng.randint(-1000, 1000, size=shape).astype(dtype) for _ in range(N)]
    return [np.asarray(rng.randn(*shape) * 10).astype(dtype) for _ in range(N)]


@pytest.mark.parametrize("protocol, precision", PROTOCOL_PRECISIONS)
@pytest.mark.parametrize("reduce_op", [tf.distribute.ReduceOp.SUM, tf.distribute.ReduceOp.MEAN])
@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.int32, np.int64])
def test_matches_reduction_to_one_device(reduce_op, dtype, protocol, precision):
    # Prepare: several shapes of one dtype, reduced as one batch.
    rng = np.random.RandomState(1)
    tensors = [_random_values(rng, shape, dtype) for shape in [(), (3,), (2, 3), (4, 1, 2)]]
    # Execute
    secure, _ = _reduce(_secure(protocol, precision), tensors, reduce_op)
    plain, _ = _reduce(tf.distribute.ReductionToOneDevice(), tensors, reduce_op)
    # Assert: every replica receives the same sum as the plaintext twin, with its dtype.
    for s_per_replica, p_per_replica in zip(secure, plain):
        for s, p in zip(s_per_replica, p_per_replica):
            assert np.asarray(s).dtype == np.asarray(p).dtype
            np.testing.assert_allclose(s, p, rtol=RTOL, atol=ATOL)


def test_mixed_batch_of_many_tensors_keeps_order():
    rng = np.random.RandomState(2)
    tensors = []
    for k in range(40):
        tensors.append(_random_values(rng, (k % 5 + 1, 3), np.float32 if k % 3 else np.int64))
    secure, _ = _reduce(_secure(), tensors, tf.distribute.ReduceOp.SUM)
    plain, _ = _reduce(tf.distribute.ReductionToOneDevice(), tensors, tf.distribute.ReduceOp.SUM)
    for s_per_replica, p_per_replica in zip(secure, plain):
        for s, p in zip(s_per_replica, p_per_replica):
            np.testing.assert_allclose(s, p, rtol=RTOL, atol=ATOL)


def test_indexed_slices_are_summed_dense():
    rng = np.random.RandomState(3)
    tensors = [_random_values(rng, (2, 3), np.float32)]
    secure, _ = _reduce(_secure(), tensors, tf.distribute.ReduceOp.SUM, sparse=True)
    expected = np.zeros((4, 3), np.float32)
    expected[[0, 2]] = tensors[0][0] + tensors[0][1]
    for s in secure[0]:
        assert np.asarray(s).shape == (4, 3)
        np.testing.assert_allclose(s, expected, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("protocol, precision", PROTOCOL_PRECISIONS)
def test_resolution_and_range_hold_at_both_ends(protocol, precision):
    # Pond's default fixed point (resolution ~1.5e-4) would zero out the tiny ones.
    big = 0.99 * tfe_estimator.PRECISIONS[precision].max_magnitude
    values = [[np.array([3e-7, big, -big], np.float64), np.array([4e-7, big, -big], np.float64)]]
    secure, _ = _reduce(_secure(protocol, precision), values, tf.distribute.ReduceOp.SUM)
    np.testing.assert_allclose(secure[0][0], [7e-7, 2 * big, -2 * big], rtol=1e-9, atol=ATOL)


@pytest.mark.parametrize("protocol, precision", PROTOCOL_PRECISIONS)
def test_servers_only_hold_integer_shares(protocol, precision):
    rng = np.random.RandomState(4)
    _, graph = _reduce(_secure(protocol, precision), [_random_values(rng, (3, 3), np.float32)], tf.distribute.ReduceOp.SUM)
    audited = tfe_estimator.assert_no_plaintext_on_servers(graph, SERVERS)
    assert audited > 0  # the servers do take part
    seeds = [op for op in graph.get_operations() if op.device in REPLICAS and op.type == "SecureSeed"]
    assert len({op.device for op in seeds}) == N, "each replica should draw its own shares from a secure seed"


def test_audit_catches_a_float_on_a_server():
    graph = tf.Graph()
    with graph.as_default(), tf.device(SERVERS[0]):
        tf.constant(1.0) + 2.0
    with pytest.raises(tfe_estimator.PlaintextOnServerError, match="float32"):
        tfe_estimator.assert_no_plaintext_on_servers(graph, SERVERS)


@pytest.mark.parametrize(
    "bad, message",
    [(np.nan, "NaN or infinite"), (np.inf, "NaN or infinite"), (3e7, "largest magnitude")],
)
def test_non_finite_or_out_of_range_values_are_refused(bad, message):
    values = [[np.array([1.0, 2.0], np.float32), np.array([1.0, bad], np.float32)]]
    with pytest.raises(tf.errors.InvalidArgumentError, match=message) as info:
        _reduce(_secure(), values, tf.distribute.ReduceOp.SUM)
    assert "replica 1" in str(info.value)


def test_out_of_range_message_names_the_limit_and_the_fixes():
    values = [[np.array([1.0], np.float32), np.array([-2.5e7], np.float32)]]
    with pytest.raises(tf.errors.InvalidArgumentError) as info:
        _reduce(_secure(), values, tf.distribute.ReduceOp.SUM)
    text = str(info.value)
    assert "2.5e+07" in text and "16777216" in text
    assert "learning rate" in text and "clip" in text and "precision=high" in text


def test_missing_secure_randomness_is_refused(monkeypatch):
    from tf_encrypted.operations import secure_random

    monkeypatch.setattr(secure_random, "supports_secure_randomness", lambda: False)
    values = [[np.array([1.0], np.float32), np.array([2.0], np.float32)]]
    with pytest.raises(InsecureRandomnessError, match="secure random op"):
        _reduce(_secure(), values, tf.distribute.ReduceOp.SUM)


def test_gather_is_refused():
    graph = tf.Graph()
    with graph.as_default():
        strategy = tf.compat.v1.distribute.MirroredStrategy(devices=REPLICAS, cross_device_ops=_secure())
        with strategy.scope():
            v = strategy.extended.call_for_each_replica(lambda: tf.constant([1.0]))
            with pytest.raises(NotImplementedError, match="only sums"):
                strategy.extended._gather_to(v, destinations=REPLICAS[0], axis=0)  # pylint: disable=protected-access


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(protocol="spdz"), ValueError, "Unknown protocol 'spdz'"),
        (dict(precision="medium"), ValueError, "Unknown precision 'medium'"),
        (dict(server_devices=["/cpu:1", "/cpu:2"]), ValueError, "needs 3 server devices, got 2"),
    ],
)
def test_bad_arguments_are_refused(kwargs, error, match):
    with pytest.raises(error, match=match):
        SecureAggregation(**kwargs)


def test_clip_norm_bounds_each_replicas_update_instead_of_refusing():
    # An all-reduce (what optimizers do with gradients) is clipped per replica.
    values = [[np.array([3e7, 4e7], np.float32), np.array([0.3, 0.4], np.float32)]]
    secure, _ = _reduce(SecureAggregation(server_devices=SERVERS, clip_norm=1.0), values, tf.distribute.ReduceOp.SUM)
    # Replica 0 is clipped to norm 1, replica 1 (norm 0.5) is left alone.
    np.testing.assert_allclose(secure[0][0], [0.6 + 0.3, 0.8 + 0.4], rtol=1e-6)


def test_clip_norm_leaves_reductions_to_one_device_alone():
    # The reported loss and metric reads go to one device and are not clipped.
    graph = tf.Graph()
    with graph.as_default():
        strategy = tf.compat.v1.distribute.MirroredStrategy(
            devices=REPLICAS, cross_device_ops=SecureAggregation(server_devices=SERVERS, clip_norm=1.0))
        with strategy.scope():
            loss = strategy.extended.call_for_each_replica(lambda: tf.constant(5.0))
            total = strategy.reduce(tf.distribute.ReduceOp.SUM, loss, axis=None)
        with tf.compat.v1.Session(graph=graph, config=_session_config()) as sess:
            assert sess.run(total) == 10.0


@pytest.mark.parametrize("clip_norm, error", [(0, ValueError), (-1.0, ValueError), (float("nan"), ValueError),
                                               ("1", TypeError), (True, TypeError)])
def test_bad_clip_norm_is_refused(clip_norm, error):
    with pytest.raises(error, match="clip_norm must be"):
        SecureAggregation(clip_norm=clip_norm)
