"""Every cross-replica reduction of `TfeStrategy` goes through `SecureAggregation`.

`MirroredExtended` hands some reductions to a fresh plaintext
`ReductionToOneDevice` whatever `cross_device_ops` it was given (TF 2.10+: every
reduction to a CPU destination and every int32 value; see
`tfe_estimator.distribute.strategy._TfeExtended`). These tests install

- a spy: `SecureAggregation` subclassed to record each reduction it does
  (and still do it, securely), used by every `TfeStrategy` built in the test;
- a tripwire: `reduce_implementation` / `batch_reduce_implementation` of
  `ReductionToOneDevice`, `AllReduceCrossDeviceOps` (NCCL) and
  `CollectiveAllReduce`, on any instance that is not a `SecureAggregation`,
  records the call and raises;

then run every reduction API, an Estimator train + evaluate step and a Keras
`model.fit`, and check that the spy saw the reductions and the tripwire none.
A mutation test puts `MirroredExtended`'s own routing back and checks that the
tripwire catches the leak.
"""
import json
import pathlib
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf
from tensorflow.python.distribute import cross_device_ops as cross_device_ops_lib
from tensorflow.python.distribute import mirrored_strategy

import tfe_estimator
from tfe_estimator.distribute import strategy as strategy_lib
from tfe_estimator.distribute.aggregation import SecureAggregation

HOST = "/job:localhost/replica:0/task:0/device:CPU:0"
SUM = tf.distribute.ReduceOp.SUM
_PLAINTEXT_CLASSES = (
    cross_device_ops_lib.ReductionToOneDevice,
    cross_device_ops_lib.AllReduceCrossDeviceOps,
    cross_device_ops_lib.CollectiveAllReduce,
)
_TF_MINOR = tuple(int(p) for p in tf.__version__.split(".")[:2])


class Routing:
    """What the spy and the tripwire saw."""

    def __init__(self):
        self.secure = []  # (method, dtype names)
        self.plaintext = []  # (class name, method, dtype names)

    def dtypes(self):
        return {d for _, names in self.secure for d in names}


def _dtype_names(values):
    names = []
    for v in values:
        inner = v.values if isinstance(v, tf.distribute.DistributedValues) else [v]
        names.extend(getattr(x, "dtype", type(x)).name for x in inner[:1])
    return names


def install_spy(patch):
    """Installs the spy and tripwire with `patch(obj, name, value)`; returns a `Routing`."""
    routing = Routing()

    class SpyAggregation(SecureAggregation):
        def batch_reduce_implementation(self, reduce_op, value_destination_pairs, options):
            routing.secure.append(("batch_reduce", _dtype_names([v for v, _ in value_destination_pairs])))
            return super().batch_reduce_implementation(reduce_op, value_destination_pairs, options)

        def broadcast_implementation(self, tensor, destinations):
            routing.secure.append(("broadcast", _dtype_names([tensor])))
            return super().broadcast_implementation(tensor, destinations)

    def tripwire(cls, method):
        original = getattr(cls, method)

        def wrapped(self, reduce_op, *args, **kwargs):
            if isinstance(self, SecureAggregation):
                return original(self, reduce_op, *args, **kwargs)
            values = [args[0]] if method == "reduce_implementation" else [v for v, _ in args[0]]
            routing.plaintext.append((type(self).__name__, method, _dtype_names(values)))
            raise AssertionError(f"plaintext {type(self).__name__}.{method} of {_dtype_names(values)}")

        return wrapped

    patch(strategy_lib, "SecureAggregation", SpyAggregation)
    for cls in _PLAINTEXT_CLASSES:
        for method in ("reduce_implementation", "batch_reduce_implementation"):
            patch(cls, method, tripwire(cls, method))
    return routing


@pytest.fixture
def routing(monkeypatch):
    return install_spy(monkeypatch.setattr)


def _per_replica(strategy, dtype):
    """Replica r holds (r + 1) * [1, 2]: the sum over 2 replicas is [3, 6]."""
    def value():
        r = tf.distribute.get_replica_context().replica_id_in_sync_group
        return tf.cast(r + 1, dtype) * tf.constant([1, 2], dtype)

    return strategy.extended.call_for_each_replica(value)


def _session(strategy, graph):
    return tf.compat.v1.Session(graph=graph, config=strategy.update_config_proto(tf.compat.v1.ConfigProto()))


@pytest.mark.parametrize("dtype", [tf.float32, tf.int32, tf.int64], ids=lambda d: d.name)
def test_every_reduction_api_is_secure_and_correct(routing, dtype):
    # Prepare
    graph = tf.Graph()
    with graph.as_default():
        strategy = tfe_estimator.TfeStrategy()
        replicas = strategy.extended.worker_devices
        with strategy.scope():
            value = _per_replica(strategy, dtype)
            # Execute: to the host CPU (TF 2.15's plaintext shortcut), to the replicas,
            # batched, through Strategy.reduce, and as a replica-context all-reduce.
            results = {
                "reduce_to host": strategy.extended.reduce_to(SUM, value, destinations=HOST),
                "reduce_to replicas": strategy.extended.reduce_to(SUM, value, destinations=value),
                "batch_reduce_to": strategy.extended.batch_reduce_to(SUM, [(value, HOST), (value, value)]),
                "strategy.reduce": strategy.reduce(SUM, value, axis=None),
                "all_reduce": strategy.extended.call_for_each_replica(
                    lambda: tf.distribute.get_replica_context().all_reduce(
                        SUM, _per_replica_in_context(dtype))),
                "broadcast_to": strategy.extended.broadcast_to(tf.constant([3, 6], dtype), destinations=value),
            }
        fetches = {k: strategy.experimental_local_results(v) if not isinstance(v, list)
                   else [strategy.experimental_local_results(x) for x in v] for k, v in results.items()}
        with _session(strategy, graph) as sess:
            out = sess.run(fetches)

    # Assert
    assert routing.plaintext == []
    for name, got in out.items():
        for x in tf.nest.flatten(got):
            np.testing.assert_array_equal(x, [3, 6], err_msg=name)
    methods = [m for m, _ in routing.secure]
    assert methods.count("batch_reduce") == 5 and methods.count("broadcast") == 1, routing.secure  # one per API
    assert routing.dtypes() == {dtype.name}
    assert len(replicas) == 2


