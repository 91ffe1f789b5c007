"""The secure sum on the wire: the bytes it moves and what the one-download reveal hides.

Bytes are counted from the built graph's cross-device edges
(`tools.bench.traffic.cross_device_bytes`: one `_Send`/`_Recv` pair per tensor
and destination device), not assumed. The blinding check recomputes, from
everything server1 receives in a real run, the most it can add up: its shares
plus the keystreams of the seeds it holds (AES-CTR from the `cryptography`
library, independent of our kernels), which must not be the sum.
"""
import numpy as np
import pytest
import tensorflow as tf
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

from tfe_estimator.audit.server_view import capture_party_views
from tfe_estimator.distribute.aggregation import narrow_update_encoding
from tfe_estimator.distribute.strategy import TfeStrategy
from tfe_estimator.secure import fused_sum
from tfe_estimator.secure.kernels import ops as kernel_ops
from tools.bench.traffic import cross_device_bytes

DEVICES = [f"/job:localhost/replica:0/task:0/device:CPU:{i}" for i in range(5)]
REPLICAS, SERVERS = DEVICES[:2], DEVICES[2:5]
SEED_BYTES = 16


def _session_config():
    return tf.compat.v1.ConfigProto(device_count={"CPU": len(DEVICES)}, allow_soft_placement=False)


def _sum_graph(make_strategy, params):
    """One SUM of a float32 vector of `params` per replica to every replica, used by an update."""
    graph = tf.Graph()
    with graph.as_default():
        strategy = make_strategy()
        with strategy.scope():
            values = strategy.extended.call_for_each_replica(lambda: tf.random.uniform([params]))
            reduced = strategy.extended.batch_reduce_to(tf.distribute.ReduceOp.SUM, [(values, values)])[0]
        for tensor in strategy.experimental_local_results(reduced):  # outside the scope: local variables
            with tf.device(tensor.device):
                tf.compat.v1.Variable(tf.zeros([params]), use_resource=True).assign_add(tensor)
    return graph


@pytest.mark.parametrize("params", [65_536])
def test_one_secure_sum_moves_8_bytes_up_and_8_down_per_parameter_per_replica(params):
    # Execute
    secure = _sum_graph(lambda: TfeStrategy(devices=REPLICAS, server_devices=SERVERS), params)
    plain = _sum_graph(lambda: tf.compat.v1.distribute.MirroredStrategy(
        devices=REPLICAS, cross_device_ops=tf.distribute.ReductionToOneDevice()), params)
    up, _ = cross_device_bytes(secure, REPLICAS, SERVERS)
    down, _ = cross_device_bytes(secure, SERVERS, REPLICAS)
    plain_bytes, _ = cross_device_bytes(plain, REPLICAS, REPLICAS)
    # Assert: per replica, one 64-bit ring element per parameter and one 16-byte seed each way
    # (before: 8 up and 16 down); plaintext moves 4 bytes per parameter each way (8 in all, 4 per replica).
    replicas = len(REPLICAS)
    assert up == replicas * (8 * params + SEED_BYTES)
    assert down == replicas * (8 * params + SEED_BYTES)
    assert plain_bytes == replicas * 4 * params


def _keystream_words(seed, n):
    key = np.asarray(seed, np.int32).reshape(4).tobytes()
    stream = Cipher(algorithms.AES(key), modes.CTR(bytes(16))).encryptor().update(bytes(8 * n))
    return np.frombuffer(stream, np.uint64)


def _what_server1_can_add_up(n=4096, steps=2):
    """Per step: server1's received ring vectors plus its seeds' keystreams, and the true encoded sum."""
    rng = np.random.RandomState(0)
    graph = tf.Graph()
    with graph.as_default():
        inputs = []
        for device in REPLICAS:
            with tf.device(device):
                inputs.append(tf.compat.v1.placeholder(tf.int64, [n]))
        totals = fused_sum.pond_sum([[x] for x in inputs], REPLICAS, SERVERS, REPLICAS,
                                    fused_sum.Encoding(64, 0, 2.0**40), tf.int64,
                                    owners=["replica 0", "replica 1"], hint="-")
    values = [rng.randint(-2**39, 2**39, size=n, dtype=np.int64) for _ in REPLICAS]
    out = []
    with tf.compat.v1.Session(graph=graph, config=_session_config()) as session:
        for _ in range(steps):
            results, views, _ = capture_party_views(session, totals, SERVERS[:2],
                                                    feed_dict=dict(zip(inputs, values)))
            np.testing.assert_array_equal(results[0][0], values[0] + values[1])
            held = np.zeros(n, np.uint64)
            for edge, value in views:
                if edge.party != SERVERS[1] or not edge.carries_value:
                    continue
                value = np.asarray(value)
                if edge.dtype == tf.int32 and value.size == 4:
                    held += _keystream_words(value, n)
                else:
                    held += value.reshape(-1).view(np.uint64)
            out.append((held, (values[0] + values[1]).view(np.uint64)))
    return out


