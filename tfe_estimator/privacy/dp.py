"""Differential privacy with distributed noise: DP-SGD whose noise is added inside the secure sum.

Secure aggregation hides each replica's gradient, but every owner learns the
sum. DP-SGD (Abadi et al., CCS 2016) bounds what the sum says about any one
record: each example's gradient is clipped to L2 norm ``l2_norm_clip`` and
Gaussian noise of standard deviation ``sigma = noise_multiplier * l2_norm_clip``
is added to the sum. Here the noise is *distributed* ("The Distributed Discrete
Gaussian Mechanism for Federated Learning with Secure Aggregation", Kairouz,
Liu, Steinke, ICML 2021): each of the N replicas adds its part, in the ring,
after fixed-point encoding and before masking (inside `TfeMaskShare`).

Every owner knows its own part, so the parts are sized against colluding
owners: with ``t = colluding_owners`` (default ``min(1, N - 1)``) each part has
variance ``sigma**2 / (N - t)``, so any t owners who pool their parts still face
``sigma``; outsiders face ``sigma * sqrt(N / (N - t))``. `DistributedDP.epsilons`
reports epsilon for both (dp-accounting's RDP accountant with the two noise
multipliers).

Each part is an exact discrete Gaussian ``N_Z(0, s2)`` (`TfeDiscreteGaussian`:
Karney's exact algorithm on AES-128-CTR randomness), with::

    Delta = l2_norm_clip * 2**F + sqrt(d)                 # L2 sensitivity of the encoded sum
    s2    = ceil((noise_multiplier * Delta)**2 / (N - t))  # ring units^2, per replica

(``d`` values per replica; ``sqrt(d)`` bounds what rounding toward zero can add
to one example's encoded contribution), ``2**40 <= s2 <= MAX_REPLICA_VARIANCE =
2**100`` (else refused). The sampler's only departure from ``N_Z(0, s2)`` is a
cap on ``|X|`` at 4096 standard deviations: a total variation distance below
``exp(-2**23)`` per sample, which is what it adds to delta (nothing a float
can represent).

How the sum of the parts is accounted for: a sum of independent discrete
Gaussians is not exactly a discrete Gaussian. Kairouz, Liu and Steinke (ICML
2021) bound the gap for a sum of n parts of variance ``s2``: it is
``eps^2 / 2``-concentrated DP with ``eps = min(sqrt(D2^2 / (n s2) + tau D1 / 2),
D2 / sqrt(n s2) + tau sqrt(D1))`` (D2, D1: L2 and L1 sensitivities), where
``tau = 10 * sum_{k=1}^{n-1} exp(-2 pi^2 s2 k / (k + 1))``. With ``s2 >= 2**40``,
``tau < exp(-10**13)``: zero in any arithmetic, and the bound is that of one
Gaussian of variance ``n * s2`` (n = N against outsiders, N - t against t
owners), as for the continuous Gaussian mechanism (Canonne et al. 2020: the
discrete Gaussian is exactly as private as the continuous one for integer
queries). We therefore account with dp-accounting's RDP accountant for the
Poisson-sampled Gaussian mechanism (`dp_epsilon`). Not covered (as in every
DP-SGD library): the floating-point computation of the clipped per-example
gradients and of their sum on a replica. The noise itself is sampled with
integers only (floating point only chooses between a fast and an exact path,
never the outcome), so the floating-point attack on noise samplers (Mironov,
CCS 2012) does not apply.

Example::

    dp = tfe_estimator.DistributedDP(l2_norm_clip=1.0, noise_multiplier=1.1)
    config = tfe_estimator.TfeRunConfig(model_dir="/tmp/m", num_replicas=2, dp=dp)
    eps = tfe_estimator.dp_epsilon(noise_multiplier=1.1, global_batch_size=64,
                                   num_examples=60000, steps=1000, delta=1e-5)
"""
import dataclasses
import importlib.util
import logging
import math
import numbers
import sys
import threading
import weakref
from fractions import Fraction
from typing import Callable, Hashable, Optional, Tuple

import tensorflow as tf

