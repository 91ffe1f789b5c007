"""Keras and custom training loops under `tfe_estimator.TfeStrategy()` on one machine.

`TfeStrategy()` takes `tf.distribute.MirroredStrategy()`'s place with nothing
else changed: the TF Encrypted RFC's example, a small Dense network (fit,
evaluate, predict) and a custom training loop each train exactly like a plain
`MirroredStrategy` on the same two replica devices, and the loop's sums go
through `SecureAggregation` (a spy, and two planted leaks it catches). Eager
logical devices are per process, so each case runs in a fresh interpreter.
"""
import copy
import json
import pathlib
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf

import tfe_estimator
from tfe_estimator.distribute import strategy_mode
from tfe_estimator.distribute.logical_devices import logical_cpus_needed

ROOT = pathlib.Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "keras_fit.py"
TWINS = ROOT / "tests" / "scripts" / "keras_twins.py"
ATOL = 1e-5  # weights, secure vs MirroredStrategy (the low precision's fixed point; measured: equal)
_CPU = "/job:localhost/replica:0/task:0/device:CPU:{}"


def _python(code_or_args, timeout=600):
    argv = [sys.executable] + (code_or_args if isinstance(code_or_args, list) else ["-c", code_or_args])
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, cwd=str(ROOT))


def _twins(tmp_path, *args):
    out = _python([str(TWINS), *args, "--json", str(tmp_path / "r.json")])
    assert out.returncode == 0, out.stderr[-4000:]
    return json.loads((tmp_path / "r.json").read_text())


def _assert_same_weights(report):
    assert len(report["secure"]["weights"]) == len(report["plaintext"]["weights"])
    for a, b in zip(report["secure"]["weights"], report["plaintext"]["weights"]):
        np.testing.assert_allclose(np.array(a), np.array(b), rtol=0, atol=ATOL)


def _assert_own_devices(report):
    """Two replicas on CPU:0 and CPU:1, the three parties on devices of their own."""
    assert report["replicas"] == [_CPU.format(0), _CPU.format(1)]
    assert report["parties"] == [_CPU.format(i) for i in (2, 3, 4)]


@pytest.mark.slow
def test_rfc_example_with_tfe_strategy_trains_like_mirrored_strategy(tmp_path):
    # Execute: the RFC's Keras example with TfeStrategy() (made first: the runtime has not started), then its twin.
    out = _python([str(EXAMPLE), "--json", str(tmp_path / "r.json")])
    assert out.returncode == 0, out.stderr[-4000:]
    report = json.loads((tmp_path / "r.json").read_text())

    # Assert: 2 replicas, the same weights after 2 epochs, and the model trained (it starts near loss 0.9).
    assert len(report["replicas"]) == 2
    _assert_same_weights(report)
    assert report["secure"]["loss"] == pytest.approx(report["plaintext"]["loss"], abs=1e-6)
    assert report["secure"]["loss"] < 0.5
    assert "largest weight difference" in out.stdout
    assert "Pool.__del__" not in out.stderr


@pytest.mark.slow
def test_small_dense_network_fit_evaluate_predict_like_mirrored_strategy_after_the_runtime_started(tmp_path):
    # The data is made before TfeStrategy(): TensorFlow's runtime already runs with its one CPU device.
    report = _twins(tmp_path, "--case", "dense")

    _assert_own_devices(report)
    _assert_same_weights(report)
    secure, plain = report["secure"], report["plaintext"]
    np.testing.assert_allclose(secure["predictions"], plain["predictions"], rtol=0, atol=ATOL)
    assert secure["loss"] == pytest.approx(plain["loss"], abs=1e-6)
    assert secure["mae"] == pytest.approx(plain["mae"], abs=1e-6)
    assert secure["train_loss"][-1] < secure["train_loss"][0] / 4


def _check_custom_loop(report):
    """What a user checks of the custom loop: its sums secure, its training MirroredStrategy's."""
    assert "error" not in report, report["error"]
    routing = report["routing"]
    assert routing["plaintext"] == [], routing["plaintext"]
    reductions = [names for method, names in routing["secure"] if method == "batch_reduce"]
    # The gradients of the 4 variables in one secure sum; strategy.reduce's SUM and MEAN one value each.
    assert ["float32"] * 4 in reductions, routing["secure"]
    assert reductions.count(["float32"]) >= 2, routing["secure"]
    _assert_same_weights(report)
    secure, plain = report["secure"], report["plaintext"]
    np.testing.assert_allclose(secure["train_loss"], plain["train_loss"], rtol=0, atol=ATOL)
    assert secure["mean_rows"] == [8.0] * 16  # MEAN over replicas of each replica's rows: 16 split in 2
    assert secure["train_loss"][-1] < secure["train_loss"][0] / 4


@pytest.mark.slow
def test_custom_training_loop_sums_securely_and_trains_like_mirrored_strategy(tmp_path):
    _check_custom_loop(_twins(tmp_path, "--case", "ctl", "--spy"))


