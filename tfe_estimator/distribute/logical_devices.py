"""Logical CPU devices for `TfeStrategy` under Keras (eager TensorFlow).

Estimator runs in graph-mode sessions, which create the CPU devices a layout
needs from `ConfigProto.device_count` (`TfeStrategy.update_config_proto`).
Keras runs eagerly: every replica and every TFE party must then be a logical
device of TensorFlow's runtime, configured before the runtime starts. Two
replicas and three parties need five logical CPU devices; with fewer,
tf-encrypted fails deep inside with a bare ``AssertionError``.

Example::

    import tensorflow as tf
    from tfe_estimator.distribute.logical_devices import configure_logical_cpus, check_logical_cpus

    configure_logical_cpus(5)            # first thing in the script
    strategy = tfe_estimator.TfeStrategy()
    check_logical_cpus(strategy)         # a clear error instead of an AssertionError
    with strategy.scope():
        model = tf.keras.Sequential([...])
"""
from typing import Sequence, Union

from tfe_estimator.validation import check_int

__all__ = ["logical_cpus_needed", "check_logical_cpus", "configure_logical_cpus"]

_HOW = ("call, before anything else runs TensorFlow ops:\n"
        "    cpu = tf.config.list_physical_devices('CPU')[0]\n"
        "    tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * {n})\n"
        "(or tfe_estimator.distribute.logical_devices.configure_logical_cpus({n}))")


def _devices_of(strategy_or_devices) -> Sequence[str]:
    if isinstance(strategy_or_devices, (list, tuple)):
        return list(strategy_or_devices)
    strategy = strategy_or_devices
    devices = list(strategy.extended.worker_devices)
    ops = getattr(strategy, "secure_aggregation", None)
    for name in ("server_devices", "_server_devices"):
        servers = getattr(ops, name, None)
        if servers:
            return devices + list(servers)
    return devices


def logical_cpus_needed(strategy_or_devices: Union[Sequence[str], object]) -> int:
    """How many logical CPU devices this process needs for a strategy (replicas and parties) or devices.

    Example::

        >>> logical_cpus_needed(["/job:localhost/replica:0/task:0/device:CPU:0", "/cpu:4"])
        5
    """
    from tfe_estimator.distribute.devices import cpus_needed  # pylint: disable=import-outside-toplevel

    return cpus_needed(_devices_of(strategy_or_devices))


def check_logical_cpus(strategy_or_devices: Union[Sequence[str], object]) -> None:
    """Raises if eager TensorFlow has fewer logical CPU devices than the layout places on.

    Raises:
      RuntimeError: naming how many devices exist, how many are needed and the call that adds them.
    """
    import tensorflow as tf  # pylint: disable=import-outside-toplevel

    need = logical_cpus_needed(strategy_or_devices)
    have = len(tf.config.list_logical_devices("CPU"))
    if have < need:
        raise RuntimeError(
            f"TfeStrategy under Keras (eager TensorFlow) places its replicas and the TFE parties on "
            f"{need} CPU devices (CPU:0..CPU:{need - 1}), but this process has {have} logical CPU "
            f"device{'s' if have != 1 else ''}. To create them, " + _HOW.format(n=need)
        )


def configure_logical_cpus(count: int) -> None:
    """Splits the physical CPU into `count` logical CPU devices (before TensorFlow's runtime starts).

    Raises:
      ValueError: for a count below 1.
      RuntimeError: if the runtime already started with a different number of devices.
    """
    import tensorflow as tf  # pylint: disable=import-outside-toplevel

    check_int(count, f"count must be an integer >= 1, got {count!r}.", minimum=1)
    cpu = tf.config.list_physical_devices("CPU")[0]
    try:
        tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * count)
    except RuntimeError as e:
        have = len(tf.config.list_logical_devices("CPU"))
        if have >= count:
            return
        raise RuntimeError(
            f"cannot create {count} logical CPU devices: TensorFlow's runtime has already started with "
            f"{have} ({e}). Call configure_logical_cpus({count}) at the top of the script, before any "
            "TensorFlow op, model or strategy is created."
        ) from None
