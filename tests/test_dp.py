"""Differential privacy with distributed noise (tfe_estimator.privacy.dp, TfeDiscreteGaussian, model_fns' DP path).

Statistical tests state their tolerance; each has a fixed false-alarm
probability (below 1e-4 unless stated) because the noise comes from
RAND_bytes-keyed AES-CTR and cannot be seeded.
"""
import importlib.util
import logging
import math
import pathlib

import numpy as np
import pytest
import tensorflow as tf
from scipy import stats

import tfe_estimator
from tfe_estimator.privacy import dp as dp_lib

DP_STACK = tuple(int(p) for p in tf.__version__.split(".")[:2]) >= (2, 14) and all(
    importlib.util.find_spec(m) for m in ("tensorflow_privacy", "dp_accounting"))
needs_dp = pytest.mark.skipif(
    not DP_STACK, reason=f"DP needs tensorflow-privacy 0.9.0 (TensorFlow >= 2.14); this is TensorFlow {tf.__version__}")


def _session(threads=2):
    return tf.compat.v1.Session(config=tf.compat.v1.ConfigProto(
        intra_op_parallelism_threads=threads, inter_op_parallelism_threads=1))


# --------------------------------------------------------------- settings --


@pytest.mark.skipif(DP_STACK, reason="this stack has tensorflow-privacy; the refusal is for TF < 2.14")
def test_distributed_dp_refuses_clearly_without_the_dp_stack():
    with pytest.raises(NotImplementedError, match=r"TensorFlow >= 2\.14.*TensorFlow 2\.\d+.*Fix: use the default stack"):
        tfe_estimator.DistributedDP(1.0, 1.1)


@needs_dp
@pytest.mark.parametrize("kwargs, error, match", [
    ({"l2_norm_clip": 0.0, "noise_multiplier": 1.0}, ValueError, r"l2_norm_clip must be > 0, got 0\.0"),
    ({"l2_norm_clip": -1, "noise_multiplier": 1.0}, ValueError, r"l2_norm_clip must be > 0"),
    ({"l2_norm_clip": 1.0, "noise_multiplier": -0.5}, ValueError, r"noise_multiplier must be >= 0, got -0\.5"),
    ({"l2_norm_clip": "1", "noise_multiplier": 1.0}, TypeError, r"l2_norm_clip must be a number, got '1'"),
    ({"l2_norm_clip": 1.0, "noise_multiplier": None}, TypeError, r"noise_multiplier must be a number"),
    ({"l2_norm_clip": True, "noise_multiplier": 1.0}, TypeError, r"l2_norm_clip must be a number"),
    ({"l2_norm_clip": 1.0, "noise_multiplier": float("nan")}, ValueError, r"noise_multiplier must be finite"),
    ({"l2_norm_clip": 1.0, "noise_multiplier": 1.0, "num_examples": 0}, ValueError, r"num_examples must be >= 1"),
    ({"l2_norm_clip": 1.0, "noise_multiplier": 1.0, "num_examples": 10.5}, TypeError, r"num_examples must be an integer"),
    ({"l2_norm_clip": 1.0, "noise_multiplier": 1.0, "delta": 1.0}, ValueError, r"delta must be in \(0, 1\)"),
])
def test_bad_settings_are_refused(kwargs, error, match):
    with pytest.raises(error, match=match):
        tfe_estimator.DistributedDP(**kwargs)


@needs_dp
def test_zero_noise_is_allowed_with_a_warning(caplog):
    with caplog.at_level(logging.WARNING, logger="tfe_estimator"):
        dp = tfe_estimator.DistributedDP(l2_norm_clip=2, noise_multiplier=0)
    assert "NOT differentially private" in caplog.text
    assert dp.noise_multiplier == 0.0 and dp.l2_norm_clip == 2.0
    with pytest.raises(dataclasses_frozen_error()):
        dp.noise_multiplier = 1.0  # frozen


def dataclasses_frozen_error():
    import dataclasses  # pylint: disable=import-outside-toplevel

    return dataclasses.FrozenInstanceError


# ------------------------------------------------------------- accounting --


@needs_dp
@pytest.mark.parametrize("multiplier, batch, examples, steps, delta", [
    (1.1, 64, 60000, 1000, 1e-5), (0.7, 256, 60000, 15000, 1e-5), (2.0, 10, 426, 300, 1e-5)])
def test_dp_epsilon_equals_dp_accounting(multiplier, batch, examples, steps, delta):
    import dp_accounting  # pylint: disable=import-outside-toplevel

    event = dp_accounting.SelfComposedDpEvent(
        dp_accounting.PoissonSampledDpEvent(batch / examples, dp_accounting.GaussianDpEvent(multiplier)), steps)
    expected = dp_accounting.rdp.RdpAccountant().compose(event).get_epsilon(delta)
    assert tfe_estimator.dp_epsilon(multiplier, batch, examples, steps, delta) == expected
    # More steps or less noise spend more.
    assert tfe_estimator.dp_epsilon(multiplier, batch, examples, 2 * steps, delta) > expected
    assert tfe_estimator.dp_epsilon(multiplier / 2, batch, examples, steps, delta) > expected


@needs_dp
def test_dp_epsilon_edge_cases():
    assert tfe_estimator.dp_epsilon(0.0, 10, 100, 5, 1e-5) == math.inf
    assert tfe_estimator.dp_epsilon(1.0, 10, 100, 0, 1e-5) == 0.0
    with pytest.raises(ValueError, match="global_batch_size <= num_examples"):
        tfe_estimator.dp_epsilon(1.0, 200, 100, 5, 1e-5)


# ------------------------------------------------------ the noise sampler --


def _discrete_gaussian(n, variance, margin_log2=40, check=False):
    from tfe_estimator.secure.kernels import ops  # pylint: disable=import-outside-toplevel

    with tf.Graph().as_default():
        noise = ops.discrete_gaussian(n, variance, fast_path_margin_log2=margin_log2, check_fast_paths=check)
        with _session() as sess:
            return sess.run(noise), sess.run(noise)


# margin 2**-40: the double-precision bounds decide almost every Bernoulli(exp); margin 2**-2:
# about half of them go to the exact multi-precision path, which must give the same pmf.
@pytest.mark.parametrize("variance, margin_log2, n", [
    (1.0, 40, 200000), (2.0, 40, 200000), (5.0, 40, 200000), (30.0, 40, 200000), (2.0, 2, 40000),
    (30.0, 2, 40000)])
