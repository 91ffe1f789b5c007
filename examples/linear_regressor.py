"""The canned LinearRegressor with secure aggregation on one machine.

Trains `tf.estimator.LinearRegressor` on scikit-learn's diabetes data twice on
the same batches: on 2 local replicas whose gradients are summed by TF
Encrypted secure aggregation, and as a plaintext twin without any
distribution strategy; then prints weights and test loss side by side.

Usage::

    python examples/linear_regressor.py --steps 400

Lines specific to tfe_estimator are marked `# tfe_estimator:`.
"""
import argparse
import tempfile

import numpy as np
import tensorflow as tf
from sklearn.datasets import load_diabetes
from sklearn.model_selection import train_test_split

import input_fns
import tfe_estimator
from model_fns import keras_optimizers  # tf.keras.optimizers.legacy where Estimator needs it (TF >= 2.11)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=400, help="training steps")
    parser.add_argument("--model-dir", default=None, help="checkpoints go to <dir>/secure and <dir>/plaintext")
    return parser.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    model_dir = args.model_dir or tempfile.mkdtemp()
    data = load_diabetes()
    x_train, x_test, y_train, y_test = train_test_split(
        data.data.astype(np.float32), data.target.astype(np.float32), test_size=0.2, random_state=0)
    mean, std = x_train.mean(axis=0), x_train.std(axis=0)
    x_train, x_test = (x_train - mean) / std, (x_test - mean) / std
    columns = [tf.feature_column.numeric_column("x", shape=[x_train.shape[1]])]

    # Per-replica batches of one global batch of 32, so both twins see the same examples per step.
    train_input_fn = input_fns.numpy_input_fn({"x": x_train}, y_train, batch_size=32, seed=0)
    # The whole test set in one step (an even size, for the 2 replicas).
    even = len(x_test) // 2 * 2
    test_input_fn = input_fns.numpy_input_fn({"x": x_test[:even]}, y_test[:even], batch_size=even,
                                             num_epochs=1, shuffle=False)

    configs = {
        "secure": tfe_estimator.TfeRunConfig(model_dir=f"{model_dir}/secure", num_replicas=2,  # tfe_estimator:
                                             tf_random_seed=0),
        "plaintext": tf.estimator.RunConfig(model_dir=f"{model_dir}/plaintext", tf_random_seed=0),
    }
    results = {}
    for name, config in configs.items():
        est = tf.estimator.LinearRegressor(feature_columns=columns, config=config,
                                           optimizer=lambda: keras_optimizers().SGD(0.05))
        est.train(train_input_fn, steps=args.steps)
        metrics = est.evaluate(test_input_fn)
        results[name] = {
            "weights": est.get_variable_value("linear/linear_model/x/weights").ravel(),
            "bias": float(est.get_variable_value("linear/linear_model/bias_weights")[0]),
            "average_loss": float(metrics["average_loss"]),
            "global_step": int(metrics["global_step"]),
        }
    print(f"{'':>12} {'secure':>10} {'plaintext':>10}")
    for i, name in enumerate(data.feature_names):
        print(f"{name:>12} {results['secure']['weights'][i]:10.3f} {results['plaintext']['weights'][i]:10.3f}")
    for key in ("bias", "average_loss"):
        print(f"{key:>12} {results['secure'][key]:10.3f} {results['plaintext'][key]:10.3f}")
    return results


if __name__ == "__main__":
    tf.compat.v1.logging.set_verbosity(tf.compat.v1.logging.WARN)
    main()
