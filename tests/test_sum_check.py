"""Service mode: every owner detects a sum that a server altered (`sum_check`), under a seed no server knows
(`check_seed`).

In-process servers (the real `AggregationServer`, mTLS on loopback) with a tampering server1 or server0: it
adds to one element of one step's answer (1, and 2**63), replaces the blind key (sealed or answered), answers two owners
differently, or alters a replayed answer; every owner given a tampered answer fails that step with
`SumIntegrityError`, and honest runs (many steps, channels, rings 32/64/128) never do. Mutations: the check
skipped accepts the tampered sum; a server1 that knows the seed forges a change that passes. The seed
agreement runs through server0's real Handshake: equal seeds, none of it in server0's table, the same seed
after restarts, a certificate from another CA or an altered wrapped seed refused.
"""
import base64
import json
import os
import pathlib
import secrets
import shutil
import subprocess
import sys

import numpy as np
import portpicker
import pytest
import tensorflow as tf
from cryptography import x509

from service_helpers import OWNER_TASKS, WAIT_SECS, cert_dirs, in_threads, owner_names  # noqa: F401 (fixtures)
from tfe_estimator.owner import check_seed, contribution, riders, sum_check
from tfe_estimator.owner.sum_check import CHECK_WORDS, PRIMES, SumCheck, SumIntegrityError
from tfe_estimator.secure.fused_sum import Encoding
from tfe_estimator.secure.kernels import _build, ops
from tfe_estimator.secure.kernels.check_pass import check_pass
from tfe_estimator.service import AggregationServer, OwnerClient, TlsFiles, ring, wire

SEED = bytes(range(32))


class TamperingServer(AggregationServer):
    """An aggregation server whose answers pass through ``tamper(identity, request, payload) -> payload``."""

    tamper = None

    def _contribute(self, identity, request, context, reply):
        answer = super()._contribute(identity, request, context, reply)
        if self.tamper is None:
            return answer
        classes = wire.messages()
        message = classes["ContributeReply"].FromString(answer if isinstance(answer, bytes)
                                                        else answer.SerializeToString())
        payload = self.tamper(identity, request, message.payload)
        return classes["ContributeReply"](step=message.step, payload=payload,
                                          sealed_blinds=message.sealed_blinds).SerializeToString()


class Cluster:
    """server0 and server1 (both `TamperingServer`, honest until told otherwise) and one client per owner."""

    def __init__(self, certs_dir, n):
        self.owners = owner_names(n)
        ports = [portpicker.pick_unused_port() for _ in range(2)]
        self.addresses = tuple(f"localhost:{p}" for p in ports)
        self.server1 = TamperingServer(1, self.addresses[1], self.owners, TlsFiles.from_dir(certs_dir, "tfe", 1),
                                       step_timeout_secs=WAIT_SECS)
        self.server1.start()
        self.server0 = TamperingServer(0, self.addresses[0], self.owners, TlsFiles.from_dir(certs_dir, "tfe", 0),
                                       peer_address=self.addresses[1], step_timeout_secs=WAIT_SECS)
        self.server0.start()
        self.tls = [TlsFiles.from_dir(certs_dir, job, index) for job, index in OWNER_TASKS[:n]]
        self.clients = [OwnerClient(self.addresses, tls, timeout_secs=WAIT_SECS, retry_secs=0.0) for tls in self.tls]

    def close(self):
        for client in self.clients:
            client.close()
        for server in (self.server0, self.server1):
            server.stop(0)


@pytest.fixture
def cluster(cert_dirs):  # noqa: F811
    made = []

    def make(n=2):
        made.append(Cluster(cert_dirs[0], n))
        return made[-1]

    yield make
    for c in made:
        c.close()


def _vector(values, ring_bits):
    """The ring words of signed integers `values` (an owner's encoded vector)."""
    n = len(values)
    words = np.zeros(ring.ring_words(n, ring_bits), np.uint64)
    if ring_bits == 32:
        words.view("<i4")[:n] = values
    elif ring_bits == 64:
        words.view("<i8")[:] = values
    else:
        words.view("<i8")[0::2] = values
        words.view("<i8")[1::2] = np.where(np.asarray(values) < 0, -1, 0)
    return words


def _signed(words, n, ring_bits):
    if ring_bits == 32:
        return words.view("<i4")[:n].astype(np.int64)
    return words.view("<i8")[:n] if ring_bits == 64 else words.view("<i8")[0::2][:n]


def _masked(values, ring_bits):
    """``(key int32[4], share int64)`` of `values`, as ``ops.mask_share`` makes them."""
    key = np.frombuffer(secrets.token_bytes(16), np.int32).copy()
    share = _vector(values, ring_bits)
    ring.sub_into(share, ring.keystream_words(key, share.size), ring_bits)
    return key, share.view(np.int64)


def _reveal(blind_key, w, n, ring_bits):
    words = np.array(np.asarray(w).view(np.uint64), copy=True)
    ring.add_into(words, ring.keystream_words(blind_key, words.size), ring_bits)
    return _signed(words, n, ring_bits)


def _sum_round(c, checks, channel, step, ring_bits, values):
    """Every owner contributes `values[o]` (checked with `checks[o]`); per owner its revealed sum or error."""
    def owner(o):
        key, share = _masked(values[o], ring_bits)
        blind_key, w = sum_check.checked_contribute(c.clients[o].contribute, checks[o], channel, step, ring_bits,
                                                    len(values[o]), key, share)
        return _reveal(blind_key, w, len(values[o]), ring_bits)

    return in_threads([lambda o=o: owner(o) for o in range(len(values))])


def _values(rng, owners, n, ring_bits):
    bound = 1 << (ring_bits - 8 if ring_bits < 128 else 56)
    return [rng.integers(-bound, bound, n) for _ in range(owners)]


def _is_prime(n):
    if n < 2 or n % 2 == 0:
        return n == 2
    d, s = n - 1, 0
    while d % 2 == 0:
        d, s = d // 2, s + 1
    for a in (2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37, 41, 43, 47, 53, 59, 61, 67, 71, 73, 79, 83, 89, 97):
        x = pow(a, d, n)
        if x in (1, n - 1):
            continue
        for _ in range(s - 1):
            x = x * x % n
            if x == n - 1:
                break
        else:
            return False
    return True