def test_sampler_matches_the_exact_discrete_gaussian_pmf(variance, margin_log2, n):
    # Chi-square goodness of fit against Pr[x] ~ exp(-x^2 / (2 variance)), alpha = 1e-4.
    samples, _ = _discrete_gaussian(n, variance, margin_log2)
    support = np.arange(-12 * int(math.sqrt(variance) + 1), 12 * int(math.sqrt(variance) + 1) + 1)
    pmf = np.exp(-support.astype(float) ** 2 / (2 * variance))
    pmf /= pmf.sum()
    keep = pmf * len(samples) >= 20  # pool the tails into one cell
    observed = np.array([np.sum(samples == x) for x in support[keep]] + [np.sum(~np.isin(samples, support[keep]))])
    expected = np.append(pmf[keep], pmf[~keep].sum()) * len(samples)
    assert stats.chisquare(observed, expected).pvalue > 1e-4


def _assert_gaussian_with_variance(samples, variance):
    z = samples.astype(np.float64) / math.sqrt(variance)
    # Standard error of the std estimate: 1/sqrt(2n) (0.16 % at n = 2e5); tolerance 5 se
    # (alpha < 1e-6); the mean within 5 se; Kolmogorov-Smirnov against N(0, 1) at alpha = 1e-4.
    assert abs(z.std() - 1.0) < 5 / math.sqrt(2 * len(z)), z.std()
    assert abs(z.mean()) < 5 / math.sqrt(len(z)), z.mean()
    assert stats.kstest(z, "norm").pvalue > 1e-4


# 2**40 (the floor), 2**64, 2**88 (where the old `t << 20` wrapped) and the cap 2**100.
@pytest.mark.parametrize("variance", [2.0**40, 2.0**64, 1.21 * 2.0**64 + 2.0**20, 2.0**88, 2.0**88 + 2.0**60,
                                      dp_lib.MAX_REPLICA_VARIANCE])
def test_sampler_at_ring_scale_is_gaussian_with_the_stated_variance(variance):
    samples, again = _discrete_gaussian(200000, variance)
    _assert_gaussian_with_variance(samples, variance)
    assert not np.array_equal(samples, again)  # a fresh key on every run


@needs_dp
def test_the_issues_overflowing_configuration_adds_its_noise():
    # l2_norm_clip=4096, noise_multiplier=2, 4 replicas at "low" (64-bit ring, F = 32, bound 2**24):
    # per-replica variance ~ 2**88.4, where the old sampler's std was 2**24.2 instead of 2**44.
    dp = tfe_estimator.DistributedDP(l2_norm_clip=4096, noise_multiplier=2)
    variance = dp_lib.check_noise_headroom(dp, 4, 64, 32, 2.0**24, 1000)
    assert variance >= (2 * 4096 * 2.0**32) ** 2 / 3  # sigma^2 / (N - t), t = 1
    samples, _ = _discrete_gaussian(20000, variance)
    _assert_gaussian_with_variance(samples, variance)


_MUTANT_RUNNER = r"""
import math, pathlib, shutil, sys
import numpy as np
from tfe_estimator.secure.kernels import _build
src = pathlib.Path(sys.argv[1])
_build.SOURCE_DIR = src
_build.OPTIMIZATION = "-O1"  # the mutant compiles ~3x faster; same values
import tensorflow as tf
from tfe_estimator.secure.kernels import ops
with tf.Graph().as_default():
    noise = ops.discrete_gaussian(int(sys.argv[3]), float(sys.argv[2]))
    with tf.compat.v1.Session() as sess:
        print("STD", np.asarray(sess.run(noise), np.float64).std() / math.sqrt(float(sys.argv[2])))
"""


#: The sources a mutant library is built from (`_run_mutant`).
_MUTANT_SOURCES = ("noise_ops.cc", "random_ops.cc")

#: Read by a mutant library built with several mutations (`_switched`): which one is planted in this process.
_MUTATION_ENV = "TFE_TEST_MUTATION"
_MUTATION_SWITCH = """
#include <cstdlib>
// Test build: which planted mutation runs ($TFE_TEST_MUTATION; 0: none).
static int TfeTestMutation() {
  static const int planted = std::getenv("TFE_TEST_MUTATION") ? std::atoi(std::getenv("TFE_TEST_MUTATION")) : 0;
  return planted;
}
"""


def _switched(old, new, number):
    """C++ that runs `new` (verbatim) where mutation `number` is planted and `old` otherwise.

    A declaration ``const T x = ...;`` keeps one declaration and chooses its initializer; another statement
    becomes ``if (...) { new } else { old }``; an expression becomes ``(... ? (new) : (old))``.
    """
    on = f"TfeTestMutation() == {number}"
    if old.startswith("const ") and old.endswith(";"):
        (lhs, old_rhs), (new_lhs, new_rhs) = old[:-1].split(" = ", 1), new[:-1].split(" = ", 1)
        assert lhs == new_lhs, (old, new)
        return f"{lhs} = {on} ? ({new_rhs}) : ({old_rhs});"
    if old.endswith(";"):
        return f"if ({on}) {{ {new} }} else {{ {old} }}"
    return f"({on} ? ({new}) : ({old}))"


def _run_mutant(tmp_path, cache, old, new, runner, args, timeout):
    """Stdout of `runner` (a script: kernel source dir, then `args`) on the kernels with `old` -> `new`, built in
    `cache` (conftest's `mutant_kernel_cache`).

    A mutation in `SWITCHED_MUTATIONS` runs in one library built with all of them, each behind a test-only
    switch (`_switched`) that this process sets to it alone: one compile of noise_ops.cc serves them all. Any
    other mutation (a constant expression) is planted by plain replacement and compiled on its own.
    """
    import os  # pylint: disable=import-outside-toplevel
    import shutil  # pylint: disable=import-outside-toplevel
    import subprocess  # pylint: disable=import-outside-toplevel
    import sys  # pylint: disable=import-outside-toplevel

    from tfe_estimator.secure.kernels import _build  # pylint: disable=import-outside-toplevel

    # Only what the runner loads: the noise op and the AES self-test `kernels.load()` runs (random_ops.cc), with
    # the headers; the secure-sum sources would only add compile time to the first mutant.
    src = tmp_path / "src"
    src.mkdir()
    for path in [*_build.SOURCE_DIR.glob("*.h"), *(_build.SOURCE_DIR / name for name in _MUTANT_SOURCES)]:
        shutil.copy(path, src)
    code = (src / "noise_ops.cc").read_text()
    plant = SWITCHED_MUTATIONS if (old, new) in SWITCHED_MUTATIONS else [(old, new)]
    for number, (was, planted) in enumerate(plant, 1):
        assert code.count(was) == 1, "the mutation no longer applies: update the test with the sampler"
        code = code.replace(was, _switched(was, planted, number) if plant is SWITCHED_MUTATIONS else planted)
    if plant is SWITCHED_MUTATIONS:
        code = code.replace('#include "common.h"\n', '#include "common.h"\n' + _MUTATION_SWITCH, 1)
    (src / "noise_ops.cc").write_text(code)
    # One cache for every mutant of this run (every xdist worker's too): the sources a mutation
    # leaves alone compile once, the switched library once (its key is its sources' contents, not their
    # directory), and a mutant of its own compiles only its noise_ops.cc.
    env = dict(os.environ, TFE_ESTIMATOR_KERNEL_CACHE=str(cache))
    env[_MUTATION_ENV] = str(SWITCHED_MUTATIONS.index((old, new)) + 1 if plant is SWITCHED_MUTATIONS else 0)
    return subprocess.run([sys.executable, "-c", runner, str(src), *map(str, args)], env=env,
                          capture_output=True, text=True, timeout=timeout, check=True).stdout


