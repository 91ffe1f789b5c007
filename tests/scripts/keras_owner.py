"""One data owner of a service-mode test cluster: Keras `model.fit` under `tfe_estimator.TfeStrategy()`.

Run by `tfe-estimator launch --workers 1 -- python keras_owner.py ...` in each owner's own directory
(tests/test_keras_service.py): reads only ./data.csv (two features, a label), builds the strategy with no
arguments, fits a Dense layer with SGD on `repeat().batch(16)` for STEPS steps, and writes ./keras_weights.json
(the initial and the trained weights).
Usage: keras_owner.py STEPS LEARNING_RATE [--refused-first TASK_DIR LR] [--crash-in TASK_DIR STEP EVERY]
                      [--then-evaluate] [--then-dp NOISE_MULTIPLIER] [--then-loop]
--refused-first TASK_DIR LR: in its first run, each owner first fits a model whose learning rate is LR on the
  owner in directory TASK_DIR (e.g. worker-0): refused by the handshake (prints the error), then the real one.
--crash-in TASK_DIR STEP EVERY: fit in epochs of EVERY steps with tf.keras.callbacks.BackupAndRestore(./backup)
  (a backup at each epoch's end: Keras 3 restores no step within an epoch), the owner in TASK_DIR exits
  (status 3) after STEP steps in its first run (no ./crashed yet); its restart resumes from its latest backup
  and replays the steps after it from the servers' window.
--then-dp NOISE_MULTIPLIER: then fit a second model for DP_STEPS steps under TfeStrategy(dp=DistributedDP(DP_CLIP,
  NOISE_MULTIPLIER, num_examples=DP_EXAMPLES)) with EpsilonCallback; writes ./keras_dp.json.
--then-loop: then (with --refused-first, each owner first runs a loop whose learning rate differs as there: refused)
  a custom training loop (strategy.run with GradientTape and apply_gradients, strategy.reduce SUM
  and MEAN in the tf.function, SUM eagerly after each step) on a fresh model for LOOP_STEPS steps, and the same
  loop twice more with a planted leak each (MUTATIONS: strategy.reduce answered by this owner alone; the gradients
  summed over this owner's replicas only); writes ./keras_loop.json (per variant: weights, losses, rows).
--then-evaluate: fit with validation_data, then model.evaluate twice (the chief on its 64 rows, the worker on its
  first 40) with tfe_estimator.OwnerMetrics, and model.predict on its first 20 rows; writes
  ./keras_evaluation.json.
"""
import json
import logging
import os
import sys
import time

import numpy as np
import tensorflow as tf

import tfe_estimator

#: --then-dp: the DP model's per-example clip norm, training-set size (epsilon's) and steps.
DP_CLIP, DP_EXAMPLES, DP_STEPS = 0.5, 128, 4
#: --then-loop: the custom loop's steps, and its variants (the honest loop, then each planted leak).
LOOP_STEPS = 4
LOOP_VARIANTS = ("secure", "reduce_local", "gradients_local")


class _CrashAt(tf.keras.callbacks.Callback):
    """Exits the process once `step` steps are done (after BackupAndRestore saved them)."""

    def __init__(self, step):
        super().__init__()
        self._step = step

    def on_train_batch_end(self, batch, logs=None):
        if int(self.model.optimizer.iterations.numpy()) >= self._step:
            open("crashed", "w").close()
            print(f"keras owner crashing after step {self._step}", flush=True)
            os._exit(3)


def _here(task_dir):
    return os.path.basename(os.getcwd()) == task_dir


def _refused_first(strategy, dataset, learning_rate):
    """Fits a first model with `learning_rate`: the owners' handshake must refuse it before its first step (the
    owners' rates differ). Then waits until every owner was refused (their directories' ./refused) and starts
    afresh as a restarted process would: the same layer names, Keras seeded alike again."""
    with strategy.scope():
        model = tf.keras.Sequential([tf.keras.layers.Dense(1, input_shape=(2,))])
        model.compile(tf.keras.optimizers.SGD(learning_rate), "mse", metrics=["mae"])
    try:
        model.fit(dataset, steps_per_epoch=1, epochs=1, verbose=0)
        print("keras owner: first model trained", flush=True)
    except Exception as e:  # noqa: BLE001 (its type is what the test checks)
        print(f"keras owner: first model refused: {type(e).__name__}: {e}", flush=True)
    open("refused", "w").close()
    parent = os.path.dirname(os.getcwd())
    owners = [d for d in os.listdir(parent) if os.path.exists(os.path.join(parent, d, "data.csv"))]
    deadline = time.monotonic() + 120
    while not all(os.path.exists(os.path.join(parent, d, "refused")) for d in owners):
        if time.monotonic() > deadline:
            raise SystemExit(f"keras owner: not every owner of {owners} was refused within 120 s")
        time.sleep(0.2)
    from tfe_estimator.owner.service_strategy import cluster_seed  # pylint: disable=import-outside-toplevel

    tf.keras.backend.clear_session()
    tf.keras.utils.set_random_seed(cluster_seed(tfe_estimator.TfeCluster.from_environment()))


