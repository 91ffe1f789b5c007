"""One data owner of a service-mode test cluster: Keras `model.fit` under `tfe_estimator.TfeStrategy()`.

Run by `tfe-estimator launch --workers 1 -- python keras_owner.py ...` in each owner's own directory
(tests/test_keras_service.py): reads only ./data.csv (two features, a label), builds the strategy with no
arguments, fits a Dense layer with SGD on `repeat().batch(16)` for STEPS steps, and writes ./keras_weights.json
(the initial and the trained weights).
Usage: keras_owner.py STEPS LEARNING_RATE [--learning-rate-in TASK_DIR LR] [--crash-in TASK_DIR STEP EVERY]
                      [--then-evaluate]
--learning-rate-in: the owner running in directory TASK_DIR (e.g. worker-0) uses LR instead.
--crash-in TASK_DIR STEP EVERY: with tf.keras.callbacks.BackupAndRestore(./backup, save_freq=EVERY), the owner
  in TASK_DIR exits (status 3) after STEP steps in its first run (no ./crashed yet); its restart resumes from
  its latest backup and replays the steps after it from the servers' window.
--then-evaluate: fit with validation_data, then model.evaluate twice (the chief on its 64 rows, the worker on its
  first 40) with tfe_estimator.OwnerMetrics, and model.predict on its first 20 rows; writes
  ./keras_evaluation.json.
"""
import json
import logging
import os
import sys

import numpy as np
import tensorflow as tf

import tfe_estimator


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


def _eval_rows(rows):
    """This owner's evaluation rows: the chief's 64, the worker's first 40 (two full batches and a partial)."""
    count = 64 if os.path.basename(os.getcwd()) == "chief-0" else 40
    return tf.data.Dataset.from_tensor_slices((rows[:count, :2], rows[:count, 2:])).batch(16)


def main(argv):
    steps, learning_rate = int(argv[1]), float(argv[2])
    if "--learning-rate-in" in argv:
        at = argv.index("--learning-rate-in")
        if os.path.basename(os.getcwd()) == argv[at + 1]:
            learning_rate = float(argv[at + 2])
    rows = np.loadtxt("data.csv", delimiter=",", dtype=np.float32)
    dataset = tf.data.Dataset.from_tensor_slices((rows[:, :2], rows[:, 2:])).repeat().batch(16)

    logging.basicConfig(format="%(name)s: %(message)s")
    logging.getLogger("tfe_estimator").setLevel(logging.INFO)  # the handshake's line: the sums are checked
    strategy = tfe_estimator.TfeStrategy()
    with strategy.scope():
        model = tf.keras.Sequential([tf.keras.layers.Dense(1, input_shape=(2,))])
        model.compile(tf.keras.optimizers.SGD(learning_rate), "mse", metrics=["mae"])
    initial = [w.tolist() for w in model.get_weights()]
    callbacks = []
    if "--crash-in" in argv:
        at = argv.index("--crash-in")
        callbacks.append(tf.keras.callbacks.BackupAndRestore("backup", save_freq=int(argv[at + 3])))
        if os.path.basename(os.getcwd()) == argv[at + 1] and not os.path.exists("crashed"):
            callbacks.append(_CrashAt(int(argv[at + 2])))
    validation = {"validation_data": _eval_rows(rows)} if "--then-evaluate" in argv else {}
    history = model.fit(dataset, steps_per_epoch=steps, epochs=1, verbose=0, callbacks=callbacks, **validation)
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

if __name__ == "__main__":
    main(sys.argv)
