"""Python wrappers of the fused secure-sum ops, one per party's step.

Pond's sum of replica vectors x_r in the ring Z_{2^R} (R = 64 or 128):

    share_r, seed_r = mask_share(x_r, ...)             # on replica r
    part_k = server_sum(seeds_k, shares_k, ...)         # on server k = 0, 1
    y = reveal_sum(part_0, part_1, dtype, ...)          # on each destination

or, with one download per destination (what `fused_sum` builds)::

    b, key = blinded_server_sum(seeds_0, shares_0, ...)          # server0
    w = server_sum(seeds_1, shares_1 + [b], ...)                 # server1
    y = reveal_sum(w, None, dtype, ..., key=key)                 # each destination

Ring tensors are int64: shape [n] on the 64-bit ring, [n, 2] (low, high
word) on the 128-bit ring.

Example::

    share, seed = mask_share(x, bound=2.0**24, ring_bits=64, fraction_bits=32,
                             owner="replica 0", hint="clip gradients")
    y = reveal_sum(server_sum([seed], [], 64, n), server_sum([], [share], 64, n),
                   tf.float32, ring_bits=64, fraction_bits=32)
"""
import math
from typing import Optional, Sequence, Union

import tensorflow as tf

from tfe_estimator.secure import kernels

__all__ = ["mask_share", "aes_seed", "server_sum", "blinded_server_sum", "reveal_sum", "decode_sum", "decode_factor",
           "keystream", "discrete_gaussian"]


def mask_share(values: Union[tf.Tensor, Sequence[tf.Tensor]], bound: float, ring_bits: int, fraction_bits: int,
               owner: str, hint: str, noise: Optional[tf.Tensor] = None, key: Optional[tf.Tensor] = None):
    """Checks, encodes and masks `values` in one pass; returns ``(share, seed)``.

    `values` is a tensor or a list of tensors of one dtype, read as one flat
    vector (their elements in order), so no concat is needed before.

    Fails at run time, naming `owner` and `hint` but no value, if an element
    is NaN/infinite or not below `bound` in magnitude. `noise` (int64, one
    element per value, in ring units) is added to the encoding before masking.
    `key` (int32[4], e.g. `aes_seed()`'s, drawn before the values are
    computed): the seed to mask with instead of a fresh one; it must mask
    nothing else.
    """
    values = list(values) if isinstance(values, (list, tuple)) else [values]
    return kernels.load().tfe_mask_share(
        values, [] if noise is None else [noise], [] if key is None else [key], ring_bits=ring_bits,
        fraction_bits=fraction_bits, bound_log2=_log2(bound), owner=owner, hint=hint)


def aes_seed():
    """A fresh 128-bit AES key (int32[4]) from the cipher library's CSPRNG (``RAND_bytes``), drawn when the op
    runs: e.g. a mask's key drawn before the values it masks are computed (`mask_share`'s ``key``).

    Example::

        key = aes_seed()
        share, seed = mask_share(grads, 2.0**24, 64, 32, "chief:0", "clip gradients", key=key)  # seed == key
    """
    return kernels.load().tfe_aes_seed()


def discrete_gaussian(num_elements: int, variance: float, fast_path_margin_log2: int = 40,
                      check_fast_paths: bool = False):
    """`num_elements` int64 samples of the exact discrete Gaussian N_Z(0, variance).

    `variance` must be an integer in [1, 2**100] (Karney's exact algorithm with
    Canonne-Kamath-Steinke Bernoullis; AES-128-CTR randomness under a fresh
    RAND_bytes key on every run). `fast_path_margin_log2` only moves work
    between the fast and the exact path (same distribution; tests lower it).
    `check_fast_paths` (tests only, slow): every fast-path decision is taken
    again by the exact path, and the op fails if they disagree.
    """
    return kernels.load().tfe_discrete_gaussian(tf.constant([num_elements], tf.int64),
                                                tf.constant(variance, tf.float64),
                                                fast_path_margin_log2=fast_path_margin_log2,
                                                check_fast_paths=check_fast_paths)


def server_sum(seeds: Sequence[tf.Tensor], shares: Sequence[tf.Tensor], ring_bits: int, num_elements: int):
    """Sum of the masks of `seeds` and of `shares`, modulo ``2**ring_bits``."""
    return kernels.load().tfe_server_sum(list(seeds), list(shares), ring_bits=ring_bits,
                                         num_elements=num_elements)[0]


