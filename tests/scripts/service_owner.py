"""One data owner of a service-mode test cluster: trains a LinearRegressor on ./data.csv into ./model.

Run by `tfe-estimator launch --cluster-mode service` in each owner's own directory
(tests/test_service_mode.py). Writes ./eval_metrics.json (the final, federated evaluation) and ./graph_audit.json: the devices of the training graph's ops
and, per contribution op (the only op that talks to the service), the ops its inputs come from.
Usage: service_owner.py STEPS LEARNING_RATE [--num-replicas L] [--step-timeout-secs S] [--step-seconds S]
                        [--second-model STEPS] [--learning-rate-in TASK_DIR LR]
--second-model: then trains a second, larger LinearRegressor (x and x**2) into ./model2 in the same launch.
--learning-rate-in: the owner running in directory TASK_DIR (e.g. worker-0) uses LR instead.
"""
import json
import os
import sys
import time

import numpy as np
import tensorflow as tf

import tfe_estimator


class GraphAudit(tf.estimator.SessionRunHook):
    """Writes what the training graph holds: op devices, and the inputs of each service contribution."""

    def begin(self):
        graph = tf.compat.v1.get_default_graph()
        contributions = [op for op in graph.get_operations() if op.type in ("PyFunc", "EagerPyFunc")]
        with open("graph_audit.json", "w") as f:
            json.dump({"devices": sorted({op.device for op in graph.get_operations()}),
                       "contributions": [[f"{t.op.type}:{t.value_index}" for t in op.inputs]
                                         for op in contributions]}, f)


class SlowSteps(tf.estimator.SessionRunHook):
    """Sleeps after every step and writes how many steps this process ran to ./progress."""

    def __init__(self, seconds):
        self.seconds, self.steps = seconds, 0

    def after_run(self, run_context, run_values):
        self.steps += 1
        with open("progress", "w") as f:
            f.write(str(self.steps))
        time.sleep(self.seconds)


def main(argv):
    steps, learning_rate = int(argv[1]), float(argv[2])
    options, hooks = {}, [GraphAudit()]
    for flag, value in zip(argv, argv[1:]):
        if flag == "--step-seconds":  # slow steps, so a test can look at the processes mid-training
            hooks.append(SlowSteps(float(value)))
        if flag == "--step-timeout-secs":
            options["step_timeout_secs"] = float(value)
        if flag == "--num-replicas":
            options["num_replicas"] = int(value)
        if flag == "--second-model":
            options["second_model"] = int(value)
        if flag == "--learning-rate-in" and os.path.basename(os.getcwd()) == value:
            learning_rate = float(argv[argv.index(flag) + 2])
    second = options.pop("second_model", None)
    data = np.loadtxt("data.csv", delimiter=",", dtype=np.float32)  # this owner's file only
    x, y = data[:, :-1], data[:, -1:]
    replicas = options.get("num_replicas", 1)

    def input_fn():  # each local replica gets its own part of this owner's rows
        dataset = tf.data.Dataset.from_tensor_slices(({"x": x}, y)).batch(len(x) // replicas)
        return dataset.take(replicas).repeat() if replicas > 1 else dataset.repeat()

    config = tfe_estimator.TfeRunConfig(model_dir="model", tf_random_seed=7, save_checkpoints_steps=steps, **options)
    estimator = tf.compat.v1.estimator.LinearRegressor(
        feature_columns=[tf.feature_column.numeric_column("x", shape=[x.shape[1]])],
        optimizer=lambda: tf.compat.v1.train.GradientDescentOptimizer(learning_rate),
        loss_reduction=tf.compat.v1.losses.Reduction.SUM_OVER_BATCH_SIZE, config=config)
    metrics, _ = tf.estimator.train_and_evaluate(
        estimator, tf.estimator.TrainSpec(input_fn, max_steps=steps, hooks=hooks),
        tf.estimator.EvalSpec(input_fn, steps=1, throttle_secs=0, start_delay_secs=0))
    with open("eval_metrics.json", "w") as f:  # federated: the metrics of every owner's evaluation data
        json.dump({k: float(v) for k, v in metrics.items()}, f)
    print("owner finished at step", estimator.get_variable_value("global_step"))
    if second:  # a second model in the same launch: its own channels and handshake (its model id)
        squares = np.concatenate([x, x * x], axis=1)
        second_estimator = tf.compat.v1.estimator.LinearRegressor(
            feature_columns=[tf.feature_column.numeric_column("x", shape=[squares.shape[1]])],
            optimizer=lambda: tf.compat.v1.train.GradientDescentOptimizer(learning_rate / 10),
            loss_reduction=tf.compat.v1.losses.Reduction.SUM_OVER_BATCH_SIZE,
            config=tfe_estimator.TfeRunConfig(model_dir="model2", tf_random_seed=7, **options))
        second_estimator.train(lambda: tf.data.Dataset.from_tensor_slices(({"x": squares}, y)).batch(len(x)).repeat(),
                               max_steps=second)
        print("second model finished at step", second_estimator.get_variable_value("global_step"))


if __name__ == "__main__":
    main(sys.argv)
