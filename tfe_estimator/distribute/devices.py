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

from tfe_estimator.secure.protocols import PROTOCOLS
from tfe_estimator.validation import is_int

__all__ = ["DEFAULT_NUM_REPLICAS", "validate_num_replicas", "validate_party_devices", "local_layout", "cpus_needed"]

DEFAULT_NUM_REPLICAS = 2
_LOCAL = "/job:localhost/replica:0/task:0/device:{}:{}"


def validate_num_replicas(num_replicas) -> int:
    """Returns `num_replicas` (default 2 for None) if it is an integer >= 1.

    Raises:
      TypeError, ValueError: naming the value.
    """
    if num_replicas is None:
        return DEFAULT_NUM_REPLICAS
    if not is_int(num_replicas):
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


def _task(device: str) -> Optional[Tuple[str, int, int]]:
    """The (job, replica, task) of a device on a cluster, None for a local one."""
    spec = tf.DeviceSpec.from_string(device)
    if spec.job in (None, "localhost"):
        return None
    return spec.job, spec.replica or 0, spec.task or 0


def validate_party_devices(
    protocol: str,
    server_devices: Optional[Sequence[str]],
    replica_devices: Sequence[str] = (),
    destinations: Sequence[str] = (),
) -> Tuple[str, ...]:
    """Checks the TFE parties' devices; returns them canonicalized.

    Each party must be on a device of its own: a device holding two parties'
    shares, or a replica's values and a share, would see what the protocol
    hides. On a cluster the boundary is the task (one process): parties must
    be on distinct tasks, and none on a replica's or destination's task.

    Args:
      protocol: "pond" or "aby3" (decides the number of parties).
      server_devices: the parties' devices, in the protocol's order.
      replica_devices: the devices whose values are shared.
      destinations: the devices that receive the sum.

    Raises:
      ValueError: naming the devices and the fix.

    Example::

        >>> validate_party_devices("pond", ["/cpu:2", "/cpu:3", "/cpu:4"], ["/cpu:0", "/cpu:1"])[0]
        '/job:localhost/replica:0/task:0/device:CPU:2'
    """
    from tensorflow.python.distribute import device_util  # pylint: disable=import-outside-toplevel

    need = PROTOCOLS[protocol]
    if server_devices is None:
        raise ValueError(
            f"protocol={protocol!r} needs {need} server devices, got None. Pass server_devices "
            "(on one machine: tfe_estimator.distribute.devices.local_layout(num_replicas)[1]; on a cluster: "
            "TfeCluster.server_devices()), or use TfeStrategy / TfeRunConfig, which choose them."
        )
    servers = tuple(device_util.canonicalize(d) for d in server_devices)
    if len(servers) != need:
        raise ValueError(f"protocol={protocol!r} needs {need} server devices, got {len(servers)}: {list(servers)}.")
    if len(set(servers)) != len(servers):
        raise ValueError(
            f"server devices must be distinct, got {list(servers)}: one device would hold two "
            "parties' shares. Give each party a device of its own."
        )
    tasks = [_task(d) for d in servers]
    on_tasks = [t for t in tasks if t is not None]
    if len(set(on_tasks)) != len(on_tasks):
        raise ValueError(
            f"server devices must be on distinct tasks of the cluster, got {list(servers)}: one "
            "process would hold two parties' shares. Put each party on its own `tfe` task."
        )
    others = [device_util.canonicalize(d) for d in (*replica_devices, *destinations)]
    for other in others:
        other_task = _task(other)
        for server, task in zip(servers, tasks):
            if other == server or (task is not None and task == other_task):
                raise ValueError(
                    f"server device {server} is (on the same task as) the replica or destination "
                    f"device {other}: that party would see a replica's values or the sum. Put the "
                    "parties on devices (on a cluster: tasks) of their own."
                )
    return servers
