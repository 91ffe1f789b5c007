"""Bounded waits across data owners in between-graph mode, and who had not contributed.

An owner whose peer died would otherwise wait forever in ``BarrierTakeMany``
or ``QueueDequeueV2`` (their ``timeout_ms`` attributes are not implemented by
TensorFlow, and Estimator's session runs without a deadline). Every
cross-owner wait instead polls a size on the server (``wait_until``) and, when
`timeout_secs` pass, fails with a message naming the step, the channel, and
the owners that had not contributed, read from a per-channel presence table
on server0 (owner index -> the last step it contributed to). The servers
learn nothing new from it: which owner contributed to which step is visible
to them anyway.

Example::

    table = presence_table("/job:tfe/task:0/device:CPU:0", "sum_0")
    done = wait_until(lambda: tf.raw_ops.BarrierReadySize(handle=barrier) > 0, 120.0, owner_device)
    missing = missing_owners(table, ["chief:0", "worker:0"], step)
"""
import time
from typing import Callable, Sequence

import numpy as np
import tensorflow as tf

__all__ = ["wait_until", "presence_table", "record_presence", "last_steps", "missing_owners",
           "POLL_SECONDS", "DEFAULT_STEP_TIMEOUT_SECS", "validate_step_timeout"]

#: Pause between two polls of a server while a step's contributions are incomplete.
POLL_SECONDS = 0.005
#: How long an owner waits for the other owners' contributions to one step before it stops.
DEFAULT_STEP_TIMEOUT_SECS = 300.0


def validate_step_timeout(step_timeout_secs) -> float:
    """`step_timeout_secs` as a float, or a ValueError/TypeError naming it and the fix."""
    if isinstance(step_timeout_secs, bool) or not isinstance(step_timeout_secs, (int, float)):
        raise TypeError(f"step_timeout_secs must be a number of seconds, got {step_timeout_secs!r} "
                        f"({type(step_timeout_secs).__name__}). Pass e.g. step_timeout_secs=300.")
    if not np.isfinite(step_timeout_secs) or step_timeout_secs <= 0:
        raise ValueError(f"step_timeout_secs={step_timeout_secs!r}: an owner must stop waiting for the others "
                         "after a finite, positive time. Pass e.g. step_timeout_secs=300 (longer than your "
                         "slowest owner's step, including its first one).")
    return float(step_timeout_secs)


def _sleep(seconds):
    time.sleep(seconds)
    return np.int64(0)


def wait_until(probe: Callable[[], tf.Tensor], timeout_secs: float, device: str,
               after: Sequence[tf.Operation] = ()) -> tf.Tensor:
    """A bool tensor: whether `probe()` became true within `timeout_secs` (polled from `device`).

    `probe` builds the check (it runs again on every poll, e.g. a size read on a
    server: it places its ops itself); the loop and its pauses run on `device`,
    the owner's, and start after the ops `after`. Call it outside any
    ``tf.control_dependencies`` block (pass `after` instead).
    """
    with tf.device(device), tf.name_scope("bounded_wait"):
        with tf.control_dependencies(list(after)):
            start = tf.timestamp()
        with tf.control_dependencies([start]):
            first = tf.convert_to_tensor(probe())

        def cond(done, now):
            return tf.logical_and(tf.logical_not(done), now - start < timeout_secs)

        def body(done, now):
            pause = tf.numpy_function(_sleep, [tf.constant(POLL_SECONDS, tf.float64)], tf.int64, stateful=True)
            with tf.control_dependencies([pause, done, now]):
                now = tf.timestamp()
            with tf.control_dependencies([now]):
                return tf.convert_to_tensor(probe()), now

        done, _ = tf.while_loop(cond, body, [first, start], back_prop=False)
        return done


def presence_table(server: str, name: str) -> tf.Tensor:
    """The table on `server` of the last step each owner contributed to (shared by every owner's graph)."""
    with tf.device(server):
        return tf.raw_ops.MutableHashTableV2(key_dtype=tf.int64, value_dtype=tf.int64,
                                             shared_name=f"{name}/presence")


def record_presence(table: tf.Tensor, owner: int, step: tf.Tensor) -> tf.Operation:
    """Records that `owner` contributed to `step`."""
    with tf.device(table.device):  # on the server that holds the table, not the caller's device
        return tf.raw_ops.LookupTableInsertV2(table_handle=table, keys=tf.constant([owner], tf.int64),
                                              values=tf.reshape(tf.cast(step, tf.int64), [1]))


def last_steps(table: tf.Tensor, num_owners: int) -> tf.Tensor:
    """Each owner's last step in the table, -1 for none."""
    with tf.device(table.device):
        return tf.raw_ops.LookupTableFindV2(table_handle=table, keys=tf.range(num_owners, dtype=tf.int64),
                                            default_value=tf.constant(-1, tf.int64))


def missing_owners(table: tf.Tensor, owner_names: Sequence[str], step: tf.Tensor) -> tf.Tensor:
    """A string naming the owners that had not contributed to `step`, with the last step each did."""
    lasts = last_steps(table, len(owner_names))
    late = tf.not_equal(lasts, tf.cast(step, tf.int64))
    described = tf.strings.join([tf.constant(list(owner_names)), " (last contributed at step ",
                                 tf.strings.as_string(lasts), ")"])
    named = tf.strings.reduce_join(tf.boolean_mask(described, late), separator=", ")
    return tf.where(tf.reduce_any(late), named, tf.constant("none (every owner contributed)"))