def test_the_check_primes_are_prime_and_cover_the_ring():
    for ring_bits, primes in PRIMES.items():
        assert all(_is_prime(p) for p in primes), ring_bits
        assert primes[0] * primes[1] > 2**ring_bits  # a nonzero change is nonzero modulo one of them
        assert sum_check.MAX_OWNERS[ring_bits] * max(primes) <= 2**ring_bits  # the check words never wrap
        assert 2**sum_check.COEFFICIENT_BITS <= min(primes)
    assert sum_check.ROWS * sum_check.COEFFICIENT_BITS >= 40
    assert sum_check.CHUNK * (2**16 - 1) * (2**sum_check.COEFFICIENT_BITS - 1) < 2**53  # exact float64 products


@pytest.mark.parametrize("ring_bits", [32, 64, 128])
def test_honest_sums_pass_over_many_steps_and_channels(cluster, ring_bits):
    c = cluster(3)
    rng = np.random.default_rng(ring_bits)
    checks = [SumCheck(SEED, num_owners=3)] * 3
    for step in range(12):
        for channel, n in (("sum_0", 1), ("sum_1", 7), ("sum_2", 1000)):
            values = _values(rng, 3, n, ring_bits)
            results = _sum_round(c, checks, channel, step, ring_bits, values)
            for result in results:
                assert not isinstance(result, Exception), result
                np.testing.assert_array_equal(result, np.sum(values, axis=0))


def test_a_large_sum_crosses_chunks_exactly():
    # n above CHUNK (several float64 products) at the bounds of the encodings: the check words still agree.
    n = sum_check.CHUNK + 5
    check = SumCheck(SEED)
    rng = np.random.default_rng(1)
    values = [rng.integers(-2**62, 2**62, n), rng.integers(-2**60, 2**60, n)]
    acc = np.zeros(ring.ring_words(n + CHECK_WORDS, 64), np.uint64)
    for v in values:
        key, share = _masked(v, 64)
        ring.add_into(acc, check.extend("big", 3, 64, n, key, share), 64)
        ring.add_into(acc, ring.keystream_words(key, acc.size), 64)
    check.verify("big", 3, 64, n, np.zeros(4, np.int32), acc.view(np.int64) - ring.keystream_words(
        np.zeros(4, np.int32), acc.size).view(np.int64))


@pytest.mark.parametrize("ring_bits", [32, 64, 128])
def test_the_kernel_pass_computes_the_numpy_definition_exactly(ring_bits):
    # The C++ pass (`check_pass`) that extend and verify run, against the NumPy definition (`coefficients`,
    # `values`): across pass blocks (4096 elements), odd sizes (the 32-bit ring's padding lane), extreme words.
    check = SumCheck(SEED)
    rng = np.random.default_rng(ring_bits)
    for n in (0, 1, 3, 4097, 2 * 4096 + 5, 4096):
        total = n + CHECK_WORDS
        words = rng.integers(0, 2**64, ring.ring_words(total, ring_bits), dtype=np.uint64, endpoint=False)
        words[:2] = [2**63, 2**63 - 1]
        key = rng.integers(-2**31, 2**31, 4, dtype=np.int32)
        stream = ring.keystream_words(key, words.size)
        if n == 4096:  # a whole pass block whose plain words are all ones: the largest 32-bit halves, all negative
            words = ring.sub_into(np.full_like(words, 2**64 - 1), stream, ring_bits)
        coefficient_key = sum_check._derive(SEED, "sum_3", 11)  # pylint: disable=protected-access
        coefficients = check.coefficients("sum_3", 11, n)
        for copy, given in ((True, n), (False, total)):
            out = np.empty(words.size, np.uint64)
            values = check_pass(words, given, total, n, ring_bits, key, coefficient_key, out, copy=copy)
            plain = sum_check._plus(words, stream, ring_bits)  # pylint: disable=protected-access
            assert values == SumCheck.values(coefficients, plain, n, ring_bits), (n, copy)
            rest = total - given
            assert ring.elements(out, 0, given, ring_bits) == \
                ring.elements(words if copy else plain, 0, given, ring_bits), (n, copy)
            assert ring.elements(out, given, rest, ring_bits) == \
                ring.elements(stream, given, rest, ring_bits), (n, copy)


def _extremes(n, ring_bits):
    """`n` ring elements alternately the ring's largest positive and most negative signed value (uint64 words of
    n + CHECK_WORDS elements: the check words' places hold 0)."""
    per = ring_bits // 32  # 32-bit lanes per element
    words = np.zeros(ring.ring_words(n + CHECK_WORDS, ring_bits), np.uint64)
    lanes = words.view("<u4")[:n * per].reshape(n, per)
    lanes[0::2] = 0xFFFFFFFF
    lanes[0::2, per - 1] = 0x7FFFFFFF
    lanes[1::2, per - 1] = 0x80000000
    return words


@pytest.mark.parametrize("ring_bits", [32, 64, 128])
def test_the_kernel_pass_at_the_largest_values_and_odd_sizes_equals_the_numpy_definition(ring_bits):
    # The vectorised products (4 elements a step, a scalar tail) at their exactness bounds: every element the
    # ring's largest positive or most negative value, over odd sizes whose blocks end mid-step (a tail of 1-3).
    check = SumCheck(SEED)
    key = np.arange(4, dtype=np.int32)
    coefficient_key = sum_check._derive(SEED, "sum_1", 5)  # pylint: disable=protected-access
    for n in (5, 4096 + 7, 2 * 4096 + 1):
        plain = _extremes(n, ring_bits)
        words = ring.sub_into(plain.copy(), ring.keystream_words(key, plain.size), ring_bits)
        expected = SumCheck.values(check.coefficients("sum_1", 5, n), plain, n, ring_bits)
        out = np.empty(words.size, np.uint64)
        assert check_pass(words, n + CHECK_WORDS, n + CHECK_WORDS, n, ring_bits, key, coefficient_key, out,
                          copy=False) == expected, n
        np.testing.assert_array_equal(out[:ring.ring_words(n, ring_bits)], plain[:ring.ring_words(n, ring_bits)])


def _decode_sum(words, dtype, ring_bits, fraction_bits, scale, shapes):
    """`ops.decode_sum` (TfeRevealSum of one revealed part) of ring `words`, run in a graph of its own."""
    with tf.Graph().as_default():
        parts = ops.decode_sum(tf.constant(words.view(np.int64).reshape(-1 if ring_bits < 128 else (-1, 2))), dtype,
                               ring_bits, fraction_bits, scale, shapes)
        with tf.compat.v1.Session() as session:
            return session.run(parts)


