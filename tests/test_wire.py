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
from tfe_estimator.distribute.strategy import TfeStrategy
from tfe_estimator.secure import fused_sum
from tfe_estimator.secure.kernels import ops as kernel_ops
from tfe_estimator.tools.bench.traffic import cross_device_bytes

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


def test_server1_could_add_up_the_sum_if_server0_sent_its_part_unblinded(monkeypatch):
    """Mutation: server0 hands its part over in the clear; the check above must then fail."""
    def unblinded(seeds, shares, ring_bits, num_elements):
        return kernel_ops.server_sum(seeds, shares, ring_bits, num_elements), tf.zeros([4], tf.int32)

    real_reveal = kernel_ops.reveal_sum

    def reveal(share0, share1, *args, key=None, **kwargs):  # nothing to unblind: the second part is 0
        return real_reveal(share0, tf.zeros_like(share0), *args, **kwargs)

    monkeypatch.setattr(kernel_ops, "blinded_server_sum", unblinded)
    monkeypatch.setattr(kernel_ops, "reveal_sum", reveal)
    with pytest.raises(AssertionError):
        test_server1_cannot_add_up_the_sum_from_what_it_receives()
