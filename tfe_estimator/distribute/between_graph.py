"""`BetweenGraphStrategy`: each data owner trains in its own graph; sums meet only on the TFE servers.

Estimator's independent-worker mode (TF_CONFIG with a cluster and a
``train_distribute`` whose ``experimental_between_graph`` is true) runs the
training function on every chief and worker task, each in its own graph and
session. This strategy is MultiWorkerMirroredStrategy with every collective
replaced: each owner has one local replica; its gradients and reported loss
go through `tfe_estimator.distribute.step_sum` (masked on the owner's device,
summed on the Pond servers ``/job:tfe/task:0`` and ``task:1``, revealed on
the owner's device). No op of an owner's graph is placed on another owner's
task: the session's device filters name only the owner's task and the
``tfe`` job.

- Identical initial values come from one `tf_random_seed` on every owner (an
  explicit one, or the one `TfeRunConfig` derives alike on every owner from
  TF_CONFIG's cluster); no initial value travels.
- Every owner checkpoints its own copy into its own ``model_dir`` (claimed:
  `tfe_estimator.cluster.model_dir_claim` refuses a second owner), and every
  step the owners check through the servers that their copies are equal
  (`tfe_estimator.distribute.weight_check`, riding on the reported loss's sum).
- Pond on tfe_estimator's fused kernels only (64-bit ring, or clipped
  updates on the 32-bit ring); ABY3 and DP are refused in this mode (see
  `check_between_graph_settings`).

Estimator chooses its multi-worker training path (hooks, checkpoint saving)
by the strategy's class *name*, so the class is named like TensorFlow's
``CollectiveAllReduceStrategyV1``.

Example::

    cluster = TfeCluster.from_environment()
    strategy = BetweenGraphStrategy(cluster, protocol="pond")
    config = tf.estimator.RunConfig(train_distribute=strategy, tf_random_seed=7, model_dir="/tmp/mine")
"""
import collections
import copy
import weakref
from typing import Optional

import tensorflow as tf
from tensorflow.python.distribute import collective_all_reduce_strategy as collective_lib
from tensorflow.python.distribute import collective_util
from tensorflow.python.distribute import cross_device_ops as cross_device_ops_lib
from tensorflow.python.distribute import distribute_lib
from tensorflow.python.distribute import distribute_utils
from tensorflow.python.distribute import mirrored_strategy
from tensorflow.python.distribute import multi_worker_util
from tensorflow.python.distribute import numpy_dataset
from tensorflow.python.distribute import values as value_lib
from tensorflow.python.distribute.cluster_resolver import cluster_resolver as cluster_resolver_lib

from tfe_estimator.cluster.spec import TFE_JOB, TfeCluster
from tfe_estimator.distribute import aggregation
from tfe_estimator.distribute import progress
from tfe_estimator.distribute import step_sum
from tfe_estimator.distribute import step_wait
from tfe_estimator.distribute import weight_check
from tfe_estimator.distribute import weight_check_handshake
from tfe_estimator.secure import secure_sum

__all__ = ["BetweenGraphStrategy", "check_between_graph_settings"]


def check_between_graph_settings(protocol: str, dp=None) -> None:
    """Refuses what between-graph mode cannot run yet, with the reason and the fix.

    Raises:
      ValueError: for ABY3 or DP.
    """
    if protocol != "pond":
        raise ValueError(
            f"protocol={protocol!r} is not available in between-graph cluster mode: its per-step sum across "
            "owners runs on Pond's two servers with tfe_estimator's fused kernels only (ABY3's replicated "
            "sharing needs all three servers to exchange shares, not built yet). Use protocol='pond', or "
            "cluster_mode='in-graph' on a trusted network.")
    if dp is not None:
        raise ValueError(
            f"dp={dp!r} is not available in between-graph cluster mode yet (each owner's noise share "
            "would need the same per-owner accounting across separate graphs). Use cluster_mode='in-graph' "
            "on a trusted network, or leave dp unset.")


