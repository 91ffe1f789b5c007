"""Between-graph owners agree through server0 on settings, number of owners, model and step.

At the first step of every session (so also after a restore), before its
first contribution, each owner writes a small descriptor into a table on
server0, waits (bounded, `step_wait`) until every owner's descriptor of the
same step is there, and stops with a clear error naming the first field that
differs and the owners it differs for:

    [step, settings, number of owners, model]

- settings: a hash of the protocol, precision and clip norm;
- model: a hash of the trainable variables' names, shapes and dtypes.

Without it, owners with different models meet as a shape error of a shared
Barrier, and owners restored at different steps as a bare timeout. The
servers (and the other owners) learn only these hashes and the step.
Whether the weights stay equal is `weight_check`'s (every step, in the sum).

Example::

    ready = handshake(tf.compat.v1.trainable_variables(), step, owner=0,
                      owner_names=["chief:0", "worker:0"], settings="pond/low/clip=None",
                      server="/job:tfe/task:0/device:CPU:0",
                      owner_device="/job:chief/task:0/device:CPU:0", timeout_secs=270.0)
"""
import hashlib
from typing import Sequence

import tensorflow as tf

from tfe_estimator.distribute import step_wait

__all__ = ["handshake", "FIELDS"]

#: The descriptor's fields, in order (the first one that differs is named).
FIELDS = ("step", "settings (protocol, precision, clip_norm)", "number of owners",
          "model (variable names, shapes, dtypes)")


def _hash63(text: str) -> int:
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "big") >> 1


def handshake(variables: Sequence[tf.Variable], step: tf.Tensor, owner: int, owner_names: Sequence[str],
              settings: str, server: str, owner_device: str, timeout_secs: float) -> tf.Tensor:
    """A bool tensor that, at a session's first run, fails unless every owner agrees with this one.

    Args:
      variables: this owner's trainable variables.
      step: the scalar int64 global step this run trains.
      owner: this owner's index; owner_names: every owner's name by index.
      settings: a string equal on owners with the same secure-sum settings.
      server: the device of the table (Pond's server0); owner_device: this owner's device.
      timeout_secs: how long to wait for the others (below the session's step timeout).

    Returns:
      True, or an InvalidArgumentError naming the field, the owners and the step.
    """
    num = len(owner_names)
    structure = ";".join(f"{v.name}:{v.shape}:{v.dtype.name}" for v in sorted(variables, key=lambda v: v.name))
    with tf.device(owner_device), tf.name_scope("between_graph_handshake"):
        first = tf.compat.v1.Variable(True, trainable=False, name="first_run",
                                      collections=[tf.compat.v1.GraphKeys.LOCAL_VARIABLES])
        due = first.read_value()
    with tf.device(server):
        table = tf.raw_ops.MutableHashTableOfTensorsV2(key_dtype=tf.int64, value_dtype=tf.int64,
                                                       value_shape=[len(FIELDS)],
                                                       shared_name="tfe_between_graph/handshake")

    def rows():
        with tf.device(server):
            return tf.raw_ops.LookupTableFindV2(table_handle=table, keys=tf.range(num, dtype=tf.int64),
                                                default_value=tf.fill([len(FIELDS)], tf.constant(-1, tf.int64)))

    def check():
        with tf.device(owner_device):
            mine = tf.stack([tf.cast(step, tf.int64), tf.constant(_hash63(settings), tf.int64),
                             tf.constant(num, tf.int64), tf.constant(_hash63(structure), tf.int64)])
        with tf.device(server):
            sent = tf.raw_ops.LookupTableInsertV2(table_handle=table, keys=tf.constant([owner], tf.int64),
                                                  values=tf.expand_dims(mine, 0))
        arrived = step_wait.wait_until(lambda: tf.reduce_all(tf.equal(rows()[:, 0], mine[0])), timeout_secs,
                                       owner_device, after=[sent])
        with tf.device(owner_device), tf.control_dependencies([arrived]):
            table_rows = rows()
            names = tf.constant(list(owner_names))
            late = tf.not_equal(table_rows[:, 0], mine[0])
            late_names = tf.strings.reduce_join(tf.boolean_mask(tf.strings.join(
                [names, " (at step ", tf.strings.as_string(table_rows[:, 0]), ")"]), late), separator=", ")
            checks = [tf.debugging.Assert(arrived, [
                f"Between-graph handshake: {owner_names[owner]} starts at step", step,
                f"but after {timeout_secs:g} s these owners had not started there (-1: not yet at all):", late_names,
                ". Start every owner from the same checkpoint step (each restores its own latest checkpoint), "
                "or raise TfeRunConfig(step_timeout_secs=...) if one is only slow."])]
            for index, field in enumerate(FIELDS[1:], start=1):  # in order: the first field that differs is named
                differ = tf.not_equal(table_rows[:, index], mine[index])
                with tf.control_dependencies(checks[-1:]):
                    checks.append(tf.debugging.Assert(tf.logical_not(tf.reduce_any(differ)), [
                        "Between-graph handshake at step", step, f": the {field} of",
                        tf.strings.reduce_join(tf.boolean_mask(names, differ), separator=", "),
                        f"differ from {owner_names[owner]}'s. Every owner must run the same model script with "
                        "the same TfeRunConfig (protocol, precision, clip_norm) and cluster: fix the owner named."]))
            with tf.control_dependencies(checks):
                done = first.assign(False, read_value=False)
            with tf.control_dependencies([done]):
                return tf.constant(True)

    with tf.device(owner_device):
        return tf.cond(due, check, lambda: tf.constant(True))