def _honest_sum(check, channel, step, n, ring_bits, rng):
    """A revealed sum's ring words (n random elements, the ring's extremes first, then its check words) and the
    same masked under the key ``0, 1, 2, 3``: ``(plain, masked, key)``."""
    plain = rng.integers(0, 2**64, ring.ring_words(n + CHECK_WORDS, ring_bits), dtype=np.uint64)
    plain[:ring.ring_words(4, ring_bits)] = _extremes(4, ring_bits)[:ring.ring_words(4, ring_bits)]
    values = SumCheck.values(check.coefficients(channel, step, n), plain, n, ring_bits)
    ring.set_elements(plain, n, check.residues(values, ring_bits), ring_bits)
    key = np.arange(4, dtype=np.int32)
    return plain, ring.sub_into(plain.copy(), ring.keystream_words(key, plain.size), ring_bits), key


@pytest.mark.parametrize("ring_bits", [32, 64, 128])
def test_a_sum_decoded_in_the_checking_pass_equals_decode_sum_bit_for_bit(ring_bits):
    # verify's decoded arrays (one per shape, 64-byte aligned for TensorFlow) against the graph's decode_sum of
    # the same revealed words, and on rings 32 and 64 against NumPy: float(double(signed(x)) * factor); the ring's
    # extremes first, odd sizes, an empty shape; the check words after them are those verify returns undecoded.
    check = SumCheck(SEED)
    shapes = [[3, 5], [4096], [2], [0], [1]]
    sizes = [int(np.prod(s)) for s in shapes]
    n = sum(sizes)
    plain, masked, key = _honest_sum(check, "sum_2", 9, n, ring_bits, np.random.default_rng(ring_bits))
    whole = check.verify("sum_2", 9, ring_bits, n, key, masked).copy()
    for dtype, fraction_bits, scale in ((tf.float32, 32, 1.0), (tf.float64, 20, 1.0 / 3), (tf.float32, 0, 0.5)):
        arrays = sum_check._decoded_arrays(dtype.as_numpy_dtype, sizes)  # pylint: disable=protected-access
        factor = ops.decode_factor(fraction_bits, scale)
        tail = check.verify("sum_2", 9, ring_bits, n, key, masked, arrays, factor)
        assert ring.elements(tail, n, CHECK_WORDS, ring_bits) == ring.elements(whole, n, CHECK_WORDS, ring_bits)
        expected = _decode_sum(plain[:ring.ring_words(n, ring_bits)], dtype, ring_bits, fraction_bits, scale, shapes)
        for got, want, shape in zip(arrays, expected, shapes):
            assert got.size == 0 or got.ctypes.data % 64 == 0
            np.testing.assert_array_equal(got.reshape(shape).view(np.uint8), want.view(np.uint8))
        if ring_bits < 128:
            numpy = (_signed(plain, n, ring_bits).astype(np.float64) * factor).astype(dtype.as_numpy_dtype)
            np.testing.assert_array_equal(np.concatenate(arrays).view(np.uint8), numpy.view(np.uint8))


def test_a_tampered_sum_decoded_in_the_checking_pass_is_refused():
    # Decoding in the pass changes nothing of the check: one element altered fails verify, decoded or not.
    check = SumCheck(SEED)
    plain, masked, key = _honest_sum(check, "sum_2", 9, 1001, 64, np.random.default_rng(5))
    masked[700] += 1
    arrays = sum_check._decoded_arrays(np.float32, [1000, 1])  # pylint: disable=protected-access
    with pytest.raises(SumIntegrityError, match="failed 4 of 4 integrity checks"):
        check.verify("sum_2", 9, 64, 1001, key, masked, arrays, 1.0)


def _own_sums(checked=True):
    """``(sum, calls)``: `sum(values, channel, step)` is `contribution.service_sum` of one owner (float32, 16
    fraction bits) whose service answers its own vector back (blind key = its key, the masked share it sent),
    checked or not; `calls` lists each call's ``(channel, step)``."""
    calls, check = [], SumCheck(SEED)

    def contribute(channel, step, ring_bits, n, key, share):
        calls.append((channel, int(step)))
        return np.asarray(key).copy(), np.asarray(share).copy()

    def total(values, channel, step):
        return contribution.service_sum([values], ["/cpu:0"], ["/cpu:0"], Encoding(64, 16, 2.0**20), tf.float32,
                                        "chief:0", "clip", 1.0, channel, step, contribute,
                                        checks=(lambda: check) if checked else None)[0]

    return total, calls


@pytest.mark.parametrize("checked", [True, False])
def test_a_float_sum_is_decoded_in_the_answers_pass_eagerly_and_in_a_tf_function_too(checked):
    # Keras reads a metric across owners eagerly (a scalar: one decoded array) and trains in a tf.function. Eagerly
    # tf.numpy_function returns a one-element output list unwrapped: the scalar's read failed after its call was
    # made (the owner died, and its restart was refused as a fresh training answered from the replay window).
    total, calls = _own_sums(checked)
    step = tf.constant(3, tf.int64)
    assert [t.numpy() for t in total([tf.constant(2.5)], "eager_sum_0", step)] == [2.5]
    vector = total([tf.constant([1.0, -2.25])], "eager_sum_1", step)
    assert len(vector) == 1 and vector[0].numpy().tolist() == [1.0, -2.25]
    assert [t.numpy().tolist() for t in total([tf.constant([[1.0, 2.0]]), tf.constant(-0.5)], "eager_sum_2",
                                              step)] == [[[1.0, 2.0]], -0.5]

    @tf.function
    def train_step(x, step):
        return total([x, tf.reduce_sum(x)], "sum_0", step), total([tf.reduce_mean(x)], "sum_1", step)

    held = [train_step(tf.constant([1.0, 2.0, 3.0]) * (s + 1), tf.constant(s, tf.int64)) for s in range(3)]
    for s, (grads, loss) in enumerate(held):  # earlier steps' tensors keep their values (their arrays not reused)
        assert grads[0].numpy().tolist() == [s + 1.0, 2 * (s + 1.0), 3 * (s + 1.0)] and grads[1].numpy() == 6 * (s + 1)
        assert loss[0].numpy() == 2 * (s + 1)
    # each sum called once per step, keyed by its step (the calls of two channels run in two threads: any order)
    assert sorted(calls) == sorted([(f"eager_sum_{i}", 3) for i in range(3)] +
                                   [(f"sum_{i}", s) for s in range(3) for i in (0, 1)]), calls
    graph = train_step.get_concrete_function(tf.constant([1.0, 2.0, 3.0]), tf.constant(0, tf.int64)).graph
    types = [op.type for op in graph.get_operations()]
    assert "TfeRevealSum" not in types and types.count("PyFuncStateless") == 4, types  # 2 sums: call, answer
    from tfe_estimator.audit.owner_graph import audit_owner_graph  # pylint: disable=import-outside-toplevel

    assert audit_owner_graph(graph) == 2


