"""Every party's view of a real secure sum is independent of the secret.

The harness (`tfe_estimator.audit.server_view.capture_party_views`) builds a real
`SecureAggregation` graph through `TfeStrategy` and `batch_reduce_to`/`reduce_to`
(an update of float32 and int64 values to the replicas, and a read of a float32
value to a destination of its own), runs it in a session with Estimator's own
session config (soft placement, Grappler on), and captures, for each of the
three party devices, every tensor another device sends it in that run: the
``_Recv`` nodes of the party's partition in ``RunMetadata.partition_graphs``,
whose producers the same run also fetches. The secrets are fed through
placeholders on the replicas' devices, as gradients are computed at run time
(a constant secret would be folded by Grappler into a different graph).

Properties, for every supported (protocol, precision) pair and both
implementations (fused Pond kernels, tf-encrypted's reference Pond, ABY3),
for an all-zero secret and for secrets at the limit of the encoding:

- every value a party receives is a uniform ring element or a uniform seed
  (chi-square tests on the low, middle and high bits of every 64-bit word,
  and on the nibbles and per-word bit counts of the 128-bit seeds, each at
  ``ALPHA = 1e-6``);
- every received value differs on every step;
- no party receives a float (only control-edge carriers, which are empty).

Each property has a mutation test beside it: a planted unmasked share, a
zero mask in tf-encrypted's generator, or a planted float edge makes the
harness's check raise.
"""
import collections
import contextlib
import sys
import types

import numpy as np
import pytest
import tensorflow as tf
from scipy import stats

from tfe_estimator import TfeStrategy
from tfe_estimator.secure import kernels as _KERNELS
from tfe_estimator.secure import secure_sum
from tfe_estimator.secure.kernels import ops as kernel_ops
from tfe_estimator.secure.precision import READ_PRECISION, get_precision
from tfe_estimator.secure.protocols import load_backend, supported_combinations
from tfe_estimator.distribute.run_config import default_session_config
from tfe_estimator.audit.party_audit import PartyAuditError, assert_no_plaintext_on_servers, audit_party_inputs
from tfe_estimator.audit.server_view import capture_party_views

DEVICES = [f"/job:localhost/replica:0/task:0/device:CPU:{i}" for i in range(6)]
REPLICAS, SERVERS, ELSEWHERE = DEVICES[:2], DEVICES[2:5], DEVICES[5]
SIZE = 1 << 13  # elements per replica vector: 128 words per chi-square bin (64 bins)
STEPS = 3
BINS = 64
ALPHA = 1e-6  # fixed significance per check: a false alarm in a million
COMBINATIONS = supported_combinations()
SUM = tf.distribute.ReduceOp.SUM


def _fused(protocol, implementation):
    return protocol == "pond" and implementation == "auto"


def _configs():
    """(protocol, precision, implementation, tf-encrypted Pond seed placement) to test."""
    configs = []
    for protocol, precision in COMBINATIONS:
        configs.append((protocol, precision, "auto", None))
        # tf-encrypted's own Pond; its 128-bit ring needs tf-encrypted's int128 ops.
        if protocol == "pond" and (precision == "low" or ("aby3", "high") in COMBINATIONS):
            configs += [(protocol, precision, "tf-encrypted", 0), (protocol, precision, "tf-encrypted", 1)]
    return configs


CONFIGS = _configs()
CONFIG_IDS = [f"{p}-{q}-{'fused' if _fused(p, i) else i}"
              + ("" if s is None else f"-seed-to-server{s}") for p, q, i, s in CONFIGS]


# ---------------------------------------------------------------- the harness

