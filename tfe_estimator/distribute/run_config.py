"""`TfeRunConfig`: the one line a user changes to train with secure aggregation.

Built like `tf.estimator.tpu.RunConfig`: its own keyword arguments plus any
`tf.estimator.RunConfig` keyword argument, an immutable settings object, and a
`replace()` that keeps the settings.

Example::

    config = TfeRunConfig(model_dir="/tmp/model", protocol="pond", num_replicas=2,
                          save_checkpoints_steps=100)
    est = tf.estimator.LinearRegressor(feature_columns=cols, config=config)
    tf.estimator.train_and_evaluate(est, train_spec, eval_spec)

Note: `tf.estimator.RunConfig` already has an argument called `protocol`, the
gRPC protocol of distributed servers. Here `protocol` is the tf-encrypted
protocol; pass the gRPC one as `grpc_protocol`. The inherited `protocol`
property keeps its gRPC meaning (Estimator reads it); the tf-encrypted one is
`tfe_protocol`.
"""
import dataclasses
import logging
import os
from typing import Optional, Sequence

import tensorflow as tf
from tensorflow.python.distribute import distribute_lib
from tensorflow.python.distribute import mirrored_strategy

from tfe_estimator.cluster import model_dir_claim, peers
from tfe_estimator.cluster.quiet import hide_deprecation_warnings
from tfe_estimator.cluster import spec as cluster_lib
from tfe_estimator.distribute import distributed_eval
from tfe_estimator.owner.step_wait import DEFAULT_STEP_TIMEOUT_SECS
from tfe_estimator.distribute.aggregation import validate_clip_norm
from tfe_estimator.owner.estimator import EstimatorServiceStrategy
from tfe_estimator.owner.service_strategy import ServiceStrategy, cluster_seed, service_binding
from tfe_estimator.distribute.devices import cpus_needed, local_layout, validate_num_replicas
from tfe_estimator.secure.precision import get_precision
from tfe_estimator.secure.protocols import load_backend, validate_protocol
from tfe_estimator.distribute.strategy import TfeStrategy
from tfe_estimator.validation import is_number
from tfe_estimator.compat import require_estimator

require_estimator("tfe_estimator.TfeRunConfig")  # TensorFlow 2.16+ has no Estimator: the fix, not an ImportError
from tensorflow_estimator.python.estimator import run_config as run_config_lib  # noqa: E402

__all__ = ["TfeRunConfig", "TfeSettings", "default_session_config", "plaintext_twin_config"]

#: Set by `tfe-estimator launch` in every task's environment (defined in `cluster`).
LAUNCH_PROTOCOL_ENV = cluster_lib.LAUNCH_PROTOCOL_ENV

_OURS = ("protocol", "precision", "num_replicas", "clip_norm", "grpc_protocol", "dp", "update_ring_bits",
         "cluster_mode", "step_timeout_secs")


def default_session_config() -> tf.compat.v1.ConfigProto:
    """Estimator's default session config (soft placement, one optimizer pass)."""
    return run_config_lib.get_default_session_config()


def plaintext_twin_config(devices: Sequence[str], session_config=None, **run_config_kwargs) -> tf.estimator.RunConfig:
    """The plaintext twin of a `TfeRunConfig`: the same replicas, summed in the clear.

    Its strategies are `MirroredStrategy` with `ReductionToOneDevice` on
    `devices` (local, or a cluster's `TfeCluster.replica_devices()`), so a
    model trained with it is what the secure one must match.

    Example::

        secure = TfeRunConfig(model_dir="/tmp/secure", num_replicas=2)
        plain = plaintext_twin_config(secure.train_distribute.extended.worker_devices,
                                      model_dir="/tmp/plain")
    """
    with tf.Graph().as_default():  # in-graph multi-worker MirroredStrategy is graph-only
        # Evaluation with partial batches and the evaluation mends, as TfeRunConfig's (distributed_eval).
        strategies = [_PlaintextTwinStrategy(list(devices), partial_batches=evaluation) for evaluation in (False, True)]
    session_config = session_config or default_session_config()
    session_config.device_count["CPU"] = max(session_config.device_count.get("CPU", 1), cpus_needed(devices))
    return tf.estimator.RunConfig(train_distribute=strategies[0], eval_distribute=strategies[1],
                                  session_config=session_config, **run_config_kwargs)


