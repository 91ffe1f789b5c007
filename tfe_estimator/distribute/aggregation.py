"""`SecureAggregation`: a `tf.distribute.CrossDeviceOps` that sums by secret sharing.

Implements the design of tf-encrypted's RFC "Using TF Encrypted with
Distribution Strategies" (2019): every reduction a `MirroredStrategy` does
(gradients in `apply_gradients`, the reported loss, metric and other
`SyncOnRead` variables) goes through a secure sum instead of a plaintext copy
to one device. Per reduction and per replica, all dense values of one kind
(floats, or integers) are checked, fixed-point encoded and secret-shared once
on the replica's own device, as one vector (Pond: one fused kernel,
`fused_sum`; ABY3 or the "tf-encrypted" reference: tf-encrypted's protocol
code, `secure_sum`); the TFE servers add the shares they hold; each
destination device receives the sum masked by a keystream and the key of
that keystream (`fused_sum`), unmasks and decodes it once (the MEAN's
division folded into the decoding). The servers only ever hold ring
elements. `tfe_estimator.owner.service_strategy` is the same contract
across organisations, with the servers behind the aggregation service.

It subclasses `ReductionToOneDevice` only because `MirroredStrategy` refuses
in-graph multi-worker training with any other cross-device ops; none of the
parent's reduction code runs.

Use it through `tfe_estimator.TfeStrategy`: on TensorFlow 2.15 a plain
`MirroredStrategy` sums CPU and int32 values in the clear whatever
cross-device ops it is given.

Example::

    ops = tfe_estimator.SecureAggregation(
        protocol="pond", server_devices=["/cpu:2", "/cpu:3", "/cpu:4"])
    strategy = tfe_estimator.TfeStrategy(devices=["/cpu:0", "/cpu:1"],
                                         server_devices=ops.server_devices)
"""
import collections
import math
from typing import Optional, Sequence

import tensorflow as tf
from tensorflow.python.distribute import cross_device_ops as cross_device_ops_lib
from tensorflow.python.distribute import device_util
from tensorflow.python.distribute import distribute_utils
from tensorflow.python.distribute import values as value_lib

from tfe_estimator.privacy import dp as dp_lib
from tfe_estimator.secure import fused_sum
from tfe_estimator.secure import secure_sum
from tfe_estimator.distribute import replica_public
from tfe_estimator.distribute.devices import validate_party_devices
from tfe_estimator.secure.precision import READ_PRECISION, get_precision
from tfe_estimator.secure.protocols import check_supported, load_backend, validate_protocol
from tfe_estimator.validation import is_number

__all__ = ["SecureAggregation", "narrow_update_encoding"]

_FLOAT, _INT = "float", "int"

#: `implementation` values: "auto" runs Pond on tfe_estimator's fused AES-CTR
#: kernels and ABY3 on tf-encrypted; "tf-encrypted" runs tf-encrypted's own
#: protocol code for both (the reference implementation, with our AES-CTR
#: generator as its randomness).
IMPLEMENTATIONS = ("auto", "tf-encrypted")
# The DP clipping groups whose gradients this graph's step shares (at most one).
_DP_GROUPS_COLLECTION = "tfe_estimator_dp_shared_groups"


