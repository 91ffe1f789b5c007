"""`SecureAggregation`: a `tf.distribute.CrossDeviceOps` that sums by secret sharing.

Implements the design of tf-encrypted's RFC "Using TF Encrypted with
Distribution Strategies" (2019): every reduction a `MirroredStrategy` does
(gradients in `apply_gradients`, the reported loss, metric and other
`SyncOnRead` variables) goes through a secure sum instead of a plaintext copy
to one device. Per reduction and per replica, all dense values of one kind
(floats, or integers) are packed into one vector, checked, fixed-point encoded
and secret-shared once on the replica's own device; the TFE servers add the
shares they hold; each destination device receives both shares of the sum,
adds them and decodes the result once (the MEAN's division folded into the
decoding scale). The servers only ever hold ring elements.

It subclasses `ReductionToOneDevice` only because `MirroredStrategy` refuses
in-graph multi-worker training with any other cross-device ops; none of the
parent's reduction code runs.

Example::

    strategy = tf.distribute.MirroredStrategy(
        devices=["/cpu:0", "/cpu:1"],
        cross_device_ops=tfe_estimator.SecureAggregation(
            protocol="pond", server_devices=["/cpu:2", "/cpu:3", "/cpu:4"]))
"""
import collections
import math
from typing import Optional, Sequence

import tensorflow as tf
from tensorflow.python.distribute import cross_device_ops as cross_device_ops_lib
from tensorflow.python.distribute import device_util
from tensorflow.python.distribute import distribute_utils
from tensorflow.python.distribute import values as value_lib
from tensorflow.python.platform import tf_logging as logging

from tfe_estimator.precision import get_precision
from tfe_estimator.protocols import PROTOCOLS, load_backend, validate_protocol
from tfe_estimator import secure_sum

__all__ = ["SecureAggregation"]

_FLOAT, _INT = "float", "int"