def _mutant_std(tmp_path, cache, old, new, variance, n):
    """Std / sqrt(variance) of `n` samples from a copy of the kernels with `old` replaced by `new`."""
    out = _run_mutant(tmp_path, cache, old, new, _MUTANT_RUNNER, (repr(variance), n), timeout=600)
    return float(out.split("STD")[-1])


#: The old kind of overflow, planted back: a product that needs 128 bits (k^2 v, with v up to
#: 2^100) computed in 64 bits, as the old `t << 20` was; here in the acceptance exponent's
#: (c^2 - k^2 v) / (2v), which the fast path uses.
OVERFLOW_MUTATION = ("return ToDouble(static_cast<u128>(c) * c - KSquaredV(k)) * inv_two_v_;",
                     "return ToDouble(static_cast<u128>(c) * c - static_cast<uint64_t>(k * k * static_cast<uint64_t>(v_))) "
                     "* inv_two_v_;")


@pytest.mark.slow
def test_mutation_a_64_bit_product_fails_the_sampler_test_at_2_88(tmp_path, mutant_kernel_cache):
    # The correct kernel gives std / sqrt(v) = 1 at 2**88 (tested above, 5 standard errors);
    # with k^2 v wrapped modulo 2^64 it does not (at 2**40 the mutation is inert).
    std = _mutant_std(tmp_path, mutant_kernel_cache, *OVERFLOW_MUTATION, 2.0**88, 2000)
    with pytest.raises(AssertionError):
        assert abs(std - 1.0) < 5 / math.sqrt(2 * 2000), std


# Every decision of a fast path (the k table's 32-bit bounds, the exp(-x) Taylor and std::exp
# bounds) taken again by the exact multi-precision path with the same uniform bits: the op
# fails on any disagreement. Margin 2**-40 (production) and 2**-3 (wide bands: more decisions
# near the bounds reach the exact path, and the fast ones that remain are checked).
@pytest.mark.parametrize("variance, margin_log2", [
    (1.0, 40), (2.0, 40), (30.0, 40), (30.0, 3), (2.0**40, 40), (1.21 * 2.0**64 + 2.0**20, 40), (2.0**88, 40),
    (2.0**88, 3), (dp_lib.MAX_REPLICA_VARIANCE, 40)])
def test_sampler_fast_paths_agree_with_the_exact_path(variance, margin_log2):
    samples, _ = _discrete_gaussian(20000, variance, margin_log2, check=True)
    assert samples.shape == (20000,)


_CHECK_RUNNER = r"""
import pathlib, sys
import numpy as np
from tfe_estimator.secure.kernels import _build
_build.SOURCE_DIR = pathlib.Path(sys.argv[1])
_build.OPTIMIZATION = "-O1"  # the mutant compiles ~3x faster; same values
import tensorflow as tf
from tfe_estimator.secure.kernels import ops
with tf.Graph().as_default():
    noise = ops.discrete_gaussian(20000, float(sys.argv[2]), fast_path_margin_log2=int(sys.argv[3]),
                                  check_fast_paths=True)
    with tf.compat.v1.Session() as sess:
        try:
            sess.run(noise)
            print("RESULT ok")
        except tf.errors.OpError as e:
            print("RESULT failed:", e.message)
"""


def _mutant_check(tmp_path, cache, old, new, variance, margin_log2):
    """The op's check_fast_paths run ("ok" or "failed: <message>") on a copy of the kernels with `old` -> `new`."""
    out = _run_mutant(tmp_path, cache, old, new, _CHECK_RUNNER, (repr(variance), margin_log2), timeout=600)
    return out.split("RESULT ")[-1].strip()


#: Planted errors in the fast paths, each of which the exact re-decision must catch:
#: an upper bound of exp(-f) without its Lagrange remainder f^4/24 (it is then below exp(-f)
#: for every f > 0); and a k-table decision taken inside the band between a boundary's
#: bounds (visible with the wide bands of margin 2**-2).
FAST_PATH_MUTATIONS = {
    "exp_upper_bound_without_remainder": (
        "table_.hi[i] * (t3 + f2 * f2 * (1.0 / 24))", "table_.hi[i] * (t3)", 30.0, 40, "disagreed"),
    "k_table_decides_inside_the_band": (
        "const bool decided = c == kBoundaries || u < lo_[c];",
        "const bool decided = c == kBoundaries || u < hi_[c];", 30.0, 2, "disagreed"),
    "k_table_regions_above_one": (
        "kRNum = 23,", "kRNum = 24,", 30.0, 40, "do not fit"),
}


@pytest.mark.slow
@pytest.mark.parametrize("mutation", sorted(FAST_PATH_MUTATIONS))
def test_mutation_of_a_sampler_fast_path_fails_its_check(tmp_path, mutant_kernel_cache, mutation):
    old, new, variance, margin_log2, message = FAST_PATH_MUTATIONS[mutation]
    result = _mutant_check(tmp_path, mutant_kernel_cache, old, new, variance, margin_log2)
    assert result.startswith("failed") and message in result, result


#: A wrong k distribution planted in the table (both its fast bounds and the exact path):
#: regions of length c p^(k(k+1)) instead of c p^(k^2), which the statistical test must see.
K_TABLE_MUTATION = ("const uint64_t n = static_cast<uint64_t>(i) * i;",
                    "const uint64_t n = static_cast<uint64_t>(i) * (i + 1);")


@pytest.mark.slow
def test_mutation_of_the_sampler_k_table_fails_the_variance_test(tmp_path, mutant_kernel_cache):
    std = _mutant_std(tmp_path, mutant_kernel_cache, *K_TABLE_MUTATION, 30.0, 20000)
    with pytest.raises(AssertionError):
        assert abs(std - 1.0) < 5 / math.sqrt(2 * 20000), std


