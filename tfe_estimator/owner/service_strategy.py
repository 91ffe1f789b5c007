"""`ServiceStrategy`: one data owner's strategy across organisations, its sums through the aggregation service.

Every data owner runs its own Estimator in its own process, like local
training: its own graph, its own `model_dir`, its own evaluation, and no
TensorFlow server (nobody can connect to an owner). Its `L` local replicas
(GPUs, or CPU devices) are summed in plaintext inside the owner; each
reduction across owners (the gradients, the reported loss) is one secure
contribution per owner and step to the aggregation service
(`tfe_estimator.owner.contribution`, `tfe_estimator.service`). The
contract is `SecureAggregation`'s, with its ring, encodings, clipping and
checks: only where the sum is computed differs.

- Identical initial values come from one `tf_random_seed` on every owner
  (`TfeRunConfig` derives one from the cluster when none is given).
- Before a session's first step every owner agrees with the others through
  server0 on its model record (variables, optimizer and hyperparameters,
  feature constants, settings, number of owners) and, at the same step, its
  weights (`handshake`), then rewinds its own state on both servers.
  The record's hash, the model id, prefixes every channel of the model's
  sums (`channel_name`), so models trained one after another in one launch
  never share the servers' state. The record includes the training's number
  in this process (`training_run`): two trainings of identical models get
  two ids, and a restarted owner reads its training's back from model_dir.
- A MEAN divides by every replica of every owner; every owner has the same
  number of local replicas (the handshake's settings include it).
- Evaluation is federated (``ServiceStrategy(evaluation=True)``, what
  `TfeRunConfig` sets as ``eval_distribute``): every owner evaluates on its
  own data and the metrics' totals and counts are summed through the service.

Example::

    binding = ServiceBinding(addresses=("s0.example:7000", "s1.example:7000"), tls_dir="/etc/tfe/certs",
                             owner="chief:0", owners=("chief:0", "worker:0"))
    strategy = ServiceStrategy(binding, num_replicas=1)
    config = tf.estimator.RunConfig(train_distribute=strategy, tf_random_seed=7, model_dir="/data/chief")
"""
import dataclasses
import logging
import os
import weakref
from typing import Callable, Optional, Sequence, Tuple

import tensorflow as tf
from tensorflow.python.distribute import device_util
from tensorflow.python.distribute import distribute_lib
from tensorflow.python.distribute import input_util
from tensorflow.python.distribute import values as value_lib

from tfe_estimator.cluster import spec as cluster_lib
from tfe_estimator.distribute import distributed_eval
from tfe_estimator.owner import contribution
from tfe_estimator.owner import step_key
from tfe_estimator.owner import training_run
from tfe_estimator.distribute.aggregation import SecureAggregation
from tfe_estimator.distribute.devices import cpus_needed, local_layout
from tfe_estimator.distribute.strategy import TfeStrategy, _TfeExtended
from tfe_estimator.owner.step_wait import DEFAULT_STEP_TIMEOUT_SECS

__all__ = ["ServiceBinding", "ServiceAggregation", "ServiceStrategy", "ServiceExtended", "model_of", "service_client",
           "channel_name", "repeated_releases", "service_binding", "cluster_seed", "register_graph", "sums_built"]

log = logging.getLogger("tfe_estimator")


@dataclasses.dataclass(frozen=True)
class ServiceBinding:
    """Where one owner's sums go, and who it is.

    Attributes:
      addresses: ``host:port`` of the aggregation servers 0 and 1 (the ``tfe`` job of TF_CONFIG).
      tls_dir: directory with ``ca.crt`` and this owner's ``<job>-<index>.crt``/``.key``
        (`tfe_estimator.cluster.certs`); the servers know the owner by its certificate only.
      owner: this owner's name, ``"<job>:<index>"``; owners: every owner's name, in one order.
      timeout_secs: how long one contribution may wait for the other owners and the servers.
    """

    addresses: Tuple[str, str]
    tls_dir: str
    owner: str
    owners: Tuple[str, ...]
    timeout_secs: float = DEFAULT_STEP_TIMEOUT_SECS

    def __post_init__(self):
        if len(self.addresses) != 2:
            raise ValueError(f"the aggregation service has two servers (server0, server1), got addresses "
                             f"{list(self.addresses)!r}: list exactly two in TF_CONFIG's 'tfe' job.")
        if self.owner not in self.owners:
            raise ValueError(f"owner {self.owner!r} is not one of the owners {list(self.owners)!r}.")