class _PlaintextTwinExtended(distributed_eval.ReplicaEvaluation, mirrored_strategy.MirroredExtended):
    """`MirroredExtended` without the unused collective all-reduce, evaluating as `TfeStrategy` does.

    MirroredStrategy also builds a `CollectiveAllReduce` (for XLA on GPUs),
    which Estimator deep-copies with the config; on TF 2.9 the copy creates a
    variable on the replicas' devices eagerly and fails once the process's
    eager runtime has fewer CPU devices than the twin. The twin's reductions
    are all `ReductionToOneDevice`, as `TfeStrategy`'s are `SecureAggregation`.
    Its evaluation metrics are a single replica's evaluation of all the data
    (`distributed_eval.ReplicaEvaluation`), as `TfeStrategy`'s: a plain
    `MirroredStrategy` reports half of `model_to_estimator`'s loss on 2
    replicas and a wrong `accuracy_baseline`.
    """

    def _make_collective_ops(self, devices):  # TF 2.9
        del devices
        return self._cross_device_ops

    def _make_collective_ops_with_fallbacks(self):  # TF 2.10+
        return self._cross_device_ops


class _PlaintextTwinStrategy(tf.compat.v1.distribute.MirroredStrategy):
    """`MirroredStrategy` with `ReductionToOneDevice` on `devices`: the plaintext twin."""

    def __init__(self, devices, partial_batches=False):  # pylint: disable=super-init-not-called
        extended = _PlaintextTwinExtended(self, devices=devices, cross_device_ops=tf.distribute.ReductionToOneDevice(),
                                          partial_batches=partial_batches)
        distribute_lib.StrategyV1.__init__(self, extended)  # pylint: disable=non-parent-init-called


@dataclasses.dataclass(frozen=True)
class TfeSettings:
    """The validated secure-aggregation settings of a `TfeRunConfig`."""

    protocol: str = "pond"
    precision: str = "low"
    num_replicas: Optional[int] = None
    clip_norm: Optional[float] = None
    dp: Optional[object] = None  # a tfe_estimator.DistributedDP (checked by SecureAggregation)
    update_ring_bits: int = 64  # 32: clipped updates on a 32-bit ring (checked by SecureAggregation)
    cluster_mode: Optional[str] = None  # None: service mode on a TF_CONFIG cluster (see cluster.peers)
    step_timeout_secs: float = DEFAULT_STEP_TIMEOUT_SECS  # service mode: longest wait of one contribution

    def __post_init__(self):
        value = self.step_timeout_secs
        if not is_number(value) or not 0 < value < 2**31 / 1000:
            raise ValueError(
                f"step_timeout_secs={value!r} must be a number of seconds > 0 (and below 2**31 ms): how long one "
                "service-mode contribution may wait for the other owners and the servers before it fails.")
        validate_protocol(self.protocol)
        if self.cluster_mode is not None:
            peers.validate_mode(self.cluster_mode)
        validate_clip_norm(self.clip_norm)
        get_precision(self.precision)
        if self.num_replicas is not None:
            validate_num_replicas(self.num_replicas)