__all__ = [
    "DistributedDP",
    "dp_epsilon",
    "check_dp_stack",
    "replica_noise_variance",
    "check_noise_headroom",
    "make_dp_optimizer",
    "mark_clipped_sums",
    "clipped_sum_norm",
    "clipped_sum_group",
    "EpsilonLoggingHook",
    "show_epsilon",
    "log_epsilon",
    "EPSILON_METRIC",
    "OUTSIDER_EPSILON_METRIC",
    "EPSILON_METRICS",
    "noise_parties",
    "NOISE_TAIL_SIGMAS",
    "MAX_REPLICA_VARIANCE",
]

_LOG = logging.getLogger("tfe_estimator")

#: The ring headroom covers this many standard deviations of the summed noise:
#: discrete Gaussian tails are sub-Gaussian (Canonne et al. 2020), so the sum
#: exceeds k sigma with probability below 2 exp(-k^2 / 2), here below 1e-347.
NOISE_TAIL_SIGMAS = 40
#: Below this per-replica variance (ring units^2) the sum-of-discrete-Gaussians
#: gap of Kairouz et al. 2021 is not negligible; refused.
_MIN_REPLICA_VARIANCE = 2.0**40
#: The cap on a replica's noise variance (ring units^2): `TfeDiscreteGaussian`
#: samples every integer variance up to it exactly (128/256-bit arithmetic;
#: tests/test_dp.py at 2**40, 2**64, 2**88 and the cap); above it, refused.
MAX_REPLICA_VARIANCE = 2.0**100
#: Minimum versions of the DP stack.
_MIN_TF = (2, 14)
#: Per graph: the marked clipped sums, ``[(tensor, clip norm, group)]``. Not a graph collection: a
#: collection of tuples cannot be serialized into the MetaGraph (TensorFlow warned on every checkpoint).
_CLIPPED: "weakref.WeakKeyDictionary[tf.Graph, list]" = weakref.WeakKeyDictionary()


def check_dp_stack() -> None:
    """Refuses a stack without tensorflow-privacy 0.9.0 / dp-accounting (TF >= 2.14).

    Raises:
      NotImplementedError: naming the installed versions and the fix.
    """
    version = tuple(int(p) for p in tf.__version__.split(".")[:2])
    missing = [name for name in ("tensorflow_privacy", "dp_accounting") if importlib.util.find_spec(name) is None]
    if version < _MIN_TF or missing:
        raise NotImplementedError(
            f"Differential privacy (DistributedDP) needs tensorflow-privacy 0.9.0 and dp-accounting, "
            f"which need TensorFlow >= 2.14 and Python < 3.12; this is TensorFlow {tf.__version__}"
            + (f" without {', '.join(missing)}" if missing else "")
            + ". Fix: use the default stack (Python 3.11, TensorFlow 2.15.1: requirements/tf215.txt) "
            "and pip install 'tfe-estimator[dp]'."
        )


def _number(name, value, *, integer=False):
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or (
            integer and not isinstance(value, numbers.Integral)):
        kind = "an integer" if integer else "a number"
        raise TypeError(f"DistributedDP: {name} must be {kind}, got {value!r} ({type(value).__name__}).")
    if not math.isfinite(value):
        raise ValueError(f"DistributedDP: {name} must be finite, got {value!r}.")
    return value