#: Per graph: [sums built, the step tensor, {"model": the model id once known}] (module-level: Estimator
#: deep-copies its config, and so the strategy, which must not copy graphs).
_CHANNELS: "weakref.WeakKeyDictionary[tf.Graph, list]" = weakref.WeakKeyDictionary()


def model_of(graph: tf.Graph) -> dict:
    """The holder of `graph`'s model id: set by the handshake (training) or `ModelIdHook` (evaluation)."""
    state = _CHANNELS.get(graph)
    if state is None:
        global_step = step_key.graph_global_step(graph, "ServiceAggregation")
        # Made at the graph's first sum, and shared by every later one (the checkpoint saver's reads too): never
        # under that first sum's control dependencies (a model_fn's UPDATE_OPS around `minimize`), which would
        # run, with every later sum, the batch-norm updates and the input pipeline they read.
        with graph.control_dependencies(None):
            step = step_key.read_step(global_step, name="service_step")
        state = _CHANNELS[graph] = [0, step, {"model": None}]
    return state[2]


def register_graph(graph: tf.Graph, step: tf.Tensor, model: dict) -> None:
    """Keys `graph`'s sums by `step` and names their channels by `model` (``{"model": id}``, set by the
    handshake): for a graph without Estimator's global step (Keras' ``train_function``, `keras_fit`)."""
    if graph not in _CHANNELS:
        _CHANNELS[graph] = [0, step, model]


def sums_built(graph: tf.Graph) -> int:
    """How many service sums `graph` holds."""
    state = _CHANNELS.get(graph)
    return state[0] if state is not None else 0


def repeated_releases(graph: tf.Graph) -> int:
    """How many steps of `graph`'s training the servers released again, counted under
    ``DistributedDP(count_repeated_releases=True)`` (`training_run.ReleaseLedger`); 0 outside service mode."""
    state = _CHANNELS.get(graph)
    ledger = state[2].get("ledger") if state is not None else None
    return ledger.repeated if ledger is not None else 0


def service_binding(spec, step_timeout_secs: float = DEFAULT_STEP_TIMEOUT_SECS, who: str = "TfeRunConfig"):
    """This owner's `ServiceBinding` from its TF_CONFIG cluster `spec` (`tfe_estimator.cluster.spec.TfeCluster`)
    and ``TFE_ESTIMATOR_TLS_DIR``: what `TfeRunConfig` (Estimator) and `TfeStrategy()` (Keras) both build.

    Raises:
      ValueError: naming TF_CONFIG or the variable, when the cluster has not two servers or no certificates.
    """
    servers = spec.jobs[cluster_lib.TFE_JOB]
    if len(servers) != 2:
        raise ValueError(
            f"cluster_mode='service' needs exactly 2 '{cluster_lib.TFE_JOB}' tasks (aggregation server0 and "
            f"server1, each running `tfe-estimator server`), but TF_CONFIG lists {len(servers)}: {list(servers)}. "
            "Note that these values come from the TF_CONFIG environment variable.")
    tls_dir = os.environ.get(cluster_lib.TLS_DIR_ENV)
    if not tls_dir:
        raise ValueError(
            f"{who} in cluster_mode='service' needs this owner's certificate: set {cluster_lib.TLS_DIR_ENV} to a "
            f"directory with ca.crt and {spec.task_type}-{spec.task_index}.crt/.key (`tfe-estimator certs`; "
            "`tfe-estimator launch` makes them for a loopback cluster).")
    owners = tuple(f"{job}:{index}" for job, index in spec.data_owners())
    return ServiceBinding(addresses=(servers[0], servers[1]), tls_dir=tls_dir,
                          owner=f"{spec.task_type}:{spec.task_index}", owners=owners, timeout_secs=step_timeout_secs)


def cluster_seed(spec) -> int:
    """The seed every owner derives alike from its TF_CONFIG cluster: the first 31 bits of the SHA-256 of the
    cluster's canonical JSON (`tfe_estimator.cluster.spec.cluster_digest`)."""
    return int.from_bytes(cluster_lib.cluster_digest(spec.jobs)[:4], "big") >> 1


