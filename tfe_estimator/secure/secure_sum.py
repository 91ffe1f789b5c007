"""Pure secure-sum functions: pack, check, encode, share, add, reveal, decode, unpack.

Nothing here knows about `PerReplica` or `Mirrored`; `aggregation.py` wires
these functions into a `tf.distribute.CrossDeviceOps`. The cryptography is
tf-encrypted's: `share_and_sum` calls the protocol's `define_private_input`
(secret-share on the owner's device; Pond sends one of the two shares as a
seed) and `add` (each server adds the shares it holds); the sum's shares go
to each destination device, which adds them: the servers never see the sum.

Encoding and decoding are done here, in the vector's own float type, because
they are cheaper than tf-encrypted's generic path and give the same ring
elements: scaling by ``2**F`` is exact in binary floating point, so
``cast(x * 2**F, int64)`` equals tf-encrypted's
``cast(float64(x) * 2**F, int64)`` (round toward zero) for every ``|x|`` that
`check_encodable` lets through. Values are shared unscaled
(``apply_scaling=False``) and decoded once on each destination.

Example::

    vector, shapes = pack([grad_a, grad_b], tf.float32)
    vector = check_encodable(vector, precision.max_magnitude, "replica 0", hint)
    ring = encode(vector, precision.fraction_bits)
    sums = share_and_sum(protocol, [(player0, ring0), (player1, ring1)],
                         [dest_player0, dest_player1])
    grad_a_sum, grad_b_sum = unpack(decode(sums[0], tf.float32, precision.fraction_bits), shapes)
"""
import functools
from typing import List, Sequence, Tuple

import tensorflow as tf

__all__ = ["pack", "parts", "unpack", "check_encodable", "encode", "decode", "share_and_sum"]


def pack(tensors: Sequence[tf.Tensor], dtype: tf.DType) -> Tuple[tf.Tensor, List[tf.TensorShape]]:
    """Flattens and concatenates `tensors` into one vector of `dtype`.

    Args:
      tensors: tensors with fully defined shapes.
      dtype: the dtype of the packed vector.

    Returns:
      The vector and the shapes needed by `unpack`.

    Raises:
      NotImplementedError: if a shape is not fully defined (the protocol needs
        static shapes to draw its random masks).
    """
    shapes = _static_shapes(tensors)
    flat = [tf.reshape(tf.cast(t, dtype), [-1]) for t in tensors]
    vector = flat[0] if len(flat) == 1 else tf.concat(flat, axis=0)
    return vector, shapes


def parts(tensors: Sequence[tf.Tensor], dtype: tf.DType) -> Tuple[List[tf.Tensor], List[tf.TensorShape]]:
    """`tensors` as they are, cast to `dtype` where they differ: for the fused kernels.

    Raises:
      NotImplementedError: if a shape is not fully defined (see `pack`).
    """
    _static_shapes(tensors)
    return [tf.cast(t, dtype) for t in tensors], [t.shape for t in tensors]


def _static_shapes(tensors: Sequence[tf.Tensor]) -> List[tf.TensorShape]:
    for t in tensors:
        if not t.shape.is_fully_defined():
            raise NotImplementedError(
                f"Secure aggregation needs values of static shape, got {t.name} with "
                f"shape {t.shape}. Give the model's variables fully defined shapes."
            )
    return [t.shape for t in tensors]


def unpack(vector: tf.Tensor, shapes: Sequence[tf.TensorShape]) -> List[tf.Tensor]:
    """Splits a vector made by `pack` back into tensors of `shapes`."""
    if len(shapes) == 1 and vector.shape == shapes[0]:
        return [vector]
    sizes = [s.num_elements() for s in shapes]
    parts = [vector] if len(sizes) == 1 else tf.split(vector, sizes, axis=0)
    return [tf.reshape(p, s) for p, s in zip(parts, shapes)]


