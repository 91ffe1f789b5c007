"""One owner's part of a per-step secure sum across data owners that run separate graphs.

In between-graph mode every data owner builds and runs only its own graph. A
sum across owners therefore meets on the two Pond servers, in resources that
every owner's graph names alike (TensorFlow's ``shared_name``):

    owner r (own device):  share_r, seed_r = mask_share(x_r)
    server0:               accumulator "<channel>/server0" (keys), server1: "<channel>/server1" (masked shares):
                           our step-keyed accumulators (`ops.step_accumulator`), one contribution per owner and step
    owner r:               puts seed_r into server0's accumulator and share_r into server1's, under the step
    chief (its session):   takes each server's complete step (it waits until all N owners put it); on server0
                           ``b, blind = blinded_server_sum(seeds)`` (the owners' masks minus the keystream of a
                           fresh blind key), on server1 ``w = server_sum(shares + [b])``; enqueues ``(step, blind)``
                           on server0 and ``(step, w)`` on server1 into each owner's queue
                           "<channel>/server<k>/owner<o>"
    owner r (own device):  dequeues its two queues, checks the step, ``reveal_sum(w, key=blind)``

The accumulators refuse, naming the owners and steps: a second contribution of
an owner to a step, a stale step (at or below the last step taken, unless its
owner rewound), and owners out of step; a take waits for the owners still
missing and is cancelled with its session run. Before its first contribution
in each session an owner runs `rewind_ops` (the owners' handshake hook does):
its own contribution and queue items left by a failed session go, and it may
contribute from the restored step again, so owners that all recovered from
one checkpoint (after a server restart) continue. The servers only ever hold a
fresh key or a masked ring vector per owner, and the ring sums of those;
server1 receives server0's part blinded by a keystream whose key goes only to
the owners (server1's ``RecvTensor`` to server0 is the one server-to-server
link); only owners reveal. Each owner downloads one ring vector and a 16-byte
key per sum.

Example::

    totals = step_sum([grad_w, grad_b], channel="grads_0", step=global_step_value,
                      owner=0, owners=["chief:0", "worker:0"], is_chief=True,
                      owner_device="/job:chief/task:0/device:CPU:0",
                      servers=("/job:tfe/task:0/device:CPU:0", "/job:tfe/task:1/device:CPU:0"),
                      encoding=Encoding(64, 32, 2.0**24), dtype=tf.float32, hint="clip gradients")
"""
import weakref
from typing import List, NamedTuple, Sequence, Tuple

import tensorflow as tf

from tfe_estimator.secure.fused_sum import Encoding
from tfe_estimator.secure.kernels import ops

__all__ = ["step_sum", "read_step", "graph_global_step", "rewind_ops", "SHARED_NAME_PREFIX"]

#: Prefix of every server resource a between-graph sum creates (one name scheme for all owners).
SHARED_NAME_PREFIX = "tfe_between_graph"


class _Channel(NamedTuple):
    """How to name one of this owner's server resources again: an accumulator and this owner's queue beside it."""
    server: str
    shared_name: str
    owners: Tuple[str, ...]
    owner: int
    dtype: tf.DType
    shape: tf.TensorShape


#: Per graph, this owner's server resources: one `_Channel` per accumulator (what `rewind_ops` names again).
_CHANNELS: "weakref.WeakKeyDictionary[tf.Graph, List[_Channel]]" = weakref.WeakKeyDictionary()


def graph_global_step(graph: tf.Graph, who: str):
    """`graph`'s global step, which keys every per-step sum; a clear error naming `who` when there is none."""
    global_step = tf.compat.v1.train.get_global_step(graph)
    if global_step is None:
        raise ValueError(f"{who} keys each sum by the global step, but this graph has none: "
                         "train with an Estimator (it creates one), or create it with "
                         "tf.compat.v1.train.get_or_create_global_step() first.")
    return global_step