def channel_name(model: int, name: str) -> str:
    """A sum's channel on the servers: the model id, then the sum's name (two models never share one)."""
    return f"{model:016x}/{name}"


def service_client(binding: ServiceBinding):
    """This process's `tfe_estimator.service.OwnerClient` for `binding` (made on first use, then shared)."""
    from tfe_estimator.service import OwnerClient, TlsFiles, get_client  # pylint: disable=import-outside-toplevel

    def make():
        job, index = binding.owner.split(":")
        return OwnerClient(binding.addresses, TlsFiles.from_dir(binding.tls_dir, job, int(index)),
                           timeout_secs=binding.timeout_secs)

    return get_client(repr(binding), make)


class ServiceAggregation(SecureAggregation):
    """`SecureAggregation` whose sums across owners go through the aggregation service.

    Args:
      binding: the service and this owner (`ServiceBinding`).
      local_replicas: this owner's replicas (1, 2, 4 or 8: a power of two, so the
        owner's local sum has a power-of-two bound, as every fixed-point limit has).
      precision, clip_norm, update_ring_bits: as `SecureAggregation` (Pond on the fused kernels).
      channel_prefix: prefixes every sum's name ("eval_" for federated evaluation: its sums, keyed
        by the evaluated checkpoint's step, never meet the training's).
      dp: optional `tfe_estimator.DistributedDP`: each OWNER (not each local replica) adds its
        discrete Gaussian part to its local sum before masking, sized against t colluding owners of
        N = the number of owners; the reported loss and metrics stay local (`SecureAggregation`).
    """

    def __init__(self, binding: ServiceBinding, local_replicas: int = 1, precision: str = "low",
                 clip_norm: Optional[float] = None, update_ring_bits: int = 64, channel_prefix: str = "",
                 dp=None) -> None:
        if local_replicas not in (1, 2, 4, 8):
            raise ValueError(f"num_replicas={local_replicas!r} local replicas per owner: use 1, 2, 4 or 8 (a "
                             "power of two: the owner's plaintext sum of its replicas is checked against the "
                             "per-replica bound times the number of replicas, a power of two).")
        self._binding = binding
        self._local_replicas = local_replicas
        self._channel_prefix = channel_prefix
        #: ``() -> (name, step, model state)`` of a sum made eagerly, set by a framework adapter whose
        #: framework reads values across owners after its steps (`keras_fit`); None: refused.
        self.eager_channel: Optional[Callable[[], tuple]] = None
        #: ``(graph) -> None`` raising for a graph whose sums no step keys (set by an adapter, `keras_fit`).
        self.check_unkeyed: Optional[Callable[[tf.Graph], None]] = None
        super().__init__(protocol="pond", precision=precision, server_devices=None, clip_norm=clip_norm,
                         update_ring_bits=update_ring_bits, dp=dp)

    @property
    def binding(self) -> ServiceBinding:
        """The service and this owner."""
        return self._binding

    def _init_parties(self, server_devices):
        del server_devices  # the parties are the service's two servers, not devices of this process
        return ()

    @property
    def _num_between_graph_workers(self):
        # CrossDeviceOps.reduce/batch_reduce return a single local value unreduced when this is 1
        # (cross_device_ops.py: "Shortcut if `per_replica_value` only contains one value"): an owner
        # with one replica would train on its own gradients alone.
        return len(self._binding.owners)

    def _num_summands(self, num_sources: int) -> int:
        return num_sources * len(self._binding.owners)

    def _noise_parties(self, num_summands: int) -> int:
        del num_summands  # one noise part per owner, on its local sum of its replicas
        return len(self._binding.owners)

    def _check_devices(self, sources, targets) -> None:
        del sources, targets  # every device is this owner's: nothing but the contribution op leaves it

    def _fused_sum(self, vectors, sources, targets, encoding, dtype, owners, hint, scale, noise_variance):
        if len(sources) != self._local_replicas:
            raise ValueError(f"this owner sums {len(sources)} replicas, but its ServiceAggregation was made for "
                             f"{self._local_replicas}.")
        channel, step, model = self._next_channel()
        binding = self._binding

        def contribute(name, *args):
            if model["model"] is None:
                raise ValueError(f"sum {name!r} of owner {binding.owner} runs before the owners' handshake named "
                                 "the model: train through TfeRunConfig (Estimator) or TfeStrategy() (Keras), whose "
                                 "adapters run the handshake that names the model's channels on the servers.")
            client, sum_channel = service_client(binding), channel_name(model["model"], name)
            replays = client.answers.get(sum_channel, [0, 0])[1]
            answer = client.contribute(sum_channel, *args)
            training_run.check_answer(model, binding.owner, sum_channel, int(args[0]),
                                      replayed=client.answers[sum_channel][1] > replays)
            return answer

        def checks():  # the model's sum checks under the owners' check seed (the handshake's); None: evaluation
            from tfe_estimator.owner import check_seed  # pylint: disable=import-outside-toplevel

            return check_seed.lookup(binding.owner, model["model"])

        def put_key(name, step, *args):  # the step's key on server0 before its share (OwnerClient.put_key)
            if model["model"] is not None:  # else the contribution refuses, naming the handshake
                service_client(binding).put_key(channel_name(model["model"], name), step, *args)

        return contribution.service_sum(vectors, sources, targets, encoding, dtype, binding.owner, hint, scale,
                                           channel, step, contribute, noise_variance=noise_variance, checks=checks,
                                           put_key=put_key)

    def _next_channel(self):
        """The graph's next sum's name (equal on every owner: they build the same graph), the step and the
        model's state (`model_of`); eagerly, the framework adapter's `eager_channel` (Keras reading a
        metric across owners: `keras_fit.eager_sum`)."""
        if tf.executing_eagerly():
            if self.eager_channel is None:
                raise ValueError("a sum across owners read eagerly, outside any training step: in service mode "
                                 "every sum is keyed by a step the owners agreed on; sum inside the training "
                                 "step (Estimator's model_fn, Keras' model.fit).")
            name, step, model = self.eager_channel()
            return f"{self._channel_prefix}{name}", step, model
        graph = tf.compat.v1.get_default_graph()
        if graph not in _CHANNELS and self.check_unkeyed is not None:
            self.check_unkeyed(graph)  # the adapter refuses a graph it cannot key (a tf.function with no step)
        model = model_of(graph)
        state = _CHANNELS[graph]
        state[0] += 1
        return f"{self._channel_prefix}sum_{state[0] - 1}", state[1], model


