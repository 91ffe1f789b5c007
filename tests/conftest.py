"""Shared fixtures: quiet TensorFlow logs, a fresh graph per test, small data."""
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402

tf.compat.v1.logging.set_verbosity(tf.compat.v1.logging.ERROR)


@pytest.fixture(autouse=True)
def _fresh_default_graph():
    tf.compat.v1.reset_default_graph()
    yield


@pytest.fixture
def linear_data():
    """A small noiseless linear regression problem: y = x . w + b."""
    rng = np.random.RandomState(0)
    x = rng.randn(512, 3).astype(np.float32)
    w = np.array([1.5, -2.0, 0.5], np.float32)
    y = (x @ w + 0.3).astype(np.float32)
    return x, y, w