@dataclasses.dataclass(frozen=True)
class DistributedDP:
    """DP-SGD settings whose noise each replica adds inside the secure sum.

    Args:
      l2_norm_clip: each example's gradient is clipped to this L2 norm (> 0).
      noise_multiplier: the summed noise has standard deviation
        ``noise_multiplier * l2_norm_clip`` (>= 0; 0 gives no privacy and warns).
      num_examples: optional size of the training set; with it the chief logs
        the epsilon spent at the end of ``train()`` and ``evaluate()`` reports it.
      delta: the delta of that epsilon (default 1e-5).
      colluding_owners: t, how many owners (replicas) may pool the noise they
        added themselves and still face ``noise_multiplier * l2_norm_clip`` of
        noise: each of the N replicas adds ``sigma**2 / (N - t)``. Default
        ``min(1, N - 1)``: every owner knows its own part, so t = 0 would
        protect the records only against outsiders. Must be below N (checked
        when N is known).
      expected_batch_size: for Poisson-sampled batches (unequal sizes), the
        expected *global* batch ``q * num_examples`` (a number, not rounded:
        epsilon uses exactly ``q = expected_batch_size / num_examples``): the
        noisy sum is divided by it on every replica (so mirrored variables
        stay equal). None: fixed-size batches, divided by local batch size
        times replicas. Required in service mode when the batch size is not
        static (Poisson sampling): refused otherwise.
      count_repeated_releases: service mode. A step is released once: an owner
        restored from an earlier checkpoint is answered from the servers'
        replay window. If the servers release a step again with fresh noise
        (both were restarted and lost their windows), the owners refuse it by
        default (`tfe_estimator.owner.training_run.ReleaseLedger`); True
        lets training go on and epsilon counts every release (each repeated
        step once more), on the terminal and in evaluation.

    Raises:
      TypeError, ValueError: for non-numbers, ``l2_norm_clip <= 0``,
        ``noise_multiplier < 0``, ``num_examples < 1``, delta outside (0, 1),
        ``colluding_owners < 0`` or ``expected_batch_size < 1``.
      NotImplementedError: on a stack without tensorflow-privacy (TF < 2.14).

    Example::

        dp = DistributedDP(l2_norm_clip=1.0, noise_multiplier=1.1, num_examples=60000)
        config = tfe_estimator.TfeRunConfig(model_dir="/tmp/m", dp=dp)
    """

    l2_norm_clip: float
    noise_multiplier: float
    num_examples: Optional[int] = None
    delta: float = 1e-5
    colluding_owners: Optional[int] = None
    expected_batch_size: Optional[int] = None
    count_repeated_releases: bool = False

    def __post_init__(self):
        check_dp_stack()
        clip = _number("l2_norm_clip", self.l2_norm_clip)
        multiplier = _number("noise_multiplier", self.noise_multiplier)
        if clip <= 0:
            raise ValueError(f"DistributedDP: l2_norm_clip must be > 0, got {clip!r}.")
        if multiplier < 0:
            raise ValueError(f"DistributedDP: noise_multiplier must be >= 0, got {multiplier!r}.")
        if self.num_examples is not None and _number("num_examples", self.num_examples, integer=True) < 1:
            raise ValueError(f"DistributedDP: num_examples must be >= 1, got {self.num_examples!r}.")
        if not 0 < _number("delta", self.delta) < 1:
            raise ValueError(f"DistributedDP: delta must be in (0, 1), got {self.delta!r}.")
        if self.colluding_owners is not None and _number("colluding_owners", self.colluding_owners,
                                                         integer=True) < 0:
            raise ValueError(f"DistributedDP: colluding_owners must be >= 0, got {self.colluding_owners!r}.")
        if self.expected_batch_size is not None and _number("expected_batch_size", self.expected_batch_size) < 1:
            raise ValueError(f"DistributedDP: expected_batch_size must be >= 1, got {self.expected_batch_size!r}.")
        if not isinstance(self.count_repeated_releases, bool):
            raise TypeError(f"DistributedDP: count_repeated_releases must be True or False, got "
                            f"{self.count_repeated_releases!r}.")
        object.__setattr__(self, "l2_norm_clip", float(clip))
        object.__setattr__(self, "noise_multiplier", float(multiplier))
        if multiplier == 0:
            _LOG.warning("DistributedDP(noise_multiplier=0): gradients are clipped per example but no "
                         "noise is added, so training is NOT differentially private.")

    @property
    def noise_stddev(self) -> float:
        """Standard deviation of the summed noise, in gradient units."""
        return self.noise_multiplier * self.l2_norm_clip

    def colluders(self, num_replicas: int) -> int:
        """t for N = `num_replicas` owners: `colluding_owners`, or ``min(1, N - 1)``.

        Raises:
          ValueError: if ``colluding_owners >= N`` (their pooled noise would be all of it).
        """
        if self.colluding_owners is None:
            return min(1, num_replicas - 1)
        if self.colluding_owners >= num_replicas:
            raise ValueError(
                f"DistributedDP(colluding_owners={self.colluding_owners}) with {num_replicas} replicas (owners): "
                "t colluding owners must leave at least one other owner's noise, so t < N. Fix: "
                f"colluding_owners <= {num_replicas - 1}, or more replicas.")
        return self.colluding_owners

    def noise_multipliers(self, num_replicas: int) -> Tuple[float, float]:
        """``(against outsiders, against t colluding owners)`` for N = `num_replicas`.

        The N parts sum to variance ``N sigma**2 / (N - t)``; t owners who
        subtract their own parts leave exactly ``sigma**2``.
        """
        shares = _noise_shares(self, num_replicas)
        return self.noise_multiplier * math.sqrt(num_replicas / shares), self.noise_multiplier

    def epsilon(self, global_batch_size: int, steps: int, num_replicas: int = 1) -> Optional[float]:
        """`dp_epsilon` against t colluding owners (the guarantee), or None without `num_examples`."""
        eps = self.epsilons(global_batch_size, steps, num_replicas)
        return None if eps is None else eps[1]

    def epsilons(self, global_batch_size: int, steps: int, num_replicas: int) -> Optional[Tuple[float, float]]:
        """``(epsilon against outsiders, epsilon against t colluding owners)``, or None without `num_examples`.

        `global_batch_size` is ignored when `expected_batch_size` is set.
        """
        if self.num_examples is None:
            return None
        batch = self.expected_batch_size or global_batch_size
        return tuple(dp_epsilon(m, batch, self.num_examples, steps, self.delta)
                     for m in self.noise_multipliers(num_replicas))