@pytest.mark.slow
@pytest.mark.parametrize("mutation", ["reduce_to", "cross_device_ops"])
def test_mutation_a_plaintext_sum_in_the_custom_loop_is_caught(tmp_path, mutation):
    # Plant the leak: strategy.reduce (reduce_to) or every sum, gradients included (cross_device_ops), in the clear.
    report = _twins(tmp_path, "--case", "ctl", "--spy", "--mutate", mutation)

    assert report["routing"]["plaintext"], report
    with pytest.raises(AssertionError):
        _check_custom_loop(report)


_TOO_FEW = """
import numpy as np, tensorflow as tf, tfe_estimator
cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
tf.constant(1.0)  # the runtime starts with 2 CPU devices: no more can be added
strategy = tfe_estimator.TfeStrategy()
try:
    with strategy.scope():
        model = tf.keras.Sequential([tf.keras.layers.Dense(1, input_shape=(3,))])
except RuntimeError as e:
    print(e)
"""


@pytest.mark.slow
def test_too_few_logical_devices_after_the_runtime_started_is_a_clear_error():
    out = _python(_TOO_FEW, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    text = out.stdout
    assert "places its replicas and the TFE parties on 5 CPU devices" in text
    assert "this process has 2 logical CPU devices" in text
    assert "Make tfe_estimator.TfeStrategy() before any other TensorFlow work" in text
    assert "tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 5)" in text
    assert "AssertionError" not in out.stderr


def test_devices_needed_count_replicas_and_parties():
    assert logical_cpus_needed(["/cpu:0", "/cpu:1", "/cpu:2", "/cpu:3", "/cpu:4"]) == 5
    assert logical_cpus_needed(["/job:localhost/replica:0/task:0/device:CPU:6"]) == 7


def test_num_replicas_picks_the_local_replicas_and_the_parties_after_them():
    with tf.Graph().as_default():  # a graph: the eager runtime is left alone
        strategy = tfe_estimator.TfeStrategy(num_replicas=3)
    assert list(strategy.extended.worker_devices) == [_CPU.format(i) for i in range(3)]
    assert list(strategy.secure_aggregation.server_devices) == [_CPU.format(i) for i in (3, 4, 5)]


@pytest.mark.parametrize("kwargs, error, match", [
    ({"num_replicas": 3, "devices": ["/cpu:0", "/cpu:1"]}, ValueError, r"num_replicas=3.*lists 2 replica devices"),
    ({"num_replicas": 0}, ValueError, r"num_replicas must be >= 1, got 0"),
    ({"num_replicas": "2"}, TypeError, r"num_replicas must be an int"),
])
def test_bad_num_replicas_is_refused_naming_it(kwargs, error, match):
    with tf.Graph().as_default(), pytest.raises(error, match=match):
        tfe_estimator.TfeStrategy(**kwargs)


_CLUSTER = {"cluster": {"chief": ["localhost:1"], "worker": ["localhost:2"], "tfe": ["localhost:3", "localhost:4"]},
            "task": {"type": "worker", "index": 0}}


def test_without_a_cluster_in_tf_config_the_strategy_is_local():
    assert strategy_mode.pick_mode(environ={}) == strategy_mode.LOCAL
    assert strategy_mode.pick_mode(environ={"TF_CONFIG": json.dumps({"task": {}})}) == strategy_mode.LOCAL


def test_a_service_cluster_is_service_mode_and_other_clusters_are_refused_naming_the_fix():
    service = {"TF_CONFIG": json.dumps(_CLUSTER)}
    assert strategy_mode.pick_mode(environ=service) == strategy_mode.SERVICE
    in_graph = dict(service, TFE_ESTIMATOR_CLUSTER_MODE="in-graph")
    with pytest.raises(NotImplementedError, match=r"worker:0, cluster_mode='in-graph'.*--cluster-mode service"):
        strategy_mode.pick_mode(environ=in_graph)
    cluster = dict(_CLUSTER["cluster"], evaluator=["localhost:5"])
    evaluator = {"TF_CONFIG": json.dumps({"cluster": cluster, "task": {"type": "evaluator", "index": 0}})}
    with pytest.raises(NotImplementedError, match=r"evaluator:0.*unset TF_CONFIG"):
        strategy_mode.pick_mode(environ=evaluator)


def test_a_deep_copy_under_a_cluster_copies_the_strategy_without_picking_a_mode_again(monkeypatch):
    # Estimator deep-copies its config, and so its strategies, with ``cls.__new__(cls)`` (an in-graph chief's
    # TfeStrategy under its cluster's TF_CONFIG): only a call of TfeStrategy picks the mode.
    with tf.Graph().as_default():
        strategy = tfe_estimator.TfeStrategy()
        monkeypatch.setenv("TF_CONFIG", json.dumps(_CLUSTER))
        monkeypatch.setenv("TFE_ESTIMATOR_CLUSTER_MODE", "in-graph")
        copied = copy.deepcopy(strategy)
    assert type(copied) is tfe_estimator.TfeStrategy and copied is not strategy
    assert copied.num_replicas_in_sync == strategy.num_replicas_in_sync == 2
