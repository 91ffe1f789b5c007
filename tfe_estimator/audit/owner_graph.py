"""What a service-mode owner's graph lets out: per contribution, the step, a fresh key and a masked share.

In service mode (`tfe_estimator.owner.service_strategy`) an owner's
graph runs in its own process (no TensorFlow server, no remote device) and
talks to the aggregation service only through its contribution ops (one
``tf.numpy_function`` per sum, `contribution.CONTRIBUTE_OP_NAME`).
`audit_owner_graph` checks, on the graph itself, that

- no op is placed on another task (every device is this process's), and
- every contribution op takes exactly the step (a scalar int64) and the two
  outputs of one ``TfeMaskShare`` op: its key (output 1) and its masked share
  (output 0), so the only values that leave are a fresh key and a value
  masked by that key's keystream;
- every answer op (``service_answer``, the other ``tf.numpy_function`` of a
  sum, which waits for the call) takes exactly one contribution op's ticket,
  so nothing leaves through it;
- every key op (``service_key``, which puts a contribution's key on server0
  when the step starts) takes exactly the step and a ``TfeAesSeed`` key that
  nothing but it and one ``TfeMaskShare``'s key input reads.

`ServiceStrategy` runs it when a training graph is finalized (the owners'
handshake hook), so a graph that would send anything else stops before its
first step.

Example::

    audit_owner_graph(tf.compat.v1.get_default_graph())   # raises OwnerGraphAuditError naming the op
"""
import tensorflow as tf

from tfe_estimator.errors import PlaintextOnServerError

__all__ = ["audit_owner_graph", "OwnerGraphAuditError", "CONTRIBUTION_OP_TYPES"]

#: The op types a `tf.numpy_function` / `tf.py_function` becomes (stateless ones in a tf.function: `contribution`).
CONTRIBUTION_OP_TYPES = ("PyFunc", "PyFuncStateless", "EagerPyFunc")


class OwnerGraphAuditError(PlaintextOnServerError):
    """An owner's graph would let out something other than a fresh key and a masked share."""


def _local(device: str) -> bool:
    """Whether `device` is this process's: no job (e.g. ``/replica:0/task:0/device:CPU:0``, what a
    strategy's reduction to the current device writes) or ``/job:localhost``; a session without a
    TensorFlow server has no other."""
    return not device or tf.DeviceSpec.from_string(device).job in (None, "localhost")


def _check_key_op(op: tf.Operation) -> None:
    """A key op sends the step and a key drawn for one mask op only (module docstring)."""
    inputs = list(op.inputs)
    sent = ", ".join(f"{t.op.name}:{t.value_index} ({t.op.type})" for t in inputs)
    ok = len(inputs) == 2 and inputs[0].dtype == tf.int64 and inputs[0].shape.rank == 0 \
        and inputs[1].op.type == "TfeAesSeed"
    if ok:
        readers = inputs[1].consumers()
        masks = [r for r in readers if r.type == "TfeMaskShare" and r.get_attr("num_key") == 1
                 and r.inputs[-1].op is inputs[1].op and r.inputs[-1].value_index == inputs[1].value_index]
        ok = len(masks) == 1 and all(r is op or r is masks[0] for r in readers)
    if not ok:
        raise OwnerGraphAuditError(
            f"owner graph audit: the key op {op.name} would send [{sent}], but a key op may send only the step and "
            "a TfeAesSeed key read by nothing but it and one TfeMaskShare's key input.")


def audit_owner_graph(graph: tf.Graph, contribution_name: str = "service_contribute",
                      answer_name: str = "service_answer", key_name: str = "service_key") -> int:
    """Checks `graph` (module docstring); returns how many contributions it holds.

    Raises:
      OwnerGraphAuditError: naming the op placed elsewhere, or the contribution and what it would send.
    """
    count = 0
    for op in graph.get_operations():
        if not _local(op.device):
            raise OwnerGraphAuditError(
                f"owner graph audit: {op.name} ({op.type}) is placed on {op.device}, another task: in service mode "
                "an owner's graph runs in its own process only.")
        if op.type not in CONTRIBUTION_OP_TYPES:
            continue
        inputs = list(op.inputs)
        if op.name.split("/")[-1].startswith(answer_name):
            if len(inputs) != 1 or not inputs[0].op.name.split("/")[-1].startswith(contribution_name) or \
                    inputs[0].op.type not in CONTRIBUTION_OP_TYPES:
                sent = ", ".join(f"{t.op.name}:{t.value_index} ({t.op.type})" for t in inputs)
                raise OwnerGraphAuditError(
                    f"owner graph audit: the answer op {op.name} takes [{sent}], but an answer op may take only "
                    "its contribution's ticket.")
            continue
        if op.name.split("/")[-1].startswith(key_name):
            _check_key_op(op)
            continue
        if not op.name.split("/")[-1].startswith(contribution_name):
            continue
        count += 1
        sent = ", ".join(f"{t.op.name}:{t.value_index} ({t.op.type})" for t in inputs)
        ok = (len(inputs) == 3 and inputs[0].dtype == tf.int64 and inputs[0].shape.rank == 0
              and inputs[1].op.type == "TfeMaskShare" and inputs[1].value_index == 1
              and inputs[2].op is inputs[1].op and inputs[2].value_index == 0)
        if not ok:
            raise OwnerGraphAuditError(
                f"owner graph audit: the contribution {op.name} would send [{sent}], but a contribution may send "
                "only the step and one TfeMaskShare's key (output 1) and masked share (output 0).")
    return count
