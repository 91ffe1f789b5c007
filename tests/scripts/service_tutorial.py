"""One data owner running TensorFlow's linear tutorial in service mode (tests/test_tutorials.py).

Run by `tfe-estimator launch --cluster-mode service` in each owner's own directory: reads
./titanic.npz (this owner's training and evaluation rows), runs `linear_titanic` of
tests/test_tutorials.py with `TfeRunConfig` as its only change, and writes the evaluation's
(federated) metrics to ./metrics.json; then `batch_norm_custom` (a custom model_fn with batch
normalization, checkpoints every BATCH_NORM_SAVE_STEPS steps) into ./bn_model, its metrics to
./bn_metrics.json.
"""
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir))

import tfe_estimator  # noqa: E402
from test_tutorials import BATCH_NORM_SAVE_STEPS, SEED, batch_norm_custom, linear_titanic  # noqa: E402


def main():
    with np.load("titanic.npz") as f:
        frames = []
        for part in ("train", "eval"):
            columns = {key[len(part) + 1:]: f[key] for key in f.files if key.startswith(part + "_")}
            frames.append((columns, f[part]))
    metrics = linear_titanic(tfe_estimator.TfeRunConfig(model_dir="model", tf_random_seed=SEED), frames)
    with open("metrics.json", "w") as out:
        json.dump({key: float(value) for key, value in metrics.items()}, out)
    # In the same launch: a custom model_fn with batch normalization, step-based checkpoints (into ./bn_model).
    metrics = batch_norm_custom(tfe_estimator.TfeRunConfig(model_dir="bn_model", tf_random_seed=SEED,
                                                           save_checkpoints_steps=BATCH_NORM_SAVE_STEPS), frames)
    with open("bn_metrics.json", "w") as out:
        json.dump({key: float(value) for key, value in metrics.items()}, out)
    print("tutorial owner done")


if __name__ == "__main__":
    main()
