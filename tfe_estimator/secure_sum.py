"""Pure secure-sum functions: pack, check, share, add, reveal, unpack.

Nothing here knows about `PerReplica` or `Mirrored`; `aggregation.py` wires
these functions into a `tf.distribute.CrossDeviceOps`. The cryptography is
tf-encrypted's: `share_and_sum` calls the protocol's `define_private_input`
(encode to the ring and secret-share on the owner's device; Pond sends one of
the two shares as a seed), `add` (each server adds the shares it holds) and
`define_output` (both shares of the sum go to one destination device, which
adds and decodes them: the servers never see the sum).

Example::

    vector, shapes = pack([grad_a, grad_b], tf.float32)
    vector = check_encodable(vector, precision.max_magnitude, "replica 0", hint)
    sums = share_and_sum(protocol, [(player0, v0), (player1, v1)],
                         [dest_player0, dest_player1], scaled=True)
    grad_a_sum, grad_b_sum = unpack(sums[0], shapes)
"""
import functools
from typing import List, Sequence, Tuple

import tensorflow as tf

__all__ = ["pack", "unpack", "check_encodable", "share_and_sum"]


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
    shapes = []
    for t in tensors:
        if not t.shape.is_fully_defined():
            raise NotImplementedError(
                f"Secure aggregation needs values of static shape, got {t.name} with "
                f"shape {t.shape}. Give the model's variables fully defined shapes."
            )
        shapes.append(t.shape)
    flat = [tf.reshape(tf.cast(t, dtype), [-1]) for t in tensors]
    vector = flat[0] if len(flat) == 1 else tf.concat(flat, axis=0)
    return vector, shapes


def unpack(vector: tf.Tensor, shapes: Sequence[tf.TensorShape]) -> List[tf.Tensor]:
    """Splits a vector made by `pack` back into tensors of `shapes`."""
    sizes = [s.num_elements() for s in shapes]
    parts = [vector] if len(sizes) == 1 else tf.split(vector, sizes, axis=0)
    return [tf.reshape(p, s) for p, s in zip(parts, shapes)]


def check_encodable(vector: tf.Tensor, bound: float, owner: str, hint: str) -> tf.Tensor:
    """Makes `vector` usable only once it is finite and below `bound` in magnitude.

    Fixed-point encoding turns NaN and infinity into garbage and wraps values
    out of range without a sound; the reduced loss takes the same path, so
    Estimator's NaN guard would never fire. The checks are control
    dependencies of the returned tensor, so they run whenever it is used.

    Args:
      vector: a float or integer vector, on its owner's device.
      bound: exclusive bound on `|vector|`.
      owner: who owns the values, for the error message (e.g. "replica 0 (/device:CPU:0)").
      hint: how to fix an out-of-range value, for the error message.

    Returns:
      `vector`, guarded.
    """
    with tf.name_scope("check_encodable"):
        as_float = tf.cast(vector, tf.float64)
        checks = []
        if vector.dtype.is_floating:
            non_finite = tf.reduce_sum(tf.cast(tf.logical_not(tf.math.is_finite(as_float)), tf.int64))
            checks.append(
                tf.debugging.Assert(
                    tf.equal(non_finite, 0),
                    [
                        f"Secure aggregation refused the values of {owner}: they contain",
                        non_finite,
                        "NaN or infinite elements, which fixed-point encoding cannot represent "
                        "(training has diverged or the input data has NaN/Inf). Check the "
                        "input data and lower the learning rate.",
                    ],
                    name="assert_finite",
                )
            )
        with tf.control_dependencies(checks):
            largest = tf.reduce_max(tf.abs(as_float))
            checks.append(
                tf.debugging.Assert(
                    largest < bound,
                    [
                        f"Secure aggregation refused the values of {owner}: largest magnitude",
                        largest,
                        f"is not below the fixed-point limit {bound:.10g}. Encoding it would "
                        f"wrap around the ring. {hint}",
                    ],
                    name="assert_in_range",
                )
            )
        with tf.control_dependencies(checks):
            return tf.identity(vector)


def share_and_sum(protocol, inputs, destinations, scaled: bool) -> List[tf.Tensor]:
    """Secret-shares each input, sums the shares on the servers, reveals to each destination.

    Args:
      protocol: a tf-encrypted protocol (`Pond` or `ABY3`) whose players are
        devices (see `tfe_backend.DevicePlayers`).
      inputs: `(player, vector)` pairs, one per replica; each vector is
        shared on its player's device.
      destinations: players to reveal the sum to.
      scaled: True for floats (fixed-point encoded), False for integers
        (shared exactly).

    Returns:
      One revealed, decoded sum per destination (float64 if `scaled`,
      otherwise int64), placed on that destination's device.
    """
    shared = [
        protocol.define_private_input(
            player, functools.partial(tf.identity, vector), apply_scaling=scaled
        )
        for player, vector in inputs
    ]
    total = functools.reduce(protocol.add, shared)
    revealed: List[tf.Tensor] = []
    for player in destinations:
        # define_output decodes on `player`'s device and passes the plaintext
        # to the function; returning None keeps tf-encrypted from re-sharing it.
        protocol.define_output(player, [total], revealed.append)
    return revealed