class TfeRunConfig(tf.estimator.RunConfig):
    """A `RunConfig` whose `train_distribute` and `eval_distribute` are `TfeStrategy`.

    Without a cluster in TF_CONFIG it trains on `num_replicas` local replicas.
    With one, the chief and worker tasks are the replicas (the data owners)
    and the tasks of the job `tfe` are the TFE parties; see
    `tfe_estimator.cluster.spec`.

    Args:
      protocol: tf-encrypted protocol, "pond" or "aby3".
      num_replicas: local replicas (default 2). Ignored in a TF_CONFIG
        cluster, where each chief/worker task is one replica.
      precision: "low" or "high"; see `tfe_estimator.secure.precision`.
      clip_norm: optional per-replica L2 norm to clip gradients to before
        they are shared, so out-of-range gradients are bounded instead of
        refused (see `SecureAggregation`).
      grpc_protocol: `tf.estimator.RunConfig`'s `protocol` (gRPC flavour).
      dp: optional `tfe_estimator.DistributedDP`: DP-SGD whose noise each
        replica adds inside the secure sum (see `tfe_estimator.privacy.dp`); our
        model_fns clip per example when it is set.
      update_ring_bits: 64 (default), or 32: gradients clipped to `clip_norm`
        travel on a 32-bit ring with random rounding, half the bytes up and
        down (see `SecureAggregation`).
      cluster_mode: on a TF_CONFIG cluster, "service" (the default, across
        organisations: each data owner trains as a local Estimator, with
        `num_replicas` local replicas (default 1), and sums only through the
        two aggregation servers of the ``tfe`` job, with mutual TLS from the
        certificates in ``TFE_ESTIMATOR_TLS_DIR``; evaluation is federated;
        Pond) or "in-graph" (one organisation on a trusted network: the chief
        runs ops on every task). In service mode, without `tf_random_seed`
        every owner derives the same one from TF_CONFIG's cluster. Ignored
        without a cluster. The retired "between-graph" is refused naming both.
      step_timeout_secs: service mode: how long one contribution may wait
        for every other owner and both servers before it fails (the server's
        DEADLINE_EXCEEDED naming each missing owner) and the owner's process
        exits, instead of waiting forever for an owner or a server that died
        or is out of step (default 300; keep it above the slowest step).
      **kwargs: any other `tf.estimator.RunConfig` argument except
        `train_distribute` and `eval_distribute`.

    Raises:
      ValueError, TypeError: for a bad protocol, precision or num_replicas,
        a distribute argument, a TF_CONFIG that cannot run secure
        aggregation (the message names TF_CONFIG and the fix), or a data
        owner in service mode without a model_dir (neither `model_dir` nor
        ``TFE_ESTIMATOR_MODEL_DIR``: Estimator would pick a temporary one).
    """

    def __init__(
        self,
        protocol: str = "pond",
        num_replicas: Optional[int] = None,
        precision: str = "low",
        clip_norm: Optional[float] = None,
        grpc_protocol: Optional[str] = None,
        dp=None,
        update_ring_bits: int = 64,
        cluster_mode: Optional[str] = None,
        step_timeout_secs: float = DEFAULT_STEP_TIMEOUT_SECS,
        **kwargs,
    ) -> None:
        for name in ("train_distribute", "eval_distribute"):
            if kwargs.get(name) is not None:
                raise ValueError(
                    f"TfeRunConfig sets {name} itself (a TfeStrategy); got {name}="
                    f"{kwargs[name]!r}. To combine your own strategy, use "
                    "tf.estimator.RunConfig with tfe_estimator.TfeStrategy."
                )
        settings = TfeSettings(protocol=protocol, precision=precision, num_replicas=num_replicas,
                               clip_norm=clip_norm, dp=dp, update_ring_bits=update_ring_bits,
                               cluster_mode=cluster_mode, step_timeout_secs=step_timeout_secs)
        kwargs["model_dir"] = model_dir_claim.default_model_dir(kwargs.get("model_dir"))
        _require_owner_model_dir(settings, kwargs["model_dir"])  # before the kernels load (maybe compile)
        kwargs.update(_distribute_kwargs(settings, kwargs.get("session_config")))
        _default_seed(kwargs)
        with cluster_lib.tf_config_hidden(isinstance(kwargs["train_distribute"], ServiceStrategy)):
            super().__init__(protocol=grpc_protocol, **kwargs)
        self._tfe_settings = settings
        _claim_owner_model_dir(self)
        _check_model_dir_replicas(self)
        _say_when_resuming(self.model_dir)

    @property
    def tfe_settings(self) -> TfeSettings:
        """The secure-aggregation settings."""
        return self._tfe_settings

    @property
    def tfe_protocol(self) -> str:
        """The tf-encrypted protocol ("pond" or "aby3")."""
        return self._tfe_settings.protocol

    @property
    def precision(self) -> str:
        """The fixed-point precision ("low" or "high")."""
        return self._tfe_settings.precision

    @property
    def num_replicas(self) -> int:
        """How many replicas train: local ones, or the cluster's chief + workers."""
        return self._train_distribute.num_replicas_in_sync

    def replace(self, **kwargs) -> "TfeRunConfig":
        """Returns a copy with `kwargs` replaced; keeps the TFE settings.

        Accepts the `tf.estimator.RunConfig.replace` properties plus
        `protocol` (tf-encrypted's), `precision`, `num_replicas`, `clip_norm`,
        `dp` and `grpc_protocol`.
        """
        ours = {k: kwargs.pop(k) for k in _OURS if k in kwargs}
        if "grpc_protocol" in ours:
            kwargs["protocol"] = ours.pop("grpc_protocol")
        settings = self._tfe_settings
        if ours:
            settings = dataclasses.replace(settings, **ours)
            kwargs.update(_distribute_kwargs(settings, kwargs.get("session_config", self.session_config)))
        new = super().replace(**kwargs)
        new._tfe_settings = settings  # pylint: disable=protected-access
        if "model_dir" in kwargs:
            _claim_owner_model_dir(new)
        if "model_dir" in kwargs or "num_replicas" in ours:
            _check_model_dir_replicas(new)
        return new