def read_step(global_step, name=None) -> tf.Tensor:
    """The global step's value as an int64 scalar: what keys a between-graph sum and the owners' handshake."""
    value = global_step.read_value() if hasattr(global_step, "read_value") else tf.identity(global_step)
    return tf.cast(value, tf.int64, name=name)


def step_sum(
    parts: Sequence[tf.Tensor],
    channel: str,
    step: tf.Tensor,
    owner: int,
    owners: Sequence[str],
    is_chief: bool,
    owner_device: str,
    servers: Sequence[str],
    encoding: Encoding,
    dtype: tf.DType,
    hint: str,
    scale: float = 1.0,
) -> List[tf.Tensor]:
    """This owner's contribution to the sum of `parts` over all owners, revealed on `owner_device`.

    Args:
      parts: this owner's tensors (one flat vector in order), on `owner_device`.
      channel: a name unique in the graph and equal on every owner (the n-th sum of the graph).
      step: a scalar int64 tensor, equal on all owners for the same step (the global step).
      owner: this owner's index in `owners`.
      owners: every owner's name by index (for the servers' error messages; equal on all owners).
      is_chief: whether this owner takes each step's contributions and hands out the partial sums.
      owner_device: this owner's device.
      servers: Pond's server0 and server1 devices.
      encoding: ring, fraction bits and bound.
      dtype: the dtype to decode to.
      hint: how to fix a value out of range, for error messages.
      scale: multiplies the decoded floats (``1/N`` for a MEAN).

    Returns:
      The decoded sums, shaped like `parts`, on `owner_device`.
    """
    owners = list(owners)
    num_owners, owner_name = len(owners), owners[owner]
    shapes = [p.shape for p in parts]
    num_elements = sum(s.num_elements() for s in shapes)
    with tf.device(owner_device), tf.name_scope("between_graph_mask_share"):
        share, seed = ops.mask_share(list(parts), encoding.bound, encoding.ring_bits, encoding.fraction_bits,
                                     owner_name, hint)
    accumulators, puts, queues = [], [], []
    for k, (contribution, server) in enumerate(zip((seed, share), servers[:2])):
        name = f"{SHARED_NAME_PREFIX}/{channel}/server{k}"
        with tf.device(server), tf.name_scope(f"between_graph_server{k}"):
            if not contribution.shape.is_fully_defined():
                raise ValueError(f"between-graph sum {channel!r}: the shape of {contribution.name} is "
                                 f"{contribution.shape}, but the servers' accumulators need full shapes.")
            with tf.control_dependencies([contribution]):  # created with this owner's first contribution
                accumulators.append(ops.step_accumulator(owners, contribution.dtype, contribution.shape, name))
            _CHANNELS.setdefault(tf.compat.v1.get_default_graph(), []).append(
                _Channel(server, name, tuple(owners), owner, contribution.dtype, contribution.shape))
            puts.append(ops.step_put(accumulators[k], step, contribution, owner))
            # What each owner fetches from server k: (step, blind key) from server0, (step, part) from server1:
            # a key like the owner's seed, ring words like its share.
            queues.append([_owner_queue(name, o, contribution.dtype) for o in range(num_owners)])
    # The chief's session also runs the takes, the server sums and every owner's enqueues.
    handed_out = (_distribute(accumulators, queues, step, (seed, share), num_owners, encoding, num_elements,
                              servers) if is_chief else [])
    fetched = []
    for k, (server, like) in enumerate(zip(servers[:2], (seed, share))):
        with tf.device(server), tf.name_scope(f"between_graph_server{k}"):
            with tf.control_dependencies(puts + handed_out):
                got_step, value = _dequeue(queues[k][owner], like.dtype)
                got_step.set_shape([])  # what every enqueue puts in (raw queue ops carry no shapes)
                value.set_shape(like.shape)  # a key, or ring words as every share (32-bit: two elements per word)
        with tf.device(owner_device), tf.name_scope(f"between_graph_fetch{k}"):
            got_step = tf.identity(got_step)  # on the owner: the check's guard (a Switch) runs here, not on server k
            in_step = tf.debugging.Assert(
                tf.equal(got_step, step),
                [f"Between-graph secure sum {channel!r}: {owner_name} at step", step,
                 f"received server{k}'s part of step", got_step,
                 "; the owners are out of step (restart every owner from the same checkpoint)."])
            with tf.control_dependencies([in_step]):
                fetched.append(tf.identity(value))
    with tf.device(owner_device), tf.name_scope("between_graph_reveal"):
        return ops.reveal_sum(fetched[1], None, dtype, encoding.ring_bits, encoding.fraction_bits,
                              scale, shapes, key=fetched[0])