def _region_ends(variance, regions=8):
    """Karney's regions of |X| for N_Z(0, v): k's is [ceil(k sigma), ceil((k + 1) sigma)), exactly (integers).

    Returns (the first integers of regions 1.., the last integers of regions 0..).
    """
    v = int(variance)
    starts = [0] + [math.isqrt(k * k * v - 1) + 1 for k in range(1, regions + 1)]
    return np.array(starts[1:regions]), np.array(starts[1:regions + 1]) - 1


def _assert_region_boundary_counts(samples, variance):
    # The sampler builds |X| region by region (k, then m = ceil(k sigma) + j); an off-by-one at a
    # region's end or start removes (or doubles) 1 integer in sigma: invisible to the variance, tails
    # and chi-square tests at ring scale, but not to a count of samples at those integers. Each count
    # is Poisson with mean n Pr[|X| in set]; tolerance 5 of its standard deviations (alpha < 1e-6).
    v = float(variance)
    norm = 1 + 2 * sum(math.exp(-x * x / (2 * v)) for x in range(1, int(40 * math.sqrt(v))))
    magnitudes = np.abs(samples)
    for name, ends in zip(("first", "last"), _region_ends(variance)):
        expected = len(samples) * sum(2 * math.exp(-float(x) ** 2 / (2 * v)) for x in ends) / norm
        observed = int(np.isin(magnitudes, ends).sum())
        assert expected > 400, expected  # enough to see a missing integer
        assert abs(observed - expected) < 5 * math.sqrt(expected), (name, observed, expected)


#: Regions of about 1000 integers (sigma ~ 1000.9): 6e-4 of the samples fall on their last integers.
BOUNDARY_VARIANCE = 1001803.0


def test_sampler_puts_the_right_mass_on_every_region_boundary():
    samples, _ = _discrete_gaussian(3_000_000, BOUNDARY_VARIANCE)
    _assert_region_boundary_counts(samples, BOUNDARY_VARIANCE)


_BOUNDARY_RUNNER = r"""
import pathlib, sys
import numpy as np
from tfe_estimator.secure.kernels import _build
_build.SOURCE_DIR = pathlib.Path(sys.argv[1])
_build.OPTIMIZATION = "-O1"  # the mutant compiles ~3x faster; same values
import tensorflow as tf
from tfe_estimator.secure.kernels import ops
with tf.Graph().as_default():
    noise = ops.discrete_gaussian(int(sys.argv[3]), float(sys.argv[2]))
    with tf.compat.v1.Session() as sess:
        np.save(sys.argv[4], sess.run(noise))
"""

#: The last integer of each region dropped (m < ceil((k + 1) sigma) - 1), only where regions are
#: wider than 64 integers: ring-scale variances, where the variance, tails and lattice tests run (a
#: missing 1/sigma of the mass), while the chi-square tests (variance <= 30) and check_fast_paths see
#: the unmutated sampler.
REGION_END_MUTATION = ("ok &= (m < Ceil(k + 1)) & !((m == 0) & negative);",
                       "ok &= (m + (width_ > 64) < Ceil(k + 1)) & !((m == 0) & negative);")

#: The mutations one switched library serves (`_run_mutant`); the k table's regions above one change a
#: constant expression (kRNum) and build on their own.
SWITCHED_MUTATIONS = [OVERFLOW_MUTATION, K_TABLE_MUTATION, REGION_END_MUTATION] + [
    FAST_PATH_MUTATIONS[name][:2] for name in ("exp_upper_bound_without_remainder", "k_table_decides_inside_the_band")]


@pytest.mark.slow
def test_mutation_dropping_the_last_integer_of_each_region_fails_the_boundary_count(tmp_path, mutant_kernel_cache):
    path = tmp_path / "samples.npy"
    _run_mutant(tmp_path, mutant_kernel_cache, *REGION_END_MUTATION, _BOUNDARY_RUNNER,
                (repr(BOUNDARY_VARIANCE), 3_000_000, path), timeout=600)
    samples = np.load(path)
    _assert_gaussian_with_variance(samples[:200000], BOUNDARY_VARIANCE)  # the mutant passes this test
    with pytest.raises(AssertionError, match="last"):
        _assert_region_boundary_counts(samples, BOUNDARY_VARIANCE)


def test_sampler_refuses_a_non_integer_variance():
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"variance must be an integer in \[1, 2\*\*100\]"):
        _discrete_gaussian(4, 2.5)


@pytest.mark.parametrize("ring_bits", [64, 128])
def test_noise_is_added_in_the_ring_before_masking(ring_bits):
    from tfe_estimator.secure.kernels import ops  # pylint: disable=import-outside-toplevel

    x = np.array([0.5, -1.25, 3.0, 0.0], np.float32)
    noise = np.array([7, -(2**40), 2**62, -1], np.int64)
    with tf.Graph().as_default():
        with_noise = ops.mask_share(tf.constant(x), 2.0**24, ring_bits, 32, "replica 0", "", noise=tf.constant(noise))
        plain = ops.mask_share(tf.constant(x), 2.0**24, ring_bits, 32, "replica 0", "")
        reveal = [ops.reveal_sum(ops.server_sum([seed], [], ring_bits, 4), ops.server_sum([], [share], ring_bits, 4),
                                 tf.int64, ring_bits, 0) for share, seed in (with_noise, plain)]
        with _session() as sess:
            noisy, clean = sess.run(reveal)
    # Fraction bits 0 at reveal: the ring integers themselves.
    np.testing.assert_array_equal(noisy - clean, noise)
    np.testing.assert_array_equal(clean, (x.astype(np.float64) * 2.0**32).astype(np.int64))


# ----------------------------------------------- ring scale and headroom --


@needs_dp
def test_replica_variance_covers_the_encoded_sensitivity():
    dp = tfe_estimator.DistributedDP(l2_norm_clip=1.0, noise_multiplier=1.1)
    # Default colluding_owners=1: sigma^2 / (N - 1) each; colluding_owners=0: sigma^2 / N.
    for t, shares in ((None, 2), (0, 3), (2, 1)):
        dp = tfe_estimator.DistributedDP(l2_norm_clip=1.0, noise_multiplier=1.1, colluding_owners=t)
        variance = dp_lib.replica_noise_variance(dp, num_replicas=3, fraction_bits=32, num_elements=10000)
        target = (1.1 * (2.0**32 + 100.0)) ** 2 / shares
        assert variance == math.floor(variance) and target <= variance <= target * (1 + 1e-15)