def _default_seed(kwargs) -> None:
    """Owners that each build their own graph start from identical variables only with one graph-level seed.

    Without `tf_random_seed`, every owner derives the same one from the
    cluster all of their TF_CONFIGs list: the first 31 bits of
    `spec.cluster_digest` (SHA-256 of the cluster's canonical JSON). An
    explicit seed wins.
    """
    if kwargs.get("tf_random_seed") is not None:
        return
    if not _each_owner_builds_its_graph(kwargs["train_distribute"]):
        return
    seed = cluster_seed(cluster_lib.TfeCluster.from_environment())
    kwargs["tf_random_seed"] = seed
    logging.getLogger("tfe_estimator").info(
        "tf_random_seed=%d derived from TF_CONFIG's cluster (first 31 bits of the SHA-256 of its canonical JSON), "
        "alike on every owner, so all owners start from identical variables; pass tf_random_seed=<int> to choose "
        "another.", seed)


def _each_owner_builds_its_graph(strategy) -> bool:
    """Service mode: every data owner builds and runs only its own graph."""
    return isinstance(strategy, ServiceStrategy)


def _claim_owner_model_dir(config: "TfeRunConfig") -> None:
    """A data owner that writes checkpoints claims its model_dir (`cluster.model_dir_claim`), before any write.

    The chief always; a worker when each owner trains its own graph (service mode); never the evaluator.
    """
    spec = cluster_lib.TfeCluster.from_environment()
    if spec is None or config.model_dir is None:
        return
    if spec.task_type == "chief" or (spec.task_type == "worker" and _each_owner_builds_its_graph(
            config.train_distribute)):
        model_dir_claim.claim_model_dir(config.model_dir, f"{spec.task_type}:{spec.task_index}",
                                        model_dir_claim.cluster_id(spec.jobs))


def _require_owner_model_dir(settings: TfeSettings, model_dir: Optional[str]) -> None:
    """A data owner in service mode needs a model_dir (`model_dir_claim.require_owner_model_dir`).

    One machine without TF_CONFIG, the evaluator and in-graph mode keep Estimator's own default.
    """
    spec = cluster_lib.TfeCluster.from_environment()
    if spec is None or spec.task_type not in cluster_lib.DATA_OWNER_JOBS:
        return
    if peers.cluster_mode(settings.cluster_mode) == peers.SERVICE:
        model_dir_claim.require_owner_model_dir(model_dir, f"{spec.task_type}:{spec.task_index}")


def _say_when_resuming(model_dir: Optional[str]) -> None:
    """Says that Estimator will restore `model_dir`'s checkpoint (a restart resumes; a new model needs a new dir)."""
    if not model_dir or not tf.io.gfile.exists(model_dir):
        return
    checkpoint = tf.train.latest_checkpoint(model_dir)
    if checkpoint:
        logging.getLogger("tfe_estimator").warning(
            "model_dir %s already holds checkpoint %s: Estimator restores it and training resumes from there "
            "(what a restarted owner needs). For a fresh model, pass another model_dir (to the Estimator or "
            "TfeRunConfig) or delete that directory.", model_dir, os.path.basename(checkpoint))


def _check_model_dir_replicas(config: "TfeRunConfig") -> None:
    """Refuses more replicas than wrote model_dir's checkpoint (a clear error, not a missing key)."""
    if config.task_type == "evaluator":  # evaluation restores no per-replica optimizer slots
        return
    from tfe_estimator.distribute.checkpoint_replicas import check_checkpoint_replicas  # pylint: disable=import-outside-toplevel

    if isinstance(config.train_distribute, ServiceStrategy):  # the owner's checkpoint holds its local replicas
        replicas, source = len(config.train_distribute.extended.worker_devices), "num_replicas (this owner's)"
    else:
        replicas = config.num_replicas
        source = "the chief and workers of TF_CONFIG" if config.cluster_spec else "num_replicas"
    check_checkpoint_replicas(config.model_dir, replicas, source)


#: Above this many local replicas TfeRunConfig warns: they all share this machine's cores.
MANY_LOCAL_REPLICAS = 16


