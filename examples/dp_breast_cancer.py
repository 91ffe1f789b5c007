"""Differentially private logistic regression on the breast cancer data, noise added inside the secure sum.

Trains `model_fns.logistic_regression` twice on 2 local replicas whose
gradients are summed by secure aggregation: once with DP-SGD
(`tfe_estimator.DistributedDP`: each example's gradient clipped to
``--l2-norm-clip``, each replica adding its part of the discrete Gaussian
noise inside the secure sum), once without DP; then prints the test metrics
side by side and the epsilon spent at delta = 1e-5 (dp-accounting, RDP,
Poisson-sampled Gaussian: see README, "Differential privacy").

Usage::

    python examples/dp_breast_cancer.py --steps 150

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

METRICS = ("accuracy", "auc", "average_loss")
DELTA = 1e-5


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=150, help="training steps")
    parser.add_argument("--batch-size", type=int, default=32, help="global batch size (even)")
    parser.add_argument("--learning-rate", type=float, default=0.5, help="SGD learning rate")
    parser.add_argument("--l2-norm-clip", type=float, default=1.0, help="per-example gradient clip norm")
    parser.add_argument("--noise-multiplier", type=float, default=2.0, help="noise std / l2_norm_clip")
    parser.add_argument("--model-dir", default=None, help="checkpoints go to <dir>/dp and <dir>/secure")
    parser.add_argument("--seed", type=int, default=0, help="split, shuffle and TF seed")
    return parser.parse_args(argv)


def load_data(seed):
    """Standardised train/test split (the scaler is fitted on the training part)."""
    x, y = load_breast_cancer(return_X_y=True)
    x_train, x_test, y_train, y_test = train_test_split(x, y, test_size=0.25, random_state=seed, stratify=y)
    scaler = StandardScaler().fit(x_train)
    return (scaler.transform(x_train).astype(np.float32), y_train.astype(np.int32),
            scaler.transform(x_test).astype(np.float32), y_test.astype(np.int32))


def _run(args):
    x_train, y_train, x_test, y_test = load_data(args.seed)
    model_dir = args.model_dir or tempfile.mkdtemp(prefix="dp_breast_cancer_")
    params = {
        "feature_columns": [tf.feature_column.numeric_column("x", shape=(x_train.shape[1],))],
        "optimizer": "sgd",
        "learning_rate": args.learning_rate,
    }
    # tfe_estimator: DP-SGD settings; num_examples lets training log and evaluation report epsilon.
    dp = tfe_estimator.DistributedDP(l2_norm_clip=args.l2_norm_clip, noise_multiplier=args.noise_multiplier,
                                     num_examples=len(x_train), delta=DELTA)
    configs = {
        # tfe_estimator: the same secure aggregation, with and without distributed DP noise.
        "secure DP": tfe_estimator.TfeRunConfig(model_dir=os.path.join(model_dir, "dp"), num_replicas=2,
                                                dp=dp, tf_random_seed=args.seed),
        "secure": tfe_estimator.TfeRunConfig(model_dir=os.path.join(model_dir, "secure"), num_replicas=2,
                                             tf_random_seed=args.seed),
    }
    # Repeats forever, so every step has full, equal per-replica batches (DP-SGD's normalisation).
    train_fn = input_fns.numpy_input_fn({"x": x_train}, y_train, batch_size=args.batch_size, seed=args.seed)
    eval_fn = input_fns.numpy_input_fn({"x": x_test}, y_test, batch_size=len(x_test) + len(x_test) % 2,
                                       num_epochs=1, shuffle=False)
    results = {}
    for name, config in configs.items():
        est = tf.estimator.Estimator(logistic_regression.model_fn, params=params, config=config)
        est.train(train_fn, steps=args.steps)
        results[name] = {k: float(v) for k, v in est.evaluate(eval_fn).items()}
    return results


def main(argv=None):
    """Runs the example; returns {"secure DP": metrics, "secure": metrics}."""
    args = parse_args(argv)
    results = _run(args)
    print(f"{'metric':<14}{'secure DP':>12}{'secure':>12}")
    for metric in METRICS:
        print(f"{metric:<14}{results['secure DP'][metric]:>12.4f}{results['secure'][metric]:>12.4f}")
    print(f"DP-SGD: epsilon = {results['secure DP']['dp_epsilon']:.3g} at delta = {DELTA:g} against the other "
          f"owner (who knows its own noise), {results['secure DP']['dp_epsilon_outsiders']:.3g} against outsiders "
          f"(noise_multiplier {args.noise_multiplier}, l2_norm_clip {args.l2_norm_clip}, "
          f"global batch {args.batch_size}, {args.steps} steps, Poisson-sampling accounting)")
    return results


if __name__ == "__main__":
    main()