@needs_dp
def test_headroom_refuses_noise_that_could_wrap():
    # 128 replicas fill the 64-bit ring's headroom at "low" precision: no room for noise.
    dp = tfe_estimator.DistributedDP(l2_norm_clip=1.0, noise_multiplier=1.0)
    with pytest.raises(ValueError, match="could wrap the 64-bit ring.*precision='high'"):
        dp_lib.check_noise_headroom(dp, 128, 64, 32, 2.0**24, 100)
    assert dp_lib.check_noise_headroom(dp, 64, 64, 32, 2.0**24, 100) > 0
    assert dp_lib.check_noise_headroom(dp, 128, 128, 32, 2.0**30, 100) > 0
    huge = tfe_estimator.DistributedDP(l2_norm_clip=1000.0, noise_multiplier=1e5)
    with pytest.raises(ValueError, match=r"outside \[2\*\*40, 2\*\*100\]"):
        dp_lib.check_noise_headroom(huge, 2, 128, 32, 2.0**30, 100)
    tiny = tfe_estimator.DistributedDP(l2_norm_clip=1e-9, noise_multiplier=1e-3)
    with pytest.raises(ValueError, match=r"outside \[2\*\*40, 2\*\*100\]"):
        dp_lib.check_noise_headroom(tiny, 2, 64, 32, 2.0**24, 100)


@needs_dp
@pytest.mark.parametrize("kwargs", [{"protocol": "aby3"}, {"implementation": "tf-encrypted"}])
def test_dp_without_the_fused_kernels_is_not_implemented(kwargs):
    with pytest.raises(NotImplementedError, match="protocol='pond' with implementation='auto'"):
        tfe_estimator.TfeStrategy(dp=tfe_estimator.DistributedDP(1.0, 1.0), **kwargs)


def test_dp_must_be_a_distributed_dp():
    with pytest.raises(TypeError, match="dp must be a tfe_estimator.DistributedDP or None"):
        tfe_estimator.TfeStrategy(dp={"l2_norm_clip": 1.0})


# ------------------------------------------------------------- training --


def _zero_feature_step(tmp_path, num_replicas, dims, batch, dp, **config_kwargs):
    """One SGD step (learning rate 1) from zero weights on all-zero features."""
    from model_fns import logistic_regression  # pylint: disable=import-outside-toplevel

    config = tfe_estimator.TfeRunConfig(model_dir=str(tmp_path), num_replicas=num_replicas, dp=dp,
                                        save_summary_steps=None, log_step_count_steps=None, **config_kwargs)
    est = tf.estimator.Estimator(
        logistic_regression.model_fn, config=config,
        params={"feature_columns": [tf.feature_column.numeric_column("x", shape=(dims,))],
                "optimizer": "sgd", "learning_rate": 1.0})

    def input_fn():
        x = np.zeros((batch * num_replicas * 4, dims), np.float32)
        y = np.ones((batch * num_replicas * 4, 1), np.int64)
        return tf.data.Dataset.from_tensor_slices(({"x": x}, y)).batch(batch, drop_remainder=True).repeat()

    est.train(input_fn, steps=1)
    return est, input_fn


def _assert_std(weights, expected):
    # Standard error of the sample std of n Gaussians: expected / sqrt(2n)
    # (1.3 % at n = 3000); tolerance 4.5 standard errors (false alarm < 1e-5).
    tolerance = 4.5 * expected / math.sqrt(2 * weights.size)
    assert abs(weights.std() - expected) < tolerance, (weights.std(), expected, tolerance)
    assert abs(weights.mean()) < 4.5 * expected / math.sqrt(weights.size)
    assert stats.kstest(weights / expected, "norm").pvalue > 1e-5


@needs_dp
@pytest.mark.slow
@pytest.mark.parametrize("num_replicas", [2, 3])
def test_one_step_update_carries_noise_of_the_stated_scale(num_replicas, tmp_path, caplog):
    dims, batch = 3000, 4
    dp = tfe_estimator.DistributedDP(l2_norm_clip=0.5, noise_multiplier=1.5, num_examples=1000)
    with caplog.at_level(logging.INFO, logger="tensorflow"):  # TensorFlow's logger: where a user sees it
        est, input_fn = _zero_feature_step(tmp_path, num_replicas, dims, batch, dp)
    weights = est.get_variable_value("logits/kernel").ravel()
    global_batch = batch * num_replicas
    # Zero features: the kernel's clipped gradients are 0, so its update is the noise / global batch.
    # Default colluding_owners=1: each replica adds sigma^2 / (N - 1), so the sum carries
    # sqrt(N / (N - 1)) sigma and any one owner who removes its own part still faces sigma.
    outsider_multiplier = dp.noise_multiplier * math.sqrt(num_replicas / (num_replicas - 1))
    _assert_std(weights, outsider_multiplier * dp.l2_norm_clip / global_batch)
    epsilon = tfe_estimator.dp_epsilon(1.5, global_batch, 1000, 1, 1e-5)
    outsiders = tfe_estimator.dp_epsilon(outsider_multiplier, global_batch, 1000, 1, 1e-5)
    assert outsiders < epsilon
    assert f"epsilon = {epsilon:.4g} at delta = 1e-05 against 1 colluding owner(s) of {num_replicas}" in caplog.text
    assert f"epsilon = {outsiders:.4g} against outsiders" in caplog.text
    metrics = est.evaluate(input_fn, steps=1)
    assert metrics["dp_epsilon"] == pytest.approx(epsilon, rel=1e-12)
    assert metrics["dp_epsilon_outsiders"] == pytest.approx(outsiders, rel=1e-12)


@needs_dp
@pytest.mark.slow
def test_mutation_noise_divided_among_replicas_wrongly_fails_the_scale_test(tmp_path, monkeypatch):
    # Plant the classic bug: each replica adds sigma^2 / N^2 (the mean's noise) instead of sigma^2 / N.
    real = dp_lib.check_noise_headroom
    monkeypatch.setattr(dp_lib, "check_noise_headroom",
                        lambda dp, num, *a: float(math.ceil(real(dp, num, *a) / num)))
    dp = tfe_estimator.DistributedDP(l2_norm_clip=0.5, noise_multiplier=1.5)
    est, _ = _zero_feature_step(tmp_path, 2, 3000, 4, dp)
    with pytest.raises(AssertionError):
        _assert_std(est.get_variable_value("logits/kernel").ravel(), math.sqrt(2) * 1.5 * 0.5 / 8)


