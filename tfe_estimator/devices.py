"""Local device layout: where replicas and TFE parties live on one machine.

On one machine each replica gets a GPU when there are enough, otherwise its
own CPU device; the three TFE parties get CPU devices of their own after
those. Graph-mode sessions (all Estimator uses) create their CPU devices from
`ConfigProto.device_count["CPU"]`, not from the eager runtime, so
`cpus_needed` tells how many to ask for and nothing here touches TensorFlow's
global runtime state.

Example::

    >>> replicas, servers = local_layout(2, num_gpus=0)
    >>> [tf.DeviceSpec.from_string(d).device_index for d in replicas + servers]
    [0, 1, 2, 3, 4]
    >>> cpus_needed(replicas + servers)
    5
"""
from typing import Optional, Sequence, Tuple

import tensorflow as tf

from tfe_estimator.protocols import PROTOCOLS

__all__ = ["DEFAULT_NUM_REPLICAS", "validate_num_replicas", "local_layout", "cpus_needed"]

DEFAULT_NUM_REPLICAS = 2
_LOCAL = "/job:localhost/replica:0/task:0/device:{}:{}"


def validate_num_replicas(num_replicas) -> int:
    """Returns `num_replicas` (default 2 for None) if it is an integer >= 1.

    Raises:
      TypeError, ValueError: naming the value.
    """
    if num_replicas is None:
        return DEFAULT_NUM_REPLICAS
    if isinstance(num_replicas, bool) or not isinstance(num_replicas, int):
        raise TypeError(
            f"num_replicas must be an int >= 1, got {num_replicas!r} of type "
            f"{type(num_replicas).__name__}."
        )
    if num_replicas < 1:
        raise ValueError(f"num_replicas must be >= 1, got {num_replicas}.")
    return num_replicas


def local_layout(
    num_replicas: int, protocol: str = "pond", num_gpus: Optional[int] = None
) -> Tuple[Tuple[str, ...], Tuple[str, ...]]:
    """The replica devices and the TFE party devices for one machine.

    Args:
      num_replicas: how many replicas.
      protocol: the protocol, which decides how many parties.
      num_gpus: GPUs available; None asks TensorFlow.

    Returns:
      `(replica_devices, server_devices)`, fully qualified device names.
    """
    if num_gpus is None:
        num_gpus = len(tf.config.list_physical_devices("GPU"))
    parties = PROTOCOLS[protocol]
    if num_gpus >= num_replicas:
        replicas = tuple(_LOCAL.format("GPU", i) for i in range(num_replicas))
        first_server_cpu = 1
    else:
        replicas = tuple(_LOCAL.format("CPU", i) for i in range(num_replicas))
        first_server_cpu = num_replicas
    servers = tuple(_LOCAL.format("CPU", first_server_cpu + i) for i in range(parties))
    return replicas, servers


def cpus_needed(devices: Sequence[str]) -> int:
    """How many CPU devices this process must have to hold `devices`."""
    count = 1
    for device in devices:
        spec = tf.DeviceSpec.from_string(device)
        if spec.job in (None, "localhost") and (spec.device_type or "CPU").upper() == "CPU":
            count = max(count, (spec.device_index or 0) + 1)
    return count
