"""Between-graph owners agree through server0 on settings, number of owners, model and step.

Once per training session (so also after every restore), after the session
is created and before its first step, each owner writes a small descriptor
into a table on server0, polls the table (bounded: `step_wait.poll`) until
every owner's descriptor of the same step is there, and stops with
`OwnersDisagreeError` naming the first field that differs and the owners it
differs for:

    [step, settings, number of owners, model]

- settings: a hash of the protocol, precision, clip norm and update ring;
- model: a hash of the trainable variables' names, shapes and dtypes.

Without it, owners with different models meet as a shape error of a server's
step accumulator, and owners restored at different steps as a bare timeout. The
servers (and the other owners) learn only these hashes and the step.
Whether the weights stay equal is `weight_check`'s (every step, in the sum).

The handshake runs in its own session runs (`HandshakeHook.after_create_session`),
not in the training step: a training step's partition graphs hold the secure
sum's channels only, which is what `PartyAuditHook` audits. What server0
receives in the handshake's runs is the descriptor: the step and three
constants of the owner's graph (two hashes and the number of owners).

Once the owners agree, each owner rewinds its own state on the servers
(`step_sum.rewind_ops`): its contribution left by a failed session is dropped
and its queues emptied, and the servers' accumulators accept its
contributions from the restored step again, so owners that all recovered
from the same checkpoint (e.g. after a server restart) continue together.

Example::

    hook = HandshakeHook(owner=0, owner_names=["chief:0", "worker:0"], settings="pond/low/clip=None",
                         server="/job:tfe/task:0/device:CPU:0",
                         owner_device="/job:chief/task:0/device:CPU:0", timeout_secs=270.0)
    estimator_spec = estimator_spec._replace(training_hooks=(*estimator_spec.training_hooks, hook))
"""
import hashlib
from typing import Optional, Sequence

import numpy as np
import tensorflow as tf

from tfe_estimator.distribute import step_sum
from tfe_estimator.distribute import step_wait

__all__ = ["HandshakeHook", "OwnersDisagreeError", "FIELDS", "TABLE_SHARED_NAME", "mismatch", "descriptor"]

#: The descriptor's fields, in order (the first one that differs is named).
FIELDS = ("step", "settings (protocol, precision, clip_norm, update_ring_bits)", "number of owners",
          "model (variable names, shapes, dtypes)")
#: The shared name of server0's table of descriptors.
TABLE_SHARED_NAME = "tfe_between_graph/handshake"
#: A row not written yet.
_MISSING = -1


class OwnersDisagreeError(ValueError):
    """Data owners of one between-graph cluster start at different steps or with different settings or models."""


def _hash63(text: str) -> int:
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "big") >> 1


def mismatch(rows: np.ndarray, owner: int, owner_names: Sequence[str], timeout_secs: float,
             arrived: bool) -> Optional[str]:
    """The error message for the table's `rows` as seen by `owner` (None: every owner agrees).

    Args:
      rows: int64 [owners, len(FIELDS)], row o = owner o's descriptor (-1: none yet).
      owner: this owner's index; owner_names: every owner's name by index.
      timeout_secs, arrived: how long this owner waited and whether every row reached its step.
    """
    me = owner_names[owner]
    step = int(rows[owner, 0])
    if not arrived:
        late = ", ".join(f"{owner_names[o]} (at step {int(rows[o, 0])})" for o in range(len(rows))
                         if rows[o, 0] != step)
        return (f"Between-graph handshake: {me} starts at step [{step}] but after {timeout_secs:g} s these owners "
                f"had not started there (-1: not yet at all): {late}. Start every owner from the same checkpoint "
                "step (each restores its own latest checkpoint), or raise TfeRunConfig(step_timeout_secs=...) if "
                "one is only slow.")
    for index, field in enumerate(FIELDS[1:], start=1):  # in order: the first field that differs is named
        differ = [owner_names[o] for o in range(len(rows)) if rows[o, index] != rows[owner, index]]
        if differ:
            return (f"Between-graph handshake at step [{step}]: the {field} of [{', '.join(differ)}] differ from "
                    f"{me}'s. Every owner must run the same model script with the same TfeRunConfig (protocol, "
                    "precision, clip_norm, update_ring_bits) and cluster: fix the owner named.")
    return None


def descriptor(settings: str, num_owners: int):
    """This owner's ``(step, descriptor)`` tensors in the default graph: the row `FIELDS` describes.

    The model field hashes the trainable variables' names, shapes and dtypes.
    """
    variables = tf.compat.v1.trainable_variables()
    structure = ";".join(f"{v.name}:{v.shape}:{v.dtype.name}" for v in sorted(variables, key=lambda v: v.name))
    step = step_sum.read_step(tf.compat.v1.train.get_global_step())
    return step, tf.stack([step, tf.constant(_hash63(settings), tf.int64), tf.constant(num_owners, tf.int64),
                           tf.constant(_hash63(structure), tf.int64)])


class HandshakeHook(tf.compat.v1.train.SessionRunHook):
    """Checks, before a session's first step, that every owner agrees with this one (module docstring).

    Args:
      owner: this owner's index; owner_names: every owner's name by index.
      settings: a string equal on owners with the same secure-sum settings.
      server: the device of the table (Pond's server0); owner_device: this owner's device.
      timeout_secs: how long to wait for the others (below the session's step timeout).

    Raises (from `after_create_session`):
      OwnersDisagreeError: naming the field, the owners and the step.
    """

    def __init__(self, owner: int, owner_names: Sequence[str], settings: str, server: str, owner_device: str,
                 timeout_secs: float):
        self._owner, self._names = owner, list(owner_names)
        self._settings, self._server, self._device = settings, server, owner_device
        self._timeout = timeout_secs
        self._mine = self._insert = self._rows = None
        self._rewinds, self._drains = [], []

    def begin(self):
        num = len(self._names)
        with tf.device(self._device), tf.name_scope("between_graph_handshake"):
            step, self._mine = descriptor(self._settings, num)
        self._rewinds, self._drains = step_sum.rewind_ops(step)
        with tf.device(self._server), tf.name_scope("between_graph_handshake"):
            table = tf.raw_ops.MutableHashTableOfTensorsV2(key_dtype=tf.int64, value_dtype=tf.int64,
                                                           value_shape=[len(FIELDS)], shared_name=TABLE_SHARED_NAME)
            self._insert = tf.raw_ops.LookupTableInsertV2(table_handle=table,
                                                          keys=tf.constant([self._owner], tf.int64),
                                                          values=tf.expand_dims(self._mine, 0))
            self._rows = tf.raw_ops.LookupTableFindV2(table_handle=table, keys=tf.range(num, dtype=tf.int64),
                                                      default_value=tf.fill([len(FIELDS)],
                                                                            tf.constant(_MISSING, tf.int64)))

    def after_create_session(self, session, coord):
        del coord
        mine, _ = session.run([self._mine, self._insert])
        rows = [None]

        def everyone_at_my_step():
            rows[0] = session.run(self._rows)
            return bool(np.all(rows[0][:, 0] == mine[0]))

        arrived = step_wait.poll(everyone_at_my_step, self._timeout)
        message = mismatch(rows[0], self._owner, self._names, self._timeout, arrived)
        if message:
            raise OwnersDisagreeError(message)
        # Then this owner's leftovers of a failed session go, before its first contribution. A peer may have
        # passed on this owner's old row and contributed already: the rewind touches this owner's state only.
        session.run(self._rewinds)
        for size, dequeue in self._drains:
            for _ in range(int(session.run(size))):
                session.run(dequeue)
