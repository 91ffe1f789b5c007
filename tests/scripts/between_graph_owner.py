"""One data owner of a between-graph test cluster: trains a LinearRegressor on ./data.csv into ./model.

Run by `tfe-estimator launch` in each owner's own directory (tests/test_between_graph.py).
Usage: between_graph_owner.py STEPS LEARNING_RATE [--mutate-reveal-x2] [--check-every K]
                               [--perturb-worker-after-step S] [--worker-extra-feature]
                               [--step-seconds T] [--step-timeout T]
"""
import json
import os
import sys
import time

import numpy as np
import tensorflow as tf

import tfe_estimator
from tfe_estimator.secure.kernels import ops


class PartitionDevicesHook(tf.estimator.SessionRunHook):
    """Writes the devices of every node of the first training step's partition graphs to ./partition_devices.json."""

    def __init__(self):
        self.done = False

    def before_run(self, run_context):
        if not self.done:
            return tf.estimator.SessionRunArgs(None, options=tf.compat.v1.RunOptions(output_partition_graphs=True))
        return None

    def after_run(self, run_context, run_values):
        if not self.done and run_values.run_metadata.partition_graphs:
            devices = sorted({node.device for g in run_values.run_metadata.partition_graphs for node in g.node})
            with open("partition_devices.json", "w") as f:
                json.dump(devices, f)
            self.done = True


class PerturbHook(tf.estimator.SessionRunHook):
    """A planted divergence: after step `step`, worker:0 adds 0.5 to its bias (the chief does not)."""

    def __init__(self, step):
        self.step = step

    def begin(self):
        bias = [v for v in tf.compat.v1.global_variables() if v.name.startswith("linear/linear_model/bias_weights")]
        self.op = bias[0].assign_add([0.5])
        self.global_step = tf.compat.v1.train.get_global_step()

    def after_run(self, run_context, run_values):
        if run_context.session.run(self.global_step) == self.step + 1:
            run_context.session.run(self.op)


class SlowHook(tf.estimator.SessionRunHook):
    """Slows each step down so that a test can kill a task mid-training."""

    def __init__(self, seconds):
        self.seconds = seconds

    def after_run(self, run_context, run_values):
        time.sleep(self.seconds)


def _flag(argv, name, default, kind=int):
    return kind(argv[argv.index(name) + 1]) if name in argv else default


def main(argv):
    steps, learning_rate = int(argv[1]), float(argv[2])
    if "--mutate-reveal-x2" in argv:  # a planted bug: every revealed sum doubled
        reveal = ops.reveal_sum
        ops.reveal_sum = lambda *a, **k: [2 * t for t in reveal(*a, **k)]
    data = np.loadtxt("data.csv", delimiter=",", dtype=np.float32)  # this owner's file only
    x, y = data[:, :-1], data[:, -1:]
    if "--worker-extra-feature" in argv and json.loads(os.environ["TF_CONFIG"])["task"]["type"] == "worker":
        x = np.column_stack([x, x[:, :1] ** 2])  # a planted mismatch: this owner's model has 3 weights

    def input_fn():
        return tf.data.Dataset.from_tensors(({"x": x}, y)).repeat()

    config = tfe_estimator.TfeRunConfig(model_dir="model", tf_random_seed=7, save_checkpoints_steps=steps,
                                        check_every_steps=_flag(argv, "--check-every", 100),
                                        step_timeout_secs=_flag(argv, "--step-timeout", 60.0, float))
    hooks = [PartitionDevicesHook(), SlowHook(_flag(argv, "--step-seconds", 0.0, float))]
    if "--perturb-worker-after-step" in argv and json.loads(os.environ["TF_CONFIG"])["task"]["type"] == "worker":
        hooks.append(PerturbHook(_flag(argv, "--perturb-worker-after-step", 0)))
    estimator = tf.compat.v1.estimator.LinearRegressor(
        feature_columns=[tf.feature_column.numeric_column("x", shape=[x.shape[1]])],
        optimizer=lambda: tf.compat.v1.train.GradientDescentOptimizer(learning_rate),
        loss_reduction=tf.compat.v1.losses.Reduction.SUM_OVER_BATCH_SIZE, config=config)
    tf.estimator.train_and_evaluate(estimator, tf.estimator.TrainSpec(input_fn, max_steps=steps, hooks=hooks),
                                    tf.estimator.EvalSpec(input_fn, steps=1))
    print("owner finished at step", estimator.get_variable_value("global_step"))


if __name__ == "__main__":
    main(sys.argv)
