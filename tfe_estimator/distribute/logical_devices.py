"""Logical CPU devices for `TfeStrategy` under Keras and custom training loops (eager TensorFlow).

Estimator runs in graph-mode sessions, which create the CPU devices a layout
needs from `ConfigProto.device_count` (`TfeStrategy.update_config_proto`).
Keras and custom training loops run eagerly: every replica and every TFE party
must then be a logical device of TensorFlow's eager runtime. Two replicas and
three parties need five logical CPU devices; with fewer, tf-encrypted fails
deep inside with a bare ``AssertionError``.

`TfeStrategy()` creates them itself (`ensure_logical_cpus`):

- before TensorFlow's runtime starts, with TensorFlow's public
  `tf.config.set_logical_device_configuration`;
- after it started with the one CPU device TensorFlow gives by default (a
  dataset, a tensor or a model was made first), by adding the missing ones
  to the running context, as TensorFlow's DTensor does (`Context.
  set_logical_cpu_devices`); tensors and variables made before stay valid.

Only a runtime that already started with some logical CPU devices, but too
few, cannot get more: `check_logical_cpus` (called by `TfeStrategy.scope()`)
then names the numbers and the fix.

Example::

    import tensorflow as tf
    import tfe_estimator

    strategy = tfe_estimator.TfeStrategy()   # creates CPU:0..CPU:4 (2 replicas, 3 parties)
    with strategy.scope():
        model = tf.keras.Sequential([...])
"""
import logging
from typing import Sequence, Union

from tfe_estimator.validation import check_int

__all__ = ["logical_cpus_needed", "check_logical_cpus", "ensure_logical_cpus", "configure_logical_cpus"]

_HOW = ("Make tfe_estimator.TfeStrategy() before any other TensorFlow work (then it creates them itself), "
        "or, before anything else runs TensorFlow ops:\n"
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
            f"device{'s' if have != 1 else ''}, and its runtime, already started, cannot get more. "
            + _HOW.format(n=need)
        )


def ensure_logical_cpus(count: int) -> bool:
    """Gives eager TensorFlow at least `count` logical CPU devices, if it can; True when it has them.

    Before the runtime starts, configures `count` logical devices on the
    physical CPU (never fewer than a configuration already set). After it
    started with a single CPU device, adds the missing ones to the running
    context. After it started with several, but fewer than `count`, it cannot:
    returns False (`check_logical_cpus` then explains).

    Raises:
      ValueError: for a count below 1.
    """
    import tensorflow as tf  # pylint: disable=import-outside-toplevel
    from tensorflow.python.eager import context  # pylint: disable=import-outside-toplevel

    check_int(count, f"count must be an integer >= 1, got {count!r}.", minimum=1)
    cpu = tf.config.list_physical_devices("CPU")[0]
    if len(tf.config.get_logical_device_configuration(cpu) or ()) >= count:
        return True  # configured before the runtime started: it has them (or will)
    try:
        tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * count)
        return True
    except RuntimeError:
        pass  # "Virtual devices cannot be modified after being initialized": the runtime started
    have = len(tf.config.list_logical_devices("CPU"))
    if have >= count:
        return True
    add = getattr(context.context(), "set_logical_cpu_devices", None)  # TensorFlow's own, used by DTensor
    if have != 1 or add is None:
        return False
    add(count)
    logging.getLogger("tfe_estimator").info(
        "TensorFlow's runtime had already started with one CPU device: added logical CPU devices "
        "CPU:1..CPU:%d for the replicas and the TFE parties.", count - 1)
    return len(tf.config.list_logical_devices("CPU")) >= count


def configure_logical_cpus(count: int) -> None:
    """Makes sure eager TensorFlow has at least `count` logical CPU devices (see `ensure_logical_cpus`).

    Raises:
      ValueError: for a count below 1.
      RuntimeError: if the runtime already started with several, but fewer, devices.
    """
    import tensorflow as tf  # pylint: disable=import-outside-toplevel

    if not ensure_logical_cpus(count):
        have = len(tf.config.list_logical_devices("CPU"))
        raise RuntimeError(
            f"cannot create {count} logical CPU devices: TensorFlow's runtime has already started with "
            f"{have}. Call configure_logical_cpus({count}) at the top of the script, before any "
            "TensorFlow op, model or strategy is created."
        )
