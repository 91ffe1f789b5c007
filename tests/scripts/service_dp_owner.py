"""One data owner of a service-mode DP-SGD test cluster: logistic regression runs, each on ./RUN/train.csv.

Run by `tfe-estimator launch --cluster-mode service` in each owner's own directory
(tests/test_service_dp.py). Trains the runs one after the other in this one process (one launch
serves several tests): run NAME reads ./NAME/train.csv, evaluates on ./NAME/test.csv and trains
into ./NAME/model. Each local replica gets Poisson-sampled batches of its part of this owner's rows
(every row with probability Q per step, so batches may be empty); the noise is added by each owner
inside the service sum (`DistributedDP`). Prints one line ``RESULT NAME {json}`` per run: the
evaluation's accuracy and epsilons and whether the trained weights are finite.
Usage: service_dp_owner.py CLIP MULTIPLIER Q NUM_EXAMPLES NAME:STEPS:LEARNING_RATE:LOCAL_REPLICAS [...]
"""
import json
import os
import sys

import numpy as np
import tensorflow as tf

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # model_fns
import tfe_estimator  # noqa: E402  pylint: disable=wrong-import-position
from model_fns import logistic_regression  # noqa: E402  pylint: disable=wrong-import-position


def train_run(name, steps, learning_rate, replicas, dp, q):
    """Trains run `name` (./name/train.csv, `replicas` local replicas, sampling rate `q`); returns its RESULT."""
    train = np.loadtxt(os.path.join(name, "train.csv"), delimiter=",", dtype=np.float32)  # this owner's rows only
    test = np.loadtxt(os.path.join(name, "test.csv"), delimiter=",", dtype=np.float32)
    dims = train.shape[1] - 1
    parts = np.array_split(train, replicas)
    rng = np.random.default_rng()  # Poisson sampling: fresh randomness, not a seed the others could know

    def batches():
        while True:
            for part in parts:  # successive batches go to successive local replicas
                rows = part[rng.random(len(part)) < q]
                yield {"x": rows[:, :dims]}, rows[:, dims:].astype(np.int64)

    def input_fn():
        return tf.data.Dataset.from_generator(batches, output_signature=(
            {"x": tf.TensorSpec([None, dims], tf.float32)}, tf.TensorSpec([None, 1], tf.int64)))

    def test_input_fn():
        return tf.data.Dataset.from_tensor_slices(({"x": test[:, :dims]}, test[:, dims:].astype(np.int64))).batch(
            len(test))

    config = tfe_estimator.TfeRunConfig(model_dir=os.path.join(name, "model"), tf_random_seed=7,
                                        num_replicas=replicas, dp=dp, save_checkpoints_steps=steps,
                                        save_summary_steps=steps)
    estimator = tf.estimator.Estimator(
        logistic_regression.model_fn, config=config,
        params={"feature_columns": [tf.feature_column.numeric_column("x", shape=(dims,))],
                "optimizer": "sgd", "learning_rate": learning_rate})
    estimator.train(input_fn, max_steps=steps)
    metrics = estimator.evaluate(test_input_fn, steps=1)
    weights = estimator.get_variable_value("logits/kernel")
    return {"step": int(metrics["global_step"]), "accuracy": float(metrics["accuracy"]),
            "dp_epsilon": float(metrics["dp_epsilon"]), "dp_epsilon_outsiders": float(metrics["dp_epsilon_outsiders"]),
            "finite": bool(np.all(np.isfinite(weights))), "weights": weights.ravel().tolist()}


def main(argv):
    clip, multiplier, q, num_examples = float(argv[1]), float(argv[2]), float(argv[3]), int(argv[4])
    tf.compat.v1.logging.set_verbosity(tf.compat.v1.logging.INFO)  # where Estimator logs, and epsilon
    dp = tfe_estimator.DistributedDP(l2_norm_clip=clip, noise_multiplier=multiplier, num_examples=num_examples,
                                     expected_batch_size=round(q * num_examples))
    for run in argv[5:]:
        name, steps, learning_rate, replicas = run.split(":")
        result = train_run(name, int(steps), float(learning_rate), int(replicas), dp, q)
        print(f"RESULT {name} " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main(sys.argv)
