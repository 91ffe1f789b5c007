"""Keras `model.fit`, `evaluate` and `predict` under `TfeStrategy`, secure vs plaintext.

`TfeStrategy` is a `MirroredStrategy` whose cross-replica sums are secure
sums, so a Keras model built under its `scope()` trains data-parallel with
secret-shared gradients. In eager TensorFlow every replica and every TFE
party is a logical CPU device, created before anything else runs: two
replicas and three parties need five. The same model, data and seed trained
under a plain `MirroredStrategy` on the same two replica devices gives the
same weights.

    python examples/keras_fit.py --epochs 2

Lines specific to tfe_estimator are marked `# tfe_estimator:`.
"""
import argparse
import gc
import json

import numpy as np
import tensorflow as tf

import tfe_estimator
from tfe_estimator.distribute.logical_devices import check_logical_cpus, configure_logical_cpus

REPLICAS = ["/cpu:0", "/cpu:1"]


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=32, help="global batch size (split over 2 replicas)")
    parser.add_argument("--json", default=None, help="also write the results to this JSON file")
    return parser.parse_args(argv)


def make_data(rows=256, seed=0):
    """A small linear regression problem: y = x . w + 0.3."""
    rng = np.random.RandomState(seed)
    x = rng.randn(rows, 3).astype(np.float32)
    y = (x @ np.array([1.5, -2.0, 0.5], np.float32) + 0.3)[:, None]
    return x, y


def _dataset(x, y, batch_size):
    """Batches in order; each replica gets half of every global batch (no file-based auto-sharding)."""
    dataset = tf.data.Dataset.from_tensor_slices(x if y is None else (x, y)).batch(batch_size)
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.DATA
    return dataset.with_options(options)


def fit_evaluate_predict(strategy, x, y, epochs, batch_size):
    """Builds, fits, evaluates and predicts with one Keras model under `strategy`."""
    with strategy.scope():
        tf.keras.utils.set_random_seed(0)  # the same initial weights for both runs
        model = tf.keras.Sequential([tf.keras.layers.Dense(8, activation="tanh", input_shape=(3,)),
                                     tf.keras.layers.Dense(1)])
        model.compile(optimizer=tf.keras.optimizers.SGD(0.05), loss="mse", metrics=["mae"])
    history = model.fit(_dataset(x, y, batch_size), epochs=epochs, verbose=0)
    loss, mae = model.evaluate(_dataset(x, y, 64), verbose=0)
    predictions = model.predict(_dataset(x[:8], None, 8), verbose=0)
    return {"weights": [w.tolist() for w in model.get_weights()], "loss": float(loss), "mae": float(mae),
            "train_loss": [float(v) for v in history.history["loss"]], "predictions": predictions.ravel().tolist()}


def main(argv=None):
    args = parse_args(argv)
    configure_logical_cpus(5)  # tfe_estimator: 2 replicas + 3 TFE parties, before any other TensorFlow work
    x, y = make_data()
    secure = tfe_estimator.TfeStrategy(devices=REPLICAS, protocol="pond",  # tfe_estimator: the strategy
                                       server_devices=["/cpu:2", "/cpu:3", "/cpu:4"])
    check_logical_cpus(secure)  # tfe_estimator: a clear error if the devices are missing
    results = {
        "secure": fit_evaluate_predict(secure, x, y, args.epochs, args.batch_size),
        "plaintext": fit_evaluate_predict(tf.distribute.MirroredStrategy(REPLICAS), x, y, args.epochs,
                                          args.batch_size),
    }
    s, p = results["secure"], results["plaintext"]
    results["max_weight_difference"] = max(
        float(np.max(np.abs(np.array(a) - np.array(b)))) for a, b in zip(s["weights"], p["weights"]))
    print(f"{'':>12} {'secure':>12} {'plaintext':>12}")
    for key in ("loss", "mae"):
        print(f"{key:>12} {s[key]:12.6f} {p[key]:12.6f}")
    print(f"largest weight difference: {results['max_weight_difference']:.2e}")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(results, f)
    gc.collect()  # the strategies' thread pools, before interpreter exit (no Pool.__del__ traceback)
    return results


if __name__ == "__main__":
    main()