class SecureAggregation(tf.distribute.ReductionToOneDevice):
    """Cross-device reduction by TF Encrypted secure aggregation.

    Args:
      protocol: "pond" (2 servers + a crypto producer, 2-out-of-2 additive
        sharing) or "aby3" (3 servers, replicated sharing, honest majority).
      precision: "low" (64-bit ring) or "high" (128-bit ring); see
        `tfe_estimator.secure.precision`.
      server_devices: the three devices of the protocol's parties (for Pond:
        server0, server1 and the crypto producer, which a sum never uses),
        all distinct, and none a replica or destination device (on a
        cluster: none on a replica's or destination's task). Required:
        `tfe_estimator.distribute.devices.local_layout` gives a one-machine layout, and
        `TfeStrategy` chooses one for you.
      clip_norm: if set, each replica's float values of an update (a
        reduction to variables or an all-reduce, which is what optimizers do
        with gradients) are clipped to this global L2 norm on the replica's
        device before the range check, so large gradients are bounded
        instead of refused. Reductions to one device (the reported loss,
        metric reads) are never clipped.
      implementation: "auto" (Pond on tfe_estimator's fused AES-CTR kernels,
        ABY3 on tf-encrypted) or "tf-encrypted" (tf-encrypted's own Pond as
        well: the reference implementation; slower, same ring sums).
      update_ring_bits: 64 (default: updates on the precision's ring, exact
        fixed point) or 32: clipped float updates travel on a 32-bit ring
        whose scale comes from `clip_norm` (each element is below the next
        power of two above it), rounded at random to the ring's resolution
        (unbiased; Kairouz, Liu and Steinke 2021 quantise the same way for
        distributed DP): half the bytes up and down. Needs `clip_norm`, Pond
        on the fused kernels and no `dp`. The reported loss and metrics keep
        their exact rings.
      dp: optional `tfe_estimator.DistributedDP`: every float update (the
        gradients) must be a sum of per-example clipped gradients (marked by
        `tfe_estimator.privacy.dp.make_dp_optimizer`; others are refused), and each
        replica adds its part of the discrete Gaussian noise to its encoded
        values inside the fused mask op (see `tfe_estimator.privacy.dp`). Pond on
        the fused kernels only.

    Raises:
      ValueError: for an unknown protocol, precision or implementation, or
        server devices that are missing, too few or too many, or not distinct.
      NotImplementedError: for a combination this TensorFlow cannot run.

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
        implementation: str = "auto",
        dp: Optional["dp_lib.DistributedDP"] = None,
        update_ring_bits: int = 64,
    ) -> None:
        self._protocol = validate_protocol(protocol)
        self._clip_norm = validate_clip_norm(clip_norm)
        self._precision = get_precision(precision)
        if implementation not in IMPLEMENTATIONS:
            raise ValueError(f"implementation must be one of {IMPLEMENTATIONS}, got {implementation!r}.")
        self._fused = implementation == "auto" and self._protocol == "pond"
        if not self._fused:  # tf-encrypted's protocol code: its 128-bit ring may be missing
            check_supported("aby3" if self._precision.ring_bits == 128 else self._protocol, self._precision)
        self._server_devices = self._init_parties(server_devices)
        self._dp = _validate_dp(dp, self._protocol, self._fused)
        self._update_ring_bits = _validate_update_ring_bits(update_ring_bits, self._clip_norm, self._fused, dp)
        super().__init__()

    def _init_parties(self, server_devices):
        """The validated devices of the protocol's parties (a subclass may hold its parties elsewhere)."""
        return validate_party_devices(self._protocol, server_devices)

    @property
    def protocol(self) -> str:
        """The tf-encrypted protocol's name."""
        return self._protocol

    @property
    def precision(self):
        """The `tfe_estimator.secure.precision.Precision` in use."""
        return self._precision

    @property
    def clip_norm(self) -> Optional[float]:
        """The per-replica L2 clipping norm of updates, or None."""
        return self._clip_norm

    @property
    def server_devices(self):
        """The devices of the protocol's parties."""
        return self._server_devices

    @property
    def dp(self) -> Optional["dp_lib.DistributedDP"]:
        """The `DistributedDP` whose noise is added inside the secure sum, or None."""
        return self._dp

    @property
    def update_ring_bits(self) -> int:
        """The ring of clipped float updates: 64 (the precision's ring) or 32."""
        return self._update_ring_bits

    @property
    def implementation(self) -> str:
        """"fused" (tfe_estimator's kernels) or "tf-encrypted" (its protocol code)."""
        return "fused" if self._fused else "tf-encrypted"

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
            # An update (gradients to variables, an all-reduce) or a read (the
            # reported loss, a metric value, to one device).
            update = isinstance(destinations, value_lib.DistributedValues)
            groups.setdefault((sources, targets, kind, update), []).append(index)

        results = [None] * len(value_destination_pairs)
        for (sources, targets, kind, update), indices in groups.items():
            values = [value_destination_pairs[i][0] for i in indices]
            reduced = self._secure_reduce(reduce_op, values, sources, targets, kind, update)
            for i, r in zip(indices, reduced):
                results[i] = r
        return results

    def broadcast_implementation(self, tensor, destinations):
        """Copies a value computed outside the replicas (e.g. in cross-replica context) to `destinations`.

        Refuses a value placed on a device that is not among the
        destinations, which is how `MirroredVariable` updates a variable of
        ``aggregation=ONLY_FIRST_REPLICA`` in replica context: it would send
        replica 0's value, computed from its owner's data, to every replica
        in plaintext. A secure channel would not help: a broadcast's purpose
        is that every destination learns the value.

        Allows a value that every replica already has: one computed only from
        constants and the destination variable's own (mirrored) copies, such
        as Keras 3's ``iterations.assign(iterations + 1)`` in replica context
        (`tfe_estimator.distribute.replica_public`).
        """
        source = device_util.canonicalize(tensor.device) if getattr(tensor, "device", "") else ""
        targets = [device_util.canonicalize(d) for d in cross_device_ops_lib.get_devices_from(destinations)]
        if source and any(target != source for target in targets) \
                and not replica_public.is_replica_independent(tensor, destinations):
            raise NotImplementedError(
                f"SecureAggregation does not broadcast {getattr(tensor, 'name', tensor)} from {source} to "
                f"{targets}: a value on one replica's device (e.g. a variable with "
                "aggregation=ONLY_FIRST_REPLICA assigned in replica context) would reach every replica in "
                "plaintext. Use aggregation=SUM or MEAN (summed securely), or compute the value in "
                "cross-replica context (strategy.scope(), outside the replica function).")
        return super().broadcast_implementation(tensor, destinations)

    def _gather_implementation(self, per_replica_value, destinations, axis, options):
        raise NotImplementedError(
            "SecureAggregation only sums: gathering would send each replica's values "
            "in plaintext to one device. Avoid strategy.gather / all_gather with "
            "TfeStrategy."
        )

    def _secure_reduce(self, reduce_op, values, sources, targets, kind, update):
        """Securely reduces PerReplica `values` (all on `sources`) to `targets`."""
        if self._reads_stay_local(kind, update):
            return self._dp_local_read(reduce_op, values, sources, targets)
        tfe_backend = load_backend()  # our kernels, and tf-encrypted with our generator
        num = self._num_summands(len(sources))
        self._precision.check_headroom(num)
        self._check_devices(sources, targets)
        dtypes = [v.values[0].dtype for v in values]
        pack_dtype = _pack_dtype(kind, dtypes)
        encoding = self._encoding(kind, update, num)
        scale = 1.0 / num if kind == _FLOAT and reduce_op == tf.distribute.ReduceOp.MEAN else 1.0
        owners = [f"replica {r} ({device})" for r, device in enumerate(sources)]
        hint = self._hint(kind, update, encoding)
        clip = self._clip_norm is not None and kind == _FLOAT and update
        vectors, shapes = [], None
        with tf.name_scope("secure_aggregation"):
            for r, device in enumerate(sources):
                with tf.device(device):
                    dense = [_densify(v.values[r]) for v in values]
                    if self._fused:
                        # The fused kernels read a list of tensors as one vector:
                        # no concat here, no split after the reveal.
                        vector, shapes = secure_sum.parts(dense, pack_dtype)
                        if clip:
                            vector = tf.clip_by_global_norm(vector, self._clip_norm)[0]
                    else:
                        vector, shapes = secure_sum.pack(dense, pack_dtype)
                        if clip:
                            vector = tf.clip_by_norm(vector, self._clip_norm)
                vectors.append(vector)
            num_elements = sum(s.num_elements() for s in shapes)
            noise_variance = self._dp_noise_variance(values, kind, update, num, encoding, num_elements)
            if self._fused:
                totals = self._fused_sum(vectors, sources, targets, encoding, pack_dtype, owners, hint, scale,
                                         noise_variance)
            else:
                totals = self._tfe_sum(tfe_backend, vectors, sources, targets, encoding, pack_dtype,
                                       owners, hint, scale)
        per_target = []
        for device, total in zip(targets, totals):
            with tf.device(device), tf.name_scope("secure_aggregation_unpack"):
                parts = total if self._fused else secure_sum.unpack(total, shapes)
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

    def _num_summands(self, num_sources: int) -> int:
        """How many replicas' values a sum adds up: here, one per source device."""
        return num_sources

    def _noise_parties(self, num_summands: int) -> int:
        """How many parties add a part of the DP noise to a sum of `num_summands` values: here, each replica."""
        return num_summands

    def noise_parties(self, num_replicas_in_sync: int) -> int:
        """N of the DP accounting for a strategy of `num_replicas_in_sync` replicas: who adds a noise part.

        Every replica here; one per owner through the aggregation service (`ServiceAggregation`).
        """
        return self._noise_parties(num_replicas_in_sync)

    def _check_devices(self, sources, targets) -> None:
        """Refuses a party on a replica's or destination's device."""
        validate_party_devices(self._protocol, self._server_devices, sources, targets)

    def _fused_sum(self, vectors, sources, targets, encoding, dtype, owners, hint, scale, noise_variance):
        """Pond's sum on the fused kernels, with the parties on `server_devices`; decoded, one per target."""
        return fused_sum.pond_sum(vectors, sources, self._server_devices, targets, encoding, dtype, owners, hint,
                                  scale, noise_variance=noise_variance)

    def _reads_stay_local(self, kind, update) -> bool:
        """Under DP, reported float values (loss, metrics) are not summed across owners."""
        return self._dp is not None and kind == _FLOAT and not update

    def _dp_local_read(self, reduce_op, values, sources, targets):
        """Under DP, a reported value (loss, metric) is read from one replica's own data, never summed.

        The secure sum of the reported loss or a metric would reveal an
        un-noised value derived from the other owners' data. Each target gets
        the value of the replica on that device (else replica 0): as is for a
        MEAN, times N for a SUM (the local value extrapolated to the N replicas of every owner).
        """
        num = self._num_summands(len(sources))
        results = []
        for value in values:
            on_targets = []
            for device in targets:
                local = value.values[sources.index(device) if device in sources else 0]
                with tf.device(device), tf.name_scope("dp_local_read"):
                    on_targets.append(tf.identity(local) if reduce_op == tf.distribute.ReduceOp.MEAN
                                      else local * tf.cast(num, local.dtype))
            results.append(on_targets[0] if len(on_targets) == 1
                           else distribute_utils.regroup(on_targets, wrap_class=value_lib.Mirrored))
        return results

    def _dp_noise_variance(self, values, kind, update, num, encoding, num_elements):
        """Each replica's noise variance (ring units^2) for a DP update, else None.

        Refuses an update whose values are not marked as sums of gradients
        clipped per example to at most the `DistributedDP`'s l2_norm_clip, a
        step that shares two clipping groups, and a clipping group shared
        twice in one step (two noisy releases per step, accounted as one).

        The noise parties (`_noise_parties`: the replicas, or the owners of a
        service sum) each add ``sigma**2 / (N - t)`` to their contribution,
        which is bounded by the per-replica bound times the replicas it sums.
        """
        if self._dp is None or kind != _FLOAT or not update:
            return None
        groups = set()
        for value in values:
            for tensor in value.values:
                clip, group = dp_lib.clipped_sum_group(tensor) or (None, None)
                groups.add(group)
                if clip is None:
                    raise ValueError(
                        f"SecureAggregation(dp={self._dp}) refuses to share gradients that are not "
                        f"clipped per example ({tensor.name}): without per-example clipping the noise "
                        "bounds nothing. Use our model_fns (they clip when the RunConfig carries dp), or "
                        "a tensorflow-privacy DP head/estimator (e.g. tensorflow_privacy.DNNClassifier) "
                        "with optimizer=tfe_estimator.privacy.dp.make_dp_optimizer("
                        "tf.keras.optimizers.legacy.SGD(...), "
                        "l2_norm_clip) instead of an ordinary optimizer or a canned tf.estimator model.")
                if clip > self._dp.l2_norm_clip:
                    raise ValueError(
                        f"SecureAggregation: gradients clipped per example to {clip}, above "
                        f"DistributedDP.l2_norm_clip={self._dp.l2_norm_clip}: the noise would be too small. "
                        "Use the same l2_norm_clip in make_dp_optimizer and DistributedDP.")
        graph = tf.compat.v1.get_default_graph()
        shared = set(graph.get_collection(_DP_GROUPS_COLLECTION))
        if groups & shared:
            raise ValueError(
                f"SecureAggregation(dp={self._dp}): this step shares the gradients of one clipping group twice "
                "(e.g. apply_gradients or an all-reduce of the same clipped sums called twice): each share adds "
                "its own noisy release of every example's gradient, but the accounting (epsilon) counts one "
                "release per step. Fix: reduce the clipped gradients once per step (one optimizer, one "
                "apply_gradients).")
        groups |= shared
        if len(groups) > 1:
            raise ValueError(
                f"SecureAggregation(dp={self._dp}): this step shares gradients of {len(groups)} clipping "
                "groups (e.g. DNNLinearCombined's linear and dnn optimizers), each clipped to l2_norm_clip "
                f"separately, so one example moves the update by up to sqrt({len(groups)}) * l2_norm_clip "
                "and the noise would be too small. Fix: train all variables with one "
                "make_dp_optimizer (our model_fns, tensorflow_privacy.DNNClassifier), e.g. a "
                "DNNEstimator or LinearEstimator instead of DNNLinearCombined.")
        for group in groups - set(graph.get_collection(_DP_GROUPS_COLLECTION)):
            graph.add_to_collection(_DP_GROUPS_COLLECTION, group)
        parties = self._noise_parties(num)
        # Each party's contribution sums num / parties replicas (one, or an owner's local replicas).
        variance = dp_lib.check_noise_headroom(self._dp, parties, encoding.ring_bits, encoding.fraction_bits,
                                               encoding.bound * (num // parties), num_elements)
        return variance or None

    def _tfe_sum(self, tfe_backend, vectors, sources, targets, encoding, dtype, owners, hint, scale):
        """The sum by tf-encrypted's own protocol code; decoded, one tensor per target."""
        players = tfe_backend.DevicePlayers(self._server_devices)
        with tfe_backend.players_scope(players):
            protocol = tfe_backend.make_protocol(self._protocol, self._precision, players.servers)
            inputs = []
            for vector, device, owner in zip(vectors, sources, owners):
                with tf.device(device):
                    vector = secure_sum.check_encodable(vector, encoding.bound, owner, hint)
                    inputs.append((players.device_player(device), secure_sum.encode(vector, encoding.fraction_bits)))
            sums = secure_sum.share_and_sum(protocol, inputs, [players.device_player(d) for d in targets])
        totals = []
        for device, total in zip(targets, sums):
            with tf.device(device):
                totals.append(secure_sum.decode(total, dtype, encoding.fraction_bits, scale))
        return totals

    def _encoding(self, kind, update, num) -> fused_sum.Encoding:
        """Ring, fraction bits and per-replica bound for one group of values."""
        if kind == _INT:
            # Integers are shared exactly. On the 64-bit ring the sum of N
            # values must stay below 2**63; on the 128-bit ring any int64 fits
            # and the reveal refuses a sum that does not fit the dtype.
            ring = self._precision.ring_bits
            bits = 63 if ring == 128 else 63 - math.ceil(math.log2(max(num, 1)))
            return fused_sum.Encoding(ring, 0, float(2**bits))
        if self._update_ring_bits == 32 and update and kind == _FLOAT:  # clipped: see narrow_update_encoding
            return narrow_update_encoding(self._clip_norm, num)
        precision = self._precision
        if not update and self._fused:
            # The reported loss and metric values: any magnitude float32
            # training produces in practice, on the 128-bit ring.
            precision = READ_PRECISION
            precision.check_headroom(num)
        return fused_sum.Encoding(precision.ring_bits, precision.fraction_bits, precision.max_magnitude)

    def _hint(self, kind, update, encoding):
        if kind == _INT:
            return "Integer values are shared exactly; keep counters below this limit."
        if not update:
            return (
                "These are values the model reports (the loss or a metric), not gradients. Fix: "
                f"scale the labels (and features) so that they stay below {encoding.bound:.3g}."
            )
        return (
            "Fixes: lower the learning rate, clip gradients (clip_norm=... in TfeRunConfig, or "
            "tf.clip_by_global_norm in the model_fn), scale features and labels"
            + (", or use precision='high' (limit 2**30)." if self._precision.name == "low" else ".")
        )


def validate_clip_norm(clip_norm) -> Optional[float]:
    """Returns `clip_norm` as a float if it is None or a finite number > 0."""
    if clip_norm is None:
        return None
    if not is_number(clip_norm):
        raise TypeError(f"clip_norm must be a positive number or None, got {clip_norm!r}.")
    if not math.isfinite(clip_norm) or clip_norm <= 0:
        raise ValueError(f"clip_norm must be a finite number > 0 or None, got {clip_norm!r}.")
    return float(clip_norm)


def narrow_update_encoding(clip_norm: float, num: int) -> fused_sum.Encoding:
    """The 32-bit ring's encoding of updates clipped to `clip_norm`, summed over `num` replicas.

    Each element of a clipped update is at most `clip_norm` < ``2**b`` (b the
    exponent of the next power of two above it); with F fraction bits and
    ``h = ceil(log2 num)`` headroom bits, ``b + F + h = 30`` keeps the sum of
    `num` randomly rounded values (each below ``2**(b+F)`` plus one unit)
    inside the signed 32-bit ring.

    Raises:
      ValueError: if fewer than 8 fraction bits remain, naming the values and the fix.
    """
    b = math.floor(math.log2(clip_norm)) + 1
    headroom = math.ceil(math.log2(max(num, 1)))
    fraction = 30 - b - headroom
    if fraction < 8:
        raise ValueError(
            f"update_ring_bits=32 with clip_norm={clip_norm} and {num} replicas leaves {fraction} fraction "
            "bits (resolution 2**-fraction): too coarse. Lower clip_norm or use update_ring_bits=64.")
    return fused_sum.Encoding(32, fraction, float(2**b))


def _validate_update_ring_bits(bits, clip_norm, fused, dp) -> int:
    if bits == 64:
        return 64
    if bits != 32 or isinstance(bits, bool):
        raise ValueError(f"update_ring_bits must be 64 or 32, got {bits!r}.")
    if clip_norm is None:
        raise ValueError("update_ring_bits=32 needs clip_norm=...: the 32-bit ring's scale comes from the "
                         "clipping bound. Set clip_norm, or keep update_ring_bits=64.")
    if not fused or dp is not None:
        raise NotImplementedError(
            "update_ring_bits=32 runs on the fused Pond kernels without DistributedDP (the noise is "
            "sized for the 64-bit ring). Use protocol='pond', implementation='auto' and no dp, or "
            "update_ring_bits=64.")
    return 32


def _validate_dp(dp, protocol, fused):
    """Returns `dp` if it is None or a `DistributedDP` this configuration can run."""
    if dp is None:
        return None
    if not isinstance(dp, dp_lib.DistributedDP):
        raise TypeError(f"dp must be a tfe_estimator.DistributedDP or None, got {type(dp).__name__}: {dp!r}.")
    if not fused:
        raise NotImplementedError(
            f"DistributedDP adds its noise inside tfe_estimator's fused Pond kernels; protocol={protocol!r} "
            "with this implementation shares through tf-encrypted, which has no noise input. Use "
            "protocol='pond' with implementation='auto' for differential privacy.")
    return dp


def _kind(value):
    dtype = value.values[0].dtype if isinstance(value, value_lib.DistributedValues) else value.dtype
    if dtype.is_floating:
        return _FLOAT
    if dtype.is_integer and dtype.is_unsigned:
        raise NotImplementedError(
            f"SecureAggregation does not sum unsigned integers (got {dtype.name}): their sums "
            "would wrap silently. Cast them to int64 first."
        )
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
    if kind == _INT and dtype.size < 8:
        # Integers are summed in int64: a sum that does not fit the narrower dtype is an
        # error, never wrapped. The message carries no value (it may cross owners).
        fits = tf.reduce_all(tf.logical_and(part >= dtype.min, part <= dtype.max))
        check = tf.debugging.Assert(fits, [f"Secure aggregation: a sum of {dtype.name} values does not fit "
                                           f"{dtype.name}; keep counters smaller or use int64."], name="sum_fits")
        with tf.control_dependencies([check]):
            part = tf.identity(part)
    if kind == _INT and reduce_op == tf.distribute.ReduceOp.MEAN:
        return tf.cast(part, dtype) / num  # like ReductionToOneDevice
    return tf.cast(part, dtype)