def check_encodable(vector: tf.Tensor, bound: float, owner: str, hint: str) -> tf.Tensor:
    """Makes `vector` usable only once it is finite and below `bound` in magnitude.

    Fixed-point encoding turns NaN and infinity into garbage and wraps values
    out of range without a sound; the reduced loss takes the same path, so
    Estimator's NaN guard would never fire. The checks are control
    dependencies of the returned tensor, so they run whenever it is used.

    The checks are plain `Assert` ops over two cheap reductions (all finite;
    the largest magnitude), not `tf.debugging.Assert`, whose `tf.cond` guard
    costs ~40 ms of graph building per call: an evaluation with many metric
    variables makes a hundred reductions.

    Args:
      vector: a float or integer vector, on its owner's device.
      bound: exclusive bound on `|vector|`.
      owner: who owns the values, for the error message (e.g. "replica 0 (/device:CPU:0)").
      hint: how to fix an out-of-range value, for the error message.

    Returns:
      `vector`, guarded.
    """
    with tf.name_scope("check_encodable"):
        checks = []
        if vector.dtype.is_floating:
            magnitude = tf.abs(vector)
            checks.append(tf.raw_ops.Assert(
                condition=tf.reduce_all(tf.math.is_finite(vector)),
                data=[f"Secure aggregation refused the values of {owner}: they contain NaN or "
                      "infinite elements, which fixed-point encoding cannot represent (training "
                      "has diverged or the input data has NaN/Inf). Check the input data and "
                      "lower the learning rate."],
                name="assert_finite",
            ))
        with tf.control_dependencies(checks):  # report NaN before range
            if vector.dtype.is_floating:
                in_range = tf.reduce_max(magnitude) < tf.constant(bound, vector.dtype)
            else:
                # Integers (counters): compared in their own dtype, exactly (float64
                # would round values near 2**62 and refuse valid ones); no abs, which
                # overflows at the dtype's minimum.
                largest = tf.constant(min(int(bound) - 1, vector.dtype.max), vector.dtype)
                in_range = tf.reduce_all((vector >= -largest) & (vector <= largest))
            checks.append(tf.raw_ops.Assert(
                condition=in_range,
                # No value computed from the data in the message: on a cluster it
                # travels from the owner's host to the chief.
                data=[f"Secure aggregation refused the values of {owner}: an element's magnitude is "
                      f"not below the fixed-point limit {bound:.10g}, so encoding it would wrap "
                      f"around the ring. {hint}"],
                name="assert_in_range",
            ))
        with tf.control_dependencies(checks):
            return tf.identity(vector)


def encode(vector: tf.Tensor, fraction_bits: int) -> tf.Tensor:
    """Fixed-point encodes a checked float vector (integers: as they are) to int64.

    ``round_toward_zero(x * 2**fraction_bits)``, computed in the vector's own
    float type: multiplying by a power of two is exact, and the cast truncates
    toward zero, so the result is the same integer tf-encrypted's encoder
    would produce via float64.
    """
    with tf.name_scope("encode"):
        if vector.dtype.is_floating:
            vector = vector * tf.constant(2.0**fraction_bits, vector.dtype)
        return tf.cast(vector, tf.int64)


def decode(ring: tf.Tensor, dtype: tf.DType, fraction_bits: int, scale: float = 1.0) -> tf.Tensor:
    """Decodes an int64 sum to `dtype`, times `scale` (e.g. ``1/N`` for a mean).

    Floats: ``cast(ring, dtype) * (2**-fraction_bits * scale)``, one rounding
    to `dtype` instead of tf-encrypted's float64 detour. Integers: the exact
    sum, cast to `dtype` (`scale` must be 1).
    """
    with tf.name_scope("decode"):
        if not dtype.is_floating:
            return tf.cast(ring, dtype)
        return tf.cast(ring, dtype) * tf.constant(2.0**-fraction_bits * scale, dtype)


def share_and_sum(protocol, inputs, destinations) -> List[tf.Tensor]:
    """Secret-shares each input, sums the shares on the servers, reveals to each destination.

    Args:
      protocol: a tf-encrypted protocol (`Pond` or `ABY3`) whose players are
        devices (see `tfe_backend.DevicePlayers`).
      inputs: `(player, vector)` pairs, one per replica; each vector holds
        ring elements (int64, see `encode`) and is shared on its player's device.
      destinations: players to reveal the sum to.

    Returns:
      One revealed int64 sum (still encoded) per destination, placed on that
      destination's device.
    """
    shared = [
        protocol.define_private_input(
            player, functools.partial(tf.identity, vector), apply_scaling=False
        )
        for player, vector in inputs
    ]
    total = functools.reduce(protocol.add, shared)
    shares = _native_int64_shares(protocol, total)
    revealed: List[tf.Tensor] = []
    for player in destinations:
        if shares is not None:
            # Pond on the 64-bit ring: the two shares travel to the
            # destination, which adds them (tf-encrypted's reconstruction,
            # without its decode, which is the identity on int64 apart from
            # two extra passes over the vector).
            with tf.name_scope("reveal"), tf.device(player.device_name):
                revealed.append(tf.add(shares[0], shares[1]))
        else:
            # define_output reconstructs on `player`'s device and passes the
            # integers to the function; returning None keeps tf-encrypted from
            # re-sharing them.
            protocol.define_output(player, [total], revealed.append)
    return revealed


def _native_int64_shares(protocol, total):
    """The two int64 share tensors of a Pond sum on the 64-bit ring, else None."""
    factory = getattr(protocol, "tensor_factory", None)
    parts = getattr(total, "unwrapped", None)
    if factory is None or parts is None or len(parts) != 2:
        return None
    if factory.native_type != tf.int64 or factory.modulus != 2**64:
        return None
    values = [getattr(p, "value", None) for p in parts]
    if not all(isinstance(v, tf.Tensor) and v.dtype == tf.int64 for v in values):
        return None
    return values