def _secrets(kind, protocol, precision, implementation, rng):
    """Per-replica secrets: float32 update, int64 update, float32 read."""
    if kind == "zeros":
        return [(np.zeros(SIZE, np.float32), np.zeros(SIZE, np.int64), np.zeros(SIZE, np.float32))
                for _ in REPLICAS]
    update_bound = get_precision(precision).max_magnitude
    # Reads (the loss, metrics) to one device: a wider encoding on the fused kernels.
    read_bound = READ_PRECISION.max_magnitude if _fused(protocol, implementation) else update_bound
    int_limit = 2**62 if get_precision(precision).ring_bits == 64 else 2**63  # 2 replicas

    def near(bound):
        return (rng.choice([-1.0, 1.0], SIZE) * bound * rng.uniform(0.98, 0.99, SIZE)).astype(np.float32)

    # Integers at the limit with opposite signs on the two replicas: the sum must fit int64.
    # (At least 2**11 below it: tf-encrypted's path checks the range in float64,
    # whose spacing there is 2**10.)
    signs = rng.choice([-1, 1], SIZE)
    return [(near(update_bound),
             (sign * signs * (int_limit - rng.randint(2**11, 2**20, SIZE))).astype(np.int64),
             near(read_bound))
            for sign in (1, -1)]


def _build(protocol, precision, implementation):
    """A secure update (float32 + int64, to the replicas) and read (float32, elsewhere)."""
    graph = tf.Graph()
    with graph.as_default():
        strategy = TfeStrategy(devices=REPLICAS, protocol=protocol, precision=precision,
                               server_devices=SERVERS, implementation=implementation)
        placeholders = []
        for device in REPLICAS:
            with tf.device(device):
                placeholders.append((tf.compat.v1.placeholder(tf.float32, [SIZE]),
                                     tf.compat.v1.placeholder(tf.int64, [SIZE]),
                                     tf.compat.v1.placeholder(tf.float32, [SIZE])))
        with strategy.scope():

            def replica_fn():
                rid = tf.get_static_value(tf.distribute.get_replica_context().replica_id_in_sync_group)
                return [tf.identity(p) for p in placeholders[rid]]

            floats, ints, reads = strategy.extended.call_for_each_replica(replica_fn)
            updated = strategy.extended.batch_reduce_to(SUM, [(floats, floats), (ints, ints)])
            read = strategy.extended.reduce_to(SUM, reads, ELSEWHERE)
            fetches = [strategy.experimental_local_results(v) for v in updated] + [[read]]
    servers = strategy.extended._cross_device_ops.server_devices  # pylint: disable=protected-access
    assert list(servers) == SERVERS
    return graph, placeholders, fetches, servers


def _session_config():
    config = default_session_config()  # what Estimator runs with: soft placement, Grappler on
    config.device_count["CPU"] = len(DEVICES)
    return config


@contextlib.contextmanager
def _pond_seed_to(server):
    """Forces tf-encrypted's Pond to send every seed to `server` (0 or 1).

    `Pond._share` draws Python's ``random.random() < 0.5`` per sharing: below,
    server0 expands the seed and server1 gets the masked share; else the reverse.
    """
    load_backend()
    pond_module = sys.modules["tf_encrypted.protocol.pond.pond"]
    original = pond_module.random
    pond_module.random = types.SimpleNamespace(random=lambda: 0.0 if server == 0 else 0.99)
    try:
        yield
    finally:
        pond_module.random = original


def _party_outputs(graph, servers):
    """The ops on party devices whose outputs leave them: a run of these runs every party's inputs."""
    servers = set(servers)
    return [op for op in graph.get_operations()
            if _canonical(op.device) in servers
            and any(_canonical(c.device) not in servers for t in op.outputs for c in t.consumers())]


def _canonical(device):
    return tf.DeviceSpec.from_string(device).to_string() if device else ""


def collect_views(protocol, precision, implementation, placement, secret, steps=STEPS, seed=0, reveal=True):
    """Runs `steps` steps of a real secure sum; returns each step's party views and the results.

    Returns:
      A `Collected` ``(views, results, expected, partition_graphs)``:
      ``views[step]`` is a list of ``(PartyEdge, value)``; ``results`` the
      last step's fetched sums, ``partition_graphs`` its partitioned graphs. With
      ``reveal=False`` the run stops at the parties' outputs (a mutated
      graph's sums may be refused by the destinations), and results is None.
    """
    rng = np.random.RandomState(seed)
    secrets = _secrets(secret, protocol, precision, implementation, rng)
    scope = _pond_seed_to(placement) if placement is not None else contextlib.nullcontext()
    with scope:
        graph, placeholders, fetches, servers = _build(protocol, precision, implementation)
    if not reveal:
        fetches = _party_outputs(graph, servers)
    feed = {ph: value for phs, values in zip(placeholders, secrets) for ph, value in zip(phs, values)}
    views = []
    with tf.compat.v1.Session(graph=graph, config=_session_config()) as session:
        for _ in range(steps):
            results, step_views, partition_graphs = capture_party_views(session, fetches, servers, feed_dict=feed)
            views.append(step_views)
    results = results if reveal else None
    expected = [sum(s[k].astype(np.float64 if k != 1 else np.int64) for s in secrets) for k in range(3)]
    return Collected(views, results, expected, partition_graphs)


