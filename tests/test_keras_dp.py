"""Keras ``model.fit`` under ``TfeStrategy(dp=DistributedDP(...))`` on one machine (2 replicas, each adding its
noise part inside the secure sum), with the mutations of the DP path: noise off trains the clipped plaintext model
exactly (the noise check fails), clipping off (an ordinary optimizer) and a reduced loss are refused. Service mode:
tests/test_keras_service.py (--then-dp)."""
import importlib.util
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from keras_dp_check import check_dp_noise, clipped_plaintext

pytestmark = [pytest.mark.slow, pytest.mark.skipif(importlib.util.find_spec("tensorflow_privacy") is None,
                                                    reason="DistributedDP needs tensorflow-privacy (TF >= 2.14)")]

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CLIP, NOISE, STEPS, LEARNING_RATE, EXAMPLES = 0.5, 1.0, 4, 0.1, 64

_FIT = """
import io, json, sys, numpy as np, tensorflow as tf, tfe_estimator
from tfe_estimator.privacy.dp import make_dp_optimizer
clip, noise, steps, lr, examples = json.loads(sys.argv[1])
rows = np.random.default_rng(7).normal(size=(64, 3)).astype(np.float32)
rows[:, 2] = rows[:, 0] + 2 * rows[:, 1] + 3
out = {"rows": rows.tolist()}
for case, multiplier, clipping, loss in [("noisy", noise, True, "none"), ("noise off", 0.0, True, "none"),
                                         ("clipping off", noise, False, "none"), ("reduced loss", noise, True, "auto")]:
    dp = tfe_estimator.DistributedDP(l2_norm_clip=clip, noise_multiplier=multiplier, num_examples=examples)
    strategy = tfe_estimator.TfeStrategy(dp=dp)
    with strategy.scope():
        tf.keras.utils.set_random_seed(1)
        model = tf.keras.Sequential([tf.keras.layers.Dense(1, input_shape=(2,))])
        sgd = tf.keras.optimizers.legacy.SGD(lr)
        model.compile(make_dp_optimizer(sgd, clip) if clipping else sgd,
                      tf.keras.losses.MeanSquaredError(reduction=loss))
    initial = [w.tolist() for w in model.get_weights()]
    stream = io.StringIO()
    data = tf.data.Dataset.from_tensor_slices((rows[:, :2], rows[:, 2:])).batch(16, drop_remainder=True)
    try:
        model.fit(data.repeat(), steps_per_epoch=steps, verbose=0,
                  callbacks=[tfe_estimator.EpsilonCallback(dp, every_n_steps=2, stream=stream)])
        out[case] = {"initial": initial, "trained": [w.tolist() for w in model.get_weights()],
                     "lines": stream.getvalue().splitlines()}
    except Exception as e:  # noqa: BLE001
        out[case] = {"error": f"{type(e).__name__}: {e}"}
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def fits():
    env = {k: v for k, v in os.environ.items() if k != "TF_CONFIG"}
    out = subprocess.run([sys.executable, "-c", _FIT, json.dumps([CLIP, NOISE, STEPS, LEARNING_RATE, EXAMPLES])],
                         capture_output=True, text=True, timeout=600, cwd=ROOT, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def _weights(case):
    return np.append(np.array(case["trained"][0]).ravel(), case["trained"][1])


def _expected(fits, case):
    # One machine: each step's 16 rows split over the 2 replicas, 8 each; the clipped sum is over all 16.
    steps = np.array(fits["rows"]).reshape(-1, 16, 3)
    halves = [steps[:, :8].reshape(-1, 3), steps[:, 8:].reshape(-1, 3)]
    return clipped_plaintext(halves, case["initial"], CLIP, STEPS, LEARNING_RATE)


def _scale(multiplier):
    # 2 replicas, 1 colluding: the 2 noise parts sum to variance 2 (multiplier * clip)**2.
    return LEARNING_RATE * multiplier * CLIP * np.sqrt(2) / 16 * np.sqrt(STEPS)


def _epsilon(multiplier, steps=STEPS):
    import dp_accounting  # pylint: disable=import-outside-toplevel

    event = dp_accounting.SelfComposedDpEvent(dp_accounting.PoissonSampledDpEvent(
        16 / EXAMPLES, dp_accounting.GaussianDpEvent(multiplier)), steps)
    return dp_accounting.rdp.RdpAccountant().compose(event).get_epsilon(1e-5)


def test_keras_fit_with_distributed_dp_is_the_clipped_model_plus_noise_and_shows_dp_accountings_epsilon(fits):
    noisy = fits["noisy"]
    assert "error" not in noisy, noisy
    check_dp_noise(_weights(noisy), _expected(fits, noisy), _scale(NOISE))
    # every 2 steps from the first, and at the end: dp-accounting's RDP epsilon for the steps taken
    assert noisy["lines"] == [
        f"tfe_estimator: step {step}, DP epsilon {_epsilon(NOISE, step):.4g} at delta 1e-05 (against 1 colluding "
        f"owner(s) of 2; {_epsilon(NOISE * np.sqrt(2), step):.4g} against outsiders)"
        for step in (1, 3, 4)], noisy["lines"]


def test_mutation_noise_off_trains_the_clipped_plaintext_model_exactly_so_the_noise_check_fails(fits):
    off = fits["noise off"]
    assert "error" not in off, off
    np.testing.assert_allclose(_weights(off), _expected(fits, off), rtol=1e-5, atol=1e-6)
    with pytest.raises(AssertionError):
        check_dp_noise(_weights(off), _expected(fits, off), _scale(NOISE))


def test_mutation_clipping_off_or_a_reduced_loss_is_refused(fits):
    assert "refuses to share gradients that are not clipped per example" in fits["clipping off"]["error"], fits
    assert "reduction=tf.keras.losses.Reduction.NONE" in fits["reduced loss"]["error"], fits


@pytest.mark.parametrize("every", [0, -3, 2.5, "10"])
def test_a_bad_every_n_steps_is_refused_naming_it(every):
    import tfe_estimator  # pylint: disable=import-outside-toplevel

    dp = tfe_estimator.DistributedDP(l2_norm_clip=1.0, noise_multiplier=1.1, num_examples=64)
    with pytest.raises(ValueError, match=rf"EpsilonCallback\(every_n_steps={every!r}\): give a positive int"):
        tfe_estimator.EpsilonCallback(dp, every_n_steps=every)