#: The eval metric that reports the epsilon spent by the evaluated checkpoint's training, against t colluding
#: owners (`DistributedDP.colluding_owners`: the guarantee), and the same against outsiders.
EPSILON_METRIC, OUTSIDER_EPSILON_METRIC = "dp_epsilon", "dp_epsilon_outsiders"
EPSILON_METRICS = (EPSILON_METRIC, OUTSIDER_EPSILON_METRIC)


def dp_epsilon(noise_multiplier: float, global_batch_size: int, num_examples: int, steps: int,
               delta: float) -> float:
    """The epsilon DP-SGD spends, by dp-accounting's RDP accountant.

    The event is the Poisson-sampled Gaussian mechanism with sampling
    probability ``q = global_batch_size / num_examples`` and noise multiplier
    `noise_multiplier`, composed over `steps` (see README, "Differential
    privacy", for when Poisson sampling is the right model).

    Returns:
      epsilon (``inf`` for noise_multiplier 0, 0 for 0 steps).
    """
    import dp_accounting  # pylint: disable=import-outside-toplevel

    if not 0 < global_batch_size <= num_examples:
        raise ValueError(f"dp_epsilon: need 0 < global_batch_size <= num_examples, got "
                         f"global_batch_size={global_batch_size!r}, num_examples={num_examples!r}.")
    if steps < 0 or not 0 < delta < 1 or noise_multiplier < 0:
        raise ValueError(f"dp_epsilon: need steps >= 0, 0 < delta < 1, noise_multiplier >= 0; got "
                         f"steps={steps!r}, delta={delta!r}, noise_multiplier={noise_multiplier!r}.")
    if steps == 0:
        return 0.0
    if noise_multiplier == 0:
        return math.inf
    event = dp_accounting.SelfComposedDpEvent(
        dp_accounting.PoissonSampledDpEvent(global_batch_size / num_examples,
                                            dp_accounting.GaussianDpEvent(noise_multiplier)),
        int(steps))
    return float(dp_accounting.rdp.RdpAccountant().compose(event).get_epsilon(delta))


# ------------------------------------------------------- noise in the ring --


def _noise_shares(dp: DistributedDP, num_replicas: int) -> int:
    # N - t: the number of replicas whose noise outlasts t colluding owners.
    return num_replicas - dp.colluders(num_replicas)


