"""Between-graph owners check through the servers that they run the same model, settings and step.

At the first step of every session (so also after a restore) and every
`check_every_steps` steps, each owner writes a small descriptor into a table
on server0, waits (bounded, see `step_wait`) until every owner's descriptor
for the same step is there, and stops with a clear error if any differs:

    [step, settings, number of owners, model, weights 1, weights 2]

- settings: a hash of the protocol and precision;
- model: a hash of the trainable variables' names, shapes and dtypes;
- weights: SipHash-2-4 (``tf.strings.to_hash_bucket_strong``, two keys) of the
  serialized trainable variables: equal models give equal fingerprints.

The servers (and the other owners) learn only these hashes: whether the
owners' settings, model structure and weights are equal, never a weight.
Owners that disagree on the step (one restored an older checkpoint) wait
for each other until the step timeout and then stop naming the owners not
at this owner's step and the step each of them is at.

Example::

    check = check_identical(tf.compat.v1.trainable_variables(), step, owner=0,
                            owner_names=["chief:0", "worker:0"], settings="pond/low",
                            server="/job:tfe/task:0/device:CPU:0",
                            owner_device="/job:chief/task:0/device:CPU:0",
                            every=100, timeout_secs=300.0)
"""
import hashlib
from typing import Sequence

import tensorflow as tf

from tfe_estimator.distribute import step_wait

__all__ = ["check_identical", "DEFAULT_CHECK_EVERY_STEPS", "validate_check_every", "FIELDS"]

#: How often (in steps) owners compare their weights, besides each session's first step.
DEFAULT_CHECK_EVERY_STEPS = 100
#: The descriptor's fields, in order.
FIELDS = ("step", "settings (protocol, precision)", "number of owners", "model (variable names, shapes, dtypes)",
          "weights", "weights")
_SIPHASH_KEYS = ((0x74666533, 0x77656967), (0x68745f63, 0x6865636b))  # fixed: fingerprints compare across owners


def validate_check_every(check_every_steps) -> int:
    """`check_every_steps` as an int, or a ValueError/TypeError naming it and the fix."""
    if isinstance(check_every_steps, bool) or not isinstance(check_every_steps, int):
        raise TypeError(f"check_every_steps must be an int, got {check_every_steps!r} "
                        f"({type(check_every_steps).__name__}). Pass e.g. check_every_steps=100.")
    if check_every_steps < 1:
        raise ValueError(f"check_every_steps={check_every_steps}: owners compare their weights every that many "
                         "steps, so it must be >= 1. Pass e.g. check_every_steps=100.")
    return check_every_steps


def _hash63(text: str) -> int:
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "big") >> 1


def _fingerprint(variables):
    serialized = tf.strings.reduce_join(
        [tf.io.serialize_tensor(tf.convert_to_tensor(v)) for v in variables])
    return [tf.cast(tf.strings.to_hash_bucket_strong(serialized, 2**63 - 1, list(key)), tf.int64)
            for key in _SIPHASH_KEYS]


def check_identical(variables: Sequence[tf.Variable], step: tf.Tensor, owner: int, owner_names: Sequence[str],
                    settings: str, server: str, owner_device: str, every: int, timeout_secs: float) -> tf.Tensor:
    """An op that, at the session's first run and every `every` steps, checks the owners agree.

    Args:
      variables: this owner's trainable variables.
      step: the scalar int64 global step this run trains.
      owner: this owner's index; owner_names: every owner's name by index.
      settings: a string equal on owners with the same secure-sum settings.
      server: the device of the table (Pond's server0); owner_device: this owner's device.
      every: steps between two checks; timeout_secs: how long to wait for the others.

    Returns:
      A bool tensor (True) that fails the run with an InvalidArgumentError naming
      the owners, the field and the step when the owners differ or do not arrive.
    """
    num = len(owner_names)
    structure = ";".join(f"{v.name}:{v.shape}:{v.dtype.name}" for v in sorted(variables, key=lambda v: v.name))
    with tf.device(owner_device), tf.name_scope("between_graph_weight_check"):
        first = tf.compat.v1.Variable(True, trainable=False, name="first_run",
                                      collections=[tf.compat.v1.GraphKeys.LOCAL_VARIABLES])
        due = tf.logical_or(first.read_value(), tf.equal(step % every, 0))
    with tf.device(server):
        table = tf.raw_ops.MutableHashTableOfTensorsV2(key_dtype=tf.int64, value_dtype=tf.int64,
                                                       value_shape=[len(FIELDS)],
                                                       shared_name="tfe_between_graph/weight_check")

    def check():
        with tf.device(owner_device):
            mine = tf.stack([tf.cast(step, tf.int64), tf.constant(_hash63(settings), tf.int64),
                             tf.constant(num, tf.int64), tf.constant(_hash63(structure), tf.int64),
                             *_fingerprint(variables)])
        with tf.device(server):
            sent = tf.raw_ops.LookupTableInsertV2(table_handle=table, keys=tf.constant([owner], tf.int64),
                                                  values=tf.expand_dims(mine, 0))

        def rows():
            with tf.device(server):
                return tf.raw_ops.LookupTableFindV2(table_handle=table, keys=tf.range(num, dtype=tf.int64),
                                                    default_value=tf.fill([len(FIELDS)], tf.constant(-1, tf.int64)))

        arrived = step_wait.wait_until(lambda: tf.reduce_all(tf.equal(rows()[:, 0], mine[0])), timeout_secs,
                                       owner_device, after=[sent])
        with tf.device(owner_device), tf.control_dependencies([arrived]):
            table_rows = rows()
            names = tf.constant(list(owner_names))
            late = tf.not_equal(table_rows[:, 0], mine[0])
            late_names = tf.strings.reduce_join(tf.boolean_mask(tf.strings.join(
                [names, " (at step ", tf.strings.as_string(table_rows[:, 0]), ")"]), late), separator=", ")
            in_step = tf.debugging.Assert(arrived, [
                f"Between-graph model check: {owner_names[owner]} at step", step,
                f"waited {timeout_secs:g} s for every owner; owners not at that step (-1: none yet):", late_names,
                ". Restart every owner from the same checkpoint step (each restores its own latest checkpoint: "
                "give them the same one), or raise TfeRunConfig(step_timeout_secs=...) if one is only slow."])
            checks = [in_step]
            for index, field in enumerate(FIELDS[1:], start=1):  # in order: the first field that differs is named
                differ = tf.not_equal(table_rows[:, index], mine[index])
                with tf.control_dependencies(checks[-1:]):
                    checks.append(tf.debugging.Assert(tf.logical_not(tf.reduce_any(differ)), [
                        "Between-graph model check at step", step, f": the {field} of",
                        tf.strings.reduce_join(tf.boolean_mask(names, differ), separator=", "),
                        f"differ from {owner_names[owner]}'s. Every owner must run the same model script with "
                        "the same TfeRunConfig (protocol, precision, tf_random_seed), cluster and checkpoint; "
                        + ("owners' weights diverged: restart every owner from the same checkpoint."
                           if index >= 4 else "fix the owner named.")]))
            with tf.control_dependencies(checks):
                done = first.assign(False, read_value=False)
            with tf.control_dependencies([done]):
                return tf.constant(True)

    with tf.device(owner_device):
        return tf.cond(due, check, lambda: tf.constant(True))
