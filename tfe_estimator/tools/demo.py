"""The main job: a canned LinearRegressor on a real data set, secure vs plaintext.

Trains `tf.estimator.LinearRegressor` on scikit-learn's diabetes data (442
patients, 10 standardised features, disease progression after one year)
twice with the same seed, data and steps: once with `TfeRunConfig` on two
replicas, once with its plaintext twin (a `MirroredStrategy` with
`ReductionToOneDevice` on the same devices), and prints weights and test
metrics side by side.

Example::

    $ tfe-estimator demo            # or: make demo
"""
import tempfile
import time
from typing import Dict, Optional

import numpy as np
import tensorflow as tf

from model_fns import keras_optimizers  # tf.keras.optimizers.legacy where Estimator needs it (TF >= 2.11)

__all__ = ["load_diabetes_split", "run_local_demo", "format_comparison"]

FEATURES = "x"


def load_diabetes_split(seed: int = 0):
    """Scikit-learn's diabetes data, standardised, split 80/20.

    Returns:
      `(x_train, y_train, x_test, y_test, feature_names)`, float32 arrays.
    """
    from sklearn.datasets import load_diabetes  # pylint: disable=import-outside-toplevel
    from sklearn.model_selection import train_test_split  # pylint: disable=import-outside-toplevel

    data = load_diabetes()
    x_train, x_test, y_train, y_test = train_test_split(
        data.data.astype(np.float32), data.target.astype(np.float32), test_size=0.2, random_state=seed
    )
    mean, std = x_train.mean(axis=0), x_train.std(axis=0)
    return (x_train - mean) / std, y_train, (x_test - mean) / std, y_test, list(data.feature_names)


def _input_fn(x, y, batch_size, repeat):
    def input_fn():
        dataset = tf.data.Dataset.from_tensor_slices(({FEATURES: x}, y))
        if repeat:
            dataset = dataset.shuffle(len(x), seed=0).repeat()
        return dataset.batch(batch_size)

    return input_fn


def _estimator(config, num_features, learning_rate):
    return tf.estimator.LinearRegressor(
        feature_columns=[tf.feature_column.numeric_column(FEATURES, shape=[num_features])],
        optimizer=lambda: keras_optimizers().SGD(learning_rate),
        config=config,
    )


def _train_and_test(config, data, steps, batch_size, learning_rate) -> Dict:
    x_train, y_train, x_test, y_test, _ = data
    est = _estimator(config, x_train.shape[1], learning_rate)
    start = time.perf_counter()
    est.train(_input_fn(x_train, y_train, batch_size, repeat=True), steps=steps)
    seconds = time.perf_counter() - start
    # One evaluation step over the whole test set: in graph mode a final
    # partial batch split across replicas can race with end-of-input and be
    # dropped (by plaintext MirroredStrategy too), which would blur the comparison.
    whole_test_set = _input_fn(x_test, y_test, len(x_test), repeat=False)
    metrics = est.evaluate(whole_test_set)
    predictions = np.array([p["predictions"][0] for p in est.predict(whole_test_set)])
    r2 = 1.0 - np.sum((y_test - predictions) ** 2) / np.sum((y_test - y_test.mean()) ** 2)
    return {
        "weights": est.get_variable_value("linear/linear_model/x/weights").ravel(),
        "bias": float(est.get_variable_value("linear/linear_model/bias_weights")[0]),
        "test_mse": float(metrics["average_loss"]),
        "test_r2": float(r2),
        "train_seconds": seconds,
        "global_step": int(metrics["global_step"]),
    }


def run_local_demo(
    steps: int = 400,
    num_replicas: int = 2,
    protocol: str = "pond",
    batch_size: int = 32,
    learning_rate: float = 0.05,
    model_dir: Optional[str] = None,
    seed: int = 0,
) -> Dict[str, Dict]:
    """Trains the secure model and its plaintext twin; returns both results."""
    from tfe_estimator.distribute.run_config import TfeRunConfig, plaintext_twin_config  # pylint: disable=import-outside-toplevel

    model_dir = model_dir or tempfile.mkdtemp(prefix="tfe-estimator-demo-")
    data = load_diabetes_split(seed)
    secure_config = TfeRunConfig(  # tfe_estimator: the one changed line
        model_dir=f"{model_dir}/secure", protocol=protocol, num_replicas=num_replicas, tf_random_seed=seed
    )
    replicas = secure_config.train_distribute.extended.worker_devices
    plain_config = plaintext_twin_config(replicas, model_dir=f"{model_dir}/plaintext", tf_random_seed=seed)
    results = {
        "secure": _train_and_test(secure_config, data, steps, batch_size, learning_rate),
        "plaintext": _train_and_test(plain_config, data, steps, batch_size, learning_rate),
        "feature_names": data[4],
        "workdir": model_dir,
    }
    results["secure"]["model_dir"], results["plaintext"]["model_dir"] = f"{model_dir}/secure", f"{model_dir}/plaintext"
    return results


def format_comparison(results: Dict, title: str) -> str:
    """A side-by-side table of secure and plaintext results."""
    s, p = results["secure"], results["plaintext"]
    lines = [title, f"{'':>18} {'secure':>12} {'plaintext':>12} {'|diff|':>10}"]
    for name, a, b in zip(results["feature_names"], s["weights"], p["weights"]):
        lines.append(f"{'weight ' + name:>18} {a:12.4f} {b:12.4f} {abs(a - b):10.2e}")
    for key in ("bias", "test_mse", "test_r2"):
        lines.append(f"{key:>18} {s[key]:12.4f} {p[key]:12.4f} {abs(s[key] - p[key]):10.2e}")
    if np.isfinite(s["train_seconds"]) and np.isfinite(p["train_seconds"]):  # with graph building
        lines.append(f"{'train seconds':>18} {s['train_seconds']:12.2f} {p['train_seconds']:12.2f}")
    worst = max(np.max(np.abs(s["weights"] - p["weights"])), abs(s["bias"] - p["bias"]))
    lines.append(f"largest weight difference: {worst:.2e} "
                 + ("(agree)" if worst < 1e-2 else "(DISAGREE: more than 1e-2)"))
    if results.get("workdir"):
        lines.append(f"model directories (checkpoints, eval summaries) are kept under {results['workdir']}; "
                     "delete it when done")
    return "\n".join(lines)