def test_server1_cannot_add_up_the_sum_from_what_it_receives():
    for held, total in _what_server1_can_add_up():
        assert np.mean(held == total) < 0.01  # uniform words: a match is chance (2**-64 each)


def plant_unblinded_server0(monkeypatch):
    """Mutation: server0 hands its part over in the clear (and the reveal has nothing to unblind)."""
    def unblinded(seeds, shares, ring_bits, num_elements):
        return kernel_ops.server_sum(seeds, shares, ring_bits, num_elements), tf.zeros([4], tf.int32)

    real_reveal = kernel_ops.reveal_sum

    def reveal(share0, share1, *args, key=None, **kwargs):  # the second part is 0
        return real_reveal(share0, tf.zeros_like(share0), *args, **kwargs)

    monkeypatch.setattr(kernel_ops, "blinded_server_sum", unblinded)
    monkeypatch.setattr(kernel_ops, "reveal_sum", reveal)


def test_server1_could_add_up_the_sum_if_server0_sent_its_part_unblinded(monkeypatch):
    """Mutation: server0 hands its part over in the clear; the check above must then fail."""
    plant_unblinded_server0(monkeypatch)
    with pytest.raises(AssertionError):
        test_server1_cannot_add_up_the_sum_from_what_it_receives()


# ------------------------------------------------------------------ the 32-bit update ring

CLIP = 1.0


@pytest.mark.parametrize("params", [65_536])
def test_clipped_updates_on_the_32_bit_ring_move_4_bytes_up_and_4_down(params):
    # Execute
    narrow = _sum_graph(lambda: TfeStrategy(devices=REPLICAS, server_devices=SERVERS, clip_norm=CLIP,
                                            update_ring_bits=32), params)
    up, _ = cross_device_bytes(narrow, REPLICAS, SERVERS)
    down, _ = cross_device_bytes(narrow, SERVERS, REPLICAS)
    # Assert: 8 bytes per parameter and replica in all, plaintext's own figure (4 each way per 2 replicas)
    assert up == len(REPLICAS) * (4 * params + SEED_BYTES)
    assert down == len(REPLICAS) * (4 * params + SEED_BYTES)


def _narrow_sum(values_per_replica, clip=CLIP):
    """Runs one SUM update of float32 vectors (one per replica) on the 32-bit ring; returns replica 0's result."""
    n = values_per_replica[0].size
    graph = tf.Graph()
    with graph.as_default():
        strategy = TfeStrategy(devices=REPLICAS, server_devices=SERVERS, clip_norm=clip, update_ring_bits=32)
        placeholders = []
        for device in REPLICAS:
            with tf.device(device):
                placeholders.append(tf.compat.v1.placeholder(tf.float32, [n]))
        with strategy.scope():
            values = strategy.extended.call_for_each_replica(
                lambda: tf.identity(placeholders[tf.get_static_value(
                    tf.distribute.get_replica_context().replica_id_in_sync_group)]))
            reduced = strategy.extended.batch_reduce_to(tf.distribute.ReduceOp.SUM, [(values, values)])[0]
            result = strategy.experimental_local_results(reduced)[0]
    with tf.compat.v1.Session(graph=graph, config=_session_config()) as session:
        return session.run(result, dict(zip(placeholders, values_per_replica)))


def test_the_32_bit_ring_sums_clipped_updates_to_its_resolution():
    rng = np.random.RandomState(1)
    n = 4097  # odd: the padding lane
    xs = [rng.normal(size=n).astype(np.float32) for _ in REPLICAS]
    xs = [x / np.linalg.norm(x) * 0.999 * CLIP for x in xs]  # already within the clip: nothing scaled
    encoding = narrow_update_encoding(CLIP, len(REPLICAS))
    got = _narrow_sum(xs)
    # Each replica's rounding moves a value by less than one unit of 2**-F; float32 output rounding on top.
    np.testing.assert_allclose(got, xs[0] + xs[1], rtol=0, atol=len(REPLICAS) * 2.0**-encoding.fraction_bits + 1e-7)