def _warn_many_local_replicas(num_replicas: int) -> None:
    """Warns that local replicas are devices of this one process, however large the ring."""
    if num_replicas > MANY_LOCAL_REPLICAS:
        logging.getLogger("tfe_estimator").warning(
            "num_replicas=%d local replicas: every replica is a CPU device of this one process, so the "
            "graph holds %d copies of the model and each step secret-shares %d updates on this machine's "
            "cores; graph building and steps grow about linearly (precision only bounds how many values the "
            "ring can sum, not the cost). Use a few local replicas to test, and a cluster "
            "(TF_CONFIG, one task per data owner) for many owners.", num_replicas, num_replicas, num_replicas)


def _check_launch_protocol(protocol: str) -> None:
    """Refuses a protocol other than the one `tfe-estimator launch` started the cluster for."""
    launched = os.environ.get(LAUNCH_PROTOCOL_ENV)
    if launched and launched != protocol:
        raise ValueError(
            f"TfeRunConfig(protocol={protocol!r}) but this task was launched for protocol "
            f"{launched!r} ({LAUNCH_PROTOCOL_ENV}={launched}): every task of a cluster must use "
            f"the same protocol. Pass protocol=os.environ[{LAUNCH_PROTOCOL_ENV!r}] or launch "
            f"with --protocol {protocol}."
        )


def _service_kwargs(spec: cluster_lib.TfeCluster, settings: TfeSettings, session_config) -> dict:
    """Service mode: this owner trains alone (a local Estimator) and sums through the aggregation service."""
    if settings.protocol != "pond":
        raise ValueError(
            f"TfeRunConfig(protocol={settings.protocol!r}) in cluster_mode='service': the aggregation service "
            "runs Pond's sum (two servers). Use protocol='pond', or cluster_mode='in-graph' on a trusted network.")
    binding = service_binding(spec, settings.step_timeout_secs, "TfeRunConfig")
    train, evaluate = (EstimatorServiceStrategy(binding, num_replicas=settings.num_replicas or 1,
                                                precision=settings.precision, clip_norm=settings.clip_norm,
                                                update_ring_bits=settings.update_ring_bits, evaluation=evaluation,
                                                dp=settings.dp)
                       for evaluation in (False, True))
    session_config = train.update_config_proto(session_config or default_session_config())
    return {"train_distribute": train, "eval_distribute": evaluate, "session_config": session_config}


def _distribute_kwargs(settings: TfeSettings, session_config) -> dict:
    """The strategies and session config `RunConfig` gets for `settings`."""
    _check_launch_protocol(settings.protocol)
    spec = cluster_lib.TfeCluster.from_environment()
    if spec is not None and spec.task_type == cluster_lib.TFE_JOB:
        raise ValueError(
            f"TF_CONFIG says this is task {spec.task_index} of the '{cluster_lib.TFE_JOB}' job: "
            "TFE parties run `tfe-estimator server`, not a training script."
        )
    if spec is not None:  # a cluster task, maybe run by hand: no deprecation blocks unless asked
        hide_deprecation_warnings()
    # Fail early without secure randomness, and register tf-encrypted's ops
    # before Estimator starts this task's TensorFlow server.
    load_backend()
    if spec is not None and spec.is_evaluator:
        # Survive checkpoint rotation: skip (and log) a checkpoint deleted before it is restored.
        from tfe_estimator.cluster.evaluator import install_checkpoint_retry  # pylint: disable=import-outside-toplevel

        install_checkpoint_retry()
    if spec is None or spec.is_evaluator:  # the evaluator evaluates on its own replicas
        _warn_many_local_replicas(validate_num_replicas(settings.num_replicas))
        replicas, servers = local_layout(validate_num_replicas(settings.num_replicas), settings.protocol)
    else:
        mode = peers.cluster_mode(settings.cluster_mode)
        if mode == peers.SERVICE:
            return _service_kwargs(spec, settings, session_config)
        spec.check_protocol(settings.protocol)
        replicas, servers = spec.replica_devices(), spec.server_devices()
    strategies = [
        TfeStrategy(devices=replicas, protocol=settings.protocol, precision=settings.precision,
                    server_devices=servers, clip_norm=settings.clip_norm,
                    dp=settings.dp,  # differential privacy pass-through
                    update_ring_bits=settings.update_ring_bits,
                    # exact evaluation with fewer batches than replicas; training keeps
                    # its steps free of the per-step cross-worker synchronisation
                    partial_batches=(mode == "eval"))
        for mode in ("train", "eval")
    ]
    # The strategy's update_config_proto asks for the CPU devices of its layout.
    session_config = strategies[0].update_config_proto(session_config or default_session_config())
    return {
        "train_distribute": strategies[0],
        "eval_distribute": strategies[1],
        "session_config": session_config,
    }
