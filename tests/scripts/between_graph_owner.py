"""One data owner of a between-graph test cluster: trains a LinearRegressor on ./data.csv into ./model.

Run by `tfe-estimator launch` in each owner's own directory (tests/test_between_graph.py). The
evaluator belongs to the chief's organisation: it evaluates the chief's checkpoints (../chief-0/model)
on the chief's data, and writes the final metrics to ../chief-0/eval_metrics.json.
Usage: between_graph_owner.py STEPS LEARNING_RATE [--mutate-reveal-x2]
"""
import glob
import json
import os
import sys

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


def main(argv):
    steps, learning_rate = int(argv[1]), float(argv[2])
    task_type = json.loads(os.environ["TF_CONFIG"])["task"]["type"]
    if task_type == "evaluator":
        os.chdir(os.path.join("..", "chief-0"))
    if "--mutate-reveal-x2" in argv:  # a planted bug: every revealed sum doubled
        reveal = ops.reveal_sum
        ops.reveal_sum = lambda *a, **k: [2 * t for t in reveal(*a, **k)]
    data = np.loadtxt("data.csv", delimiter=",", dtype=np.float32)  # this owner's file only
    x, y = data[:, :-1], data[:, -1:]

    def input_fn():
        return tf.data.Dataset.from_tensors(({"x": x}, y)).repeat()

    config = tfe_estimator.TfeRunConfig(model_dir="model", tf_random_seed=7, save_checkpoints_steps=steps)
    estimator = tf.compat.v1.estimator.LinearRegressor(
        feature_columns=[tf.feature_column.numeric_column("x", shape=[x.shape[1]])],
        optimizer=lambda: tf.compat.v1.train.GradientDescentOptimizer(learning_rate),
        loss_reduction=tf.compat.v1.losses.Reduction.SUM_OVER_BATCH_SIZE, config=config)
    tf.estimator.train_and_evaluate(
        estimator, tf.estimator.TrainSpec(input_fn, max_steps=steps, hooks=[PartitionDevicesHook()]),
        tf.estimator.EvalSpec(input_fn, steps=1, throttle_secs=0, start_delay_secs=0))
    if task_type == "evaluator":  # train_and_evaluate returns nothing here: read the evaluator's events
        metrics = {}
        for path in sorted(glob.glob(os.path.join("model", "eval", "events.*"))):
            for event in tf.compat.v1.train.summary_iterator(path):
                for value in event.summary.value:
                    metrics[value.tag] = float(value.simple_value)
                    metrics["global_step"] = int(event.step)
        with open("eval_metrics.json", "w") as f:
            json.dump(metrics, f)
        print("evaluator finished at step", metrics.get("global_step"))
        return
    print("owner finished at step", estimator.get_variable_value("global_step"))


if __name__ == "__main__":
    main(sys.argv)