class BetweenGraphExtended(collective_lib.CollectiveAllReduceExtended):
    """`CollectiveAllReduceExtended` whose reductions are secure sums through the TFE servers."""

    _enable_check_health = False  # no collectives, no peer health checks between owners

    def __init__(self, container_strategy, cluster: TfeCluster, precision: str, clip_norm: Optional[float],
                 update_ring_bits: int = 64, step_timeout_secs: float = step_wait.DEFAULT_STEP_TIMEOUT_SECS):
        # pylint: disable=super-init-not-called,non-parent-init-called
        self._tfe_cluster = cluster
        # The handshake names late owners before the session's own deadline ends the run.
        self._handshake_timeout_secs = 0.9 * step_timeout_secs
        self._aggregation = aggregation.SecureAggregation(
            protocol="pond", precision=precision, server_devices=cluster.server_devices(), clip_norm=clip_norm,
            update_ring_bits=update_ring_bits)
        self._cluster_resolver = cluster_resolver_lib.SimpleClusterResolver(
            cluster.cluster_spec(), task_type=cluster.task_type, task_id=cluster.task_index, rpc_layer="grpc")
        distribute_lib.StrategyExtendedV1.__init__(self, container_strategy)
        self._communication_options = collective_util.Options()
        self._collective_key_base = 0
        self._initialize_multi_worker(self._cluster_resolver)
        self._cfer_fn_cache = weakref.WeakKeyDictionary()
        self.experimental_enable_get_next_as_optional = True
        self._channels = weakref.WeakKeyDictionary()  # graph -> [number of sums built, the step tensor]

    def _initialize_multi_worker(self, cluster_resolver):
        """Sets up one local replica; unlike MWMS, no collective ops, no eager server, keeps the `tfe` job."""
        cluster = self._tfe_cluster
        self._cluster_spec = multi_worker_util.normalize_cluster_spec(cluster_resolver.cluster_spec())
        self._task_type, self._task_id = cluster.task_type, cluster.task_index
        owners = cluster.data_owners()
        self._id_in_cluster = owners.index((self._task_type, self._task_id))
        self._owner_names = [f"{job}:{index}" for job, index in owners]
        self._num_workers = len(owners)
        self._is_chief = self._task_type == "chief"
        self._worker_device = f"/job:{self._task_type}/task:{self._task_id}"
        self._host_input_device = numpy_dataset.SingleDevice(self._worker_device)
        local_devices = (f"{self._worker_device}/device:CPU:0",)
        # Local-only ops (one device): broadcasts within this owner. Every reduction is overridden below.
        self._cross_device_ops = cross_device_ops_lib.ReductionToOneDevice()
        self._host_cross_device_ops = self._cross_device_ops
        mirrored_strategy.MirroredExtended._initialize_single_worker(self, local_devices)  # pylint: disable=protected-access
        self._default_device = self._worker_device
        self._num_devices_per_worker = 1
        self._local_device_type = "CPU"
        self._rpc_layer = "grpc"

    def _configure(self, session_config=None, cluster_spec=None, task_type=None, task_id=None):
        if cluster_spec and (task_type, task_id) != (self._task_type, self._task_id):
            raise ValueError(f"BetweenGraphStrategy was built for {self._task_type}:{self._task_id} "
                             f"(TF_CONFIG) but is configured for {task_type}:{task_id}.")
        if session_config:
            session_config.CopyFrom(self._update_config_proto(session_config))

    def _update_config_proto(self, config_proto):
        updated = copy.deepcopy(config_proto)
        del updated.device_filters[:]
        # This owner's task and the servers: never another owner's task.
        updated.device_filters.extend([self._worker_device, f"/job:{TFE_JOB}"])
        return updated

    def _get_variable_creator_initial_value(self, replica_id, device, primary_var, **kwargs):
        # No broadcast from the chief: every owner computes the same values from the same tf_random_seed.
        return mirrored_strategy.MirroredExtended._get_variable_creator_initial_value(  # pylint: disable=protected-access
            self, replica_id=replica_id, device=device, primary_var=primary_var, **kwargs)

    def _use_merge_call(self):
        return True

    def _replica_ctx_all_reduce(self, reduce_op, value, options=None):
        return distribute_lib.StrategyExtendedV2._replica_ctx_all_reduce(self, reduce_op, value, options)  # pylint: disable=protected-access

    def _gather_to_implementation(self, value, destinations, axis, options):
        raise NotImplementedError(
            "BetweenGraphStrategy does not gather values across data owners: a gather would hand one "
            "owner's values to the others in the clear. Reduce (SUM or MEAN) instead.")

    def _reduce_to(self, reduce_op, value, destinations, options):
        if isinstance(value, value_lib.Mirrored) and reduce_op == tf.distribute.ReduceOp.MEAN:
            return value
        return self._batch_reduce_to(reduce_op, [(value, destinations)], options)[0]

    def _batch_reduce_to(self, reduce_op, value_destination_pairs, options):
        del options
        if reduce_op not in (tf.distribute.ReduceOp.SUM, tf.distribute.ReduceOp.MEAN):
            raise ValueError(f"reduce_op must be ReduceOp.SUM or ReduceOp.MEAN, got {reduce_op}.")
        groups = collections.OrderedDict()
        for index, (value, destinations) in enumerate(value_destination_pairs):
            local = value.values[0] if isinstance(value, value_lib.DistributedValues) else tf.convert_to_tensor(value)
            update = isinstance(destinations, value_lib.DistributedValues)
            groups.setdefault((aggregation._kind(local), update), []).append((index, local))  # pylint: disable=protected-access
        results = [None] * len(value_destination_pairs)
        for (kind, update), members in groups.items():
            for (index, _), total in zip(members, self._secure_sum(reduce_op, [v for _, v in members], kind, update)):
                results[index] = distribute_utils.regroup((total,), wrap_class=value_lib.Mirrored)
        return results

    def _secure_sum(self, reduce_op, local_values, kind, update):
        """The sum over owners of this owner's `local_values` (one kind), revealed on this owner."""
        agg = self._aggregation
        num = self._num_workers
        agg.precision.check_headroom(num)
        dtypes = [v.dtype for v in local_values]
        pack_dtype = aggregation._pack_dtype(kind, dtypes)  # pylint: disable=protected-access
        encoding = agg._encoding(kind, update, num)  # pylint: disable=protected-access
        scale = 1.0 / num if kind == "float" and reduce_op == tf.distribute.ReduceOp.MEAN else 1.0
        device = self.worker_devices[0]
        owner = self._owner_names[self._id_in_cluster]
        with tf.device(device), tf.name_scope("between_graph_sum"):
            dense = [aggregation._densify(v) for v in local_values]  # pylint: disable=protected-access
            vector, _ = secure_sum.parts(dense, pack_dtype)
            if agg.clip_norm is not None and kind == "float" and update:
                vector = tf.clip_by_global_norm(vector, agg.clip_norm)[0]
            channel, step = self._next_channel()
            state = self._channels[tf.compat.v1.get_default_graph()]
            if kind == "float" and update and state[2] is None:
                # The weights as this step found them: read before the update this sum feeds.
                state[2] = weight_check.fingerprint(_local_weights())
                with tf.control_dependencies([state[2]]):
                    vector = [tf.identity(v) for v in vector]
            carries_fingerprint = kind == "float" and not update and state[2] is not None and not state[3]
            if carries_fingerprint:  # rides along with the reported loss: two more elements
                state[3] = True
                vector = list(vector) + [weight_check.fingerprint_pair(state[2], pack_dtype)]
            totals = step_sum.step_sum(
                vector, channel, step, owner=self._id_in_cluster, owners=self._owner_names, is_chief=self._is_chief,
                owner_device=device, servers=agg.server_devices, encoding=encoding, dtype=pack_dtype,
                hint=agg._hint(kind, update, encoding), scale=scale)  # pylint: disable=protected-access
            if carries_fingerprint:
                check = weight_check.assert_identical(totals[-1], num, scale, step, owner)
                with tf.control_dependencies([check]):
                    totals = [tf.identity(t) for t in totals[:-1]]
            return [aggregation._finish(t, d, kind, reduce_op, num) for t, d in zip(totals, dtypes)]  # pylint: disable=protected-access

    def _call_for_each_replica(self, fn, args, kwargs):
        """Runs `fn` on this owner's replica; a training `EstimatorSpec` gets the owners' handshake hook and the
        progress line (`progress.ProgressHook`)."""

        def with_handshake(*fn_args, **fn_kwargs):
            result = fn(*fn_args, **fn_kwargs)
            if isinstance(result, tf.estimator.EstimatorSpec) and result.mode == tf.estimator.ModeKeys.TRAIN:
                result = result._replace(training_hooks=(*result.training_hooks, self._handshake_hook()))
            return progress.with_progress(result, fn_args)

        return super()._call_for_each_replica(with_handshake, args, kwargs)

    def _handshake_hook(self):
        """The check, before a session's first step, that every owner starts at its step with its settings and model."""
        agg = self._aggregation
        return weight_check_handshake.HandshakeHook(
            self._id_in_cluster, self._owner_names,
            settings=f"pond/{agg.precision.name}/clip={agg.clip_norm}/ring={agg.update_ring_bits}",
            server=agg.server_devices[0], owner_device=self.worker_devices[0],
            timeout_secs=self._handshake_timeout_secs)

    def _next_channel(self):
        """A name for the graph's next sum (equal on all owners: they build the same graph) and the step.

        The step is one read of the global step per graph, shared by every sum of
        the session run (the gradients' sum runs before the step's increment).
        """
        graph = tf.compat.v1.get_default_graph()
        state = self._channels.get(graph)
        if state is None:
            global_step = step_sum.graph_global_step(graph, "BetweenGraphStrategy")
            with tf.device(self.worker_devices[0]):
                step = step_sum.read_step(global_step, name="between_graph_step")
            # [sums built, the step, this step's weight fingerprint, whether a sum carries it]
            state = self._channels[graph] = [0, step, None, False]
        state[0] += 1
        return f"sum_{state[0] - 1}", state[1]

    @property
    def should_checkpoint(self):
        return True  # every owner keeps its own copy in its own model_dir

    @property
    def should_save_summary(self):
        return True

    def _in_multi_worker_mode(self):
        return True


