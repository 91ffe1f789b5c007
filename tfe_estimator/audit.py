"""`assert_no_plaintext_on_servers`: a check of what the TFE servers can see.

Our promise is that a TFE server only ever holds ring elements (integer
shares and seeds), never a float gradient. This audit walks a graph and
raises, naming the op, if any op placed on a server device takes or
produces a floating-point tensor, which covers every edge into a server.

Example::

    graph = tf.compat.v1.get_default_graph()
    tfe_estimator.assert_no_plaintext_on_servers(
        graph, server_devices=strategy.secure_aggregation.server_devices)
"""
from typing import Iterable, Optional

import tensorflow as tf
from tensorflow.python.distribute import device_util

from tfe_estimator.cluster import TFE_JOB
from tfe_estimator.errors import PlaintextOnServerError

__all__ = ["assert_no_plaintext_on_servers", "server_ops"]


def _is_plaintext(dtype: tf.DType) -> bool:
    dtype = dtype.base_dtype
    return dtype.is_floating or dtype.is_complex


def server_ops(graph: tf.Graph, server_devices: Optional[Iterable[str]] = None):
    """The ops of `graph` placed on a server device.

    Args:
      graph: a `tf.Graph`.
      server_devices: the TFE party devices; None means every device of the
        job ``tfe`` (the cluster layout).
    """
    wanted = None if server_devices is None else {device_util.canonicalize(d) for d in server_devices}
    for op in graph.get_operations():
        if not op.device:
            continue
        if wanted is None:
            if tf.DeviceSpec.from_string(op.device).job == TFE_JOB:
                yield op
        elif device_util.canonicalize(op.device) in wanted:
            yield op


def assert_no_plaintext_on_servers(
    graph: tf.Graph, server_devices: Optional[Iterable[str]] = None
) -> int:
    """Raises if an op on a TFE server device takes or produces a float tensor.

    Args:
      graph: the graph to audit (e.g. Estimator's training graph).
      server_devices: the TFE party devices; None means every device of the
        job ``tfe``.

    Returns:
      How many server ops were audited (0 means the graph has none, which a
      caller expecting secure aggregation should treat as a failure).

    Raises:
      PlaintextOnServerError: naming the first op, its device and the
        offending tensor.
    """
    count = 0
    for op in server_ops(graph, server_devices):
        count += 1
        for kind, tensors in (("input", op.inputs), ("output", op.outputs)):
            for t in tensors:
                if _is_plaintext(t.dtype):
                    raise PlaintextOnServerError(
                        f"Op {op.name!r} ({op.type}) on TFE server device {op.device} has the "
                        f"{t.dtype.name} {kind} {t.name!r}: a server must only hold integer "
                        "shares. Something placed plaintext on a server device."
                    )
    return count