@needs_dp
def test_a_model_without_per_example_clipping_is_refused(tmp_path):
    config = tfe_estimator.TfeRunConfig(model_dir=str(tmp_path), num_replicas=2,
                                        dp=tfe_estimator.DistributedDP(1.0, 1.0))
    est = tf.estimator.LinearClassifier(
        feature_columns=[tf.feature_column.numeric_column("x", shape=(3,))], config=config,
        optimizer=lambda: tf.keras.optimizers.legacy.SGD(0.1))

    def input_fn():
        return tf.data.Dataset.from_tensors(({"x": np.ones((4, 3), np.float32)}, np.ones((4, 1), np.int64))).repeat()

    with pytest.raises(ValueError, match=r"not clipped per example.*make_dp_optimizer"):
        est.train(input_fn, steps=1)


@needs_dp
@pytest.mark.slow
def test_tensorflow_privacy_dnn_classifier_trains_with_distributed_dp(tmp_path):
    import tensorflow_privacy  # pylint: disable=import-outside-toplevel

    dp = tfe_estimator.DistributedDP(l2_norm_clip=1.0, noise_multiplier=0.5)
    est = tensorflow_privacy.DNNClassifier(
        hidden_units=[8], feature_columns=[tf.feature_column.numeric_column("x", shape=(4,))],
        optimizer=lambda: dp_lib.make_dp_optimizer(tf.keras.optimizers.legacy.SGD(0.5), dp.l2_norm_clip),
        config=tfe_estimator.TfeRunConfig(model_dir=str(tmp_path), num_replicas=2, dp=dp, tf_random_seed=0))
    rng = np.random.RandomState(0)
    x = rng.randn(400, 4).astype(np.float32)
    y = (x[:, :1] > 0).astype(np.int64)

    def input_fn():
        return tf.data.Dataset.from_tensor_slices(({"x": x}, y)).shuffle(400, seed=0).batch(20, drop_remainder=True).repeat()

    est.train(input_fn, steps=60)
    metrics = est.evaluate(lambda: tf.data.Dataset.from_tensor_slices(({"x": x}, y)).batch(100), steps=2)
    assert metrics["global_step"] == 60 and metrics["accuracy"] > 0.8