def replica_noise_variance(dp: DistributedDP, num_replicas: int, fraction_bits: int, num_elements: int) -> float:
    """Each replica's discrete Gaussian variance, in ring units^2 (an integer as float64).

    ``ceil((noise_multiplier * (l2_norm_clip * 2**F + sqrt(d)))**2 / (N - t))``
    (t = ``dp.colluders(N)``), computed exactly, returned as the smallest
    float64 not below it (so the noise any t owners do not know is never below
    the target).
    """
    sensitivity = Fraction(dp.l2_norm_clip) * 2**fraction_bits + Fraction(math.sqrt(num_elements))
    exact = (Fraction(dp.noise_multiplier) * sensitivity) ** 2 / _noise_shares(dp, num_replicas)
    ceiling = -(-exact.numerator // exact.denominator)
    value = float(ceiling)
    if int(value) < ceiling:
        value = math.nextafter(value, math.inf)
    return value


def check_noise_headroom(dp: DistributedDP, num_replicas: int, ring_bits: int, fraction_bits: int,
                         bound: float, num_elements: int) -> float:
    """Refuses settings whose noisy sum could wrap; returns the per-replica variance.

    Each replica's encoded values stay below ``bound * 2**F`` (the range check);
    the summed noise stays below ``NOISE_TAIL_SIGMAS`` standard deviations except
    with probability below 1e-347, so the revealed sum cannot wrap when
    ``N * bound * 2**F + 40 * sqrt(N * s2) < 2**(R - 1)``.
    """
    variance = replica_noise_variance(dp, num_replicas, fraction_bits, num_elements)
    if dp.noise_multiplier == 0:
        return 0.0
    if variance < _MIN_REPLICA_VARIANCE or variance > MAX_REPLICA_VARIANCE:
        raise ValueError(
            f"DistributedDP(l2_norm_clip={dp.l2_norm_clip}, noise_multiplier={dp.noise_multiplier}) with "
            f"{num_replicas} replicas needs a per-replica noise variance of {variance:.3g} ring units^2, "
            f"outside [2**40, 2**100] (the sampler's exact range where the sum of discrete Gaussians "
            "is accounted as one). Fix: choose l2_norm_clip and noise_multiplier nearer 1.")
    worst = num_replicas * bound * 2.0**fraction_bits + NOISE_TAIL_SIGMAS * math.sqrt(num_replicas * variance)
    if worst >= 2.0 ** (ring_bits - 1):
        raise ValueError(
            f"DistributedDP noise of standard deviation {dp.noise_stddev:.3g} plus {num_replicas} replicas' "
            f"values below {bound:.3g} could wrap the {ring_bits}-bit ring. Fix: lower noise_multiplier "
            "or l2_norm_clip, use fewer replicas, or precision='high'.")
    return variance


# ------------------------------------------- per-example clipping and marker --


def mark_clipped_sums(tensors, l2_norm_clip: float, group: Hashable = 0) -> None:
    """Records that `tensors` are sums of per-example gradients clipped to `l2_norm_clip`.

    `SecureAggregation` with a `DistributedDP` refuses every gradient (update)
    reduction whose values are not marked, so a model that does not clip per
    example cannot be trained "with DP" by mistake. `group` names the clipping
    group (one optimizer: each example's gradient over all of its variables is
    clipped once; `make_dp_optimizer` uses the names of those variables, the
    same on every replica); a step may share only one group.
    """
    for tensor in tensors:
        if tensor is not None:
            _CLIPPED.setdefault(tensor.graph, []).append((tensor, float(l2_norm_clip), group))


def clipped_sum_norm(tensor) -> Optional[float]:
    """The per-example clip norm `tensor` was marked with, or None if unmarked."""
    marked = clipped_sum_group(tensor)
    return None if marked is None else marked[0]


def clipped_sum_group(tensor) -> Optional[Tuple[float, Hashable]]:
    """``(clip norm, clipping group)`` `tensor` was marked with, or None if unmarked."""
    graph = getattr(tensor, "graph", None)
    if graph is None:
        return None
    for marked, clip, group in _CLIPPED.get(graph, ()):
        if marked is tensor:
            return clip, group
    return None


def make_dp_optimizer(optimizer, l2_norm_clip: float, expected_batch_size: Optional[int] = None):
    """A copy of a legacy Keras optimizer that clips per example for `DistributedDP`.

    Its `get_gradients(loss, params)` takes an *unreduced* per-example loss
    (as tensorflow-privacy's DP heads give it), clips each example's gradient
    to `l2_norm_clip` (tensorflow-privacy's vectorized ``clip_gradients_vmap``)
    and returns their sum, un-noised: the noise is added inside the secure
    sum. After the secure sum it divides by `expected_batch_size` (the same
    constant on every replica: Poisson-sampled batches of unequal sizes keep
    mirrored variables equal) or, if None, by the global batch size (local
    batch size times replicas; every replica must get batches of one size).
    Keras' ``model.fit`` (its ``optimizer.minimize(loss, variables, tape=tape)``) works alike: compile the model
    with a loss of ``reduction=NONE``; each example's gradient is its row of the tape's Jacobian.
    All its gradients form one clipping group: `SecureAggregation` refuses a
    step that shares gradients of two groups (each would be clipped to
    `l2_norm_clip` separately, so one example could move the update by
    ``sqrt(2) * l2_norm_clip``).

    Args:
      optimizer: a `tf.keras.optimizers.legacy` optimizer instance (copied).
      l2_norm_clip: the clip norm; must equal the `DistributedDP`'s.
      expected_batch_size: the `DistributedDP`'s ``expected_batch_size``.

    Example::

        dp = DistributedDP(1.0, 1.1)
        est = tensorflow_privacy.DNNClassifier(
            hidden_units=[16], feature_columns=cols,
            optimizer=lambda: make_dp_optimizer(tf.keras.optimizers.legacy.SGD(0.1), dp.l2_norm_clip),
            config=TfeRunConfig(dp=dp))
    """
    check_dp_stack()
    from tensorflow_privacy.privacy.optimizers.dp_optimizer_keras_vectorized import (  # pylint: disable=import-outside-toplevel
        clip_gradients_vmap)

    base = type(optimizer)
    if not isinstance(optimizer, tf.keras.optimizers.legacy.Optimizer):
        raise TypeError(f"make_dp_optimizer needs a tf.keras.optimizers.legacy optimizer, got {base.__name__}.")
    clip = float(l2_norm_clip)
    expected = None if expected_batch_size is None else float(expected_batch_size)

    class DPClippingOptimizer(base):  # pylint: disable=too-few-public-methods
        """Per-example clipping; the noise is added inside the secure sum."""

        _tfe_dp_l2_norm_clip = clip

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self._tfe_local = threading.local()  # one replica per thread under MirroredStrategy

        def get_gradients(self, loss, params):
            _check_per_example(loss)
            per_example = tf.reshape(loss, [tf.shape(loss)[0], -1])
            # An empty (Poisson-sampled) batch: pfor cannot vectorise over zero examples (its gradient's
            # AddN sees mismatched [0, ...] shapes), so a batch of none gets one row of zero loss, which
            # depends on no variable: its clipped gradient is zero, and the sum stays the empty sum, 0.
            empty = tf.cast(tf.equal(tf.shape(per_example)[0], 0), tf.int32)
            per_example = tf.concat([per_example, tf.zeros([empty, tf.shape(per_example)[1]], per_example.dtype)], 0)

            def clipped(example_loss):
                grads = base.get_gradients(self, tf.reduce_mean(example_loss), params)
                grads = [g if g is not None else tf.zeros_like(v) for g, v in zip(grads, params)]
                return clip_gradients_vmap(grads, clip)

            sums = [tf.reduce_sum(g, axis=0) for g in tf.vectorized_map(clipped, per_example)]
            self._batch_of(loss)
            return sums

        def _compute_gradients(self, loss, var_list, grad_loss=None, tape=None):
            # Keras' train_step: optimizer.minimize(loss, trainable_variables, tape=tape), the loss unreduced
            # (compiled with reduction=NONE: Keras neither averages nor scales it per replica). Each example's
            # gradient is its row of the tape's Jacobian (as tensorflow-privacy's DP Keras optimizers take it),
            # clipped over all of var_list and summed, un-noised: the noise is added inside the secure sum.
            if grad_loss is not None:
                raise ValueError("DistributedDP: minimize(grad_loss=...) is not supported (per-example clipping).")
            if tape is None and not callable(loss):
                raise ValueError("DistributedDP: minimize() of a loss tensor needs the tape that computed it "
                                 "(minimize(loss, var_list, tape=tape)), as Keras' train_step passes it.")
            tape = tape if tape is not None else tf.GradientTape()
            with tape:
                if callable(loss):
                    if not callable(var_list):
                        tape.watch(var_list)
                    loss = loss()
                var_list = var_list() if callable(var_list) else var_list
            var_list = tf.nest.flatten(var_list)
            _check_per_example(loss, keras=True)
            with tape:
                per_example = tf.reshape(loss, [tf.shape(loss)[0], -1])
                per_example = tf.reduce_sum(per_example, axis=1) / tf.cast(tf.shape(per_example)[1], loss.dtype)
            jacobians = tape.jacobian(per_example, var_list, unconnected_gradients=tf.UnconnectedGradients.ZERO,
                                      experimental_use_pfor=True)
            clipped = tf.vectorized_map(lambda grads: clip_gradients_vmap(grads, clip), jacobians)
            self._batch_of(loss)
            if loss.shape[0] is not None:  # what tfe_estimator.EpsilonCallback accounts with
                self._tfe_global_batch = int(loss.shape[0]) * tf.distribute.get_strategy().num_replicas_in_sync
            return [(tf.reduce_sum(g, axis=0), v) for g, v in zip(clipped, var_list)]

        def _batch_of(self, loss):
            """Records the local batch size `_transform_gradients` divides by; refuses an unknown one in
            service mode without expected_batch_size."""
            self._tfe_local.batch_size = tf.shape(loss)[0]
            if expected is None and loss.shape[0] is None:
                if _through_service():
                    raise ValueError(
                        "DistributedDP in service mode: the batch size is not static here (Poisson sampling?) "
                        "and no expected_batch_size is set, so each step would sum the owners' batch sizes "
                        "un-noised through the service (an owner would learn the others' batches), divide by "
                        "it, and account epsilon with it. Fix: DistributedDP(expected_batch_size=q * "
                        "num_examples) with the sampling rate q, or batches of one static size "
                        "(dataset.batch(n, drop_remainder=True)).")
                _LOG.warning("DistributedDP without expected_batch_size divides the noisy sum by local batch "
                             "size times replicas, which needs batches of one size on every replica (their "
                             "size is not static here). For Poisson-sampled batches set "
                             "DistributedDP(expected_batch_size=q * num_examples), else mirrored variables "
                             "diverge.")

        def _aggregate_gradients(self, grads_and_vars):
            # These exact tensors go to the secure sum: mark them for SecureAggregation.
            # Its group: the variables it updates (the same mirrored names on every replica).
            group = tuple(sorted(v.name for _, v in grads_and_vars))
            mark_clipped_sums([g for g, _ in grads_and_vars], clip, group=group)
            return super()._aggregate_gradients(grads_and_vars)

        def _transform_gradients(self, grads_and_vars):
            batch = getattr(self._tfe_local, "batch_size", None)
            if batch is None:
                raise ValueError("DistributedDP: apply_gradients was called without get_gradients, so the "
                                 "gradients were not clipped per example.")
            if expected is not None:
                scale = tf.constant(1.0 / expected, tf.float32)
            else:
                replicas = tf.distribute.get_strategy().num_replicas_in_sync
                scale = 1.0 / tf.cast(batch * replicas, tf.float32)
            grads_and_vars = [(None if g is None else g * tf.cast(scale, g.dtype), v) for g, v in grads_and_vars]
            return super()._transform_gradients(grads_and_vars)

    DPClippingOptimizer.__name__ = f"DPClipping{base.__name__}"
    return DPClippingOptimizer.from_config(optimizer.get_config())


def _check_per_example(loss, keras: bool = False) -> None:
    """Refuses a reduced (scalar) loss: per-example clipping needs each example's loss."""
    if loss.shape.rank == 0:
        fix = ("compile the Keras model with a loss of reduction=tf.keras.losses.Reduction.NONE, e.g. "
               "tf.keras.losses.MeanSquaredError(reduction='none')" if keras else
               "use a tensorflow-privacy DP head (e.g. tensorflow_privacy.DPBinaryClassHead) or our model_fns")
        raise ValueError(f"DistributedDP needs the unreduced per-example loss (a vector), got a scalar: {fix}.")


def _through_service(strategy=None) -> bool:
    """Whether `strategy` (default: the current one) sums through the aggregation service (service mode)."""
    strategy = strategy or tf.distribute.get_strategy()
    return hasattr(getattr(strategy.extended, "_cross_device_ops", None), "binding")


def noise_parties(strategy=None) -> int:
    """N of the DP accounting under `strategy` (default: the current one): how many parties add a noise part.

    Each replica in-graph (`num_replicas_in_sync`); each owner, not each of its local replicas,
    through the aggregation service (`ServiceStrategy`, whose ``num_replicas_in_sync`` is owners
    times local replicas).
    """
    strategy = strategy or tf.distribute.get_strategy()
    replicas = strategy.num_replicas_in_sync
    parties = getattr(getattr(strategy.extended, "_cross_device_ops", None), "noise_parties", None)
    return int(parties(replicas)) if callable(parties) else replicas


class EpsilonLoggingHook(tf.compat.v1.train.SessionRunHook):
    """Shows the epsilon spent so far: on the terminal every `every_n_steps` steps and at the end of training.

    Each line goes to standard error beside the progress line (`tfe_estimator.distribute.progress`),
    so every owner sees it without INFO logging::

        tfe_estimator: step 100, DP epsilon 1.23 at delta 1e-05 (against 1 colluding owner(s) of 2; 0.87 ...)

    and, at the end, the same through TensorFlow's logger (INFO, where Estimator logs the loss).

    Args:
      dp: the `DistributedDP` (with `num_examples`).
      global_batch_size: a scalar tensor, the global batch size of a step (unused with
        ``dp.expected_batch_size``).
      num_replicas: N, the number of noise parties (`noise_parties`: replicas, or owners).
      every_n_steps: how often to print (session runs); stream: where (default: standard error).
      repeated_releases: in service mode, ``repeated_releases()`` counts the steps the servers released
        again (``DistributedDP(count_repeated_releases=True)``): epsilon counts them once more.
    """

    def __init__(self, dp: DistributedDP, global_batch_size, num_replicas: int = 1, every_n_steps: int = 100,
                 stream=None, repeated_releases: Optional[Callable[[], int]] = None):
        self._dp = dp
        self._repeated = repeated_releases or (lambda: 0)
        self._batch = global_batch_size
        self._replicas = int(num_replicas)
        self._every = max(1, int(every_n_steps))
        self._stream = stream
        step = tf.compat.v1.train.get_global_step()
        # its read tensor, resolved once (fetching a strategy's MirroredVariable resolves it again at every run)
        self._step = None if step is None else tf.compat.v1.get_default_graph().as_graph_element(step)
        self._last = None
        self._runs = 0

    def before_run(self, run_context):
        return tf.compat.v1.train.SessionRunArgs({"batch": self._batch, "step": self._step})

    def after_run(self, run_context, run_values):
        self._last = int(run_values.results["batch"])
        self._runs += 1
        if self._dp.num_examples is not None and (self._runs - 1) % self._every == 0:
            self._show(int(run_values.results["step"]) + 1)

    def _show(self, steps: int):
        return show_epsilon(self._dp, self._last, steps, self._replicas, int(self._repeated()), self._stream)

    def end(self, session):
        if self._last is None or self._dp.num_examples is None:
            return
        steps = int(session.run(self._step))
        self._show(steps)
        log_epsilon(self._dp, self._last, steps, self._replicas, int(self._repeated()))


def show_epsilon(dp: DistributedDP, global_batch_size: int, steps: int, num_replicas: int, repeated: int = 0,
                 stream=None) -> Tuple[float, float]:
    """Writes the epsilon line `EpsilonLoggingHook` and `tfe_estimator.EpsilonCallback` show on the terminal.

    ``tfe_estimator: step S, DP epsilon E at delta D (against t colluding owner(s) of N; E' against outsiders)``,
    epsilon by `DistributedDP.epsilons` for `steps` plus `repeated` releases (steps the servers released again).

    Returns:
      ``(epsilon against outsiders, epsilon against t colluding owners)``.
    """
    outsiders, colluders = dp.epsilons(global_batch_size, steps + repeated, num_replicas)
    stream = stream or sys.stderr
    again = f"; {repeated} step(s) released twice, counted twice" if repeated else ""
    stream.write(f"tfe_estimator: step {steps}, DP epsilon {colluders:.4g} at delta {dp.delta:g} "
                 f"(against {dp.colluders(num_replicas)} colluding owner(s) of {num_replicas}; "
                 f"{outsiders:.4g} against outsiders{again})\n")
    stream.flush()
    return outsiders, colluders


def log_epsilon(dp: DistributedDP, global_batch_size: int, steps: int, num_replicas: int, repeated: int = 0,
                info: Optional[Callable[..., None]] = None) -> None:
    """Logs the epsilon spent by `steps` (plus `repeated` releases) at INFO, at the end of training: through
    `info` (default: TensorFlow's logger, where Estimator logs the loss)."""
    outsiders, colluders = dp.epsilons(global_batch_size, steps + repeated, num_replicas)
    batch = dp.expected_batch_size or global_batch_size
    (info or tf.compat.v1.logging.info)(
        "DistributedDP: %d steps of global batch %g over %d examples: epsilon = %.4g at delta = %g "
        "against %d colluding owner(s) of %d (noise_multiplier %g); epsilon = %.4g against outsiders "
        "(noise_multiplier %.4g); Poisson-sampling RDP accounting.", steps, batch,
        dp.num_examples, colluders, dp.delta, dp.colluders(num_replicas),
        num_replicas, dp.noise_multiplier, outsiders, dp.noise_multipliers(num_replicas)[0])