def _rounding_bias_in_units(monkeypatch=None, grid_point=1000):
    """Mean error of a sum of values a quarter unit above `grid_point` units, in units of 2**-F (expected 0)."""
    clip = 64.0  # 22 fraction bits; the values' norm (0.05) is far below it: nothing is scaled
    unit = 2.0**-narrow_update_encoding(clip, len(REPLICAS)).fraction_bits
    n = 40_000
    x = np.full(n, (grid_point + 0.25) * unit, np.float32)  # exact in float32
    got = _narrow_sum([x, x], clip=clip)
    return float(np.mean(got.astype(np.float64) - 2 * x.astype(np.float64)) / unit)


def test_the_random_rounding_is_unbiased():
    # Each replica rounds up with probability 1/4: the sum's error has mean 0 and
    # standard deviation sqrt(2 * 3/16) = 0.61 units per element, 0.0031 over 40,000.
    assert abs(_rounding_bias_in_units()) < 5 * 0.0031


def test_the_random_rounding_of_negative_values_is_unbiased():
    # Below zero the kernel's floor is a truncation corrected by one (-999.75 units: floor -1000, up with 1/4);
    # a floor that truncated toward zero would never round up here: biased by +3/4 unit.
    assert abs(_rounding_bias_in_units(grid_point=-1000)) < 5 * 0.0031


def _masked_32(values, fraction_bits=20, bound=16.0):
    """The 32-bit ring's plain encoding of float32 `values` by the mask op (share + the key's keystream, int32)."""
    from tfe_estimator.service import ring  # pylint: disable=import-outside-toplevel

    with tf.Graph().as_default():
        share, key = kernel_ops.mask_share(tf.constant(values, tf.float32), bound, 32, fraction_bits, "owner 0", "-")
        with tf.compat.v1.Session() as session:
            share, key = session.run([share, key])
    words = share.view(np.uint64).copy()
    ring.add_into(words, ring.keystream_words(key, words.size), 32)
    return words.view(np.int32)[:len(values)]


def test_the_32_bit_ring_encodes_grid_values_exactly_in_every_lane_and_the_tail():
    # 11 values: two steps of four lanes and a tail of three; on the grid (no rounding): exactly x * 2**F, both signs
    # and the largest magnitudes below the bound.
    unit = 2.0**-20
    values = np.array([0.0, -0.0, 1.5, -1.5, 16 - unit, -(16 - unit), 3 * unit, -7 * unit, 2.25, -2.25, -16 + unit],
                      np.float32)
    np.testing.assert_array_equal(_masked_32(values), (values.astype(np.float64) * 2.0**20).astype(np.int32))


@pytest.mark.parametrize("bad", [16.0, -16.0, np.nan, np.inf], ids=["bound", "-bound", "nan", "inf"])
def test_the_32_bit_ring_refuses_a_value_it_cannot_carry_in_any_lane(bad):
    # Each of the 11 places (the four lanes of two steps, the tail) in turn: the op refuses, naming no value.
    message = "NaN or infinite" if not np.isfinite(bad) else "magnitude is not below the fixed-point limit 16"
    for place in range(11):
        values = np.full(11, 0.5, np.float32)
        values[place] = bad
        with pytest.raises(tf.errors.InvalidArgumentError, match=message):
            _masked_32(values)


@pytest.mark.slow
def test_mutation_32_bit_lanes_that_lose_their_range_check_fail_the_refusal_test(tmp_path, mutant_kernel_cache):
    # A mask op whose four-lane path drops its range checks (only the tail's remain): a value out of range in a
    # lane would be encoded as 0 and go on without an error; the refusal test above fails on it.
    from test_sum_check import run_kernel_mutant  # pylint: disable=import-outside-toplevel

    test = "test_wire:test_the_32_bit_ring_refuses_a_value_it_cannot_carry_in_any_lane:16.0"
    out = run_kernel_mutant(tmp_path, mutant_kernel_cache, 2, [test])
    assert f"{test} FAILED" in out, out


def test_the_rounding_check_catches_truncation(monkeypatch):
    """Mutation: values truncated to the grid before the op (what round-toward-zero does): biased by 1/2 unit."""
    real = kernel_ops.mask_share

    def truncating(values, bound, ring_bits, fraction_bits, *args, **kwargs):
        scale = 2.0**fraction_bits
        values = [tf.floor(v * scale) / scale for v in (values if isinstance(values, (list, tuple)) else [values])]
        return real(values, bound, ring_bits, fraction_bits, *args, **kwargs)

    monkeypatch.setattr(kernel_ops, "mask_share", truncating)
    with pytest.raises(AssertionError):
        test_the_random_rounding_is_unbiased()


