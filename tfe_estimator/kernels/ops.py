"""Python wrappers of the fused secure-sum ops, one per party's step.

Pond's sum of replica vectors x_r in the ring Z_{2^R} (R = 64 or 128):

    share_r, seed_r = mask_share(x_r, ...)             # on replica r
    part_k = server_sum(seeds_k, shares_k, ...)         # on server k = 0, 1
    y = reveal_sum(part_0, part_1, dtype, ...)          # on each destination

Ring tensors are int64: shape [n] on the 64-bit ring, [n, 2] (low, high
word) on the 128-bit ring.

Example::

    share, seed = mask_share(x, bound=2.0**24, ring_bits=64, fraction_bits=32,
                             owner="replica 0", hint="clip gradients")
    y = reveal_sum(server_sum([seed], [], 64, n), server_sum([], [share], 64, n),
                   tf.float32, ring_bits=64, fraction_bits=32)
"""
from typing import Optional, Sequence

import tensorflow as tf

from tfe_estimator import kernels

__all__ = ["mask_share", "server_sum", "reveal_sum", "keystream"]


def mask_share(values: tf.Tensor, bound: float, ring_bits: int, fraction_bits: int, owner: str, hint: str,
               noise: Optional[tf.Tensor] = None):
    """Checks, encodes and masks `values` in one pass; returns ``(share, seed)``.

    Fails at run time, naming `owner` and `hint` but no value, if an element
    is NaN/infinite or not below `bound` in magnitude. `noise` (int64, one
    element per value, in ring units) is added to the encoding before masking.
    """
    return kernels.load().tfe_mask_share(
        values, tf.constant(bound, tf.float64), [] if noise is None else [noise], ring_bits=ring_bits,
        fraction_bits=fraction_bits, owner=owner, hint=hint)


def server_sum(seeds: Sequence[tf.Tensor], shares: Sequence[tf.Tensor], ring_bits: int, num_elements: int):
    """Sum of the masks of `seeds` and of `shares`, modulo ``2**ring_bits``."""
    return kernels.load().tfe_server_sum(list(seeds), list(shares), ring_bits=ring_bits,
                                         num_elements=num_elements)


def reveal_sum(share0, share1, dtype: tf.DType, ring_bits: int, fraction_bits: int, scale: float = 1.0):
    """Adds two ring shares and decodes them to `dtype` (floats times `scale`)."""
    return kernels.load().tfe_reveal_sum(share0, share1, tf.constant(scale, tf.float64), T=dtype,
                                         ring_bits=ring_bits, fraction_bits=fraction_bits)


def keystream(key, counter, num_bytes: int):
    """Raw AES-128-CTR keystream (uint8) of a 16-byte `key` from 16-byte block `counter`."""
    return kernels.load().tfe_aes_ctr_keystream(key, counter, tf.constant(num_bytes, tf.int64))