def test_an_unchecked_decoded_sum_with_riders_reuses_its_words_and_hands_back_the_riders():
    # The words after the decoded elements (the riders') land in this thread's scratch, not a fresh array per call.
    key, share = _masked([5 << 16, -(3 << 16)], 64)

    def contribute(channel, step, ring_bits, n, key, share):
        return np.asarray(key).copy(), np.asarray(share).copy()

    results = [sum_check.checked_contribute(contribute, None, "sum_0", s, 64, 2, key, share, reveal=True,
                                            riders=[7, 2**64 - 9], decode=(np.float32, 2.0**-16, [2])) for s in (0, 1)]
    for arrays, words in results:
        assert arrays[0].tolist() == [5.0, -3.0] and words[2:4].tolist() == [7, -9]
    assert results[0][1].ctypes.data == results[1][1].ctypes.data


def test_mutation_reusing_a_decoded_array_still_held_overwrites_an_earlier_steps_sum(monkeypatch):
    monkeypatch.setattr(sum_check.sys, "getrefcount", lambda obj: 0)  # plant it: every array looks free
    with pytest.raises(AssertionError):
        test_a_float_sum_is_decoded_in_the_answers_pass_eagerly_and_in_a_tf_function_too(True)


#: Mutations of the owner's kernels, each planted in one test-only library behind a switch (`run_kernel_mutant`):
#: a 32-bit check pass that skips the odd elements' products; a 32-bit mask op whose lanes' range checks are lost.
KERNEL_MUTATIONS = [
    ("sum_check_pass.cc", "_mm_add_epi64(_mm_mul_epu32(x0123, c), _mm_mul_epu32(x13, c13))",
     "_mm_mul_epu32(x0123, c)"),
    ("secure_sum_ops.cc", "all_ok = _mm_and_pd(all_ok, ok);", "(void)ok;"),
]
_MUTANT_SWITCH = """
#include <cstdlib>
// Test build: which planted mutation runs ($TFE_TEST_MUTATION; 0: none).
static int TfeTestMutation() {
  static const int planted = std::getenv("TFE_TEST_MUTATION") ? std::atoi(std::getenv("TFE_TEST_MUTATION")) : 0;
  return planted;
}
"""
_KERNEL_MUTANT_RUNNER = r"""
import importlib, pathlib, sys
from tfe_estimator.secure.kernels import _build
_build.SOURCE_DIR = pathlib.Path(sys.argv[1])
_build.OPTIMIZATION = "-O1"  # the mutant compiles ~3x faster; same values
sys.path.insert(0, sys.argv[2])
for test in sys.argv[3:]:
    module, name, *args = test.split(":")
    try:
        getattr(importlib.import_module(module), name)(*[eval(a) for a in args])
        print(test, "PASSED")
    except BaseException as e:  # an assertion, or pytest's Failed ("DID NOT RAISE")
        print(test, "FAILED", type(e).__name__)
"""


def run_kernel_mutant(tmp_path, cache, mutation: int, tests) -> str:
    """Stdout of running `tests` (``module:function[:arg]``) on the kernels with `KERNEL_MUTATIONS[mutation - 1]`
    planted: one library, built once per run in `cache` (conftest's `mutant_kernel_cache`; its key is its
    sources' contents), serves every mutation."""
    src = tmp_path / "src"
    src.mkdir()
    for path in [*_build.SOURCE_DIR.glob("*.h"), *(_build.SOURCE_DIR / name for name in (
            "sum_check_pass.cc", "secure_sum_ops.cc", "random_ops.cc"))]:
        shutil.copy(path, src)
    for number, (source, old, new) in enumerate(KERNEL_MUTATIONS, 1):
        code = (src / source).read_text()
        assert code.count(old) == 1, f"the mutation no longer applies to {source}: update the test with it"
        on = f"TfeTestMutation() == {number}"
        planted = f"if ({on}) {{ {new} }} else {{ {old} }}" if old.endswith(";") else f"({on} ? ({new}) : ({old}))"
        code = code.replace(old, planted).replace('#include "aes_ctr.h"\n', '#include "aes_ctr.h"\n' + _MUTANT_SWITCH, 1)
        (src / source).write_text(code)
    env = dict(os.environ, TFE_ESTIMATOR_KERNEL_CACHE=str(cache),
               TFE_TEST_MUTATION=str(mutation))
    return subprocess.run([sys.executable, "-c", _KERNEL_MUTANT_RUNNER, str(src), str(pathlib.Path(__file__).parent),
                           *tests], env=env, capture_output=True, text=True, timeout=900, check=True).stdout


@pytest.mark.slow
def test_mutation_a_32_bit_pass_skipping_a_word_fails_both_equality_tests(tmp_path, mutant_kernel_cache):
    # Each equality test above, run on kernels whose 32-bit pass leaves the odd elements out of the check values
    # (a server's change to any of them would pass every check), fails.
    tests = ["test_sum_check:test_the_kernel_pass_computes_the_numpy_definition_exactly:32",
             "test_sum_check:test_the_kernel_pass_at_the_largest_values_and_odd_sizes_equals_the_numpy_definition:32"]
    out = run_kernel_mutant(tmp_path, mutant_kernel_cache, 1, tests)
    for test in tests:
        assert f"{test} FAILED" in out, out