def _narrow_views(steps=2, n=1 << 13):
    rng = np.random.RandomState(2)
    encoding = narrow_update_encoding(CLIP, len(REPLICAS))
    graph = tf.Graph()
    with graph.as_default():
        inputs = []
        for device in REPLICAS:
            with tf.device(device):
                inputs.append(tf.compat.v1.placeholder(tf.float32, [n]))
        totals = fused_sum.pond_sum([[x] for x in inputs], REPLICAS, SERVERS, REPLICAS, encoding, tf.float32,
                                    owners=["replica 0", "replica 1"], hint="-")
    values = [np.full(n, 0.999 * CLIP, np.float32), np.zeros(n, np.float32)]  # at the bound, and zeros
    with tf.compat.v1.Session(graph=graph, config=_session_config()) as session:
        return [capture_party_views(session, totals, SERVERS[:2], feed_dict=dict(zip(inputs, values)))[1]
                for _ in range(steps)]


def test_the_32_bit_ring_shares_are_uniform_and_fresh():
    from test_security import assert_views_hide_the_secret  # pylint: disable=import-outside-toplevel

    assert_views_hide_the_secret(_narrow_views(), "32-bit ring")


def test_an_unmasked_32_bit_share_is_caught(monkeypatch):
    """Mutation: the share is the plain encoding (two int32 lanes per int64), the seed as before."""
    from test_security import assert_views_hide_the_secret  # pylint: disable=import-outside-toplevel

    real = kernel_ops.mask_share

    def unmasked(values, bound, ring_bits, fraction_bits, *args, **kwargs):
        _, seed = real(values, bound, ring_bits, fraction_bits, *args, **kwargs)
        flat = tf.concat([tf.reshape(v, [-1]) for v in (values if isinstance(values, (list, tuple)) else [values])], 0)
        lanes = tf.reshape(tf.cast(tf.round(flat * 2.0**fraction_bits), tf.int32), [-1, 2])
        return tf.bitcast(lanes, tf.int64), seed

    monkeypatch.setattr(kernel_ops, "mask_share", unmasked)
    with pytest.raises(AssertionError, match="not uniform|same value"):
        assert_views_hide_the_secret(_narrow_views(), "32-bit ring")


def test_the_32_bit_ring_refuses_what_it_cannot_carry():
    with pytest.raises(ValueError, match="update_ring_bits=32 needs clip_norm"):
        TfeStrategy(devices=REPLICAS, server_devices=SERVERS, update_ring_bits=32)
    with pytest.raises(ValueError, match="must be 64 or 32"):
        TfeStrategy(devices=REPLICAS, server_devices=SERVERS, clip_norm=1.0, update_ring_bits=16)
    with pytest.raises(NotImplementedError, match="fused Pond kernels"):
        TfeStrategy(devices=REPLICAS, server_devices=SERVERS, clip_norm=1.0, update_ring_bits=32,
                    implementation="tf-encrypted")
    with pytest.raises(ValueError, match="clip_norm=10000000.0 and 2 replicas leaves 5 fraction bits"):
        narrow_update_encoding(1e7, 2)


@pytest.mark.slow
def test_a_linear_regressor_on_the_32_bit_ring_stays_with_the_exact_ring(tmp_path, linear_data):
    """Accuracy on a real model: 20 steps of LinearRegressor, clipped, 32- against 64-bit updates."""
    import tfe_estimator  # pylint: disable=import-outside-toplevel
    from model_fns import keras_optimizers  # pylint: disable=import-outside-toplevel

    x, y, _ = linear_data

    def train(bits):
        config = tfe_estimator.TfeRunConfig(model_dir=str(tmp_path / f"ring{bits}"), tf_random_seed=7,
                                            clip_norm=1.0, update_ring_bits=bits)
        est = tf.estimator.LinearRegressor([tf.feature_column.numeric_column("x", shape=[3])], config=config,
                                           optimizer=lambda: keras_optimizers().SGD(0.1))
        assert config.train_distribute.secure_aggregation.update_ring_bits == bits
        est.train(lambda: tf.data.Dataset.from_tensor_slices(({"x": x}, y)).repeat().batch(32), steps=20)
        return {n: est.get_variable_value(n) for n in est.get_variable_names() if "linear_model" in n}

    exact, narrow = train(64), train(32)
    # Rounding moves each update by < 2 units of 2**-28 (3.7e-9) per step; after 20 steps of lr 0.1 that is
    # far below 1e-6. The weights did move (clipped steps of norm <= 0.1 each).
    for name in exact:
        np.testing.assert_allclose(narrow[name], exact[name], rtol=0, atol=1e-6, err_msg=name)
    assert np.abs(exact["linear/linear_model/x/weights"]).max() > 0.1
