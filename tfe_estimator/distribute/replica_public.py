"""Whether replica 0's value is one every replica already has: a function of constants and a mirrored variable.

`SecureAggregation` refuses to broadcast a value from one replica's device to the others: that is how a
variable of ``aggregation=ONLY_FIRST_REPLICA`` is updated in replica context, and such a value, computed from
replica 0's data, would reach every replica in plaintext. Keras 3 (TensorFlow 2.16+) updates its optimizer's
step counter exactly so: ``optimizer.apply`` ends with ``iterations.assign(iterations + 1)`` in replica
context (Keras 2 did it in cross-replica context). That value is no secret: it is computed from the
destination variable itself, whose copies are equal on every replica (it is mirrored), and from constants,
so every replica computes the same value and the broadcast reveals nothing a replica does not hold.

`is_replica_independent` checks exactly that on the value's graph: every op it depends on is stateless, a
constant other than TensorFlow's replica id (``replica_id_in_sync_group``, different on each replica), or a
read of one of the destination variable's own copies. A value that depends on anything else (a dataset, a
function argument, another variable, a random op) is not, and stays refused.

Example::

    counter = ...  # a MirroredVariable, aggregation=ONLY_FIRST_REPLICA
    is_replica_independent(counter_copy_0 + 1, counter)            # True: every replica computes it
    is_replica_independent(counter_copy_0 + batch_rows, counter)   # False: replica 0's data
"""
from typing import Optional, Set

import tensorflow as tf

__all__ = ["is_replica_independent"]

#: The name TensorFlow gives the constant holding a replica's id (different on every replica).
REPLICA_ID_NAME = "replica_id_in_sync_group"


def _handle_ids(variable) -> Set[int]:
    """The ids of the handle tensors of `variable`'s copies (a MirroredVariable's, or one variable's)."""
    copies = getattr(variable, "values", None)
    copies = copies if isinstance(copies, tuple) else (variable,)
    return {id(getattr(copy, "handle", None)) for copy in copies if getattr(copy, "handle", None) is not None}


def _captured_from(tensor: tf.Tensor) -> Optional[object]:
    """The outer tensor a function graph's placeholder `tensor` captures (None if it captures none)."""
    for external, internal in getattr(tensor.graph, "captures", ()):
        if internal is tensor:
            return external
    return None


def _is_destination_handle(tensor, handles: Set[int]) -> bool:
    """Whether `tensor` is one of the destination's handles, directly or through function captures."""
    while tensor is not None:
        if id(tensor) in handles:
            return True
        if getattr(tensor, "op", None) is None or tensor.op.type != "Placeholder":
            return False
        tensor = _captured_from(tensor)
    return False


def is_replica_independent(tensor, variable) -> bool:
    """Whether `tensor` depends only on constants and `variable`'s own copies (module docstring).

    Args:
      tensor: the value to broadcast (a graph tensor; an eager tensor has no graph to read, and is not).
      variable: the broadcast's destination, a mirrored variable.
    """
    if not hasattr(tensor, "op") or not hasattr(tensor, "graph") or tf.executing_eagerly():
        return False
    handles = _handle_ids(variable)
    if not handles:
        return False
    seen, pending = set(), [tensor.op]
    while pending:
        op = pending.pop()
        if op in seen:
            continue
        seen.add(op)
        if op.type == "Const":
            if op.name.split("/")[-1].startswith(REPLICA_ID_NAME):
                return False
            continue
        if op.type == "ReadVariableOp":
            if not _is_destination_handle(op.inputs[0], handles):
                return False
            continue
        if op.type == "Placeholder" or op._is_stateful or not op.inputs:  # pylint: disable=protected-access
            return False  # a function argument, a dataset, a random draw, a variable of another kind
        pending.extend(t.op for t in op.inputs)  # not control inputs: they order ops and carry no value
    return True