Collected = collections.namedtuple("Collected", "views results expected partition_graphs")


# ---------------------------------------------------------------- the checks

def _words(value):
    """A received tensor as unsigned words and their width in bits."""
    value = np.asarray(value)
    if value.dtype == np.int64:
        return value.reshape(-1).view(np.uint64), 64
    if value.dtype == np.int32:
        return value.reshape(-1).view(np.uint32).astype(np.uint64), 32
    raise AssertionError(f"not a ring element: dtype {value.dtype}")


def _slices(width):
    """Start bits of the 6-bit slices tested: the low, middle and high bits of a word."""
    return (0, width // 2 - 3, width - 6)


def assert_uniform_words(words, width, what):
    """Chi-square of the low, middle and high 6 bits of `words` against uniform, at ALPHA."""
    assert words.size >= 5 * BINS, f"{what}: too few words ({words.size}) for a chi-square test"
    for start in _slices(width):
        bits = ((words >> np.uint64(start)) & np.uint64(BINS - 1)).astype(np.int64)
        p = stats.chisquare(np.bincount(bits, minlength=BINS)).pvalue
        if not p > ALPHA:
            raise AssertionError(f"{what}: bits {start}..{start + 5} are not uniform (chi-square p={p:.3g})")


def assert_uniform_seeds(seeds, what):
    """128-bit seeds (4 int32 words): distinct, uniform nibbles, balanced bits in each word."""
    seeds = np.stack([np.asarray(s).reshape(4).view(np.uint32) for s in seeds])
    assert len({s.tobytes() for s in seeds}) == len(seeds), f"{what}: a seed repeats"
    nibbles = np.concatenate([(seeds >> np.uint32(4 * k)) & np.uint32(15) for k in range(8)]).reshape(-1)
    assert nibbles.size >= 5 * 16, f"{what}: too few seeds ({len(seeds)}) to test"
    p = stats.chisquare(np.bincount(nibbles.astype(np.int64), minlength=16)).pvalue
    if not p > ALPHA:
        raise AssertionError(f"{what}: seed nibbles are not uniform (chi-square p={p:.3g})")
    for word in range(4):
        ones = sum(bin(int(x)).count("1") for x in seeds[:, word])
        p = stats.binomtest(ones, 32 * len(seeds), 0.5).pvalue
        if not p > ALPHA:
            raise AssertionError(f"{what}: word {word} of the seeds has {ones} of {32 * len(seeds)} bits set")


def _is_seed(edge, value):
    return edge.dtype == tf.int32 and np.asarray(value).size == 4


def assert_views_hide_the_secret(views, what=""):
    """Every received value is integer, uniform and fresh on every step.

    Raises:
      AssertionError: naming the party, the edge and the failed check.
    """
    seeds, small = [], {}
    keys = None
    for step_views in views:
        step_keys = set()
        for edge, value in step_views:
            name = f"{what} {edge.party} <- {edge.tensor} ({edge.producer_type}, from {edge.source_device})"
            step_keys.add((edge.party, edge.tensor))
            if not (edge.dtype.is_integer and np.asarray(value).dtype in (np.int32, np.int64)):
                raise AssertionError(f"{name}: a party received a {edge.dtype.name} value")
            if _is_seed(edge, value):
                seeds.append(value)
                continue
            words, width = _words(value)
            if words.size >= 5 * BINS:
                assert_uniform_words(words, width, name)
            else:  # pooled per party and width
                small.setdefault((edge.party, width), []).append(words)
        assert keys is None or step_keys == keys, f"{what}: the parties' inputs changed between steps"
        keys = step_keys
    for (party, width), pool in small.items():
        assert_uniform_words(np.concatenate(pool), width, f"{what} {party}: small tensors")
    if seeds:
        assert_uniform_seeds(seeds, f"{what} seeds")
    assert_fresh_every_step(views, what)


def assert_fresh_every_step(views, what=""):
    """No received value repeats between two steps (a 64-bit word: not a single element)."""
    by_key = {}
    for step_views in views:
        for edge, value in step_views:
            by_key.setdefault((edge.party, edge.tensor), []).append(np.asarray(value))
    for (party, tensor), values in by_key.items():
        for i in range(len(values)):
            for j in range(i):
                a, b = values[i], values[j]
                same = np.array_equal(a, b) if a.size == 4 else np.any(a == b) if a.dtype == np.int64 \
                    else np.mean(a == b) > 1e-3
                if same:
                    raise AssertionError(f"{what} {party} <- {tensor}: the same value on steps {j} and {i}")


def assert_no_float_received(views, what=""):
    """No party receives a floating-point (or any non-integer) value."""
    for step_views in views:
        for edge, _ in step_views:
            if not edge.dtype.is_integer:
                raise AssertionError(
                    f"{what} {edge.party} receives the {edge.dtype.name} tensor {edge.tensor} "
                    f"({edge.producer_type}) from {edge.source_device}")


# ---------------------------------------------------------------- the tests

@pytest.mark.parametrize("protocol, precision, implementation, placement", CONFIGS, ids=CONFIG_IDS)
@pytest.mark.parametrize("secret", ["zeros", "limit"])
def test_every_party_sees_only_uniform_fresh_ring_elements(protocol, precision, implementation, placement, secret):
    # Execute
    views, results, expected, _ = collect_views(protocol, precision, implementation, placement, secret)
    # Assert: the graph is a working sum ...
    for got, want in zip(results, expected):
        for value in got:
            if want.dtype == np.int64:
                np.testing.assert_array_equal(value, want)
            else:
                np.testing.assert_allclose(value, want, rtol=1e-6)
    # ... whose parties each receive something, all of it uniform and fresh.
    parties = {edge.party for edge, _ in views[0]}
    assert len(parties) == (3 if protocol == "aby3" else 2), parties  # Pond's crypto producer: nothing
    assert_views_hide_the_secret(views, f"{protocol}/{precision}/{implementation}/{secret}")
    _assert_roles(protocol, implementation, placement, views[0])


def _assert_roles(protocol, implementation, placement, step_views):
    """Who receives what: Pond's seed placements, as `fused_sum` and tf-encrypted document them."""
    if protocol != "pond":
        return
    roles = {}
    for edge, value in step_views:
        kind = "seed" if _is_seed(edge, value) else "share"
        source = REPLICAS.index(edge.source_device) if edge.source_device in REPLICAS else edge.source_device
        roles.setdefault(edge.party, set()).add((source, kind))
    server0, server1 = SERVERS[0], SERVERS[1]
    if _fused(protocol, implementation):
        # replica r's seed to server r % 2, its share to the other; server0's part, blinded, to server1
        expected = {server0: {(0, "seed"), (1, "share")}, server1: {(0, "share"), (1, "seed"), (server0, "share")}}
    else:  # tf-encrypted's Pond, its coin forced: every seed to server `placement`
        seeds, shares = {(0, "seed"), (1, "seed")}, {(0, "share"), (1, "share")}
        expected = {server0: seeds, server1: shares} if placement == 0 else {server0: shares, server1: seeds}
    assert roles == expected


@pytest.mark.parametrize("protocol, precision, implementation, placement", CONFIGS, ids=CONFIG_IDS)
def test_no_party_receives_a_float(protocol, precision, implementation, placement):
    views = collect_views(protocol, precision, implementation, placement, "limit", steps=1).views
    assert views[0]
    assert_no_float_received(views)


# ---------------------------------------------------------------- mutations: the checks must fail

def plant_unmasked_fused_share(monkeypatch):
    """`kernels.ops.mask_share` sends the encoding itself as the share (the seed still goes out)."""
    real = kernel_ops.mask_share

    def mask_share(values, bound, ring_bits, fraction_bits, owner, hint, **kwargs):
        _, seed = real(values, bound, ring_bits, fraction_bits, owner, hint, **kwargs)
        values = values if isinstance(values, (list, tuple)) else [values]
        encoded = secure_sum.encode(tf.concat([tf.reshape(v, [-1]) for v in values], 0), fraction_bits)
        if ring_bits == 128:  # (low word, high word): the high word is the sign extension
            encoded = tf.stack([encoded, tf.bitwise.right_shift(encoded, 63)], axis=1)
        return encoded, seed

    monkeypatch.setattr(kernel_ops, "mask_share", mask_share)


def plant_zero_masks(monkeypatch):
    """tf-encrypted's generator (ours, installed by tfe_backend) returns zero masks."""
    from tfe_estimator.secure.kernels.random_module import AesRandomModule  # pylint: disable=import-outside-toplevel

    for name in ("secure_seeded_random_uniform", "i128_secure_seeded_random_uniform"):
        real = getattr(AesRandomModule, name)

        def zero(self, *args, _real=real, **kwargs):
            return _real(self, *args, **kwargs) * 0

        monkeypatch.setattr(AesRandomModule, name, zero)


def plant_float_edge(monkeypatch):
    """Each server op also reads replica 0's float vector.

    All zeros in these tests, so the sum stays right (`x * 0` would not do:
    Grappler folds it and nothing crosses).
    """
    floats = []
    real_mask_share, real_server_sum = kernel_ops.mask_share, kernel_ops.server_sum

    def mask_share(values, *args, **kwargs):
        floats.append(values)
        return real_mask_share(values, *args, **kwargs)

    def server_sum(*args):
        values = floats[0] if isinstance(floats[0], (list, tuple)) else [floats[0]]
        return real_server_sum(*args) + tf.cast(tf.add_n([tf.reduce_sum(v) for v in values]), tf.int64)

    monkeypatch.setattr(kernel_ops, "mask_share", mask_share)
    monkeypatch.setattr(kernel_ops, "server_sum", server_sum)


def plant_seed_beside_its_share(monkeypatch):
    """Server0 also receives the seed of the share replica 1 sends it (it can unmask it)."""
    pairs = []
    real_mask_share, real_server_sum = kernel_ops.mask_share, kernel_ops.server_sum
    real_blinded_server_sum = kernel_ops.blinded_server_sum

    def mask_share(*args, **kwargs):
        pairs.append(real_mask_share(*args, **kwargs))
        return pairs[-1]

    def blinded_server_sum(seeds, shares, ring_bits, num_elements):  # server0
        total, key = real_blinded_server_sum(seeds, shares, ring_bits, num_elements)
        assert any(s is pairs[-1][0] for s in shares)  # server0 holds replica 1's share ...
        total += real_server_sum([pairs[-1][1]], [], ring_bits, num_elements)  # ... and now its seed
        return total, key

    monkeypatch.setattr(kernel_ops, "mask_share", mask_share)
    monkeypatch.setattr(kernel_ops, "blinded_server_sum", blinded_server_sum)


POND_PRECISIONS = sorted({q for p, q in COMBINATIONS if p == "pond"})
TFE_CONFIGS = [(c, i) for c, i in zip(CONFIGS, CONFIG_IDS) if not _fused(c[0], c[2])]


@pytest.mark.parametrize("precision", POND_PRECISIONS)
@pytest.mark.parametrize("secret", ["zeros", "limit"])
def test_a_planted_unmasked_fused_share_is_caught(precision, secret, monkeypatch):
    plant_unmasked_fused_share(monkeypatch)
    views = collect_views("pond", precision, "auto", None, secret, reveal=False).views
    with pytest.raises(AssertionError, match="not uniform|same value"):
        assert_views_hide_the_secret(views)


@pytest.mark.parametrize("protocol, precision, implementation, placement",
                         [c for c, _ in TFE_CONFIGS], ids=[i for _, i in TFE_CONFIGS])
def test_tf_encrypted_shares_with_zero_masks_are_caught(protocol, precision, implementation, placement, monkeypatch):
    plant_zero_masks(monkeypatch)
    views = collect_views(protocol, precision, implementation, placement, "limit", reveal=False).views
    with pytest.raises(AssertionError, match="not uniform|same value"):
        assert_views_hide_the_secret(views)


def test_a_planted_float_edge_is_caught(monkeypatch):
    plant_float_edge(monkeypatch)
    views = collect_views("pond", "low", "auto", None, "zeros", steps=1).views
    with pytest.raises(AssertionError, match="float32"):
        assert_no_float_received(views)


def test_the_statistics_reject_encodings_and_predictable_seeds():
    encoded = np.round(np.linspace(-0.99, 0.99, SIZE) * 2**24 * 2**32).astype(np.int64)
    for words in (encoded, np.zeros(SIZE, np.int64), np.arange(SIZE, dtype=np.int64)):
        with pytest.raises(AssertionError, match="not uniform"):
            assert_uniform_words(words.view(np.uint64), 64, "planted")
    counter_seeds = [np.array([i, 0, 0, 0], np.int32) for i in range(1, 40)]
    with pytest.raises(AssertionError, match="not uniform|bits set"):
        assert_uniform_seeds(counter_seeds, "planted")
    rng = np.random.RandomState(0)
    good = [rng.randint(-2**31, 2**31 - 1, 4).astype(np.int32) for _ in range(40)]
    assert_uniform_seeds(good, "random")  # and random ones pass
    with pytest.raises(AssertionError, match="repeats"):
        assert_uniform_seeds(good + [good[3]], "planted")


# ---------------------------------------------------------------- the audit on the same graphs

@pytest.mark.parametrize("protocol, precision, implementation, placement", CONFIGS, ids=CONFIG_IDS)
def test_the_audit_passes_every_real_secure_sum(protocol, precision, implementation, placement):
    run = collect_views(protocol, precision, implementation, placement, "zeros", steps=1)
    report = audit_party_inputs(run.partition_graphs, SERVERS)
    assert len(report.parties) == (3 if protocol == "aby3" else 2)
    assert report.party_ops > 0
    assert {(e.party, e.tensor) for e in report.edges} == {(e.party, e.tensor) for e, _ in run.views[0]}
    assert assert_no_plaintext_on_servers(run.partition_graphs, SERVERS) == report.party_ops  # the alias


@pytest.mark.parametrize("plant, protocol, implementation, message", [
    (plant_unmasked_fused_share, "pond", "auto", "not a masked share"),
    (plant_float_edge, "pond", "auto", "a float32 value"),
    (plant_seed_beside_its_share, "pond", "auto", "can unmask"),
    # x - 0: Grappler may keep the Sub or rewrite it away (Identity, BroadcastTo).
    (plant_zero_masks, "pond", "tf-encrypted", "not a masked share|not an allowed producer"),
    (plant_zero_masks, "aby3", "auto", "not a masked share|not an allowed producer"),
], ids=["unmasked-fused-share", "float-edge", "seed-beside-its-share", "zero-masks-pond", "zero-masks-aby3"])
def test_the_audit_names_a_planted_leak(plant, protocol, implementation, message, monkeypatch):
    plant(monkeypatch)
    placement = 0 if implementation == "tf-encrypted" else None
    run = collect_views(protocol, "low", implementation, placement, "zeros", steps=1, reveal=False)
    with pytest.raises(PartyAuditError, match=message):
        audit_party_inputs(run.partition_graphs, SERVERS)


def test_the_audit_refuses_a_run_without_party_ops():
    graph = tf.Graph()
    with graph.as_default():
        with tf.device(REPLICAS[0]):
            a = tf.compat.v1.placeholder(tf.float32, [3])
        with tf.device(REPLICAS[1]):
            total = a + 1.0
    run_metadata = tf.compat.v1.RunMetadata()
    with tf.compat.v1.Session(graph=graph, config=_session_config()) as session:
        session.run(total, {a: np.zeros(3)}, options=tf.compat.v1.RunOptions(output_partition_graphs=True),
                    run_metadata=run_metadata)
    with pytest.raises(PartyAuditError, match="No op of this run is placed on the parties"):
        audit_party_inputs(run_metadata, SERVERS)
    with pytest.raises(TypeError, match="partition"):
        audit_party_inputs(graph, SERVERS)  # requested placement is not evidence


def _node(name, op, device, inputs=(), **attrs):
    node = tf.compat.v1.NodeDef(name=name, op=op, device=device, input=list(inputs))
    for key, value in attrs.items():
        if isinstance(value, tf.DType):
            node.attr[key].type = value.as_datatype_enum
        elif isinstance(value, bytes):
            node.attr[key].s = value
    return node


def _crossing(producer_op, dtype, source, target):
    """Two partitions: `producer_op` on `source` sends its output to an op on `target`."""
    edge = b"edge_1_x"
    sender, receiver = tf.compat.v1.GraphDef(), tf.compat.v1.GraphDef()
    sender.node.extend([_node("x", producer_op, source),
                        _node("x/_0", "_Send", source, ["x"], T=dtype, tensor_name=edge,
                              send_device=source.encode(), recv_device=target.encode())])
    receiver.node.extend([_node("x/_1", "_Recv", target, tensor_type=dtype, tensor_name=edge,
                                send_device=source.encode(), recv_device=target.encode()),
                          _node("y", "Identity", target, ["x/_1"], T=dtype)])
    return [sender, receiver]


def test_the_audit_treats_a_cluster_party_as_its_whole_task():
    # Soft placement put a server's op on another device of its `tfe` task: still that party.
    parties = [f"/job:tfe/replica:0/task:{i}/device:CPU:0" for i in range(3)]
    into_other_device = _crossing("Cast", tf.int64, "/job:worker/replica:0/task:0/device:CPU:0",
                                  "/job:tfe/replica:0/task:1/device:CPU:1")
    with pytest.raises(PartyAuditError, match=r"/job:tfe/replica:0/task:1 receives x:0 \(Cast, int64\)"):
        audit_party_inputs(into_other_device, parties)
    with pytest.raises(PartyAuditError, match=r"/job:tfe/replica:0/task:0 receives x:0 \(Cast"):
        audit_party_inputs(into_other_device and _crossing("Cast", tf.int64, "/job:chief/replica:0/task:0/device:CPU:0",
                                                           "/job:tfe/replica:0/task:0/device:CPU:0"), None)
    # Between two devices of one party's task: not a crossing (the task already holds it).
    within = _crossing("TfeAesSeed", tf.int32, "/job:tfe/replica:0/task:2/device:CPU:1",
                       "/job:tfe/replica:0/task:2/device:CPU:0")
    assert audit_party_inputs(within, parties).edges == ()


# ---------------------------------------------------------------- crafted bypasses of the audit
# Each graph hands a server a replica's plaintext using only op types a secure sum uses; the
# audit must name the op. The control (`_pond_by_hand(full_ring)`) is the same graph done right.

N = 64


def _audit_of(build):
    """Runs `build()` (returns the tensors to fetch, and a feed) once; audits its partition graphs."""
    graph = tf.Graph()
    with graph.as_default():
        fetches, feed = build()
    metadata = tf.compat.v1.RunMetadata()
    with tf.compat.v1.Session(graph=graph, config=_session_config()) as session:
        session.run(fetches, feed, options=tf.compat.v1.RunOptions(output_partition_graphs=True),
                    run_metadata=metadata)
    return audit_party_inputs(metadata, SERVERS)


def _secret():
    with tf.device(REPLICAS[0]):
        x = tf.compat.v1.placeholder(tf.int64, [N])
    return x, {x: np.arange(N, dtype=np.int64)}


def _stream(seed, low=tf.int64.min, high=tf.int64.max):
    return _KERNELS.load().tfe_aes_seeded_random_uniform(
        [N], seed, tf.constant(low, tf.int64), tf.constant(high, tf.int64))


def _pond_by_hand(low=tf.int64.min, high=tf.int64.max, seed_on=REPLICAS[0], const_seed=False):
    """tf-encrypted's Pond sharing of one replica's x: the seed to server0, x - AES(seed) to server1."""
    def build():
        x, feed = _secret()
        with tf.device(seed_on):
            seed = tf.constant([1, 2, 3, 4], tf.int32) if const_seed else _KERNELS.load().tfe_aes_seed()
        with tf.device(REPLICAS[0]):
            share = x - _stream(seed, low, high)
        with tf.device(SERVERS[0]):
            part0 = _stream(seed) + 1
        with tf.device(SERVERS[1]):
            part1 = share + 1
        return [part0, part1], feed
    return build


def test_the_audit_accepts_pond_sharing_done_right():
    report = _audit_of(_pond_by_hand())
    assert {e.producer_type for e in report.edges} == {"TfeAesSeed", "Sub"}


def test_a_mask_of_range_zero_to_one_is_refused():
    with pytest.raises(PartyAuditError, match=r"TfeAesSeededRandomUniform .* \[\[0\], \[1\]\), not the full ring"):
        _audit_of(_pond_by_hand(low=0, high=1))


def test_a_mask_whose_seed_the_receiving_server_drew_is_refused():
    with pytest.raises(PartyAuditError, match=r"CPU:3 receives .*Sub.* also holds the key of every mask on it"):
        _audit_of(_pond_by_hand(seed_on=SERVERS[1]))


def test_a_mask_keyed_by_a_constant_is_refused():
    # Grappler folds the stream of a constant key into a constant: then there is no mask at all.
    with pytest.raises(PartyAuditError, match="stands where a fresh key must be|not a masked share"):
        _audit_of(_pond_by_hand(const_seed=True))


def test_a_mask_keyed_by_a_fed_value_is_refused():
    def build():
        x, feed = _secret()
        with tf.device(REPLICAS[0]):
            key = tf.compat.v1.placeholder(tf.int32, [4])
            share = x - _stream(key)
        with tf.device(SERVERS[1]):
            part1 = share + 1
        return [part1], {**feed, key: np.arange(4, dtype=np.int32)}

    with pytest.raises(PartyAuditError, match="Placeholder.* stands where a fresh key must be"):
        _audit_of(build)


def test_a_share_forwarded_to_the_server_holding_its_key_is_refused():
    def build():
        x, feed = _secret()
        with tf.device(REPLICAS[0]):
            share, seed = kernel_ops.mask_share(tf.cast(x, tf.float32), 2.0**24, 64, 32, "replica 0", "-")
        with tf.device(SERVERS[1]):
            forwarded = kernel_ops.server_sum([], [share], 64, N)  # server1 passes replica 0's share on ...
        with tf.device(SERVERS[0]):  # ... to server0, which holds replica 0's key
            part0 = kernel_ops.server_sum([seed], [forwarded], 64, N)
        return [part0], feed

    with pytest.raises(PartyAuditError, match=r"CPU:2 receives .*TfeServerSum.* also holds the key of every mask"):
        _audit_of(build)


def test_a_float_constant_computed_on_a_party_is_refused():
    def build():
        fetches, feed = _pond_by_hand()()
        with tf.device(SERVERS[0]):
            fetches.append(fetches[0] + tf.cast(tf.cast(fetches[0], tf.float32) * 2.5, tf.int64))
        return fetches, feed

    with pytest.raises(PartyAuditError, match=r"CPU:2 runs .* on a float32 value"):
        _audit_of(build)


def test_an_op_outside_the_allow_list_on_a_party_is_refused():
    def build():
        fetches, feed = _pond_by_hand()()
        with tf.device(SERVERS[1]):
            fetches.append(tf.bitwise.bitwise_xor(fetches[1], fetches[1] + 1))
        return fetches, feed

    with pytest.raises(PartyAuditError, match=r"CPU:3 runs BitwiseXor .* not an op a party may run"):
        _audit_of(build)
