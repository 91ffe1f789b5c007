"""tfe_estimator's own kernels: the AES-CTR generator, the fused Pond sum, the build."""
import os
import pathlib
import shutil
import subprocess

import numpy as np
import pytest
import tensorflow as tf
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
from scipy import stats

from tfe_estimator.secure import kernels
from tfe_estimator.secure.kernels import _build, ops


def _run(fetches, feed=None, threads=2):
    config = tf.compat.v1.ConfigProto(intra_op_parallelism_threads=threads, inter_op_parallelism_threads=1)
    with tf.compat.v1.Session(config=config) as sess:
        return sess.run(fetches, feed)


def _aes_ctr(key: bytes, counter: bytes, n: int) -> bytes:
    return Cipher(algorithms.AES(key), modes.CTR(counter)).encryptor().update(bytes(n))


def _bytes(array) -> np.ndarray:
    return np.frombuffer(bytes(array), np.uint8)


def test_known_answer_test_passes_at_load():
    with tf.Graph().as_default():
        report = _run(kernels.load().tfe_aes_self_test())
    assert b"NIST SP 800-38A F.5.1" in report and b"passed" in report


def test_nist_vector_through_the_keystream_op():
    # NIST SP 800-38A F.5.1: ciphertext = plaintext XOR keystream.
    key = bytes.fromhex("2b7e151628aed2a6abf7158809cf4f3c")
    counter = bytes.fromhex("f0f1f2f3f4f5f6f7f8f9fafbfcfdfeff")
    plain = bytes.fromhex("6bc1bee22e409f96e93d7e117393172aae2d8a571e03ac9c9eb76fac45af8e51")
    cipher = bytes.fromhex("874d6191b620e3261bef6864990db6ce9806f66b7970fdff8617187bb9fffdff")
    with tf.Graph().as_default():
        stream = _run(ops.keystream(_bytes(key), _bytes(counter), 32))
    assert bytes(a ^ b for a, b in zip(plain, stream)) == cipher


@pytest.mark.parametrize("trial", range(4))
def test_keystream_equals_cryptography_for_random_keys(trial):
    rng = np.random.RandomState(trial)
    key, counter = rng.bytes(16), rng.bytes(16)
    if trial == 0:  # a counter that wraps its low 64 bits and carries
        counter = rng.bytes(8) + b"\xff" * 8
    n = int(rng.randint(1, 5000))
    with tf.Graph().as_default():
        stream = _run(ops.keystream(_bytes(key), _bytes(counter), n))
    assert stream.tobytes() == _aes_ctr(key, counter, n)


def test_a_failed_self_test_refuses_to_load():
    class BrokenLibrary:  # a cipher whose known-answer test fails
        @staticmethod
        def tfe_aes_self_test():
            return tf.raw_ops.Assert(condition=False, data=["known-answer test failed"])

    with pytest.raises(kernels.KernelSelfTestError, match="known-answer test failed"):
        kernels._self_test(tf, BrokenLibrary)  # pylint: disable=protected-access


def _mask_and_key(x, ring_bits, fraction_bits=32, bound=2.0**24):
    share, seed = ops.mask_share(tf.constant(x), bound, ring_bits, fraction_bits, "replica 0", "hint")
    return share, seed


@pytest.mark.parametrize("ring_bits", [64, 128])
def test_share_plus_the_seeds_keystream_is_the_encoding(ring_bits):
    # share = enc(x) - AES-CTR(seed) mod 2**R, with element i's mask the
    # keystream bytes [i*R/8, (i+1)*R/8) read little-endian, from counter 0.
    x = np.random.RandomState(0).randn(1000).astype(np.float32) * 100
    with tf.Graph().as_default():
        share, seed = _run(_mask_and_key(x, ring_bits))
    key = seed.astype("<i4").tobytes()
    words = ring_bits // 64
    mask = np.frombuffer(_aes_ctr(key, bytes(16), x.size * words * 8), "<u8").reshape(x.size, words)
    share = share.reshape(x.size, words).astype(np.uint64)
    mod = 2**ring_bits
    for i in range(0, x.size, 37):
        s = sum(int(share[i, w]) << (64 * w) for w in range(words))
        m = sum(int(mask[i, w]) << (64 * w) for w in range(words))
        value = (s + m) % mod
        value = value - mod if value >= mod // 2 else value
        assert value == int(np.float64(x[i]) * 2**32)  # truncation toward zero, like tf.cast