def test_the_revealed_sum_is_aligned_for_tensorflow_to_take_it_without_a_copy():
    # A tf.numpy_function result whose data is not 64-byte aligned is copied into a new tensor (8 MB per 1e6 sum).
    n, check = 1000, SumCheck(SEED)
    key, share = _masked(np.arange(n), 64)
    extended = check.extend("sum_0", 1, 64, n, key, share)
    revealed = check.verify("sum_0", 1, 64, n, key, extended.copy())  # blind key = key: the owner's own vector
    assert revealed.ctypes.data % 64 == 0
    np.testing.assert_array_equal(revealed[:n].view(np.int64), np.arange(n))
    plain = sum_check._plus(np.ones(n, np.uint64), np.ones(n, np.uint64), 64)  # pylint: disable=protected-access
    assert plain.ctypes.data % 64 == 0 and (plain == 2).all()


def test_the_kernel_pass_refuses_arrays_outside_its_contract():
    words = np.zeros(10, np.uint64)
    with pytest.raises(ValueError, match="writable contiguous uint64 array of 14 words"):
        check_pass(words, 10, 14, 10, 64, bytes(16), bytes(16), np.empty(10, np.uint64), copy=True)
    with pytest.raises(ValueError, match="not the 12 64-bit ring words of 12 elements"):
        check_pass(words, 12, 14, 10, 64, bytes(16), bytes(16), np.empty(14, np.uint64), copy=True)
    with pytest.raises(ValueError, match="mask_key is an AES-128 key of 16 bytes, got 15"):
        check_pass(words, 10, 14, 10, 64, bytes(15), bytes(16), np.empty(14, np.uint64), copy=True)
    with pytest.raises(ValueError, match="must not overlap"):
        out = np.empty(14, np.uint64)
        check_pass(out, 10, 14, 10, 64, bytes(16), bytes(16), out, copy=True)


def _add_to_element(index, delta, step=None, only=None):
    """server1's tamper: adds `delta` (ring 64) to element `index` of the answer (of `step`, to `only`)."""
    def tamper(identity, request, payload):
        if (step is not None and request.step != step) or (only is not None and identity != only):
            return payload
        words = np.frombuffer(payload, np.uint64).copy()
        words[index:index + 1] += np.uint64(delta)
        return words.tobytes()

    return tamper


@pytest.mark.parametrize("delta", [1, 2**63], ids=["one", "2**63"])
def test_server1_adding_to_one_element_of_one_step_is_caught_by_every_owner_in_that_step(cluster, delta):
    c = cluster(2)
    checks = [SumCheck(SEED)] * 2
    rng = np.random.default_rng(0)
    c.server1.tamper = _add_to_element(5, delta, step=2)
    for step in range(4):
        results = _sum_round(c, checks, "sum_0", step, 64, _values(rng, 2, 100, 64))
        if step == 2:
            assert all(isinstance(r, SumIntegrityError) for r in results), results
            message = str(results[0])
            assert "step 2 on channel sum_0 failed" in message and "of 4 integrity checks" in message
            assert "tfe:0" in message and "tfe:1" in message and "training stopped" in message
        else:
            assert not any(isinstance(r, Exception) for r in results), results


def test_the_check_skipped_accepts_the_tampered_sum(cluster):
    # Mutation: without the check the same tampering goes through, and the owners apply a wrong sum.
    c = cluster(2)
    c.server1.tamper = _add_to_element(5, 2**63)
    values = _values(np.random.default_rng(0), 2, 100, 64)
    results = _sum_round(c, [None, None], "sum_0", 0, 64, values)
    truth = np.sum(values, axis=0)
    for result in results:
        assert not isinstance(result, Exception)
        assert result[5] != truth[5] and np.array_equal(np.delete(result, 5), np.delete(truth, 5))


@pytest.mark.parametrize("lie", ["sealed", "answered"])
def test_server0_replacing_the_blind_key_is_caught(cluster, lie):
    # Server0 seals another key than the one it blinded the sum with (server1's answer carries it); or, sealing
    # none (an older server0), it answers another key itself.
    c = cluster(2)
    if lie == "sealed":
        c.server0._seal = lambda channel, step, keys, blind: AggregationServer._seal(  # pylint: disable=protected-access
            channel, step, keys, secrets.token_bytes(16))
    else:
        c.server0._seal = lambda *args: ()  # pylint: disable=protected-access
        c.server0.tamper = lambda identity, request, payload: secrets.token_bytes(16)
    results = _sum_round(c, [SumCheck(SEED)] * 2, "sum_0", 0, 64, _values(np.random.default_rng(0), 2, 50, 64))
    assert all(isinstance(r, SumIntegrityError) for r in results), results


@pytest.mark.parametrize("ring_bits", [32, 64])
def test_server1_answering_two_owners_differently_is_caught_by_the_owner_given_the_change(cluster, ring_bits):
    c = cluster(2)

    def tamper(identity, request, payload):
        if identity != "worker:0":
            return payload
        words = np.frombuffer(payload, np.uint32).copy()
        words[3:4] += np.uint32(1 << 31)
        return words.tobytes()

    c.server1.tamper = tamper
    results = _sum_round(c, [SumCheck(SEED)] * 2, "sum_0", 0, ring_bits,
                         _values(np.random.default_rng(0), 2, 9, ring_bits))
    assert not isinstance(results[0], Exception)  # chief:0 got the true sum
    assert isinstance(results[1], SumIntegrityError), results[1]


def test_a_replayed_answer_is_checked_too(cluster):
    # A step released honestly, then put again (a restored owner replays it from the window): server1 now
    # alters the stored answer it hands out; the replaying owner catches it.
    c = cluster(2)
    check = SumCheck(SEED)
    values = _values(np.random.default_rng(0), 2, 20, 64)
    keys_shares = [_masked(v, 64) for v in values]

    def put(o):
        key, share = keys_shares[o]
        return sum_check.checked_contribute(c.clients[o].contribute, check, "sum_0", 0, 64, 20, key, share)

    assert not any(isinstance(r, Exception) for r in in_threads([lambda: put(0), lambda: put(1)]))
    c.server1.tamper = _add_to_element(0, 1)
    with pytest.raises(SumIntegrityError, match="step 0 on channel sum_0"):
        put(0)


def _forge_with_the_seed(seed, index, n):
    """server1's tamper knowing the seed: +1 on element `index`, and every check word moved to match."""
    known = SumCheck(seed)

    def tamper(identity, request, payload):
        del identity
        words = np.frombuffer(payload, np.uint64).copy()
        coefficients = known.coefficients(request.channel, request.step, n)
        words[index] += np.uint64(1)
        for m in range(sum_check.ROWS):
            for k, p in enumerate(PRIMES[64]):
                words[n + 2 * m + k] += np.uint64(int(coefficients[m, index]) % p)
        return words.tobytes()

    return tamper


