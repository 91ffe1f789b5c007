"""Identical models across owners in between-graph mode: a weight fingerprint compared through the secure sum.

Each data owner holds its own copy of the model and applies the same revealed
update, so the copies stay equal unless something differs (a different seed,
model or checkpoint, a planted change, a bug). Every step, each owner computes
a fingerprint ``f`` of its trainable variables, before the step updates them:
the bits of every value, each weighted by its position, summed modulo a prime
``P = FINGERPRINT_MODULUS``. The pair ``(f, f**2)`` rides along in the step's
secure sum of the reported loss (two more elements), and after the reveal
each owner checks

    N * sum(f_i ** 2) == (sum(f_i)) ** 2,

which holds exactly when all ``f_i`` are equal (Cauchy-Schwarz). Two copies
that differ have equal fingerprints with probability about ``1/P`` per step,
so a lasting divergence is caught within a few steps. The servers see only
masked ring elements; the owners learn the two sums, i.e. (for two owners) the
other owner's fingerprint, which they would compute themselves if the models
were equal.

Example::

    f = fingerprint(tf.compat.v1.trainable_variables())
    pair = fingerprint_pair(f, tf.float32)           # appended to the loss's sum
    ... totals = secure sum over owners ...
    check = assert_identical(totals[-1], num_owners=2, scale=1.0, step=step, owner="worker:0")
"""
from typing import Sequence

import tensorflow as tf

__all__ = ["fingerprint", "fingerprint_pair", "assert_identical", "FINGERPRINT_MODULUS"]

#: The prime the fingerprint is taken modulo: small enough that N * f**2 stays exact in float32
#: for up to 16 owners (f**2 < 2**20), large enough that a divergence survives few steps.
FINGERPRINT_MODULUS = 1021


def fingerprint(values: Sequence[tf.Tensor]) -> tf.Tensor:
    """An int64 scalar in [0, FINGERPRINT_MODULUS): the bits of `values`, position-weighted, mod P."""
    p = FINGERPRINT_MODULUS
    terms = []
    offset = 0
    for value in values:
        flat = tf.reshape(value, [-1])
        if flat.dtype.is_floating:
            bits = tf.cast(tf.bitcast(tf.cast(flat, tf.float32), tf.int32), tf.int64)
        else:
            bits = tf.cast(flat, tf.int64)
        n = flat.shape.num_elements()
        weights = tf.math.floormod(tf.range(offset, offset + n, dtype=tf.int64), p) + 1
        offset += n
        terms.append(tf.reduce_sum(tf.math.floormod(bits, p) * weights))  # each term < p**2: no overflow
    return tf.math.floormod(tf.add_n(terms), p)


def fingerprint_pair(f: tf.Tensor, dtype: tf.DType) -> tf.Tensor:
    """``[f, f**2]`` as `dtype` (exact: both below 2**20)."""
    return tf.cast(tf.stack([f, f * f]), dtype)


def assert_identical(total: tf.Tensor, num_owners: int, scale: float, step: tf.Tensor, owner: str) -> tf.Operation:
    """Fails the step unless the revealed ``[sum f, sum f**2]`` (times `scale`) says all owners' f are equal."""
    sums = tf.cast(tf.round(tf.cast(total, tf.float64) / scale), tf.int64)
    equal = tf.equal(num_owners * sums[1], sums[0] * sums[0])
    # No apostrophes: TensorFlow escapes them in the message it prints.
    return tf.debugging.Assert(equal, [
        "Between-graph: the models of the data owners differ at step", step, f"({owner} holds weights that "
        "differ from another owner; sum and sum of squares of the weight fingerprints:", sums, "). Every owner "
        "must start from the same tf_random_seed, model and checkpoint step: restart every owner from the "
        "same checkpoint."])