@pytest.mark.parametrize("ring_bits", [32, 64, 128])
def test_a_key_drawn_before_masks_the_share_and_is_its_seed(ring_bits):
    # mask_share(key=aes_seed()): the key is drawn by its own op (it may leave the graph while the values are
    # computed) and the share is the same function of the values and that key as with a fresh one.
    x = np.random.RandomState(1).randn(999).astype(np.float32) * 100
    with tf.Graph().as_default():
        key = ops.aes_seed()
        share, seed = ops.mask_share(tf.constant(x), 2.0**10, ring_bits, 16, "replica 0", "hint", key=key)
        given = ops.mask_share(tf.constant(x), 2.0**10, ring_bits, 16, "replica 0", "hint",
                               key=tf.constant([1, 2, 3, 4], tf.int32))
        with tf.compat.v1.Session() as sess:
            drawn, share, seed, (given_share, given_seed) = sess.run([key, share, seed, given])
    np.testing.assert_array_equal(seed, drawn)
    np.testing.assert_array_equal(given_seed, [1, 2, 3, 4])
    for words, key_bytes in ((share, drawn), (given_share, np.array([1, 2, 3, 4], "<i4"))):
        masked = np.ascontiguousarray(words).reshape(-1).view(np.uint8)
        stream = np.frombuffer(_aes_ctr(key_bytes.astype("<i4").tobytes(), bytes(16), masked.nbytes), np.uint8)
        if ring_bits == 32:  # one 32-bit lane per element (random rounding: within one unit of the encoding)
            lanes = (masked.view("<u4").astype(np.uint64) + stream.view("<u4")) % 2**32
            values = np.where(lanes >= 2**31, lanes.astype(np.int64) - 2**32, lanes.astype(np.int64))[:x.size]
            assert np.all(np.abs(values - np.float64(x) * 2**16) <= 1)
        else:
            lanes = masked.view("<u8") + stream.view("<u8")
            np.testing.assert_array_equal(lanes.view("<i8")[::ring_bits // 64][:x.size],
                                          (np.float64(x) * 2**16).astype(np.int64))


def test_a_key_of_another_shape_is_refused_by_name():
    with tf.Graph().as_default():
        share, _ = ops.mask_share(tf.constant([1.0]), 2.0**24, 64, 16, "replica 0", "hint",
                                  key=tf.constant([1, 2, 3], tf.int32))
        with tf.compat.v1.Session() as sess, pytest.raises(tf.errors.InvalidArgumentError,
                                                           match=r"key must be int32\[4\], got shape \[3\]"):
            sess.run(share)


def test_masks_are_fresh_on_every_run_and_every_replica():
    x = np.zeros(256, np.float32)
    with tf.Graph().as_default():
        a, b = _mask_and_key(x, 64), _mask_and_key(x, 64)
        config = tf.compat.v1.ConfigProto(intra_op_parallelism_threads=2)
        with tf.compat.v1.Session(config=config) as sess:
            runs = [sess.run([a, b]) for _ in range(3)]
    seeds = {tuple(run[k][1]) for run in runs for k in (0, 1)}
    shares = {run[k][0].tobytes() for run in runs for k in (0, 1)}
    assert len(seeds) == 6 and len(shares) == 6


@pytest.mark.parametrize("ring_bits", [64, 128])
def test_output_is_identical_for_any_number_of_threads(ring_bits):
    rng = np.random.RandomState(1)
    n = 50_000  # several 4096-word chunks, and a partial one
    seeds = [rng.randint(-2**31, 2**31, size=4).astype(np.int32) for _ in range(2)]
    share = rng.randint(-2**63, 2**63 - 1, size=(n,) if ring_bits == 64 else (n, 2), dtype=np.int64)
    outputs = []
    for threads in (1, 2, 4):
        with tf.Graph().as_default():
            total = ops.server_sum([tf.constant(s) for s in seeds], [tf.constant(share)], ring_bits, n)
            values = ops.reveal_sum(total, tf.constant(share), tf.float64, ring_bits, 32)
            outputs.append(_run([total, values], threads=threads))
    for total, values in outputs[1:]:
        np.testing.assert_array_equal(total, outputs[0][0])
        np.testing.assert_array_equal(values, outputs[0][1])


@pytest.mark.parametrize("ring_bits", [32, 64, 128])
def test_decoding_one_revealed_part_equals_revealing_it_with_a_part_of_zeros(ring_bits):
    # What a service-mode owner's graph decodes (its answer unmasked in the call): `decode_sum` of the words alone,
    # bit for bit what `reveal_sum` of the words and a tensor of zeros gave (what it built before), in every ring,
    # dtype and split, extreme words included; an integer sum that does not fit still fails.
    rng = np.random.RandomState(3)
    n = 9_001  # several chunks, a partial one, an odd count (the 32-bit ring's padding lane)
    words = rng.randint(-2**63, 2**63 - 1, size=(n,) if ring_bits != 128 else (n, 2), dtype=np.int64)
    if ring_bits == 32:
        words = words[:(n + 1) // 2]
        words[-1] &= 0xFFFFFFFF  # the padding lane encodes 0
    words.reshape(-1)[:2] = [-2**63, 2**63 - 1]
    shapes = [[3, 1000], [n - 3000]]
    with tf.Graph().as_default():
        revealed = tf.constant(words)
        pairs = [(ops.decode_sum(revealed, dtype, ring_bits, 32, scale, shapes),
                  ops.reveal_sum(revealed, tf.zeros_like(revealed), dtype, ring_bits, 32, scale, shapes))
                 for dtype, scale in ((tf.float32, 1.0), (tf.float64, 0.5))]
        small = np.zeros_like(words)
        small.reshape(words.shape[0], -1)[:, 0] = np.arange(words.shape[0])  # small integers (the low word)
        small = tf.constant(small if ring_bits != 32 else small & 0xFFFF)  # 32-bit ring: two small lanes a word
        pairs.append((ops.decode_sum(small, tf.int64, ring_bits, 0, 1.0, shapes),
                      ops.reveal_sum(small, tf.zeros_like(small), tf.int64, ring_bits, 0, 1.0, shapes)))
        results = _run(pairs)
        with pytest.raises(tf.errors.InvalidArgumentError, match="does not fit int32"):
            _run(ops.decode_sum(revealed, tf.int32, 64, 0, 1.0, [[words.size]]))
    for one, two in results:
        for a, b in zip(one, two):
            assert a.dtype == b.dtype and a.shape == b.shape
            np.testing.assert_array_equal(a.view(np.uint8), b.view(np.uint8))


@pytest.mark.parametrize("dtype", [tf.int32, tf.int64])
def test_seeded_uniform_is_deterministic_and_in_range(dtype):
    with tf.Graph().as_default():
        lib = kernels.load()
        seed = tf.constant([1, 2, 3, 4], tf.int32)
        draw = lambda s: lib.tfe_aes_seeded_random_uniform([60_000], s, tf.constant(-3, dtype), tf.constant(4, dtype))
        a, b, c = _run([draw(seed), draw(seed), draw(seed + 1)])
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, c)
    assert a.min() == -3 and a.max() == 3
    counts = np.bincount(a + 3, minlength=7)
    assert stats.chisquare(counts).pvalue > 1e-6


def test_full_range_int64_uniform_covers_both_halves_of_the_ring():
    with tf.Graph().as_default():
        lib = kernels.load()
        draws = [lib.tfe_aes_random_uniform([20_000], tf.constant(-2**63, tf.int64), tf.constant(2**63 - 1, tf.int64))
                 for _ in range(2)]
        a, b = _run(draws)
    assert not np.array_equal(a, b)
    top = (a.view(np.uint64) >> np.uint64(58)).astype(np.int64)  # the top 6 bits
    assert stats.chisquare(np.bincount(top, minlength=64)).pvalue > 1e-6


def test_bad_bounds_are_refused():
    with tf.Graph().as_default():
        lib = kernels.load()
        draw = lib.tfe_aes_random_uniform([3], tf.constant(5, tf.int32), tf.constant(5, tf.int32))
        with pytest.raises(tf.errors.InvalidArgumentError, match="minval must be below maxval"):
            _run(draw)


def test_random_ops_are_never_constant_folded():
    # A stateful op runs anew on every session.run; Grappler may not fold it.
    with tf.Graph().as_default():
        seed = kernels.load().tfe_aes_seed()
        config = tf.compat.v1.ConfigProto()
        with tf.compat.v1.Session(config=config) as sess:
            assert not np.array_equal(sess.run(seed), sess.run(seed))


def test_cache_key_depends_on_the_sources_contents_not_their_path(tmp_path):
    # Prepare: two copies of the sources in different directories, and a third with one byte changed.
    copies = [tmp_path / "checkout-a" / "src", tmp_path / "elsewhere" / "b" / "src", tmp_path / "edited" / "src"]
    for copy in copies:
        shutil.copytree(_build.SOURCE_DIR, copy)
    edited = sorted(copies[2].glob("*.cc"))[0]
    edited.write_text(edited.read_text() + "\n// edited\n")
    # Execute
    keys = [_build.cache_key(copy) for copy in copies]
    # Assert
    assert keys[0] == keys[1] == _build.cache_key()
    assert keys[2] != keys[0]
    assert str(tmp_path) not in keys[0] and str(_build.SOURCE_DIR) not in keys[0]


def test_library_is_cached_per_tensorflow_and_source(tmp_path, monkeypatch):
    path = _build.library_path()
    assert f"tf{tf.__version__}" in str(path) and path.exists()
    monkeypatch.setenv(_build.CACHE_ENV, str(tmp_path))
    assert _build.library_path().parent.parent == tmp_path


def test_missing_compiler_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv(_build.CACHE_ENV, str(tmp_path))
    monkeypatch.setenv("CXX", "no-such-compiler-here")
    with pytest.raises(kernels.KernelBuildError, match="No C\\+\\+ compiler 'no-such-compiler-here'.*apt-get install g\\+\\+"):
        _build.build()


def test_failed_compile_names_the_command_and_the_fix(tmp_path, monkeypatch):
    monkeypatch.setenv(_build.CACHE_ENV, str(tmp_path))
    monkeypatch.setenv("CXX", "false")  # a "compiler" that always fails
    with pytest.raises(kernels.KernelBuildError) as info:
        _build.build()
    text = str(info.value)
    assert "false -c -fPIC" in text and "tfe-estimator build-kernels" in text
    assert not list(pathlib.Path(tmp_path).rglob("*.so"))  # nothing half-built left behind


def _fake_compiler(tmp_path):
    """A "compiler" that only creates its ``-o`` output: a build in milliseconds, with its own cache key."""
    path = tmp_path / "fake-g++"
    path.write_text('#!/bin/sh\nwhile [ $# -gt 0 ]; do [ "$1" = -o ] && : > "$2"; shift; done\n')
    path.chmod(0o755)
    return str(path)


def test_a_build_is_announced_before_it_starts_and_when_it_ends_and_not_when_cached(tmp_path, monkeypatch, capsys):
    """Issue 41: the first training compiled for three silent minutes."""
    monkeypatch.setenv(_build.CACHE_ENV, str(tmp_path / "cache"))
    monkeypatch.setenv("CXX", _fake_compiler(tmp_path))
    said_before = []
    real_compile = _build._compile
    monkeypatch.setattr(_build, "_compile", lambda command: (said_before.append(capsys.readouterr().err),
                                                             real_compile(command)))
    path = _build.build()
    assert path.exists()
    assert len(said_before) == len(_build._sources()) + 1 and not any(said_before[1:])  # objects, then the link
    assert said_before[:1] == [
        f"tfe_estimator: compiling tfe_estimator's kernels for TensorFlow {tf.__version__} (once per TensorFlow "
        f"version, cached in {path.parent}; about {_build.BUILD_MINUTES} minutes on 2 cores; `tfe-estimator "
        "build-kernels` does it ahead)\n"]
    assert capsys.readouterr().err.startswith("tfe_estimator: compiled tfe_estimator's kernels in ")
    assert _build.build() == path and capsys.readouterr().err == ""  # cached: silent


def test_a_process_waiting_for_another_ones_build_says_so(tmp_path, monkeypatch, capsys):
    import fcntl
    import threading

    monkeypatch.setenv(_build.CACHE_ENV, str(tmp_path / "cache"))
    monkeypatch.setenv("CXX", _fake_compiler(tmp_path))
    target = _build.library_path()
    target.parent.mkdir(parents=True)
    with open(target.parent / ".lock", "w") as held:  # another task of the cluster is compiling
        fcntl.flock(held, fcntl.LOCK_EX)
        waiter = threading.Thread(target=_build.build)
        waiter.start()
        waiter.join(timeout=0.5)
        assert waiter.is_alive()  # it waits for the lock
        said = capsys.readouterr().err
        assert said == (f"tfe_estimator: waiting for another process to compile tfe_estimator's kernels into "
                        f"{target.parent} (about {_build.BUILD_MINUTES} minutes)\n")
    waiter.join(timeout=60)
    assert not waiter.is_alive() and target.exists()


@pytest.mark.parametrize("call, compiles", [
    ("if (!tfe_estimator::AesCtrKeystream(key, 0, 0, out, 16)) return 1;", True),
    ("tfe_estimator::AesCtrKeystream(key, 0, 0, out, 16);", False),  # the planted unchecked call
    ("tfe_estimator::FreshKey(key);", False),
])
def test_an_unchecked_cipher_call_does_not_build(call, compiles, tmp_path):
    source = tmp_path / "probe.cc"
    source.write_text('#include "aes_ctr.h"\nint probe(uint8_t* key, uint8_t* out) {\n  '
                      + call + "\n  return 0;\n}\n")
    result = subprocess.run([*_build.compile_flags(), f"-I{_build.SOURCE_DIR}", "-c", str(source), "-o", os.devnull],
                            capture_output=True, text=True, timeout=120)
    assert (result.returncode == 0) == compiles, result.stderr[-2000:]
    if not compiles:
        assert "unused-result" in result.stderr or "warn_unused_result" in result.stderr