def test_a_server_that_knows_the_seed_forges_a_change_that_passes(cluster):
    # Mutation: a seed derived from public data (here: a constant server1 knows) lets server1 forge a
    # change; so the seed's secrecy is what the checks rest on.
    c = cluster(2)
    c.server1.tamper = _forge_with_the_seed(SEED, 4, 30)
    values = _values(np.random.default_rng(0), 2, 30, 64)
    results = _sum_round(c, [SumCheck(SEED)] * 2, "sum_0", 0, 64, values)
    for result in results:
        assert not isinstance(result, Exception), result
        assert result[4] == np.sum(values, axis=0)[4] + 1  # altered, and accepted
    # The same forgery under a seed server1 does not know is caught.
    c.server1.tamper = _forge_with_the_seed(SEED, 4, 30)
    results = _sum_round(c, [SumCheck(b"another seed the servers never see")] * 2, "sum_0", 1, 64, values)
    assert all(isinstance(r, SumIntegrityError) for r in results), results


@pytest.mark.parametrize("ring_bits", [64, 128])
def test_a_tampered_sum_fails_the_session_run_of_the_contribution_op(cluster, ring_bits):
    # Through the real graph on chief:0 (service_sum's tf.numpy_function, the mask and reveal kernels); worker:0
    # contributes from numpy in another thread.
    c = cluster(2)
    check = SumCheck(SEED)
    x = [np.arange(6, dtype=np.float32).reshape(2, 3), np.ones((2, 3), np.float32)]
    fraction_bits = 16

    def chief(steps):
        graph = tf.Graph()
        with graph.as_default():
            step = tf.compat.v1.placeholder(tf.int64, [])
            total = contribution.service_sum([[tf.constant(x[0])]], ["/cpu:0"], ["/cpu:0"],
                                            Encoding(ring_bits, fraction_bits, 2.0**20), tf.float32, "chief:0", "clip",
                                            1.0, "sum_0", step, c.clients[0].contribute, checks=lambda: check)
            with tf.compat.v1.Session(graph=graph) as session:
                out = []
                for s in steps:
                    try:
                        out.append(session.run(total[0][0], {step: s}))
                    except tf.errors.OpError as e:
                        out.append(e)
                return out

    def worker(steps):
        out = []
        for s in steps:
            key, share = _masked((x[1].reshape(-1) * 2**fraction_bits).astype(np.int64), ring_bits)
            try:
                out.append(sum_check.checked_contribute(c.clients[1].contribute, check, "sum_0", s, ring_bits, 6, key,
                                                        share))
            except SumIntegrityError as e:
                out.append(e)
        return out

    c.server1.tamper = _add_to_element(1, 2**63, step=1)
    chief_results, worker_results = in_threads([lambda: chief([0, 1]), lambda: worker([0, 1])])
    np.testing.assert_allclose(chief_results[0], x[0] + x[1])
    assert isinstance(chief_results[1], tf.errors.UnknownError), chief_results[1]
    assert "failed 4 of 4 integrity checks" in chief_results[1].message
    assert not isinstance(worker_results[0], Exception) and isinstance(worker_results[1], SumIntegrityError)


# ------------------------------------------------------------------------------------------- the seed --

def _agree(c, model, owners=None, parts_of=None, rounds=50):
    """Runs the agreement of `owners` (indexes; all) through server0's Handshake until each is done."""
    owners = range(len(c.owners)) if owners is None else owners
    agreements = {o: check_seed.SeedAgreement(c.tls[o], c.owners, c.owners[o], model) for o in owners}
    done = set()
    for _ in range(rounds):
        for o, agreement in agreements.items():
            if o in done:
                continue
            sent = agreement.part
            rows, parts = c.clients[o].handshake_parts(0, [0, 1], model, sent)
            if parts_of is not None:
                parts = parts_of(o, parts)
            if agreement.update([which for which, _, _ in rows], parts, sent) is None:
                done.add(o)
        if len(done) == len(agreements):
            return agreements
    raise AssertionError(f"no agreement after {rounds} rounds: {sorted(done)} done")


def test_the_owners_agree_on_one_seed_that_server0_never_holds(cluster):
    c = cluster(3)
    agreements = _agree(c, model=0x1234)
    seeds = {a.seed for a in agreements.values()}
    assert len(seeds) == 1 and None not in seeds
    seed = seeds.pop()
    assert len({a.check().fingerprint for a in agreements.values()}) == 1
    rows, _, _, parts = c.server0._handshakes.view_parts(0x1234)
    stored = b"".join(parts) + repr(rows).encode()
    for form in (seed, seed.hex().encode(), base64.b64encode(seed)):
        assert form not in stored
    assert all(p for p in parts)  # every owner's certificate is there, and owners[0]'s wrapped seeds
    assert set(json.loads(parts[0])["seeds"]) == {"worker:0", "worker:1"}
    # Another model: another seed.
    assert _agree(c, model=0x5678)[0].seed != seed


def test_restarted_owners_obtain_the_same_seed_alone(cluster):
    c = cluster(3)
    seed = _agree(c, model=7)[0].seed
    # worker:1 restarted alone: owners[0] and worker:0 keep training (no handshake); it reads the stored parts.
    assert _agree(c, model=7, owners=[2])[2].seed == seed
    # owners[0] restarted alone: the same seed from its key, wrapped again for everyone.
    assert _agree(c, model=7, owners=[0])[0].seed == seed
    assert _agree(c, model=7, owners=[1])[1].seed == seed