def _eval_rows(rows):
    """This owner's evaluation rows: the chief's 64, the worker's first 40 (two full batches and a partial)."""
    count = 64 if os.path.basename(os.getcwd()) == "chief-0" else 40
    return tf.data.Dataset.from_tensor_slices((rows[:count, :2], rows[:count, 2:])).batch(16)


def main(argv):
    steps, learning_rate = int(argv[1]), float(argv[2])
    rows = np.loadtxt("data.csv", delimiter=",", dtype=np.float32)
    dataset = tf.data.Dataset.from_tensor_slices((rows[:, :2], rows[:, 2:])).repeat().batch(16)

    logging.basicConfig(format="%(name)s: %(message)s")
    logging.getLogger("tfe_estimator").setLevel(logging.INFO)  # the handshake's line: the sums are checked
    strategy = tfe_estimator.TfeStrategy()
    if "--refused-first" in argv and not os.path.exists("crashed"):
        at = argv.index("--refused-first")
        _refused_first(strategy, dataset, float(argv[at + 2]) if _here(argv[at + 1]) else learning_rate)
    with strategy.scope():
        model = tf.keras.Sequential([tf.keras.layers.Dense(1, input_shape=(2,))])
        model.compile(tf.keras.optimizers.SGD(learning_rate), "mse", metrics=["mae"])
    initial = [w.tolist() for w in model.get_weights()]
    callbacks, every = [], steps
    if "--crash-in" in argv:
        at = argv.index("--crash-in")
        every = int(argv[at + 3])
        callbacks.append(tf.keras.callbacks.BackupAndRestore("backup"))
        if _here(argv[at + 1]) and not os.path.exists("crashed"):
            callbacks.append(_CrashAt(int(argv[at + 2])))
    validation = ({"validation_data": _eval_rows(rows), "validation_freq": steps // every}
                  if "--then-evaluate" in argv else {})
    history = model.fit(dataset, steps_per_epoch=every, epochs=steps // every, verbose=0, callbacks=callbacks,
                        **validation)
    with open("keras_weights.json", "w") as f:
        json.dump({"initial": initial, "trained": [w.tolist() for w in model.get_weights()],
                   "iterations": int(model.optimizer.iterations.numpy()),
                   "loss": history.history["loss"]}, f)
    from tfe_estimator.service.client import live_clients  # pylint: disable=import-outside-toplevel

    replays = sum(counts[1] for client in live_clients() for counts in client.answers.values())
    print(f"keras owner finished at step {int(model.optimizer.iterations.numpy())}; {replays} answers replayed",
          flush=True)
    if "--then-evaluate" in argv:
        # Every owner evaluates all its own rows (a different number each, the last batch partial), across
        # owners: the union's metrics returned, its own in OwnerMetrics; predict is local.
        own = tfe_estimator.OwnerMetrics()
        union = model.evaluate(_eval_rows(rows), callbacks=[own], verbose=0, return_dict=True)
        again = model.evaluate(_eval_rows(rows), verbose=0, return_dict=True)  # a second evaluation, same step
        predictions = model.predict(rows[:20, :2], batch_size=16, verbose=0)
        with open("keras_evaluation.json", "w") as f:
            json.dump({"union": union, "again": again, "own": own.own, "all_owners": own.all_owners,
                       "val": {k: v for k, v in history.history.items() if k.startswith("val_")},
                       "predictions": predictions.tolist()}, f)
        print(f"keras owner evaluated {int(model.optimizer.iterations.numpy())}", flush=True)
    if "--then-dp" in argv:
        _fit_with_dp(rows, float(argv[argv.index("--then-dp") + 1]), learning_rate)
    if "--then-loop" in argv:
        if "--refused-first" in argv:  # first a loop whose learning rates differ: refused before its first step
            at = argv.index("--refused-first")
            try:
                _custom_loop(strategy, rows, float(argv[at + 2]) if _here(argv[at + 1]) else learning_rate, "refused")
                print("keras owner: refused loop trained", flush=True)
            except Exception as e:  # noqa: BLE001 (its type is what the test checks)
                print(f"keras owner: custom loop refused: {type(e).__name__}: {e}", flush=True)
        results = {variant: _custom_loop(strategy, rows, learning_rate, variant) for variant in LOOP_VARIANTS}
        with open("keras_loop.json", "w") as f:
            json.dump(results, f)


def _fit_with_dp(rows, noise_multiplier, learning_rate):
    """A second model, under TfeStrategy(dp=DistributedDP(...)): per-example clipping (make_dp_optimizer, a loss
    of reduction NONE), each owner's noise part inside the secure sum, epsilon on the terminal
    (EpsilonCallback); writes ./keras_dp.json (initial and trained weights)."""
    from tfe_estimator.privacy.dp import make_dp_optimizer  # pylint: disable=import-outside-toplevel

    dp = tfe_estimator.DistributedDP(l2_norm_clip=DP_CLIP, noise_multiplier=noise_multiplier,
                                     num_examples=DP_EXAMPLES)
    strategy = tfe_estimator.TfeStrategy(dp=dp)
    with strategy.scope():
        model = tf.keras.Sequential([tf.keras.layers.Dense(1, input_shape=(2,))])
        model.compile(make_dp_optimizer(tf.keras.optimizers.legacy.SGD(learning_rate), dp.l2_norm_clip),
                      tf.keras.losses.MeanSquaredError(reduction="none"))
    initial = [w.tolist() for w in model.get_weights()]
    dataset = tf.data.Dataset.from_tensor_slices((rows[:, :2], rows[:, 2:])).repeat().batch(16, drop_remainder=True)
    history = model.fit(dataset, steps_per_epoch=DP_STEPS, epochs=1, verbose=0,
                        callbacks=[tfe_estimator.EpsilonCallback(dp, every_n_steps=2)])
    with open("keras_dp.json", "w") as f:
        json.dump({"initial": initial, "trained": [w.tolist() for w in model.get_weights()],
                   "iterations": int(model.optimizer.iterations.numpy()), "loss": history.history["loss"]}, f)
    print(f"keras owner trained with DP to step {int(model.optimizer.iterations.numpy())}", flush=True)


def _custom_loop(strategy, rows, learning_rate, variant):
    """The custom training loop of TensorFlow's distributed training guide on a fresh Dense layer, LOOP_STEPS steps
    on `repeat().batch(16)` (the global batch); `variant` "secure", or a planted leak (module docstring)."""
    from tensorflow.python.distribute import cross_device_ops as cross_device_ops_lib  # pylint: disable=import-outside-toplevel

    from tfe_estimator.distribute import strategy as strategy_lib  # pylint: disable=import-outside-toplevel
    from tfe_estimator.owner import service_strategy  # pylint: disable=import-outside-toplevel

    sum_op, mean_op = tf.distribute.ReduceOp.SUM, tf.distribute.ReduceOp.MEAN
    with strategy.scope():
        model = tf.keras.Sequential([tf.keras.layers.Dense(1, input_shape=(2,))])
        optimizer = tf.keras.optimizers.SGD(learning_rate)
    initial = [w.tolist() for w in model.get_weights()]

    def step_fn(features, labels):
        with tf.GradientTape() as tape:
            per_example = tf.reduce_mean(tf.square(model(features, training=True) - labels), axis=1)
            loss = tf.nn.compute_average_loss(per_example)  # over the global batch: every owner's rows
        gradients = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(gradients, model.trainable_variables))
        return loss, tf.cast(tf.shape(labels)[0], tf.float32)

    @tf.function
    def train_step(batch):
        losses, counts = strategy.run(step_fn, args=batch)
        return strategy.reduce(sum_op, losses, axis=None), strategy.reduce(mean_op, counts, axis=None), losses

    local = cross_device_ops_lib.ReductionToOneDevice()
    leaks = {"reduce_local": (service_strategy.ServiceExtended, "_reduce_to",
                              lambda self, op, value, destinations, options: local.reduce(
                                  op, value, self.worker_devices[0] if isinstance(destinations, str) else destinations)),
             "gradients_local": (strategy_lib._TfeExtended, "_batch_reduce_to",  # pylint: disable=protected-access
                                 lambda self, op, pairs, options: local.batch_reduce(op, pairs))}
    undo = None
    if variant in leaks:
        cls, name, leak = leaks[variant]
        undo = (cls, name, cls.__dict__[name])
        setattr(cls, name, leak)
    try:
        dataset = tf.data.Dataset.from_tensor_slices((rows[:, :2], rows[:, 2:])).repeat().batch(16)
        batches = iter(strategy.experimental_distribute_dataset(dataset))
        losses, eager, counts = [], [], []
        for _ in range(LOOP_STEPS):
            loss, count, per_replica = train_step(next(batches))
            losses.append(float(loss))
            counts.append(float(count))
            eager.append(float(strategy.reduce(sum_op, per_replica, axis=None)))  # eagerly, after the step
    except ValueError as e:  # a planted leak the owners' weight check stops (their weights differ)
        if variant not in leaks or "Weight check at step" not in str(e):
            raise
        print(f"keras owner: custom loop ({variant}) stopped: {type(e).__name__}: {e}", flush=True)
        return {"stopped": f"{type(e).__name__}: {e}"}
    finally:
        if undo is not None:
            setattr(*undo)
    print(f"keras owner: custom loop ({variant}) at step {int(optimizer.iterations.numpy())}", flush=True)
    return {"initial": initial, "trained": [w.tolist() for w in model.get_weights()], "loss": losses,
            "eager_loss": eager, "rows": counts, "iterations": int(optimizer.iterations.numpy())}


if __name__ == "__main__":
    main(sys.argv)
