"""The benchmarked workloads, their input pipelines, and the secure/plaintext configs.

Every workload is a canned Estimator fed by a synthetic pipeline that costs
the same for both twins and almost nothing per step: one batch per replica
is generated in-graph once (`Dataset.range(1).map(...).cache()`), then
repeated, so each step reuses the cached batch and the step time is the
model and the reduction, not the input.
"""
import dataclasses
from typing import Optional, Sequence, Tuple

import tensorflow as tf

from model_fns import keras_optimizers  # tf.keras.optimizers.legacy where Estimator needs it (TF >= 2.11)

__all__ = ["Workload", "input_fn", "make_estimator", "secure_config", "plaintext_config", "estimator_settings"]

FEATURES = "x"


@dataclasses.dataclass(frozen=True)
class Workload:
    """One benchmark case.

    Attributes:
      name: the case's name in the report.
      model: "linear" (`LinearRegressor`) or "dnn" (`DNNRegressor`).
      features: width of the one numeric feature column.
      hidden_units: for "dnn".
      replicas: local replicas, or data owners on the cluster.
      cluster: run on a loopback cluster (chief + workers + 3 tfe servers), in-graph.
      service: the cross-organisation service mode, one process per owner
        (`tools.bench.service_case`, `launch --cluster-mode service`): owners sum through the two
        grpcio aggregation servers with mutual TLS, vs MultiWorkerMirroredStrategy without TLS,
        both on loopback.
      update_ring_bits, clip_norm: the secure twin's ring for the updates (32 needs `clip_norm`).
    """

    name: str
    model: str
    features: int
    hidden_units: Tuple[int, ...] = ()
    replicas: int = 2
    cluster: bool = False
    service: bool = False
    update_ring_bits: int = 64
    clip_norm: Optional[float] = None

    def describe(self) -> str:
        model = "LinearRegressor" if self.model == "linear" else f"DNNRegressor{list(self.hidden_units)}"
        ring = f", {self.update_ring_bits}-bit ring" if self.update_ring_bits != 64 else ""
        where = (f"service mode (mTLS, loopback){ring}, {self.replicas} owners" if self.service else
                 f"loopback cluster, {self.replicas} owners" if self.cluster else f"{self.replicas} local replicas")
        return f"{model}, {self.features:,} features, {where}"


def input_fn(features: int, batch_size: int, seed: int = 0):
    """An `input_fn(input_context=None)` repeating one cached synthetic batch per replica."""

    def fn(input_context=None):
        del input_context  # every replica gets its own copy of the same kind of batch

        def make(_):
            # Rows of norm ~1, so plain SGD is stable at any width.
            x = tf.random.stateless_normal([batch_size, features], [seed, 1]) / float(features) ** 0.5
            w = tf.random.stateless_normal([features], [seed, 2])
            y = tf.reduce_sum(x * w, axis=1, keepdims=True)
            return {FEATURES: x}, y

        return tf.data.Dataset.range(1).map(make).cache().repeat()

    return fn


def make_estimator(workload: Workload, config, learning_rate: float = 0.01):
    columns = [tf.feature_column.numeric_column(FEATURES, shape=[workload.features])]
    optimizer = lambda: keras_optimizers().SGD(learning_rate)  # noqa: E731
    if workload.model == "linear":
        return tf.estimator.LinearRegressor(feature_columns=columns, optimizer=optimizer, config=config)
    return tf.estimator.DNNRegressor(hidden_units=list(workload.hidden_units), feature_columns=columns,
                                     optimizer=optimizer, config=config)


def estimator_settings(model_dir: str) -> dict:
    """RunConfig kwargs that keep checkpoints, summaries and step logs out of the timed steps."""
    return dict(model_dir=model_dir, tf_random_seed=0, save_checkpoints_steps=10**9, save_checkpoints_secs=None,
                save_summary_steps=10**9, log_step_count_steps=10**9, keep_checkpoint_max=1)


def secure_config(model_dir: str, replicas: int, protocol: str = "pond", precision: str = "low"):
    from tfe_estimator.distribute.run_config import TfeRunConfig  # pylint: disable=import-outside-toplevel

    return TfeRunConfig(protocol=protocol, num_replicas=replicas, precision=precision, **estimator_settings(model_dir))


def plaintext_config(model_dir: str, devices: Sequence[str]):
    """The twin: MirroredStrategy with ReductionToOneDevice on the same replica devices."""
    from tfe_estimator.distribute.run_config import plaintext_twin_config  # pylint: disable=import-outside-toplevel

    return plaintext_twin_config(devices, **estimator_settings(model_dir))