def _per_replica_in_context(dtype):
    r = tf.distribute.get_replica_context().replica_id_in_sync_group
    return tf.cast(r + 1, dtype) * tf.constant([1, 2], dtype)


def test_gather_is_refused_not_done_in_plaintext(routing):
    graph = tf.Graph()
    with graph.as_default():
        strategy = tfe_estimator.TfeStrategy()
        with strategy.scope():
            value = _per_replica(strategy, tf.float32)
            with pytest.raises(NotImplementedError, match="only sums"):
                strategy.extended._gather_to(value, destinations=HOST, axis=0)  # pylint: disable=protected-access
    assert routing.plaintext == []


@pytest.mark.slow
def test_estimator_train_and_evaluate_reduce_only_through_secure_aggregation(routing, tmp_path, linear_data):
    # Prepare
    x, y, _ = linear_data
    config = tfe_estimator.TfeRunConfig(model_dir=str(tmp_path), num_replicas=2, tf_random_seed=1)
    est = tf.estimator.LinearRegressor(
        feature_columns=[tf.feature_column.numeric_column("x", shape=[3])], config=config,
        optimizer=lambda: _legacy_keras_optimizers().SGD(0.05))

    def input_fn():
        return tf.data.Dataset.from_tensor_slices(({"x": x}, y)).repeat().batch(32)

    # Execute
    est.train(input_fn, steps=3)
    trained = list(routing.secure)
    metrics = est.evaluate(input_fn, steps=2)

    # Assert: gradients, the loss and the metrics all went through the spy;
    # nothing reached a plaintext implementation. (Estimator reduces no
    # integers: the global step is updated on each replica's copy, not summed.
    # int32, TF 2.15's plaintext shortcut, and int64 are covered above.)
    assert routing.plaintext == []
    assert trained and len(routing.secure) > len(trained), routing.secure
    assert "float32" in routing.dtypes()
    assert metrics["global_step"] == 3 and np.isfinite(metrics["average_loss"])


def _legacy_keras_optimizers():
    from model_fns import keras_optimizers  # pylint: disable=import-outside-toplevel

    return keras_optimizers()


_KERAS_FIT = """
import json, sys
import numpy as np
import tensorflow as tf
cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 5)
sys.path.insert(0, {tests!r})
import test_strategy_routing as t
routing = t.install_spy(setattr)
import tfe_estimator
strategy = tfe_estimator.TfeStrategy()
with strategy.scope():
    model = tf.keras.Sequential([tf.keras.layers.Dense(1, input_shape=(3,))])
    model.compile(optimizer={optimizer}, loss="mse", metrics=["mae"])
x = np.random.RandomState(0).randn(64, 3).astype(np.float32)
y = x @ np.array([1.0, -2.0, 0.5], np.float32)
history = model.fit(x, y, batch_size=16, epochs=2, verbose=0).history
print(json.dumps({{"secure": routing.secure, "plaintext": routing.plaintext, "loss": history["loss"]}}))
"""


@pytest.mark.slow
@pytest.mark.parametrize("optimizer", ["t._legacy_keras_optimizers().SGD(0.05)", "tf.keras.optimizers.SGD(0.05)"],
                         ids=["legacy-optimizer", "keras-default-optimizer"])
def test_keras_fit_reduces_only_through_secure_aggregation(tmp_path, optimizer):
    # A process of its own: Keras needs 5 logical CPU devices before TensorFlow's runtime starts.
    code = _KERAS_FIT.format(tests=str(pathlib.Path(__file__).parent), optimizer=optimizer)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-4000:]
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert report["plaintext"] == []
    assert len(report["secure"]) >= 2 and all(np.isfinite(report["loss"])), report
    assert report["loss"][-1] < report["loss"][0]


# Mutation test: MirroredExtended's own routing put back into TfeStrategy.
_MUTATIONS = {
    "_reduce_to": mirrored_strategy.MirroredExtended._reduce_to,  # pylint: disable=protected-access
    "_get_cross_device_ops": mirrored_strategy.MirroredExtended._get_cross_device_ops,  # pylint: disable=protected-access
}


@pytest.mark.skipif(_TF_MINOR < (2, 10), reason="TF 2.9 takes the plaintext shortcuts only with collective ops in use")
@pytest.mark.parametrize("override, dtype, destination", [
    ("_reduce_to", tf.float32, "host"),
    ("_get_cross_device_ops", tf.int32, "replicas"),
])
def test_mutation_without_the_override_leaks_and_the_tripwire_catches_it(
        routing, monkeypatch, override, dtype, destination):
    # Plant the leak: TfeStrategy without one of its routing overrides.
    monkeypatch.setattr(strategy_lib._TfeExtended, override, _MUTATIONS[override])  # pylint: disable=protected-access
    graph = tf.Graph()
    with graph.as_default():
        strategy = tfe_estimator.TfeStrategy()
        with strategy.scope():
            value = _per_replica(strategy, dtype)
            with pytest.raises(AssertionError, match="plaintext ReductionToOneDevice"):
                strategy.extended.reduce_to(SUM, value, destinations=HOST if destination == "host" else value)
    assert routing.plaintext and routing.plaintext[0][0] == "ReductionToOneDevice"