def rewind_ops(step: tf.Tensor) -> Tuple[List[tf.Operation], List[Tuple[tf.Tensor, tf.Operation]]]:
    """What this owner runs first in a new session (restored at `step`), before its first contribution.

    Returns ``(rewinds, drains)``: one `ops.step_rewind` per accumulator of the
    default graph's sums (this owner's unreleased contribution from a failed
    session is dropped, and it may contribute to `step` again), and per queue of
    this owner a ``(size, dequeue)`` pair to empty it of partial sums handed
    out to a failed session (run ``dequeue`` ``size`` times; the values stay
    on the server). Only this owner's state is touched: the chief hands out
    a step only after every owner contributed to it, so nothing of this
    session can be in the queues yet.
    """
    rewinds, drains = [], []
    for channel in _CHANNELS.get(tf.compat.v1.get_default_graph(), []):
        with tf.device(channel.server), tf.name_scope("between_graph_rewind"):
            handle = ops.step_accumulator(channel.owners, channel.dtype, channel.shape, channel.shared_name)
            rewinds.append(ops.step_rewind(handle, step, channel.owner))
            queue = _owner_queue(channel.shared_name, channel.owner, channel.dtype)
            dequeue = _dequeue(queue, channel.dtype)
            drains.append((tf.raw_ops.QueueSizeV2(handle=queue), tf.group(*dequeue)))  # nothing leaves the server
    return rewinds, drains


def _owner_queue(name: str, owner: int, dtype: tf.DType) -> tf.Tensor:
    """Owner `owner`'s hand-out queue beside the accumulator `name`: elements ``(step, value of dtype)``."""
    return tf.raw_ops.FIFOQueueV2(component_types=[tf.int64, dtype], shared_name=f"{name}/owner{owner}")


def _dequeue(queue: tf.Tensor, dtype: tf.DType):
    """One ``(step, value)`` element of an `_owner_queue`."""
    return tf.raw_ops.QueueDequeueV2(handle=queue, component_types=[tf.int64, dtype])


def _distribute(accumulators, queues, step, likes, num_owners, encoding, num_elements, servers):
    """The chief's ops on the servers: take the step's contributions, sum, hand out to every owner.

    Server0 expands the owners' keys and subtracts the keystream of a fresh
    blind key; server1 adds that blinded part to the owners' masked shares.
    Each owner fetches the blind key from server0 and the blinded sum from
    server1: one ring vector per owner and step instead of both parts.
    """
    contributions = []
    for k, (accumulator, like) in enumerate(zip(accumulators, likes)):
        with tf.device(servers[k]), tf.name_scope(f"between_graph_server{k}"):
            contributions.append(ops.step_take(accumulator, step, num_owners, like.dtype, like.shape))
    with tf.device(servers[0]), tf.name_scope("between_graph_server0"):
        blinded, blind_key = ops.blinded_server_sum(contributions[0], [], encoding.ring_bits, num_elements)
    with tf.device(servers[1]), tf.name_scope("between_graph_server1"):
        part = ops.server_sum([], contributions[1] + [blinded], encoding.ring_bits, num_elements)
    enqueues = []
    for k, value in enumerate((blind_key, part)):
        with tf.device(servers[k]), tf.name_scope(f"between_graph_server{k}"):
            enqueues += [tf.raw_ops.QueueEnqueueV2(handle=queue, components=[step, value]) for queue in queues[k]]
    return enqueues
