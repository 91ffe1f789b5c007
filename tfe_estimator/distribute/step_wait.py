"""A bounded wait across data owners in between-graph mode: poll a server, give up after a time.

``BarrierTakeMany`` and ``QueueDequeueV2`` ignore their ``timeout_ms``
attributes, so a graph that must wait for other owners and then report who
was missing polls a size on the server instead (``wait_until``) and decides
itself, before the session's own deadline (``step_timeout_secs``) ends the
run with a bare "Operation timed out".

Example::

    done = wait_until(lambda: tf.raw_ops.QueueSizeV2(handle=queue) > 0, 120.0, owner_device)
    check = tf.debugging.Assert(done, ["the other owners did not arrive"])
"""
import time
from typing import Callable, Sequence

import numpy as np
import tensorflow as tf

__all__ = ["wait_until", "POLL_SECONDS", "DEFAULT_STEP_TIMEOUT_SECS"]

#: How long one between-graph session run may wait for the other owners (TfeRunConfig(step_timeout_secs)).
DEFAULT_STEP_TIMEOUT_SECS = 300.0
#: Pause between two polls of a server while a step's contributions are incomplete.
POLL_SECONDS = 0.005


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
