"""The between-graph secure sum on the wire: bytes per owner, and what server1 can add up.

Two owners' graphs are built into one process (devices stand for tasks,
threads for the owners' sessions), as `distribute.step_sum` builds them on a
cluster. Bytes are counted from the graph's cross-device edges
(`tools.bench.traffic.cross_device_bytes`), per owner: its edges to and from
the two servers (the step is a feed here, on no owner's device: on a cluster
its int64 adds 8 bytes up to each server). MultiWorkerMirroredStrategy's ring all-reduce moves
``2 (N - 1) / N x 4`` bytes of float32 per parameter each way: 4 for 2 owners.
"""
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import tensorflow as tf

from tfe_estimator.distribute.aggregation import narrow_update_encoding
from tfe_estimator.distribute.step_sum import step_sum
from tfe_estimator.secure.fused_sum import Encoding
from tools.bench.traffic import cross_device_bytes
from test_wire import plant_unblinded_server0

DEVICES = [f"/job:localhost/replica:0/task:0/device:CPU:{i}" for i in range(4)]
OWNERS, SERVERS = DEVICES[:2], DEVICES[2:]
KEY_BYTES, STEP_BYTES = 16, 8
#: A ring all-reduce of float32 between 2 owners: bytes per parameter each way.
RING_ALL_REDUCE_BYTES = 2 * (2 - 1) / 2 * 4


def _two_owners(n, encoding, dtype):
    """Both owners' step_sum in one graph; returns (graph, inputs, totals, step)."""
    graph = tf.Graph()
    with graph.as_default():
        step = tf.compat.v1.placeholder(tf.int64, [])
        inputs, totals = [], []
        for owner, device in enumerate(OWNERS):
            with tf.device(device):
                inputs.append(tf.compat.v1.placeholder(dtype, [n]))
            totals.append(step_sum([inputs[-1]], "sum_0", step, owner, ["owner 0", "owner 1"], owner == 0, device, SERVERS, encoding,
                                   dtype, "hint")[0])
    return graph, inputs, totals, step


def _run(graph, fetches_per_owner, feeds, step_value):
    """Runs each owner's fetches in its own thread (the owners' sessions), as a step on a cluster."""
    config = tf.compat.v1.ConfigProto(device_count={"CPU": len(DEVICES)}, operation_timeout_in_ms=30000)
    with tf.compat.v1.Session(graph=graph, config=config) as sess, ThreadPoolExecutor(2) as pool:
        runs = [pool.submit(sess.run, fetches, {**feeds, step: step_value})
                for fetches, step in fetches_per_owner]
        return [run.result(timeout=60) for run in runs]


@pytest.mark.parametrize("ring", [64, 32])
def test_each_owner_moves_one_ring_vector_up_and_one_down_per_sum(ring):
    n = 10_000
    encoding = Encoding(64, 32, 2.0**24) if ring == 64 else narrow_update_encoding(1.0, 2)
    graph, inputs, totals, step = _two_owners(n, encoding, tf.float32)
    word_bytes = ring // 8
    for owner in OWNERS:
        up, _ = cross_device_bytes(graph, [owner], SERVERS)
        down, _ = cross_device_bytes(graph, SERVERS, [owner])
        # The masked share up (plus the 16-byte key); the blinded sum and the blind key down.
        assert up == n * word_bytes + KEY_BYTES, (owner, up)
        assert down == n * word_bytes + KEY_BYTES + 2 * STEP_BYTES, (owner, down)
    if ring == 32:  # plaintext's own figure: what a ring all-reduce moves between 2 owners
        assert n * word_bytes == n * RING_ALL_REDUCE_BYTES
    rng = np.random.RandomState(1)
    values = [rng.uniform(-0.5, 0.5, n).astype(np.float32) for _ in OWNERS]
    feeds = dict(zip(inputs, values))
    got = _run(graph, [(totals[0], step), (totals[1], step)], feeds, 3)
    for total in got:
        np.testing.assert_allclose(total, values[0] + values[1], atol=2.0 ** -(encoding.fraction_bits - 2))


def _what_server1_adds_up(n=4096):
    """Everything server1 receives for one sum, added in the ring, and the true encoded sum."""
    graph, inputs, totals, step = _two_owners(n, Encoding(64, 0, 2.0**40), tf.int64)
    server1_sum = [op for op in graph.get_operations()
                   if op.type == "TfeServerSum" and op.device == SERVERS[1]]
    assert len(server1_sum) == 1, server1_sum
    received = list(server1_sum[0].inputs)  # the owners' masked shares and server0's part
    rng = np.random.RandomState(0)
    values = [rng.randint(-2**39, 2**39, size=n, dtype=np.int64) for _ in OWNERS]
    chief, other = _run(graph, [((totals[0], received), step), (totals[1], step)], dict(zip(inputs, values)), 5)
    total, parts = chief
    np.testing.assert_array_equal(total, values[0] + values[1])
    np.testing.assert_array_equal(other, values[0] + values[1])
    held = np.zeros(n, np.uint64)
    for part in parts:
        held += np.asarray(part).reshape(-1).view(np.uint64)
    return held, (values[0] + values[1]).view(np.uint64)


def test_server1_cannot_add_up_the_sum_from_what_it_receives():
    held, total = _what_server1_adds_up()
    assert np.mean(held == total) < 0.01  # uniform words: a match is chance (2**-64 each)


def test_server1_could_add_up_the_sum_if_server0_sent_its_part_unblinded(monkeypatch):
    """Mutation: server0 hands its part over in the clear; the check above must then fail."""
    plant_unblinded_server0(monkeypatch)
    with pytest.raises(AssertionError):
        test_server1_cannot_add_up_the_sum_from_what_it_receives()
