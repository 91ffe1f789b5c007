"""Each data owner's own rows and their plaintext twin: shared by the service-mode cluster tests.

Example::

    data = _owner_data(str(tmp_path))              # tmp_path/chief-0/data.csv, tmp_path/worker-0/data.csv
    twin = _plaintext_twin(data, STEPS)             # [w_x0, w_x1, bias] after STEPS full-batch steps
    np.testing.assert_allclose(_weights(str(tmp_path / "chief-0" / "model"), STEPS), twin, atol=1e-5)
"""
import os

import numpy as np
import tensorflow as tf

__all__ = ["OWNERS", "LEARNING_RATE", "_owner_data", "_plaintext_twin", "_weights"]

OWNERS = ("chief-0", "worker-0")
LEARNING_RATE = 0.1


def _owner_data(workdir, owners=OWNERS):
    """Each owner's own rows, in its own directory."""
    rng = np.random.RandomState(0)
    data = {}
    for owner in owners:
        x = rng.randn(64, 2)
        y = x @ np.array([2.0, -3.0]) + 1.0 + 0.1 * rng.randn(64)
        data[owner] = np.column_stack([x, y]).astype(np.float32)
        os.makedirs(os.path.join(workdir, owner))
        np.savetxt(os.path.join(workdir, owner, "data.csv"), data[owner], delimiter=",", fmt="%.8g")
    return data


def _plaintext_twin(data, steps):
    """Full-batch gradient descent on the mean over owners of each owner's mean squared error."""
    w = np.zeros(3)
    for _ in range(steps):
        grads = []
        for rows in data.values():
            rows = rows.astype(np.float64)
            x = np.column_stack([rows[:, :2], np.ones(len(rows))])
            grads.append(2 * x.T @ (x @ w - rows[:, 2]) / len(rows))
        w -= LEARNING_RATE * np.mean(grads, axis=0)
    return w


def _weights(model_dir, steps):
    checkpoint = tf.train.latest_checkpoint(model_dir)
    assert checkpoint and checkpoint.endswith(f"model.ckpt-{steps}"), checkpoint
    weights = tf.train.load_variable(checkpoint, "linear/linear_model/x/weights").ravel()
    return np.append(weights, tf.train.load_variable(checkpoint, "linear/linear_model/bias_weights"))