def _local_weights():
    """This owner's copy of every trainable variable of the default graph."""
    values = []
    for variable in tf.compat.v1.trainable_variables():
        local = variable.values[0] if isinstance(variable, value_lib.DistributedValues) else variable
        values.append(local.read_value() if hasattr(local, "read_value") else tf.identity(local))
    return values


class BetweenGraphStrategy(distribute_lib.StrategyV1):
    """Between-graph secure aggregation: this data owner's strategy on a TF_CONFIG cluster.

    Args:
      cluster: the validated TF_CONFIG cluster; this task must be a chief or worker.
      protocol: "pond" (others are refused: see `check_between_graph_settings`).
      precision: "low" or "high".
      clip_norm: optional L2 norm each owner clips its gradients to before sharing.
      update_ring_bits: 64, or 32 for clipped updates on the 32-bit ring (needs `clip_norm`;
        see `tfe_estimator.distribute.aggregation.narrow_update_encoding`).
      step_timeout_secs: the session's bound on one step (`TfeRunConfig` sets it); the
        owners' handshake before a session's first step gives up at 90% of it with an
        error naming the owners not at this step (`weight_check_handshake`).

    Example::

        strategy = BetweenGraphStrategy(TfeCluster.from_environment())
    """

    def __init__(self, cluster: TfeCluster, protocol: str = "pond", precision: str = "low",
                 clip_norm: Optional[float] = None, update_ring_bits: int = 64,
                 step_timeout_secs: float = step_wait.DEFAULT_STEP_TIMEOUT_SECS) -> None:
        check_between_graph_settings(protocol)
        if cluster.task_type not in ("chief", "worker"):
            raise ValueError(f"BetweenGraphStrategy runs on data owners (chief, worker), not on "
                             f"{cluster.task_type}:{cluster.task_index} (TF_CONFIG).")
        super().__init__(BetweenGraphExtended(self, cluster, precision, clip_norm, update_ring_bits,
                                              step_timeout_secs=step_timeout_secs))


# Estimator picks its multi-worker training path (every owner saves checkpoints and runs its
# hooks) by this class name (estimator.py `_train_with_estimator_spec`, monitored_session.py).
BetweenGraphStrategy.__name__ = "CollectiveAllReduceStrategyV1"