def blinded_server_sum(seeds: Sequence[tf.Tensor], shares: Sequence[tf.Tensor], ring_bits: int, num_elements: int):
    """`server_sum` minus the mask of a fresh key drawn in the op; returns ``(blinded, key)``.

    The blinded part may go to the other server (it is uniform to anyone
    without `key`); `key` goes only to the destinations, which reveal with
    ``reveal_sum(other_part_plus_blinded, None, ..., key=key)``.
    """
    total, keys = kernels.load().tfe_server_sum(list(seeds), list(shares), ring_bits=ring_bits,
                                                num_elements=num_elements, num_blind=1)
    return total, keys[0]


def reveal_sum(share0, share1, dtype: tf.DType, ring_bits: int, fraction_bits: int, scale: float = 1.0,
               shapes: Optional[Sequence[tf.TensorShape]] = None, key=None):
    """Adds two ring shares and decodes them to `dtype` (floats times `scale`).

    With `key` (from `blinded_server_sum`) and ``share1=None``, the second
    part is the key's mask: one downloaded vector instead of two.

    Returns one vector, or, with `shapes`, a list of tensors of those shapes
    (the sum's elements in order), so no split is needed after.
    """
    if (share1 is None) == (key is None):
        raise ValueError("reveal_sum needs two parts: share1, or key (a blinded share's key), not both")
    shares = [share0] if share1 is None else [share0, share1]
    return _reveal(shares, [] if key is None else [key], dtype, ring_bits, fraction_bits, scale, shapes)


def decode_sum(revealed, dtype: tf.DType, ring_bits: int, fraction_bits: int, scale: float = 1.0,
               shapes: Optional[Sequence[tf.TensorShape]] = None):
    """Decodes the ring words of a sum revealed already (`reveal_sum`'s decoding of one part, nothing added).

    For a sum unmasked outside the graph (a service-mode owner unmasks and checks its answer in the call): the
    same op, without a second part of zeros to allocate, fill and read on every step.

    Example::

        total = decode_sum(revealed_words, tf.float32, ring_bits=64, fraction_bits=32, shapes=[[3, 2], [2]])
    """
    return _reveal([revealed], [], dtype, ring_bits, fraction_bits, scale, shapes)


def decode_factor(fraction_bits: int, scale: float = 1.0) -> float:
    """What `decode_sum` multiplies a revealed sum's signed elements by (``2**-fraction_bits / divisor``, in
    double, as the op computes it): for a decoding outside the graph (`check_pass`'s) to give the same floats.

    Example::

        decode_factor(32, 0.5) == 2.0**-33
    """
    return math.ldexp(1.0 / _divisor(scale), -fraction_bits)


def _reveal(shares, keys, dtype, ring_bits, fraction_bits, scale, shapes):
    """`TfeRevealSum` of `shares` and `keys` (two parts, or one revealed part): one vector, or one tensor per
    shape of `shapes`."""
    attrs = dict(ring_bits=ring_bits, fraction_bits=fraction_bits, divisor=_divisor(scale))
    if shapes is None:
        return kernels.load().tfe_reveal_sum(shares, keys, T=dtype, N=1, **attrs)[0]
    shapes = [tf.TensorShape(s) for s in shapes]
    return kernels.load().tfe_reveal_sum(shares, keys, T=dtype, N=len(shapes), shapes=shapes, **attrs)


def _log2(bound: float) -> int:
    """The exponent of a power-of-two bound (every fixed-point limit is one)."""
    exponent = math.frexp(bound)[1] - 1
    if bound <= 0 or 2.0**exponent != bound:
        raise ValueError(f"bound must be a power of two, got {bound!r}")
    return exponent


def _divisor(scale: float) -> int:
    """`scale` as ``1 / divisor`` (a MEAN over replicas, or 1).

    Bounds and scales are op attributes, not constant tensors: a constant
    made on one task and read by an op on another would cost a round trip
    per step on a cluster.
    """
    divisor = round(1.0 / scale)
    if divisor < 1 or 1.0 / divisor != scale:
        raise ValueError(f"scale must be 1/N for an integer N >= 1, got {scale!r}")
    return divisor


def keystream(key, counter, num_bytes: int):
    """Raw AES-128-CTR keystream (uint8) of a 16-byte `key` from 16-byte block `counter`."""
    return kernels.load().tfe_aes_ctr_keystream(key, counter, tf.constant(num_bytes, tf.int64))