@needs_dp
@pytest.mark.slow
def test_dp_example_smoke(tmp_path, capsys):
    path = pathlib.Path(__file__).parent.parent / "examples" / "dp_breast_cancer.py"
    spec = importlib.util.spec_from_file_location("example_dp_breast_cancer", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    results = module.main(["--steps", "40", "--model-dir", str(tmp_path)])
    assert set(results) == {"secure DP", "secure"}
    assert 0 < results["secure DP"]["dp_epsilon"] < math.inf
    assert results["secure"]["accuracy"] > 0.8
    assert "epsilon" in capsys.readouterr().out


@needs_dp
@pytest.mark.slow
@pytest.mark.parametrize("name, params, label_dtype", [
    ("linear_regression", {"label_dimension": 2}, np.float32),
    ("dnn_classifier", {"hidden_units": [6], "n_classes": 3, "dropout": 0.1}, np.int64),
])
def test_every_model_fn_trains_with_dp(name, params, label_dtype, tmp_path):
    import model_fns  # pylint: disable=import-outside-toplevel

    model_fn = getattr(model_fns, name).model_fn
    dp = tfe_estimator.DistributedDP(l2_norm_clip=1.0, noise_multiplier=0.3, num_examples=200)
    est = tf.estimator.Estimator(
        model_fn, config=tfe_estimator.TfeRunConfig(model_dir=str(tmp_path), num_replicas=2, dp=dp),
        params={"feature_columns": [tf.feature_column.numeric_column("x", shape=(3,))], "optimizer": "sgd",
                "learning_rate": 0.1, **params})
    rng = np.random.RandomState(0)
    x = rng.randn(200, 3).astype(np.float32)
    y = (rng.randn(200, 2) if label_dtype == np.float32 else rng.randint(0, 3, (200, 1))).astype(label_dtype)

    def input_fn():
        return tf.data.Dataset.from_tensor_slices(({"x": x}, y)).batch(10, drop_remainder=True).repeat()

    est.train(input_fn, steps=3)
    metrics = est.evaluate(input_fn, steps=1)
    assert metrics["global_step"] == 3 and np.isfinite(metrics["loss"])
    assert metrics["dp_epsilon"] == pytest.approx(tfe_estimator.dp_epsilon(0.3, 20, 200, 3, 1e-5))


# ------------------------------------------------------ colluding owners --


@needs_dp
def test_colluding_owners_default_and_validation():
    dp = tfe_estimator.DistributedDP(1.0, 1.0)
    assert [dp.colluders(n) for n in (1, 2, 3, 5)] == [0, 1, 1, 1]
    assert tfe_estimator.DistributedDP(1.0, 1.0, colluding_owners=2).colluders(3) == 2
    with pytest.raises(ValueError, match=r"colluding_owners=2\) with 2 replicas.*t < N.*colluding_owners <= 1"):
        dp_lib.check_noise_headroom(tfe_estimator.DistributedDP(1.0, 1.0, colluding_owners=2), 2, 64, 32, 2.0**24, 10)
    with pytest.raises(ValueError, match="colluding_owners must be >= 0, got -1"):
        tfe_estimator.DistributedDP(1.0, 1.0, colluding_owners=-1)
    with pytest.raises(TypeError, match="colluding_owners must be an integer"):
        tfe_estimator.DistributedDP(1.0, 1.0, colluding_owners=1.5)
    with pytest.raises(ValueError, match="expected_batch_size must be >= 1"):
        tfe_estimator.DistributedDP(1.0, 1.0, expected_batch_size=0)


@needs_dp
@pytest.mark.parametrize("num_replicas, colluding", [(2, None), (3, None), (3, 2), (4, 0)])
def test_epsilon_is_reported_against_outsiders_and_colluding_owners(num_replicas, colluding):
    dp = tfe_estimator.DistributedDP(1.0, 1.1, num_examples=60000, colluding_owners=colluding)
    t = dp.colluders(num_replicas)
    outsiders, colluders = dp.epsilons(64, 1000, num_replicas)
    # Against t owners who pool their noise: exactly noise_multiplier is left.
    assert colluders == tfe_estimator.dp_epsilon(1.1, 64, 60000, 1000, 1e-5)
    # Against outsiders: all N parts, variance N sigma^2 / (N - t).
    assert outsiders == tfe_estimator.dp_epsilon(1.1 * math.sqrt(num_replicas / (num_replicas - t)), 64, 60000,
                                                 1000, 1e-5)
    assert (outsiders < colluders) == (t > 0)
    assert dp.epsilon(64, 1000, num_replicas) == colluders


SUM = tf.distribute.ReduceOp.SUM
_DEVICES = [f"/job:localhost/replica:0/task:0/device:CPU:{i}" for i in range(6)]


def _dp_reduce(dp, per_replica, reduce_op=SUM, to=None, monkeypatch=None):
    """Reduces one vector per replica (marked as clipped sums) under `dp`; returns results and replica 0's noise."""
    from tfe_estimator.secure.kernels import ops  # pylint: disable=import-outside-toplevel

    noises = []
    if monkeypatch is not None:
        real = ops.discrete_gaussian
        monkeypatch.setattr(ops, "discrete_gaussian", lambda *a: noises.append(real(*a)) or noises[-1])
    n = len(per_replica)
    graph = tf.Graph()
    with graph.as_default():
        strategy = tfe_estimator.TfeStrategy(devices=_DEVICES[:n], server_devices=_DEVICES[n:n + 3], dp=dp)
        with strategy.scope():
            def replica_fn():
                rid = tf.distribute.get_replica_context().replica_id_in_sync_group
                value = tf.gather(tf.constant(np.stack(per_replica)), rid)
                dp_lib.mark_clipped_sums([value], dp.l2_norm_clip)
                return value

            values = strategy.extended.call_for_each_replica(replica_fn)
            reduced = strategy.extended.reduce_to(reduce_op, values, to or values)
            fetches = [tf.convert_to_tensor(x) for x in strategy.experimental_local_results(reduced)]
        config = tf.compat.v1.ConfigProto(device_count={"CPU": len(_DEVICES)})
        with tf.compat.v1.Session(graph=graph, config=config) as sess:
            return sess.run((fetches, noises[:1]))


def _assert_residual_noise_at_least(residual, sigma):
    # Residual std must reach sigma; tolerance 4.5 standard errors of the std (alpha < 1e-5).
    assert residual.std() > sigma * (1 - 4.5 / math.sqrt(2 * residual.size)), (residual.std(), sigma)


@needs_dp
@pytest.mark.parametrize("num_replicas", [2, 3])
def test_one_owner_who_removes_its_own_noise_still_faces_the_full_noise(num_replicas, monkeypatch):
    d = 20000
    dp = tfe_estimator.DistributedDP(l2_norm_clip=1.0, noise_multiplier=1.5)
    (totals, [noise0]) = _dp_reduce(dp, [np.zeros(d, np.float32)] * num_replicas, monkeypatch=monkeypatch)
    # Owner 0 knows its own part: the residual is what protects the other owners' records.
    residual = totals[0].astype(np.float64) - noise0 / 2.0**32
    _assert_residual_noise_at_least(residual, 1.5)
    np.testing.assert_array_equal(totals[0], totals[-1])


@needs_dp
def test_mutation_the_old_sigma2_over_n_split_fails_the_residual_test(monkeypatch):
    # Plant the old split: each of N replicas adds sigma^2 / N (protects against outsiders only).
    monkeypatch.setattr(dp_lib, "_noise_shares", lambda dp, num: num)
    dp = tfe_estimator.DistributedDP(l2_norm_clip=1.0, noise_multiplier=1.5)
    (totals, [noise0]) = _dp_reduce(dp, [np.zeros(20000, np.float32)] * 2, monkeypatch=monkeypatch)
    with pytest.raises(AssertionError):
        _assert_residual_noise_at_least(totals[0].astype(np.float64) - noise0 / 2.0**32, 1.5)


# ------------------------------------------- reported values under DP --


@needs_dp
@pytest.mark.parametrize("reduce_op", [SUM, tf.distribute.ReduceOp.MEAN])
def test_reported_values_under_dp_stay_local_to_the_owner(reduce_op):
    dp = tfe_estimator.DistributedDP(l2_norm_clip=1.0, noise_multiplier=1.0)
    mine = np.array([1.0, 2.0], np.float32)
    scale = 2.0 if reduce_op == SUM else 1.0
    for other in (np.array([5.0, -7.0], np.float32), np.array([100.0, 3.0], np.float32)):
        (read, _) = _dp_reduce(dp, [mine, other], reduce_op, to=_DEVICES[0])
        # The chief's replica's own value (times N for a SUM): nothing of the other owner's data.
        np.testing.assert_array_equal(read[0], scale * mine)


@needs_dp
def test_mutation_reported_values_summed_across_owners_fail_the_locality_test(monkeypatch):
    monkeypatch.setattr(tfe_estimator.SecureAggregation, "_reads_stay_local", lambda *a: False)
    dp = tfe_estimator.DistributedDP(l2_norm_clip=1.0, noise_multiplier=1.0)
    mine = np.array([1.0, 2.0], np.float32)
    (read, _) = _dp_reduce(dp, [mine, np.array([5.0, -7.0], np.float32)], SUM, to=_DEVICES[0])
    with pytest.raises(AssertionError):
        np.testing.assert_array_equal(read[0], 2 * mine)


# --------------------------------------- one clipping group, Poisson batches --


@needs_dp
@pytest.mark.slow
def test_dnn_linear_combined_with_two_clipping_optimizers_is_refused(tmp_path):
    from tensorflow_privacy.privacy.estimators.binary_class_head import DPBinaryClassHead  # pylint: disable=import-outside-toplevel

    dp = tfe_estimator.DistributedDP(l2_norm_clip=1.0, noise_multiplier=1.0)
    column = tf.feature_column.numeric_column("x", shape=(3,))
    est = tf.estimator.DNNLinearCombinedEstimator(
        head=DPBinaryClassHead(), linear_feature_columns=[column], dnn_feature_columns=[column],
        dnn_hidden_units=[4],
        linear_optimizer=lambda: dp_lib.make_dp_optimizer(tf.keras.optimizers.legacy.SGD(0.1), 1.0),
        dnn_optimizer=lambda: dp_lib.make_dp_optimizer(tf.keras.optimizers.legacy.SGD(0.1), 1.0),
        config=tfe_estimator.TfeRunConfig(model_dir=str(tmp_path), num_replicas=2, dp=dp))

    def input_fn():
        return tf.data.Dataset.from_tensors(({"x": np.ones((4, 3), np.float32)}, np.ones((4, 1), np.int64))).repeat()

    with pytest.raises(ValueError, match=r"2 clipping groups.*sqrt\(2\) \* l2_norm_clip.*one make_dp_optimizer"):
        est.train(input_fn, steps=1)


class _ReplicaCopies(tf.estimator.SessionRunHook):
    """Reads every replica's copy of a mirrored variable at the end of training."""

    def __init__(self, name):
        self._name, self.copies = name, None

    def end(self, session):
        graph = tf.compat.v1.get_default_graph()
        handles = [self._name] + [f"{self._name}/replica_{r}" for r in range(1, 4)]
        reads = {}
        for op in graph.get_operations():
            if op.type == "ReadVariableOp" and op.inputs[0].op.name in handles:
                reads.setdefault(op.inputs[0].op.name, op.outputs[0])
        self.copies = session.run([reads[h] for h in handles if h in reads])


@needs_dp
@pytest.mark.slow
@pytest.mark.parametrize("expected", [12, None], ids=["expected-batch", "mutation-own-batch"])
def test_poisson_batches_of_unequal_sizes_keep_mirrored_variables_equal(expected, tmp_path):
    from model_fns import logistic_regression  # pylint: disable=import-outside-toplevel

    dp = tfe_estimator.DistributedDP(l2_norm_clip=1.0, noise_multiplier=0.5, expected_batch_size=expected)
    config = tfe_estimator.TfeRunConfig(model_dir=str(tmp_path), num_replicas=2, dp=dp,
                                        save_summary_steps=None, log_step_count_steps=None)
    est = tf.estimator.Estimator(
        logistic_regression.model_fn, config=config,
        params={"feature_columns": [tf.feature_column.numeric_column("x", shape=(3,))],
                "optimizer": "sgd", "learning_rate": 1.0})
    rng = np.random.RandomState(0)

    def input_fn():
        # Successive batches go to successive replicas: sizes 3 and 9 (as Poisson sampling gives).
        sizes = [3, 9] * 4
        batches = [(rng.randn(k, 3).astype(np.float32), np.ones((k, 1), np.int64)) for k in sizes]
        return tf.data.Dataset.from_generator(
            lambda: (({"x": x}, y) for x, y in batches),
            output_signature=({"x": tf.TensorSpec([None, 3], tf.float32)}, tf.TensorSpec([None, 1], tf.int64)))

    hook = _ReplicaCopies("logits/kernel")
    est.train(input_fn, steps=2, hooks=[hook])
    assert len(hook.copies) == 2
    equal = np.array_equal(hook.copies[0], hook.copies[1])
    # Divided by the expected global batch: equal. The mutation (each replica divides by its own
    # batch times N, the fixed-size-batch mode, given unequal batches) must break the equality.
    assert equal == (expected is not None), hook.copies


@needs_dp
def test_one_clipping_group_shared_twice_in_a_step_is_refused():
    dp = tfe_estimator.DistributedDP(l2_norm_clip=1.0, noise_multiplier=1.0)
    with tf.Graph().as_default():
        strategy = tfe_estimator.TfeStrategy(devices=_DEVICES[:2], server_devices=_DEVICES[2:5], dp=dp)
        with strategy.scope():
            def replica_fn():
                value = tf.zeros([4])
                dp_lib.mark_clipped_sums([value], dp.l2_norm_clip)
                return value

            values = strategy.extended.call_for_each_replica(replica_fn)
            strategy.extended.reduce_to(SUM, values, values)
            # The same clipped sums again: a second noisy release of every example's gradient this step.
            with pytest.raises(ValueError, match=r"one clipping group twice.*counts one release per step"):
                strategy.extended.reduce_to(SUM, values, values)


def _poisson_estimator(tmp_path, num_replicas, dp):
    from model_fns import logistic_regression  # pylint: disable=import-outside-toplevel

    config = tfe_estimator.TfeRunConfig(model_dir=str(tmp_path), num_replicas=num_replicas, dp=dp,
                                        save_summary_steps=None, log_step_count_steps=None)
    return tf.estimator.Estimator(
        logistic_regression.model_fn, config=config,
        params={"feature_columns": [tf.feature_column.numeric_column("x", shape=(3,))],
                "optimizer": "sgd", "learning_rate": 1.0})


def _sized_batches(sizes):
    rng = np.random.RandomState(0)
    batches = [(rng.randn(k, 3).astype(np.float32), np.ones((k, 1), np.int64)) for k in sizes]

    def input_fn():
        return tf.data.Dataset.from_generator(
            lambda: (({"x": x}, y) for x, y in batches),
            output_signature=({"x": tf.TensorSpec([None, 3], tf.float32)}, tf.TensorSpec([None, 1], tf.int64)))

    return input_fn


@needs_dp
@pytest.mark.slow
def test_an_empty_poisson_batch_contributes_noise_only_and_no_batch_size_crosses_owners(tmp_path):
    # Replica 0 samples no example in either step (Poisson sampling can): it contributes a zero
    # gradient sum plus its noise part. pfor used to fail on it (AddN of [0, ...] shapes).
    dp = tfe_estimator.DistributedDP(l2_norm_clip=1.0, noise_multiplier=0.5, expected_batch_size=4,
                                     num_examples=100)
    est = _poisson_estimator(tmp_path, 2, dp)
    hook = _ReplicaCopies("logits/kernel")
    est.train(_sized_batches([0, 5, 0, 3]), steps=2, hooks=[hook])
    assert len(hook.copies) == 2 and np.all(np.isfinite(hook.copies[0]))
    np.testing.assert_array_equal(hook.copies[0], hook.copies[1])
    assert not np.allclose(hook.copies[0], 0.0)
    # With expected_batch_size the accounting uses it: no sum of the replicas' sampled batch sizes
    # (it would tell every owner the others' Poisson batch sizes, un-noised) in the graph or checkpoint.
    names = [name for name, _ in tf.train.list_variables(str(tmp_path))]
    assert "dp_global_batch_size" not in names and "dp_noise_parties" in names
    metrics = est.evaluate(_sized_batches([4, 4]), steps=1)
    assert metrics["dp_epsilon"] == pytest.approx(tfe_estimator.dp_epsilon(0.5, 4, 100, 2, 1e-5), rel=1e-12)


@needs_dp
@pytest.mark.slow
def test_an_evaluator_with_another_replica_count_reports_the_trainings_epsilon(tmp_path):
    # The issue's case: 4 replicas trained, 2 evaluate. The outsiders' epsilon depends on N (noise
    # sqrt(N / (N - t)) sigma): here 0.309 for the training's N = 4, where N = 2 would give 0.194.
    dp = tfe_estimator.DistributedDP(l2_norm_clip=0.5, noise_multiplier=1.5, num_examples=1000)
    _zero_feature_step(tmp_path, 4, 3, 4, dp)
    evaluator = _poisson_estimator(tmp_path, 2, dp)
    metrics = evaluator.evaluate(_sized_batches([4, 4]), steps=1)
    outsiders, colluders = dp.epsilons(16, 1, 4)
    assert metrics["dp_epsilon_outsiders"] == pytest.approx(outsiders, rel=1e-12)
    assert metrics["dp_epsilon"] == pytest.approx(colluders, rel=1e-12)
    assert outsiders != pytest.approx(dp.epsilons(16, 1, 2)[0], rel=1e-3)
