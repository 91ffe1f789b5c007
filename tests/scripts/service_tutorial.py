"""One data owner running TensorFlow's linear tutorial in service mode (tests/test_tutorials.py).

Run by `tfe-estimator launch --cluster-mode service` in each owner's own directory: reads
./titanic.npz (this owner's training and evaluation rows), runs `linear_titanic` of
tests/test_tutorials.py with `TfeRunConfig` as its only change, and writes the evaluation's
(federated) metrics to ./metrics.json; then `batch_norm_custom` (a custom model_fn with batch
normalization, checkpoints every BATCH_NORM_SAVE_STEPS steps) into ./bn_model, its metrics to
./bn_metrics.json; then `keras_to_estimator` (a Keras model through `model_to_estimator`) into ./keras_model,
its metrics to ./keras_metrics.json.
"""
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir))

import tfe_estimator  # noqa: E402
from test_tutorials import (BATCH_NORM_SAVE_STEPS, SEED, batch_norm_custom, keras_to_estimator,  # noqa: E402
                            linear_titanic)


def _write(metrics, path):
    with open(path, "w") as out:
        json.dump({key: float(value) for key, value in metrics.items()}, out)


def main():
    with np.load("titanic.npz") as f:
        frames = []
        for part in ("train", "eval"):
            columns = {key[len(part) + 1:]: f[key] for key in f.files if key.startswith(part + "_")}
            frames.append((columns, f[part]))
    _write(linear_titanic(tfe_estimator.TfeRunConfig(model_dir="model", tf_random_seed=SEED), frames),
           "metrics.json")
    # In the same launch: a custom model_fn with batch normalization, step-based checkpoints (into ./bn_model).
    _write(batch_norm_custom(tfe_estimator.TfeRunConfig(model_dir="bn_model", tf_random_seed=SEED,
                                                        save_checkpoints_steps=BATCH_NORM_SAVE_STEPS), frames),
           "bn_metrics.json")
    # And a Keras model converted with model_to_estimator (into ./keras_model).
    _write(keras_to_estimator(tfe_estimator.TfeRunConfig(model_dir="keras_model", tf_random_seed=SEED), frames),
           "keras_metrics.json")
    print("tutorial owner done")


if __name__ == "__main__":
    main()