class ServiceExtended(_TfeExtended):
    """`_TfeExtended` over every owner's replicas, with no framework's hooks: Estimator's (`estimator`) and
    Keras' (`keras_fit`) adapters subclass it, overriding `_call_for_each_replica`, `_local_reduce` and
    `_owner_local_dataset`."""

    @property
    def _num_replicas_in_sync(self):
        # Every owner's replicas take part in each sum: optimizers scale a MEAN loss by this. A replica building
        # an evaluation sees 1, as `ReplicaEvaluation`'s (distributed_eval.replicas_seen).
        return distributed_eval.replicas_seen(len(self.worker_devices) * len(self._cross_device_ops.binding.owners))

    def _reduce_to(self, reduce_op, value, destinations, options):
        # With one local replica MirroredStrategy hands a replica function's result back unwrapped (its
        # regroup), and MirroredExtended's rule for such a "shared" value refuses a SUM over the owners'
        # replicas (Estimator SUMs a Keras optimizer's reported loss). It is this owner's own value: reduce
        # it across owners as a PerReplica of one, like any other.
        if len(self.worker_devices) == 1:
            value = tf.nest.map_structure(
                lambda v: value_lib.PerReplica([v]) if tf.is_tensor(v) and not isinstance(
                    v, value_lib.DistributedValues) else v, value)
        if isinstance(destinations, str):  # Estimator's "/replica:0/task:0/device:CPU:0": this process's device
            destinations = device_util.canonicalize(destinations, self.worker_devices[0])
        local = self._local_reduce(reduce_op, value, destinations)
        if local is not None:  # a value the adapter keeps inside this owner (over its own replicas only)
            return local
        if any(isinstance(v, value_lib.SyncOnReadVariable) for v in tf.nest.flatten(value)):
            # The value of an on-read variable (a batch normalization's moving statistics) read across
            # replicas, e.g. by the checkpoint saver: its sum runs in the saver's session run, so it must not
            # wait for the training step's sums (service_sum's chains).
            with contribution.chain(contribution.READS_CHAIN):
                return super()._reduce_to(reduce_op, value, destinations, options)
        return super()._reduce_to(reduce_op, value, destinations, options)

    def _local_reduce(self, reduce_op, value, destinations):
        """A reduction the framework adapter answers inside this owner, or None (across owners)."""
        del reduce_op, value, destinations
        return None

    def _owner_local_dataset(self) -> bool:
        """Whether the dataset being distributed is this owner's alone, batches whole over its own replicas
        (an adapter's evaluation data), not a training dataset split over every owner's replicas."""
        return False

    def _experimental_distribute_dataset(self, dataset, options):
        if self._owner_local_dataset():
            # e.g. Keras' evaluate / predict / validation data: each owner's batches whole, over its own replicas
            # (an evaluation is not split over the owners' replicas as a training step is).
            return input_util.get_distributed_dataset(dataset, self._input_workers_with_options(options),
                                                      self._container_strategy(),
                                                      num_replicas_in_sync=len(self.worker_devices), options=options)
        return super()._experimental_distribute_dataset(dataset, options)

    def _settings(self) -> dict:
        """The secure and DP settings every owner must share (compared by the handshake)."""
        agg = self._cross_device_ops
        settings = {"protocol": "pond", "precision": agg.precision.name, "clip_norm": agg.clip_norm,
                    "update_ring_bits": agg.update_ring_bits, "local replicas": len(self.worker_devices),
                    "dp": agg.dp is not None}
        if agg.dp is not None:
            settings.update({f"dp {name}": value for name, value in dataclasses.asdict(agg.dp).items()})
        return settings

