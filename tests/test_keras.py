"""Keras under TfeStrategy: the example trains like plain MirroredStrategy; missing devices are a clear error.

Keras runs eagerly, and logical devices can only be configured before
TensorFlow's runtime starts, so each case runs in a fresh interpreter.
"""
import json
import pathlib
import subprocess
import sys

import numpy as np
import pytest

from tfe_estimator.distribute.logical_devices import logical_cpus_needed

ROOT = pathlib.Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "keras_fit.py"


def _python(code_or_args, timeout=300):
    argv = [sys.executable] + (code_or_args if isinstance(code_or_args, list) else ["-c", code_or_args])
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, cwd=str(ROOT))


@pytest.mark.slow
def test_keras_fit_under_tfe_strategy_matches_plain_mirrored_strategy(tmp_path):
    # Execute: the example fits, evaluates and predicts with both strategies (16 steps).
    out = _python([str(EXAMPLE), "--epochs", "2", "--json", str(tmp_path / "r.json")])
    assert out.returncode == 0, out.stderr[-4000:]
    results = json.loads((tmp_path / "r.json").read_text())
    secure, plain = results["secure"], results["plaintext"]
    # Assert: the same weights after training, at 1e-6, and it did train.
    for a, b in zip(secure["weights"], plain["weights"]):
        np.testing.assert_allclose(np.array(a), np.array(b), rtol=0, atol=1e-6)
    assert results["max_weight_difference"] <= 1e-6
    np.testing.assert_allclose(secure["predictions"], plain["predictions"], rtol=0, atol=1e-5)
    assert secure["loss"] == pytest.approx(plain["loss"], abs=1e-6)
    assert secure["train_loss"][-1] < secure["train_loss"][0]
    assert "largest weight difference" in out.stdout
    assert "Pool.__del__" not in out.stderr


_TOO_FEW = """
import tensorflow as tf, tfe_estimator
from tfe_estimator.distribute.logical_devices import check_logical_cpus
strategy = tfe_estimator.TfeStrategy()   # 2 replicas + 3 parties, and only 1 logical CPU
try:
    check_logical_cpus(strategy)
except RuntimeError as e:
    print(e)
"""


def test_too_few_logical_devices_is_a_clear_error_with_the_numbers_and_the_call():
    out = _python(_TOO_FEW, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    text = out.stdout
    assert "places its replicas and the TFE parties on 5 CPU devices" in text
    assert "this process has 1 logical CPU device." in text
    assert "tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 5)" in text


def test_devices_needed_count_replicas_and_parties():
    assert logical_cpus_needed(["/cpu:0", "/cpu:1", "/cpu:2", "/cpu:3", "/cpu:4"]) == 5
    assert logical_cpus_needed(["/job:localhost/replica:0/task:0/device:CPU:6"]) == 7


def test_keras_fit_without_devices_raises_the_clear_error():
    code = ("import numpy as np, tensorflow as tf, tfe_estimator\n"
            "s = tfe_estimator.TfeStrategy()\n"
            "with s.scope():\n"
            "    m = tf.keras.Sequential([tf.keras.layers.Dense(1, input_shape=(3,))])\n"
            "    m.compile(optimizer='sgd', loss='mse')\n"
            "m.fit(np.zeros((8, 3), 'float32'), np.zeros((8, 1), 'float32'), batch_size=4, verbose=0)\n")
    out = _python(code, timeout=120)
    assert "set_logical_device_configuration" in out.stderr and "AssertionError" not in out.stderr
