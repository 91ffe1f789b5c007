"""What a server sees is independent of the secret: its shares are uniform on the ring.

For two very different secrets (all zeros, and large values near the
fixed-point limit) we collect the ring elements one server receives when a
replica shares them, exactly as `secure_sum.share_and_sum` does (the
protocol's `define_private_input` on the replica's device), and test both the
high and the low bits of those 64-bit words against the uniform distribution
with a chi-square test at a fixed significance level. An unmasked encoding
would fail at once: zeros have no set bits, and encoded values have zero low
bits and sign-extended high bits.
"""
import numpy as np
import pytest
import tensorflow as tf
from scipy import stats

from tfe_estimator.precision import get_precision
from tfe_estimator.protocols import load_backend

REPLICA = "/job:localhost/replica:0/task:0/device:CPU:0"
SERVERS = [f"/job:localhost/replica:0/task:0/device:CPU:{i}" for i in (1, 2, 3)]
SIZE = 1 << 15
BINS = 64
ALPHA = 1e-6  # fixed significance: a false alarm in 1e6 runs per check


def _server_views(protocol, secret):
    """The int64 share tensors held by server0, for one replica sharing `secret`."""
    backend = load_backend()
    players = backend.DevicePlayers(SERVERS)
    graph = tf.Graph()
    with graph.as_default(), backend.players_scope(players):
        prot = backend.make_protocol(protocol, get_precision("low"), players.servers)
        with tf.device(REPLICA):
            value = tf.constant(secret)
        shared = prot.define_private_input(players.device_player(REPLICA), lambda: value)
        if protocol == "pond":
            views = [shared.share0.value]  # server0 holds share0
        else:
            views = [s.value for s in shared.shares[0]]  # server0 holds two of the three shares
        for view in views:
            assert view.device == SERVERS[0] and view.dtype == tf.int64
    config = tf.compat.v1.ConfigProto(device_count={"CPU": 4}, allow_soft_placement=False)
    with tf.compat.v1.Session(graph=graph, config=config) as sess:
        return sess.run(views)


def _p_values(words):
    words = words.astype(np.uint64)
    high = (words >> np.uint64(58)).astype(np.int64)
    low = (words & np.uint64(BINS - 1)).astype(np.int64)
    return [stats.chisquare(np.bincount(bits, minlength=BINS)).pvalue for bits in (high, low)]


@pytest.mark.parametrize("protocol", ["pond", "aby3"])
@pytest.mark.parametrize("secret", ["zeros", "large"])
def test_one_servers_shares_are_uniform_whatever_the_secret(protocol, secret):
    bound = get_precision("low").max_magnitude
    values = np.zeros(SIZE) if secret == "zeros" else np.linspace(-0.99, 0.99, SIZE) * bound
    for view in _server_views(protocol, values):
        assert view.shape == (SIZE,)
        p_high, p_low = _p_values(view)
        assert p_high > ALPHA and p_low > ALPHA, (p_high, p_low)


def test_the_test_detects_an_unmasked_encoding():
    # The same statistic on the plain fixed-point encoding must fail.
    encoded = np.round(np.linspace(-0.99, 0.99, SIZE) * 2**24 * 2**32).astype(np.int64)
    assert min(_p_values(encoded)) < ALPHA
    assert min(_p_values(np.zeros(SIZE, np.int64))) < ALPHA
