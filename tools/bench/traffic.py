"""What a graph sends between devices, counted from its cross-device edges.

TensorFlow inserts one `_Send`/`_Recv` pair per (tensor, destination device)
when an op on one device consumes a tensor produced on another, and moves
that tensor's bytes. `cross_device_bytes` finds those edges in a built graph
(e.g. Estimator's training graph) and sums ``num_elements * dtype.size`` of
each distinct (tensor, destination device): the bytes moved per step
between two sets of devices, measured from the graph rather than assumed.
"""
from typing import Iterable, Optional, Tuple

import tensorflow as tf
from tensorflow.python.distribute import device_util

__all__ = ["cross_device_bytes", "trainable_parameters"]


def _canon(device: str) -> str:
    return device_util.canonicalize(device) if device else ""


def _upstream(ops) -> set:
    """The ops `ops` depend on (data and control inputs), themselves included."""
    seen, stack = set(), list(ops)
    while stack:
        op = stack.pop()
        if op in seen:
            continue
        seen.add(op)
        stack.extend(t.op for t in op.inputs)
        stack.extend(op.control_inputs)
    return seen


def cross_device_bytes(graph: tf.Graph, sources: Iterable[str], destinations: Iterable[str],
                       fetches: Optional[Iterable] = None) -> Tuple[int, int]:
    """Bytes per run sent from ops on `sources` to ops on `destinations`.

    With `fetches` (ops or tensors), only the edges a run of them needs count
    (not, e.g., the variable initializers' copies).

    Returns:
      `(bytes, edges)`: total bytes of distinct (tensor, destination) edges,
      and how many such edges there are.

    Raises:
      ValueError: if an edge carries a tensor of unknown shape (its size
        would have to be assumed).
    """
    sources = {_canon(d) for d in sources}
    destinations = {_canon(d) for d in destinations}
    seen = set()
    total = 0
    ops = graph.get_operations()
    if fetches is not None:
        needed = _upstream(getattr(f, "op", f) for f in fetches)
        ops = [op for op in ops if op in needed]
    for op in ops:
        dst = _canon(op.device)
        if dst not in destinations:
            continue
        for t in op.inputs:
            src = _canon(t.op.device)
            if src not in sources or src == dst or (t.name, dst) in seen:
                continue
            seen.add((t.name, dst))
            if not t.shape.is_fully_defined():
                raise ValueError(f"cannot size the edge {t.name} -> {op.name}: shape {t.shape}")
            total += t.shape.num_elements() * t.dtype.size
    return total, len(seen)


def trainable_parameters(graph: tf.Graph) -> int:
    """Number of trainable parameters (mirrored variables counted once)."""
    with graph.as_default():
        variables = tf.compat.v1.trainable_variables()
    return int(sum(v.shape.num_elements() for v in variables))
