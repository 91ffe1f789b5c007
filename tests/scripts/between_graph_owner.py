"""One data owner of a between-graph test cluster: trains a LinearRegressor on ./data.csv into ./model.

Run by `tfe-estimator launch` in each owner's own directory (tests/test_between_graph.py). The
evaluator belongs to the chief's organisation: it evaluates the chief's checkpoints (../chief-0/model)
on the chief's data, and writes the final metrics to ../chief-0/eval_metrics.json.
Usage: between_graph_owner.py STEPS LEARNING_RATE [--mutate-reveal-x2] [--update-ring-bits-32]
       [--step-timeout-secs S] [--step-seconds S] [--diverge-worker]
"""
import glob
import json
import os
import sys
import time

import numpy as np
import tensorflow as tf

import tfe_estimator
from tfe_estimator.secure.kernels import ops

# The developer tools live in the checkout, not in the installed package: this script runs in a task's own
# directory, so it finds them from its own path.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from tools.bench.traffic import cross_device_bytes  # noqa: E402


#: With --update-ring-bits-32: a clipping bound these steps' gradients stay below (the twin does not clip).
CLIP_NORM = 64.0
HOOKS = []


class SlowSteps(tf.estimator.SessionRunHook):
    """Sleeps after every step, and writes how many steps this process ran to ./progress."""

    def __init__(self, seconds):
        self.seconds, self.steps = seconds, 0

    def after_run(self, run_context, run_values):
        self.steps += 1
        with open("progress", "w") as f:
            f.write(str(self.steps))
        time.sleep(self.seconds)


class Diverge(tf.estimator.SessionRunHook):
    """A planted divergence: after its first step, this owner adds 0.5 to its own copy of the bias."""

    def begin(self):
        bias = next(v for v in tf.compat.v1.global_variables() if v.name.startswith("linear/linear_model/bias"))
        self.bump = bias.assign_add([0.5])
        self.done = False

    def after_run(self, run_context, run_values):
        if not self.done:
            run_context.session.run(self.bump)
            self.done = True


class PartitionDevicesHook(tf.estimator.SessionRunHook):
    """Writes the devices of the first training step's partition graphs (./partition_devices.json) and
    the bytes this owner's graph moves to and from the servers per step (./traffic.json)."""

    def __init__(self):
        self.done = False

    def begin(self):
        # The bytes this owner's graph sends to the servers and receives from them per step.
        task = json.loads(os.environ["TF_CONFIG"])["task"]
        owner = [f"/job:{task['type']}/task:{task['index']}/device:CPU:0"]
        servers = [f"/job:tfe/task:{k}/device:CPU:0" for k in range(3)]
        graph = tf.compat.v1.get_default_graph()
        with open("traffic.json", "w") as f:
            json.dump({"up": cross_device_bytes(graph, owner, servers)[0],
                       "down": cross_device_bytes(graph, servers, owner)[0]}, f)

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
    if "--worker-extra-feature" in argv and task_type == "worker":
        x = np.column_stack([x, x[:, :1] ** 2])  # a planted mismatch: this owner's model has 3 weights

    def input_fn():
        return tf.data.Dataset.from_tensors(({"x": x}, y)).repeat()

    options = dict(update_ring_bits=32, clip_norm=CLIP_NORM) if "--update-ring-bits-32" in argv else {}
    for flag, value in zip(argv, argv[1:]):
        if flag == "--step-timeout-secs":
            options["step_timeout_secs"] = float(value)
        if flag == "--step-seconds":  # slow steps, so a test can kill a task mid-training
            HOOKS.append(SlowSteps(float(value)))
    if "--diverge-worker" in argv and json.loads(os.environ["TF_CONFIG"])["task"]["type"] == "worker":
        HOOKS.append(Diverge())
    config = tfe_estimator.TfeRunConfig(model_dir="model", tf_random_seed=7, save_checkpoints_steps=steps, **options)
    estimator = tf.compat.v1.estimator.LinearRegressor(
        feature_columns=[tf.feature_column.numeric_column("x", shape=[x.shape[1]])],
        optimizer=lambda: tf.compat.v1.train.GradientDescentOptimizer(learning_rate),
        loss_reduction=tf.compat.v1.losses.Reduction.SUM_OVER_BATCH_SIZE, config=config)
    tf.estimator.train_and_evaluate(
        estimator, tf.estimator.TrainSpec(input_fn, max_steps=steps, hooks=[PartitionDevicesHook()] + HOOKS),
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