class ServiceStrategy(TfeStrategy):
    """One data owner's secure aggregation across organisations (module docstring): the framework-neutral
    core. Estimator trains under `tfe_estimator.owner.estimator.EstimatorServiceStrategy` (what `TfeRunConfig`
    builds), Keras under `tfe_estimator.owner.keras_fit.OwnerStrategy` (what ``TfeStrategy()`` returns): each
    sets `_EXTENDED` to its adapter's `ServiceExtended`.

    Args:
      binding: the service and this owner (`ServiceBinding`).
      num_replicas: this owner's local replicas (1, 2, 4 or 8; GPUs when it has that many, else CPU devices).
      devices: explicit local replica devices instead of `num_replicas`.
      precision, clip_norm, update_ring_bits: as `TfeStrategy`.
      evaluation: for `eval_distribute`: federated evaluation. Each owner evaluates the same
        checkpoint on its own data; the metrics' sums and counts are summed through the service
        once per evaluation (keyed by the checkpoint's step), so every owner reads the metrics
        of the union of the owners' evaluation data, exactly. Every owner must evaluate the
        same checkpoints: ``EvalSpec(throttle_secs=0)`` with step-based checkpoints. Under
        `dp` the metrics are not summed (an un-noised value of the other owners' data): each
        owner reads its own.
      dp: optional `tfe_estimator.DistributedDP` (see `ServiceAggregation`).

    Example::

        strategy = ServiceStrategy(binding)
    """

    _EXTENDED = ServiceExtended

    def __init__(self, binding: ServiceBinding, num_replicas: int = 1, devices: Optional[Sequence[str]] = None,
                 precision: str = "low", clip_norm: Optional[float] = None, update_ring_bits: int = 64,
                 evaluation: bool = False, dp=None) -> None:  # pylint: disable=super-init-not-called
        if devices is None:
            devices, _ = local_layout(num_replicas, "pond")
        ops = ServiceAggregation(binding, len(devices), precision=precision, clip_norm=clip_norm,
                                 update_ring_bits=update_ring_bits, channel_prefix="eval_" if evaluation else "",
                                 dp=dp)
        ops.precision.check_headroom(len(devices) * len(binding.owners))
        with tf.Graph().as_default():
            extended = self._EXTENDED(self, list(devices), ops, cpus_needed(list(devices)),
                                      partial_batches=evaluation)
        distribute_lib.StrategyV1.__init__(self, extended)  # pylint: disable=non-parent-init-called
        self._federated_metrics = evaluation and dp is None
        log.info("secure aggregation through the service: owner %s of %s, %d local replicas %s, servers %s",
                 binding.owner, list(binding.owners), len(devices), list(devices), list(binding.addresses))

    @property
    def federated_metrics(self) -> bool:
        """Whether evaluations under this strategy read the metrics of every owner's data (not under `dp`)."""
        return self._federated_metrics
