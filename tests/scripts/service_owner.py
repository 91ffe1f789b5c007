"""One data owner of a service-mode test cluster: trains a LinearRegressor on ./data.csv into ./model.

Run by `tfe-estimator launch --cluster-mode service` in each owner's own directory
(tests/test_service_mode.py). Writes ./eval_metrics.json (the final, federated evaluation) and ./graph_audit.json: the devices of the training graph's ops
and, per contribution op (the only op that talks to the service), the ops its inputs come from.
Usage: service_owner.py STEPS LEARNING_RATE [--num-replicas L] [--step-timeout-secs S] [--step-seconds S]
                        [--second-model STEPS] [--learning-rate-in TASK_DIR LR] [--dp MULTIPLIER]
                        [--checkpoint-steps K]
--second-model: then trains a second, larger LinearRegressor (x and x**2) into ./model2 in the same launch, and a
  fresh copy of the first (the same model record) on other data (labels doubled) into ./model3.
--learning-rate-in: the owner running in directory TASK_DIR (e.g. worker-0) uses LR instead.
--checkpoint-steps: a checkpoint every K steps (default: only at the end, after step STEPS).
--dp: DP-SGD instead (model_fns.linear_regression with `DistributedDP(l2_norm_clip=1, MULTIPLIER)`, full
  batches of every owner's 64 rows: num_examples 128); --step-seconds then also writes, per process, how many
  answers of each channel were fresh releases and how many replays (./answers-<pid>.json).
"""
import json
import os
import sys
import time

import numpy as np
import tensorflow as tf

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # model_fns
import tfe_estimator  # noqa: E402  pylint: disable=wrong-import-position
from model_fns import linear_regression  # noqa: E402  pylint: disable=wrong-import-position
from tfe_estimator.owner.in_flight import TICKETS  # noqa: E402  pylint: disable=wrong-import-position
from tfe_estimator.service.client import live_clients  # noqa: E402  pylint: disable=wrong-import-position


def _answers_before(op):
    """The answer ops `op` runs after (its inputs' and control inputs' ancestors)."""
    seen, todo, found = set(), [op], set()
    while todo:
        current = todo.pop()
        for parent in [t.op for t in current.inputs] + list(current.control_inputs):
            if parent.name not in seen:
                seen.add(parent.name)
                todo.append(parent)
                if "service_answer" in parent.name:
                    found.add(parent.name)
    return found


class GraphAudit(tf.estimator.SessionRunHook):
    """Writes what the training graph holds: op devices, and the inputs of each service contribution and answer
    op (every numpy_function of the graph, by kind); at the end, the training's calls and sequential waves."""

    def begin(self):
        graph = tf.compat.v1.get_default_graph()
        functions = [op for op in graph.get_operations() if op.type in ("PyFunc", "EagerPyFunc")]
        kinds = {"contributions": [], "answers": [], "keys": [], "others": []}
        for op in functions:
            kind = ("contributions" if "service_contribute" in op.name else
                    "answers" if "service_answer" in op.name else
                    "keys" if "service_key" in op.name else "others")
            kinds[kind].append([f"{t.op.type}:{t.value_index}" for t in op.inputs])
        after_answers = [sorted(_answers_before(op)) for op in functions if "service_contribute" in op.name]
        with open("graph_audit.json", "w") as f:
            json.dump({"devices": sorted({op.device for op in graph.get_operations()}), **kinds,
                       "after_answers": after_answers}, f)
        self._totals, self._before = {"steps": 0, "calls": 0, "steps_alone": 0, "waves_alone": 0}, None

    @staticmethod
    def _counts():
        """(waves, the training's calls, the evaluations' calls) so far."""
        calls = {"train": 0, "eval": 0}
        for client in live_clients():
            for channel, counts in client.answers.items():
                calls["eval" if "/eval_" in channel else "train"] += sum(counts)
        return TICKETS.waves, calls["train"], calls["eval"]

    def before_run(self, run_context):
        self._before = self._counts()

    def after_run(self, run_context, run_values):
        # An evaluation may run inside a training step's hooks (after a checkpoint): waves only of steps without one.
        del run_context, run_values
        waves, train, evaluation = (a - b for a, b in zip(self._counts(), self._before))
        self._totals["steps"] += 1
        self._totals["calls"] += train
        if not evaluation:
            self._totals["steps_alone"] += 1
            self._totals["waves_alone"] += waves
        with open("training_calls.json", "w") as f:
            json.dump(self._totals, f)