def test_a_certificate_of_another_ca_cannot_inject_a_seed(cluster, cert_dirs):  # noqa: F811
    # server0 (or an impostor) hands worker:0 a part for chief:0 signed by another CA, wrapping a seed it
    # knows for worker:0's certificate key: worker:0 refuses it, naming the certificate.
    c = cluster(2)
    impostor = check_seed.SeedAgreement(TlsFiles.from_dir(cert_dirs[1], "chief", 0), c.owners, "chief:0", 9)
    worker = check_seed.SeedAgreement(c.tls[1], c.owners, "worker:0", 9)
    impostor._verified_key = lambda owner, body: x509.load_pem_x509_certificate(  # the attacker checks nothing
        body["cert"].encode()).public_key()
    impostor.update([9, 9], [b"", worker.part], b"")
    assert "worker:0" in json.loads(impostor.part)["seeds"]
    with pytest.raises(check_seed.CheckSeedError, match="does not prove chief:0"):
        worker.update([9, 9], [impostor.part, worker.part], worker.part)
    # The same injection the other way: owners[0] refuses to wrap its seed for a foreign worker:0.
    chief = check_seed.SeedAgreement(c.tls[0], c.owners, "chief:0", 9)
    foreign_worker = check_seed.SeedAgreement(TlsFiles.from_dir(cert_dirs[1], "worker", 0), c.owners, "worker:0", 9)
    with pytest.raises(check_seed.CheckSeedError, match="does not prove worker:0"):
        chief.update([9, 9], [chief.part, foreign_worker.part], chief.part)


def test_a_wrapped_seed_server0_altered_does_not_decrypt(cluster):
    c = cluster(2)

    def alter(o, parts):
        if o != 1 or not parts[0]:
            return parts
        body = json.loads(parts[0])
        if "worker:0" in body["seeds"]:
            raw = bytearray(base64.b64decode(body["seeds"]["worker:0"]["seed"]))
            raw[0] ^= 1
            body["seeds"]["worker:0"]["seed"] = base64.b64encode(bytes(raw)).decode()
        return [json.dumps(body).encode(), parts[1]]

    with pytest.raises(check_seed.CheckSeedError, match="does not decrypt"):
        _agree(c, model=3, parts_of=alter)


def test_a_renewed_certificate_gets_the_same_seed_wrapped_again(cluster, cert_dirs, tmp_path):  # noqa: F811
    # worker:0 renews its key and certificate (same CA) and restarts alone while owners[0] handshakes again:
    # owners[0] wraps the seed for the new certificate; the old wrapping is not taken for it.
    import shutil

    from cryptography.x509.oid import NameOID

    from tfe_estimator.identity import certs

    c = cluster(2)
    seed = _agree(c, model=11)[0].seed
    renewed = str(tmp_path / "renewed")
    shutil.copytree(cert_dirs[0], renewed)
    old = certs.load_certificate(open(f"{renewed}/worker-0.crt", "rb").read(), "worker-0.crt")
    organisation = old.subject.get_attributes_for_oid(NameOID.ORGANIZATION_NAME)[0].value
    key, csr = certs.make_key_and_csr("worker", 0, organisation, "t")
    with open(f"{renewed}/ca.crt", "rb") as ca_cert, open(f"{renewed}/ca.key", "rb") as ca_key:
        cert = certs.sign_csr(csr, ca_cert.read(), ca_key.read(), "t")
    with open(f"{renewed}/worker-0.crt", "wb") as f:
        f.write(cert)
    with open(f"{renewed}/worker-0.key", "wb") as f:
        f.write(key)
    c.tls[1] = TlsFiles.from_dir(renewed, "worker", 0)
    worker = check_seed.SeedAgreement(c.tls[1], c.owners, "worker:0", 11)
    rows, parts = c.clients[1].handshake_parts(0, [0, 1], 11, worker.part)
    assert "certificate yet" in worker.update([w for w, _, _ in rows], parts, worker.part)  # the old wrapping
    assert _agree(c, model=11)[1].seed == seed


# ------------------------------------------------------------------------------------------ riders --

def test_the_keystream_and_coefficients_at_an_offset_are_those_of_the_whole_vector():
    key = np.arange(4, dtype=np.int32)
    whole = ring.keystream_words(key, 40).tobytes()
    for offset, size in ((0, 16), (8, 8), (13, 50), (160, 120)):
        assert ring.keystream_bytes_at(key, offset, size) == whole[offset:offset + size]
    coefficient_key = sum_check._derive(SEED, "sum_0", 4)  # pylint: disable=protected-access
    n, covered = 1001, 1006
    rows = SumCheck._rider_coefficients(coefficient_key, n, covered)  # pylint: disable=protected-access
    np.testing.assert_array_equal(np.stack(rows), SumCheck(SEED).coefficients("sum_0", 4, covered)[:, n:])


def _rider_round(c, checks, step, ring_bits, values, rider_values, rider_ring=128):
    """Every owner contributes `values[o]` with the limbs of `rider_values[o]` (signed ints on `rider_ring`)
    riding; per owner (host sum, rider sum) or its error."""
    n, m = len(values[0]), len(rider_values[0])

    def owner(o):
        key, share = _masked(values[o], ring_bits)
        rider = _vector(rider_values[o], rider_ring)
        limbs = riders.to_limbs(rider, m, rider_ring, ring_bits)
        revealed = sum_check.checked_contribute(c.clients[o].contribute, checks[o], "sum_0", step, ring_bits, n, key,
                                                share, reveal=True, riders=limbs)
        words = np.asarray(revealed).view(np.uint64)
        sums = ring.elements(words, n, len(limbs), ring_bits)
        total = riders.from_limbs(sums, m, rider_ring, ring_bits).view(np.uint64)
        return _signed(words, n, ring_bits), [sum_check._signed(v, rider_ring)  # pylint: disable=protected-access
                                              for v in ring.elements(total, 0, m, rider_ring)]

    return in_threads([lambda o=o: owner(o) for o in range(len(values))])


@pytest.mark.parametrize("ring_bits", [32, 64, 128])
def test_riders_come_back_exactly_in_one_call_and_are_checked(cluster, ring_bits):
    # A small 128-bit ring sum (the reported loss) rides in the limbs of a host of every ring, odd sizes included;
    # server1 adding to a rider's limb is caught like a change to any element.
    c = cluster(2)
    rng = np.random.default_rng(ring_bits)
    checks = [SumCheck(SEED)] * 2
    calls = []
    for client in c.clients:
        original = client.contribute
        client.contribute = lambda *a, original=original: calls.append(a[0]) or original(*a)
    for n in (1, 6):
        values = _values(rng, 2, n, ring_bits)
        loss = [[2**62 + int(rng.integers(0, 2**20)), -3], [2**62 + 5, -2**63]]  # sums beyond 64 bits
        for check in (checks, [None, None]):
            calls.clear()
            results = _rider_round(c, check, n, ring_bits, values, loss)
            assert len(calls) == 2, (calls, results)  # one call per owner
            for result in results:
                assert not isinstance(result, Exception), result
                np.testing.assert_array_equal(result[0], np.sum(values, axis=0))
                assert [int(v) for v in result[1]] == [loss[0][0] + loss[1][0], loss[0][1] + loss[1][1]]
    per = {32: 1, 64: 1, 128: 2}[ring_bits]
    c.server1.tamper = _add_to_element(per * 6, 1, step=9)  # the first rider limb (64-bit word index)
    if ring_bits == 32:
        c.server1.tamper = _add_to_element(3, 1, step=9)  # 32-bit lanes: elements 6 and 7 share word 3
    results = _rider_round(c, checks, 9, ring_bits, _values(rng, 2, 6, ring_bits), [[1], [2]])
    assert all(isinstance(r, SumIntegrityError) for r in results), results