class SecureAggregation(tf.distribute.ReductionToOneDevice):
    """Cross-device reduction by TF Encrypted secure aggregation.

    Args:
      protocol: "pond" (2 servers + a crypto producer, 2-out-of-2 additive
        sharing) or "aby3" (3 servers, replicated sharing, honest majority).
      precision: "low" (64-bit ring) or "high" (128-bit ring); see
        `tfe_estimator.precision`.
      server_devices: the three devices of the protocol's parties (for Pond:
        server0, server1 and the crypto producer, which a sum never uses).
        None puts all three on the host CPU of the first replica's task: a
        functional, in-process simulation without any security boundary,
        which `TfeStrategy` never uses.
      clip_norm: if set, each replica's float values of an update (a
        reduction to variables or an all-reduce, which is what optimizers do
        with gradients) are clipped to this global L2 norm on the replica's
        device before the range check, so large gradients are bounded
        instead of refused. Reductions to one device (the reported loss,
        metric reads) are never clipped.

    Raises:
      ValueError: for an unknown protocol or precision, or a wrong number of
        server devices.

    Example::

        ops = SecureAggregation(protocol="pond", server_devices=[
            "/job:tfe/task:0", "/job:tfe/task:1", "/job:tfe/task:2"])
        strategy = tf.compat.v1.distribute.MirroredStrategy(
            devices=["/job:chief/task:0/device:CPU:0", "/job:worker/task:0/device:CPU:0"],
            cross_device_ops=ops)
    """

    def __init__(
        self,
        protocol: str = "pond",
        precision: str = "low",
        server_devices: Optional[Sequence[str]] = None,
        clip_norm: Optional[float] = None,
    ) -> None:
        self._protocol = validate_protocol(protocol)
        self._clip_norm = validate_clip_norm(clip_norm)
        self._precision = get_precision(precision)
        if server_devices is not None:
            server_devices = tuple(device_util.canonicalize(d) for d in server_devices)
            if len(server_devices) != PROTOCOLS[self._protocol]:
                raise ValueError(
                    f"protocol={self._protocol!r} needs {PROTOCOLS[self._protocol]} server "
                    f"devices, got {len(server_devices)}: {list(server_devices)}."
                )
        self._server_devices = server_devices
        super().__init__()

    @property
    def protocol(self) -> str:
        """The tf-encrypted protocol's name."""
        return self._protocol

    @property
    def precision(self):
        """The `tfe_estimator.precision.Precision` in use."""
        return self._precision

    @property
    def clip_norm(self) -> Optional[float]:
        """The per-replica L2 clipping norm of updates, or None."""
        return self._clip_norm

    @property
    def server_devices(self):
        """The devices of the protocol's parties, or None for the in-process default."""
        return self._server_devices

    def reduce_implementation(self, reduce_op, per_replica_value, destinations, options):
        return self.batch_reduce_implementation(
            reduce_op, [(per_replica_value, destinations)], options
        )[0]

    def batch_reduce_implementation(self, reduce_op, value_destination_pairs, options):
        del options  # Communication options do not apply to secret sharing.
        if reduce_op not in (tf.distribute.ReduceOp.SUM, tf.distribute.ReduceOp.MEAN):
            raise ValueError(f"reduce_op must be ReduceOp.SUM or ReduceOp.MEAN, got {reduce_op}.")
        groups = collections.OrderedDict()
        for index, (value, destinations) in enumerate(value_destination_pairs):
            sources = cross_device_ops_lib.get_devices_from(value)
            if cross_device_ops_lib.check_destinations(destinations):
                targets = cross_device_ops_lib.get_devices_from(destinations)
            else:
                targets = sources
            kind = _kind(value)
            clip = (self._clip_norm is not None and kind == _FLOAT
                    and isinstance(destinations, value_lib.DistributedValues))
            groups.setdefault((sources, targets, kind, clip), []).append(index)

        results = [None] * len(value_destination_pairs)
        for (sources, targets, kind, clip), indices in groups.items():
            values = [value_destination_pairs[i][0] for i in indices]
            reduced = self._secure_reduce(reduce_op, values, sources, targets, kind, clip)
            for i, r in zip(indices, reduced):
                results[i] = r
        return results

    def _gather_implementation(self, per_replica_value, destinations, axis, options):
        raise NotImplementedError(
            "SecureAggregation only sums: gathering would send each replica's values "
            "in plaintext to one device. Avoid strategy.gather / all_gather with "
            "TfeStrategy."
        )

    def _secure_reduce(self, reduce_op, values, sources, targets, kind, clip=False):
        """Securely reduces PerReplica `values` (all on `sources`) to `targets`."""
        tfe_backend = load_backend()
        num = len(sources)
        self._precision.check_headroom(num)
        players = tfe_backend.DevicePlayers(self._servers_for(sources))
        dtypes = [v.values[0].dtype for v in values]
        with tf.name_scope("secure_aggregation"), tfe_backend.players_scope(players):
            protocol = tfe_backend.make_protocol(self._protocol, self._precision, players.servers)
            inputs = []
            shapes = None
            pack_dtype = _pack_dtype(kind, dtypes)
            fraction_bits = self._precision.fraction_bits if kind == _FLOAT else 0
            for r, device in enumerate(sources):
                with tf.device(device):
                    dense = [_densify(v.values[r]) for v in values]
                    vector, shapes = secure_sum.pack(dense, pack_dtype)
                    if clip:
                        vector = tf.clip_by_norm(vector, self._clip_norm)
                    vector = secure_sum.check_encodable(
                        vector, self._bound(kind, num), f"replica {r} ({device})", self._hint(kind)
                    )
                    ring = secure_sum.encode(vector, fraction_bits)
                inputs.append((players.device_player(device), ring))
            sums = secure_sum.share_and_sum(protocol, inputs, [players.device_player(d) for d in targets])
        scale = 1.0 / num if kind == _FLOAT and reduce_op == tf.distribute.ReduceOp.MEAN else 1.0
        per_target = []
        for device, total in zip(targets, sums):
            with tf.device(device), tf.name_scope("secure_aggregation_decode"):
                total = secure_sum.decode(total, pack_dtype, fraction_bits, scale)
                parts = secure_sum.unpack(total, shapes)
                parts = [_finish(p, dtype, kind, reduce_op, num) for p, dtype in zip(parts, dtypes)]
            per_target.append(parts)
        results = []
        for j in range(len(values)):
            on_targets = [parts[j] for parts in per_target]
            if len(on_targets) == 1:
                results.append(on_targets[0])
            else:
                results.append(distribute_utils.regroup(on_targets, wrap_class=value_lib.Mirrored))
        return results

    def _servers_for(self, sources):
        if self._server_devices is not None:
            return self._server_devices
        host = tf.DeviceSpec.from_string(sources[0]).replace(device_type="CPU", device_index=0)
        logging.log_first_n(
            logging.WARNING,
            "SecureAggregation without server_devices: all TFE parties run on %s, "
            "in this process. This simulates the protocol; it is not a security "
            "boundary. TfeStrategy and TfeRunConfig place them on their own devices." % host.to_string(),
            1,
        )
        return (host.to_string(),) * PROTOCOLS[self._protocol]

    def _bound(self, kind, num):
        if kind == _FLOAT:
            return self._precision.max_magnitude
        bits = min(self._precision.ring_bits, 64) - 1 - math.ceil(math.log2(max(num, 1)))
        return float(2**bits)

    def _hint(self, kind):
        if kind == _INT:
            return "Integer values are shared exactly; keep counters below this limit."
        return (
            "Fixes: lower the learning rate, clip gradients (e.g. tf.clip_by_global_norm in "
            "the model_fn), scale features and labels"
            + (", or use precision=high (limit 2**30)." if self._precision.name == "low" else ".")
        )


def validate_clip_norm(clip_norm) -> Optional[float]:
    """Returns `clip_norm` as a float if it is None or a finite number > 0."""
    if clip_norm is None:
        return None
    if isinstance(clip_norm, bool) or not isinstance(clip_norm, (int, float)):
        raise TypeError(f"clip_norm must be a positive number or None, got {clip_norm!r}.")
    if not math.isfinite(clip_norm) or clip_norm <= 0:
        raise ValueError(f"clip_norm must be a finite number > 0 or None, got {clip_norm!r}.")
    return float(clip_norm)


def _kind(value):
    dtype = value.values[0].dtype if isinstance(value, value_lib.DistributedValues) else value.dtype
    if dtype.is_floating:
        return _FLOAT
    if dtype.is_integer:
        return _INT
    raise NotImplementedError(
        f"SecureAggregation sums float and integer values; got dtype {dtype.name}."
    )


def _densify(value):
    # The indices of an IndexedSlices gradient say which embedding rows a
    # replica's batch touched: revealing them leaks data, so they are summed dense.
    if isinstance(value, tf.IndexedSlices):
        return tf.convert_to_tensor(value)
    return value


def _pack_dtype(kind, dtypes):
    if kind == _INT:
        return tf.int64
    return tf.float64 if tf.float64 in dtypes else tf.float32


def _finish(part, dtype, kind, reduce_op, num):
    """Casts a decoded sum back to the input dtype; applies MEAN to integers.

    A float MEAN is already divided by `decode`'s scale.
    """
    if kind == _INT and reduce_op == tf.distribute.ReduceOp.MEAN:
        return tf.cast(part, dtype) / num  # like ReductionToOneDevice
    return tf.cast(part, dtype)
