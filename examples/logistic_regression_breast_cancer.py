"""Logistic regression on the breast cancer data set, with secure aggregation.

Trains `model_fns.logistic_regression` twice on the same batches: on 2 local
replicas whose gradients are summed by TF Encrypted secure aggregation
(`tfe_estimator.TfeRunConfig`), and as a plaintext twin without any
distribution strategy; then prints the test metrics side by side.

Usage::

    python examples/logistic_regression_breast_cancer.py --steps 300

Lines specific to tfe_estimator are marked `# tfe_estimator:`.
"""
import argparse
import os
import tempfile

import numpy as np
import tensorflow as tf
from sklearn.datasets import load_breast_cancer
from sklearn.model_selection import train_test_split
from sklearn.preprocessing import StandardScaler

import input_fns
import tfe_estimator
from model_fns import logistic_regression

METRICS = ("accuracy", "auc", "precision", "recall", "average_loss")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=300, help="training steps")
    parser.add_argument("--batch-size", type=int, default=64, help="global batch size (even)")
    parser.add_argument("--learning-rate", type=float, default=0.05, help="Adam learning rate")
    parser.add_argument("--model-dir", default=None, help="checkpoints go to <dir>/secure and <dir>/plaintext")
    parser.add_argument("--seed", type=int, default=0, help="split, shuffle and TF seed")
    return parser.parse_args(argv)


def load_data(seed):
    """Standardised train/test split (the scaler is fitted on the training part)."""
    x, y = load_breast_cancer(return_X_y=True)
    x_train, x_test, y_train, y_test = train_test_split(
        x, y, test_size=0.25, random_state=seed, stratify=y)
    scaler = StandardScaler().fit(x_train)
    return (scaler.transform(x_train).astype(np.float32), y_train.astype(np.int32),
            scaler.transform(x_test).astype(np.float32), y_test.astype(np.int32))


def _run(args):
    x_train, y_train, x_test, y_test = load_data(args.seed)
    model_dir = args.model_dir or tempfile.mkdtemp(prefix="breast_cancer_")
    params = {
        "feature_columns": [tf.feature_column.numeric_column("x", shape=(x_train.shape[1],))],
        "optimizer": "adam",
        "learning_rate": args.learning_rate,
    }
    configs = {
        # tfe_estimator: the one line that changes: gradients are summed securely by TFE servers.
        "secure": tfe_estimator.TfeRunConfig(model_dir=os.path.join(model_dir, "secure"),
                                             num_replicas=2, tf_random_seed=args.seed),
        "plaintext": tf.estimator.RunConfig(model_dir=os.path.join(model_dir, "plaintext"),
                                            tf_random_seed=args.seed),
    }
    train_fn = input_fns.numpy_input_fn({"x": x_train}, y_train, batch_size=args.batch_size,
                                        seed=args.seed)
    # One evaluation step covers the test set: each replica gets half of the batch.
    eval_fn = input_fns.numpy_input_fn({"x": x_test}, y_test, batch_size=len(x_test) + len(x_test) % 2,
                                       num_epochs=1, shuffle=False)
    results = {}
    for name, config in configs.items():
        est = tf.estimator.Estimator(logistic_regression.model_fn, params=params, config=config)
        est.train(train_fn, steps=args.steps)
        results[name] = {k: float(v) for k, v in est.evaluate(eval_fn).items()}
    return results


def print_side_by_side(results, metrics=METRICS):
    print(f"{'metric':<14}{'secure':>12}{'plaintext':>12}")
    for metric in metrics:
        print(f"{metric:<14}{results['secure'][metric]:>12.4f}{results['plaintext'][metric]:>12.4f}")


def main(argv=None):
    """Runs the example; returns {"secure": metrics, "plaintext": metrics}."""
    results = _run(parse_args(argv))
    print_side_by_side(results)
    return results


if __name__ == "__main__":
    main()