def test_mutation_a_check_over_the_host_elements_only_accepts_a_tampered_rider(cluster, monkeypatch):
    # Plant the weakness: the check covers the host's n elements, not its riders; a changed loss then passes.
    c = cluster(2)
    c.server1.tamper = _add_to_element(6, 1, step=9)
    extend = SumCheck.extend

    def extend_host_only(self, channel, step, ring_bits, n, key, share, riders_=()):
        padded = sum_check._with_riders(key, share, n, ring_bits, riders_)  # pylint: disable=protected-access
        return extend(self, channel, step, ring_bits, n + len(riders_), key, padded)

    monkeypatch.setattr(SumCheck, "extend", extend_host_only)
    monkeypatch.setattr(sum_check, "check_pass", _host_only_check_pass(sum_check.check_pass, 6))
    results = _rider_round(c, [SumCheck(SEED)] * 2, 9, 64, _values(np.random.default_rng(3), 2, 6, 64), [[1], [2]])
    assert not any(isinstance(r, Exception) for r in results), results
    assert [int(r[1][0]) for r in results] == [4, 4]  # 1 + 2, changed by the server to 4


def _host_only_check_pass(real, host_elements):
    def check_host_only(words, in_elements, total, n, ring_bits, mask_key, coefficient_key, out, copy, **decode):
        return real(words, in_elements, total, min(n, host_elements), ring_bits, mask_key, coefficient_key, out,
                    copy, **decode)

    return check_host_only


def test_a_step_of_two_sums_is_one_call_per_owner_and_passes_the_graph_audit(cluster):
    # Through the real graph on chief:0: the gradients (64-bit ring) and the reported loss (the 128-bit ring, one
    # element) of a step; the loss rides in the gradients' call, both sums exact. worker:0 contributes from numpy
    # (this process's calls of one channel run one at a time).
    from tfe_estimator.audit.owner_graph import audit_owner_graph  # pylint: disable=import-outside-toplevel

    c = cluster(2)
    check = SumCheck(SEED)
    grads = [np.arange(6, dtype=np.float32).reshape(2, 3), np.ones((2, 3), np.float32)]
    losses = [2.5e6, -0.25]
    calls = []

    def chief():
        graph = tf.Graph()
        with graph.as_default():
            step = tf.compat.v1.placeholder(tf.int64, [])

            def contribute(*args):
                calls.append(args[0] + f" of {args[3]} elements")
                return c.clients[0].contribute(*args)

            g = contribution.service_sum([[tf.constant(grads[0])]], ["/cpu:0"], ["/cpu:0"], Encoding(64, 16, 2.0**20),
                                        tf.float32, "chief:0", "clip", 1.0, "sum_0", step, contribute,
                                        checks=lambda: check)
            loss = contribution.service_sum([[tf.constant(np.float32(losses[0]))]], ["/cpu:0"], ["/cpu:0"],
                                           Encoding(128, 20, 2.0**60), tf.float32, "chief:0", "scale", 1.0,
                                           "sum_1", step, contribute, checks=lambda: check)
            assert audit_owner_graph(graph) == 2
            with tf.compat.v1.Session(graph=graph) as session:
                return [session.run([g[0][0], loss[0][0]], {step: s}) for s in (0, 1)]

    def worker():
        for s in (0, 1):
            key, share = _masked((grads[1].reshape(-1) * 2**16).astype(np.int64), 64)
            limbs = riders.to_limbs(_vector([int(losses[1] * 2**20)], 128), 1, 128, 64)
            sum_check.checked_contribute(c.clients[1].contribute, check, "sum_0", s, 64, 6, key, share, reveal=True,
                                         riders=limbs)

    results = in_threads([chief, worker])
    assert not isinstance(results[1], Exception), results[1]
    assert not isinstance(results[0], Exception), getattr(results[0], "message", results[0])
    for g, loss in results[0]:
        np.testing.assert_allclose(g, grads[0] + grads[1])
        assert loss == pytest.approx(2.5e6 - 0.25)
    assert calls == [f"sum_0 of {6 + 4 + CHECK_WORDS} elements"] * 2, calls  # the loss's 4 limbs ride


def test_a_revealed_sum_reuses_an_array_only_once_nothing_holds_it():
    # The arrays handed to TensorFlow are reused (no fresh page-faulted array per step at 1e6), but never while
    # anything (a tensor over it) still references the previous sum: that sum keeps its values.
    n, check = 1000, SumCheck(SEED)

    def reveal(values):
        key, share = _masked(values, 64)
        extended = check.extend("sum_0", 1, 64, n, key, share)
        return check.verify("sum_0", 1, 64, n, key, extended.copy())  # blind key = key: the owner's own vector

    first = reveal(np.arange(n))
    address = first.ctypes.data
    del first
    again = reveal(np.arange(n) + 1)
    assert again.ctypes.data == address  # reused
    held = again[:n].view(np.int64)  # e.g. a tensor over it
    third = reveal(np.arange(n) + 2)
    assert third.ctypes.data != address
    np.testing.assert_array_equal(held, np.arange(n) + 1)
    np.testing.assert_array_equal(third[:n].view(np.int64), np.arange(n) + 2)


def test_mutation_reusing_an_array_still_held_overwrites_the_earlier_sum(monkeypatch):
    monkeypatch.setattr(sum_check.sys, "getrefcount", lambda obj: 0)  # plant it: every array looks free
    with pytest.raises(AssertionError):
        test_a_revealed_sum_reuses_an_array_only_once_nothing_holds_it()
