"""Keras DP-SGD's expected weights (NumPy) and the check that the trained ones carry noise of the stated scale:
shared by tests/test_keras_service.py (service mode) and tests/test_keras_dp.py (one machine, mutations).

Example::

    expected = clipped_plaintext([chief_rows, worker_rows], initial, clip=0.5, steps=4, learning_rate=0.1)
    check_dp_noise(trained, expected, 0.1 * 0.5 * np.sqrt(2) / 16 * np.sqrt(4))
"""
import numpy as np

__all__ = ["clipped_plaintext", "check_dp_noise"]


def clipped_plaintext(parts, initial, clip, steps, learning_rate):
    """DP-SGD without noise for a Dense(1) MSE model (weights ``[w0, w1, bias]``): per step the next 8 rows of
    each of `parts` (feature, feature, label), each example's gradient clipped to `clip` over all weights, their
    sum divided by the rows of the step, one SGD step."""
    weights = np.append(np.array(initial[0]).ravel(), initial[1]).astype(np.float64)
    for step in range(steps):
        rows = np.concatenate([np.asarray(p)[8 * step:8 * step + 8] for p in parts]).astype(np.float64)
        x = np.column_stack([rows[:, :2], np.ones(len(rows))])
        grads = 2 * (x @ weights - rows[:, 2])[:, None] * x
        grads /= np.maximum(np.linalg.norm(grads, axis=1, keepdims=True) / clip, 1)
        weights -= learning_rate * grads.sum(axis=0) / len(rows)
    return weights


def check_dp_noise(trained, expected, scale):
    """`trained` (flat) is `expected` plus SGD's share of the summed Gaussian noise, about `scale` per coordinate
    (learning rate * noise stddev of the sum / global batch * sqrt(steps)): the RMS of the difference in units of
    `scale` lies in (0.05, 5) (below 0.05 for 3 weights: chance ~1e-4; a model trained without noise fails)."""
    z = (np.asarray(trained, np.float64).ravel() - expected) / scale
    assert 0.05 < np.sqrt(np.mean(z ** 2)) < 5, (z, scale, trained, expected)
