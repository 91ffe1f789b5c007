"""Pond's secure sum on tfe_estimator's fused AES-CTR kernels: one op per party.

For replica vectors ``x_0 .. x_{N-1}`` (same length n, on their own devices)::

    replica r:    share_r, seed_r = mask_share(x_r)        enc(x_r) - AES_CTR(seed_r)
    server0:      b, key = blinded_server_sum(seeds of replicas r with r % 2 == 0,
                                              masked shares of replicas r with r % 2 == 1)
                                                           part_0 - AES_CTR(key), fresh key
    server1:      w = server_sum(seeds of odd replicas, masked shares of even replicas + [b])
                                                           = enc(sum) - AES_CTR(key)
    destination:  y = reveal_sum(w, key)                   dec(w + AES_CTR(key))

This is Pond's 2-out-of-2 additive sharing of each ``enc(x_r)`` in the ring
``Z_{2^R}``, with the share ``AES_CTR(seed_r)`` sent compressed as its seed
(tf-encrypted's Pond does the same with ChaCha). Replica r sends its seed to
server ``r % 2`` and its masked share to the other, which splits the
keystream work between the two servers. Each server receives, per replica,
either a fresh uniformly random key or a value masked by a keystream whose
key it never sees; neither learns anything about any ``x_r`` unless the two
collude. Server0 hands its part to server1 blinded by the keystream of a
fresh key that it sends only to the destinations, so server1 holds the sum
masked by a keystream whose key it never sees, and each destination
downloads one ring vector and a 16-byte key instead of both servers' parts
(8 instead of 16 bytes per parameter at 64 bits). Pond's third party (the
crypto producer) has no part in a sum.

The same ring sums, the same encoding (``round_toward_zero(x * 2**F)``) and
the same reveal as tf-encrypted's Pond (`secure_sum.share_and_sum`), which
stays selectable as the reference implementation.

Example::

    totals = pond_sum([[x0], [x1]], ["/cpu:0", "/cpu:1"], ["/cpu:2", "/cpu:3"],
                      ["/cpu:0", "/cpu:1"], Encoding(64, 32, 2.0**24),
                      tf.float32, owners=["replica 0", "replica 1"], hint="clip gradients")
"""
import dataclasses
from typing import List, Optional, Sequence

import tensorflow as tf

from tfe_estimator.secure.kernels import ops

__all__ = ["Encoding", "pond_sum"]


@dataclasses.dataclass(frozen=True)
class Encoding:
    """How values enter the ring.

    Attributes:
      ring_bits: 64 or 128.
      fraction_bits: F of ``round_toward_zero(x * 2**F)`` (0 for integers).
      bound: exclusive bound on each replica's ``|x|``, checked before encoding.
    """

    ring_bits: int
    fraction_bits: int
    bound: float


def pond_sum(
    vectors: Sequence[Sequence[tf.Tensor]],
    sources: Sequence[str],
    servers: Sequence[str],
    targets: Sequence[str],
    encoding: Encoding,
    dtype: tf.DType,
    owners: Sequence[str],
    hint: str,
    scale: float = 1.0,
    noise_variance: Optional[float] = None,
) -> List[List[tf.Tensor]]:
    """Securely sums `vectors` (one per source device) and reveals it on each target.

    Args:
      vectors: per source, the tensors to sum (read as one flat vector), on
        ``sources[r]``; every source has tensors of the same shapes.
      sources: the replica devices.
      servers: Pond's server0 and server1 devices (a third entry is ignored).
      targets: the devices that receive the sum.
      encoding: ring, fraction bits and bound.
      dtype: the dtype to decode to.
      owners: names of the replicas for error messages ("replica 0 (/device...)").
      hint: how to fix a value out of range, for error messages.
      scale: multiplies decoded floats (``1/N`` for a MEAN).
      noise_variance: differential privacy (`tfe_estimator.privacy.dp`): each replica
        adds exact discrete Gaussian noise of this variance (ring units^2, an
        integer) to its encoded values inside `mask_share`, before masking.

    Returns:
      Per target, the decoded sums of the tensors (their shapes), on that target.
    """
    shapes = [t.shape for t in vectors[0]]
    num_elements = sum(s.num_elements() for s in shapes)
    seeds, shares = [], []
    for vector, device, owner in zip(vectors, sources, owners):
        with tf.device(device), tf.name_scope("mask_share"):
            noise = ops.discrete_gaussian(num_elements, noise_variance) if noise_variance else None
            share, seed = ops.mask_share(vector, encoding.bound, encoding.ring_bits,
                                         encoding.fraction_bits, owner, hint, noise=noise)
        shares.append(share)
        seeds.append(seed)
    with tf.device(servers[0]), tf.name_scope("server0_sum"):
        blinded, key = ops.blinded_server_sum(seeds[0::2], shares[1::2], encoding.ring_bits, num_elements)
    with tf.device(servers[1]), tf.name_scope("server1_sum"):
        part = ops.server_sum(seeds[1::2], shares[0::2] + [blinded], encoding.ring_bits, num_elements)
    totals = []
    for device in targets:
        with tf.device(device), tf.name_scope("reveal"):
            totals.append(ops.reveal_sum(part, None, dtype, encoding.ring_bits, encoding.fraction_bits,
                                         scale, shapes, key=key))
    return totals
