"""One machine: a Keras model or a custom training loop under `tfe_estimator.TfeStrategy()` and its plaintext twin.

Run by tests/test_keras.py in a fresh interpreter (eager logical devices are per
process). Trains under `TfeStrategy()` (spied on with `--spy`: every
`SecureAggregation` reduction recorded, every plaintext cross-device sum a
tripwire), then, unless the tripwire fired, under `tf.distribute.MirroredStrategy`
on the same replica devices from the same initial weights; writes both to `--json`.

    python tests/scripts/keras_twins.py --case ctl --spy --json out.json

Cases:
  dense: `fit`, `evaluate` and `predict` of a small Dense network; the data
    (tensors and a dataset) is made before the strategy, so TensorFlow's
    runtime has already started with one CPU device.
  ctl: a custom training loop (TensorFlow's distributed training guide):
    `experimental_distribute_dataset`, `strategy.run` with `tf.GradientTape`
    and `optimizer.apply_gradients`, `strategy.reduce` SUM and MEAN.
Mutations (`--mutate`, with `--spy`): a planted leak the spy must catch.
  reduce_to: MirroredExtended's own `_reduce_to` back in TfeStrategy (its
    CPU-destination shortcut sums `strategy.reduce` in the clear);
  cross_device_ops: every reduction routed to a plaintext `ReductionToOneDevice`.
"""
import argparse
import gc
import json
import pathlib
import sys

import numpy as np
import tensorflow as tf

SUM, MEAN = tf.distribute.ReduceOp.SUM, tf.distribute.ReduceOp.MEAN
GLOBAL_BATCH = 16


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--case", choices=("dense", "ctl"), required=True)
    parser.add_argument("--spy", action="store_true", help="record where every reduction goes")
    parser.add_argument("--mutate", choices=("reduce_to", "cross_device_ops"), default=None)
    parser.add_argument("--json", required=True)
    return parser.parse_args(argv)


def make_data(rows=128, seed=0):
    """A small regression problem: y = x . w + 0.3 (float32)."""
    rng = np.random.RandomState(seed)
    x = rng.randn(rows, 3).astype(np.float32)
    y = (x @ np.array([1.5, -2.0, 0.5], np.float32) + 0.3)[:, None]
    return x, y


def small_dense():
    return tf.keras.Sequential([tf.keras.layers.Dense(8, activation="tanh", input_shape=(3,)),
                                tf.keras.layers.Dense(1)])


def _weights(model):
    return [w.tolist() for w in model.get_weights()]


def dense_case(strategy, x, y, dataset):
    with strategy.scope():
        tf.keras.utils.set_random_seed(0)
        model = small_dense()
        model.compile(optimizer=tf.keras.optimizers.SGD(0.05), loss="mse", metrics=["mae"])
    history = model.fit(dataset, epochs=2, verbose=0)
    loss, mae = model.evaluate(dataset, verbose=0)
    predictions = model.predict(x[:8], batch_size=8, verbose=0)
    return {"weights": _weights(model), "loss": float(loss), "mae": float(mae),
            "train_loss": [float(v) for v in history.history["loss"]], "predictions": predictions.ravel().tolist()}


def ctl_case(strategy, x, y, dataset):
    """The custom training loop of TensorFlow's distributed training guide, on a small Dense network."""
    with strategy.scope():
        tf.keras.utils.set_random_seed(0)
        model = small_dense()
        optimizer = tf.keras.optimizers.SGD(0.05)
        loss_object = tf.keras.losses.MeanSquaredError(reduction=tf.keras.losses.Reduction.NONE)

    def train_step(inputs):
        features, labels = inputs
        with tf.GradientTape() as tape:
            per_example = loss_object(labels, model(features, training=True))
            loss = tf.nn.compute_average_loss(per_example, global_batch_size=GLOBAL_BATCH)
        gradients = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(gradients, model.trainable_variables))
        return loss, tf.cast(tf.shape(labels)[0], tf.float32)

    @tf.function
    def distributed_train_step(inputs):
        losses, rows = strategy.run(train_step, args=(inputs,))
        return strategy.reduce(SUM, losses, axis=None), strategy.reduce(MEAN, rows, axis=None)

    losses, rows = [], []
    for _ in range(2):  # epochs
        for batch in strategy.experimental_distribute_dataset(dataset):
            loss, mean_rows = distributed_train_step(batch)
            losses.append(float(loss))
            rows.append(float(mean_rows))
    return {"weights": _weights(model), "train_loss": losses, "mean_rows": rows}


def _spy(mutate):
    """The routing spy of tests/test_strategy_routing.py, installed so that it can be removed."""
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
    import test_strategy_routing  # pylint: disable=import-outside-toplevel
    from tensorflow.python.distribute import cross_device_ops as cross_device_ops_lib  # pylint: disable=import-outside-toplevel
    from tensorflow.python.distribute import mirrored_strategy  # pylint: disable=import-outside-toplevel

    from tfe_estimator.distribute import strategy as strategy_lib  # pylint: disable=import-outside-toplevel

    undo = []

    def patch(obj, name, value):
        undo.append((obj, name, obj.__dict__[name] if name in obj.__dict__ else getattr(obj, name)))
        setattr(obj, name, value)

    routing = test_strategy_routing.install_spy(patch)
    if mutate == "reduce_to":
        patch(strategy_lib._TfeExtended, "_reduce_to", mirrored_strategy.MirroredExtended._reduce_to)  # pylint: disable=protected-access
    elif mutate == "cross_device_ops":
        plaintext = cross_device_ops_lib.ReductionToOneDevice()
        patch(strategy_lib._TfeExtended, "_get_cross_device_ops", lambda self, value: plaintext)  # pylint: disable=protected-access

    def remove():
        for obj, name, value in reversed(undo):
            setattr(obj, name, value)

    return routing, remove


def main(argv=None):
    args = parse_args(argv)
    routing, remove = _spy(args.mutate) if args.spy else (None, lambda: None)
    import tfe_estimator  # pylint: disable=import-outside-toplevel

    x, y = make_data()
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.DATA
    case = {"dense": dense_case, "ctl": ctl_case}[args.case]
    report = {}
    if args.case == "dense":  # TensorFlow's runtime starts here, with its one CPU device
        dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(GLOBAL_BATCH).with_options(options)
    strategy = tfe_estimator.TfeStrategy()
    report["replicas"] = list(strategy.extended.worker_devices)
    report["parties"] = list(strategy.secure_aggregation.server_devices)
    if args.case == "ctl":
        dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(GLOBAL_BATCH).with_options(options)
    try:
        report["secure"] = case(strategy, x, y, dataset)
    except AssertionError as e:  # the tripwire: a plaintext sum
        report["error"] = str(e)
    if routing is not None:
        report["routing"] = {"secure": routing.secure, "plaintext": routing.plaintext}
    remove()
    if "error" not in report:
        report["plaintext"] = case(tf.distribute.MirroredStrategy(report["replicas"]), x, y, dataset)
    with open(args.json, "w", encoding="utf-8") as f:
        json.dump(report, f)
    gc.collect()  # the strategies' thread pools, before interpreter exit


if __name__ == "__main__":
    main()
