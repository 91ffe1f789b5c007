"""The TF Encrypted RFC's Keras example, with `tfe_estimator.TfeStrategy()` as its strategy.

The RFC "Using TF Encrypted with Distribution Strategies" (tf-encrypted/rfcs)
has one example: Keras `model.fit` under `tf.distribute.MirroredStrategy()`.
Here it runs as written with only that line changed, so the two replicas'
gradients are secret-shared and summed by three TF Encrypted parties. It then
runs again under a plain `MirroredStrategy` on the same two replica devices,
from the same initial weights, and prints both: they train alike.

    python examples/keras_fit.py

The line specific to tfe_estimator is marked `# tfe_estimator:`.
"""
import argparse
import gc
import json

import numpy as np
import tensorflow as tf

import tfe_estimator


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--epochs", type=int, default=2, help="the RFC's model.fit(dataset, epochs=2)")
    parser.add_argument("--seed", type=int, default=0, help="Keras' seed: the same initial weights for both runs")
    parser.add_argument("--json", default=None, help="also write the results to this JSON file")
    return parser.parse_args(argv)


def rfc_example(mirrored_strategy, epochs=2):
    """The RFC's example as written after its first line, `mirrored_strategy = ...` (the caller's)."""
    with mirrored_strategy.scope():
        model = tf.keras.Sequential([tf.keras.layers.Dense(1, input_shape=(1,))])
        model.compile(loss='mse', optimizer='sgd')

    dataset = tf.data.Dataset.from_tensors(([1.], [1.])).repeat(100).batch(10)
    model.fit(dataset, epochs=epochs)
    loss = model.evaluate(dataset)
    return {"weights": [w.tolist() for w in model.get_weights()], "loss": float(loss)}


def main(argv=None):
    args = parse_args(argv)
    tf.keras.utils.set_random_seed(args.seed)
    mirrored_strategy = tfe_estimator.TfeStrategy()  # tfe_estimator: was tf.distribute.MirroredStrategy()
    secure = rfc_example(mirrored_strategy, args.epochs)

    # The plaintext twin: the same replica devices and initial weights, summed in the clear.
    replicas = mirrored_strategy.extended.worker_devices
    tf.keras.utils.set_random_seed(args.seed)
    plaintext = rfc_example(tf.distribute.MirroredStrategy(replicas), args.epochs)

    difference = max(float(np.max(np.abs(np.array(a) - np.array(b))))
                     for a, b in zip(secure["weights"], plaintext["weights"]))
    results = {"secure": secure, "plaintext": plaintext, "replicas": list(replicas),
               "max_weight_difference": difference}
    print(f"\n{len(replicas)} replicas {list(replicas)}")
    print(f"{'':>12} {'secure':>12} {'plaintext':>12}")
    print(f"{'loss':>12} {secure['loss']:12.6f} {plaintext['loss']:12.6f}")
    print(f"largest weight difference: {difference:.2e}")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(results, f)
    gc.collect()  # the strategies' thread pools, before interpreter exit (no Pool.__del__ traceback)
    return results


if __name__ == "__main__":
    main()