class SlowSteps(tf.estimator.SessionRunHook):
    """Sleeps after every step and writes how many steps this process ran to ./progress."""

    def __init__(self, seconds):
        self.seconds, self.steps = seconds, 0

    def after_run(self, run_context, run_values):
        self.steps += 1
        with open("progress", "w") as f:
            f.write(str(self.steps))
        answers = {}  # per channel [fresh releases, replays] this process received (the service's answers)
        for client in live_clients():
            for channel, counts in client.answers.items():
                answers[channel] = [a + b for a, b in zip(answers.get(channel, [0, 0]), counts)]
        with open("answers.tmp", "w") as f:
            json.dump(answers, f)
        os.replace("answers.tmp", f"answers-{os.getpid()}.json")  # whole, even if the process is killed now
        time.sleep(self.seconds)


def main(argv):
    steps, learning_rate = int(argv[1]), float(argv[2])
    options, hooks, dp, checkpoint_steps = {}, [GraphAudit()], None, steps
    for flag, value in zip(argv, argv[1:]):
        if flag == "--step-seconds":  # slow steps, so a test can look at the processes mid-training
            hooks.append(SlowSteps(float(value)))
        if flag == "--step-timeout-secs":
            options["step_timeout_secs"] = float(value)
        if flag == "--checkpoint-steps":
            checkpoint_steps = int(value)
        if flag == "--num-replicas":
            options["num_replicas"] = int(value)
        if flag == "--second-model":
            options["second_model"] = int(value)
        if flag == "--dp":
            dp = tfe_estimator.DistributedDP(l2_norm_clip=1.0, noise_multiplier=float(value), num_examples=128)
        if flag == "--learning-rate-in" and os.path.basename(os.getcwd()) == value:
            learning_rate = float(argv[argv.index(flag) + 2])
    second = options.pop("second_model", None)
    data = np.loadtxt("data.csv", delimiter=",", dtype=np.float32)  # this owner's file only
    x, y = data[:, :-1], data[:, -1:]
    replicas = options.get("num_replicas", 1)

    def input_fn():  # each local replica gets its own part of this owner's rows
        # Under DP the batches' size is static (DP-SGD in service mode refuses unknown sizes without
        # expected_batch_size: the sum of the sizes would cross the owners un-noised).
        dataset = tf.data.Dataset.from_tensor_slices(({"x": x}, y)).batch(len(x) // replicas,
                                                                            drop_remainder=dp is not None)
        return dataset.take(replicas).repeat() if replicas > 1 else dataset.repeat()

    config = tfe_estimator.TfeRunConfig(model_dir="model", tf_random_seed=7, save_checkpoints_steps=checkpoint_steps,
                                        dp=dp, **options)
    columns = [tf.feature_column.numeric_column("x", shape=[x.shape[1]])]
    if dp is not None:  # DP-SGD: the model_fns' DP path (per-example clipping, each owner's noise in the sum)
        estimator = tf.estimator.Estimator(linear_regression.model_fn, config=config, params={
            "feature_columns": columns, "optimizer": "sgd", "learning_rate": learning_rate})
    else:
        estimator = tf.compat.v1.estimator.LinearRegressor(
            feature_columns=columns, optimizer=lambda: tf.compat.v1.train.GradientDescentOptimizer(learning_rate),
            loss_reduction=tf.compat.v1.losses.Reduction.SUM_OVER_BATCH_SIZE, config=config)
    metrics, _ = tf.estimator.train_and_evaluate(
        estimator, tf.estimator.TrainSpec(input_fn, max_steps=steps, hooks=hooks),
        tf.estimator.EvalSpec(input_fn, steps=1, throttle_secs=0, start_delay_secs=0,  # under DP: own metrics line
                              exporters=[tfe_estimator.LocalMetricsExporter(input_fn, steps=1)] if dp else []))
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
        # A fresh copy of the first model (an identical model record) on other data: its own training run, so
        # its own channels (the servers' window still holds the first model's steps).
        copy = tf.compat.v1.estimator.LinearRegressor(
            feature_columns=columns, optimizer=lambda: tf.compat.v1.train.GradientDescentOptimizer(learning_rate),
            loss_reduction=tf.compat.v1.losses.Reduction.SUM_OVER_BATCH_SIZE,
            config=tfe_estimator.TfeRunConfig(model_dir="model3", tf_random_seed=7, **options))
        copy.train(lambda: tf.data.Dataset.from_tensor_slices(({"x": x}, 2 * y)).batch(len(x)).repeat(),
                   max_steps=second)
        print("copy of the first model finished at step", copy.get_variable_value("global_step"))


if __name__ == "__main__":
    main(sys.argv)
