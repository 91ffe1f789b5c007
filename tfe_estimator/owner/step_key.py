"""The global step of an owner's graph, which keys each per-step sum across data owners.

Service mode keys every contribution (and the owners' handshake) by the
global step: `graph_global_step` finds it with a clear error when the graph
has none, `read_step` reads it as an int64 scalar.

Example::

    step = read_step(graph_global_step(tf.compat.v1.get_default_graph(), "ServiceAggregation"))
"""
import tensorflow as tf

__all__ = ["read_step", "graph_global_step"]


def graph_global_step(graph: tf.Graph, who: str):
    """`graph`'s global step, which keys every per-step sum; a clear error naming `who` when there is none."""
    global_step = tf.compat.v1.train.get_global_step(graph)
    if global_step is None:
        raise ValueError(f"{who} keys each sum by the global step, but this graph has none: "
                         "train with an Estimator (it creates one), or create it with "
                         "tf.compat.v1.train.get_or_create_global_step() first.")
    return global_step


def read_step(global_step, name=None) -> tf.Tensor:
    """The global step's value as an int64 scalar: what keys a per-step sum and the owners' handshake."""
    value = global_step.read_value() if hasattr(global_step, "read_value") else tf.identity(global_step)
    return tf.cast(value, tf.int64, name=name)
