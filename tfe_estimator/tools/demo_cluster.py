"""The main job on a loopback cluster: each data owner reads only its own files.

`run_cluster_demo` splits scikit-learn's diabetes data between the owners
(the chief and each worker), writes each share into that owner's own
directory as ``data/train.csv`` and the test set into the evaluator's, and
launches the cluster twice with `tfe_estimator.cluster.launcher.Launcher`: once with
`TfeRunConfig` (secure aggregation on the ``tfe`` tasks) and once with the
plaintext in-graph twin (`MirroredStrategy` with `ReductionToOneDevice` over
the same devices). Every task runs ``python -m tfe_estimator.tools.demo_cluster``
(`main` below) in its own directory, so the one relative pattern
``data/train.csv`` names different files in different processes.

Example::

    $ tfe-estimator demo --cluster        # or: make demo-cluster
"""
import argparse
import gc
import os
import sys
import tempfile
import time
from typing import Dict, Optional, Sequence, TextIO, Tuple

import numpy as np
import tensorflow as tf

from input_fns import csv_input_fn
from model_fns import keras_optimizers  # tf.keras.optimizers.legacy where Estimator needs it (TF >= 2.11)
from tfe_estimator.audit.party_audit import PartyAuditHook, assert_no_plaintext_on_servers
from tfe_estimator.cluster.spec import LAUNCH_PROTOCOL_ENV, TfeCluster
from tfe_estimator.tools.demo import load_diabetes_split
from tfe_estimator.cluster.launcher import Launcher
from tfe_estimator.distribute.run_config import TfeRunConfig, plaintext_twin_config

__all__ = ["COLUMNS", "AuditHook", "write_owner_data", "run_cluster_demo", "main"]

COLUMNS = ["age", "sex", "bmi", "bp", "s1", "s2", "s3", "s4", "s5", "s6", "target"]
TRAIN_FILE, TEST_FILE = "data/train.csv", "data/test.csv"


def write_owner_data(workdir: str, owners: Sequence[str], x_train, y_train, x_test, y_test) -> Dict[str, int]:
    """Writes one share of the training and of the test data into each owner's directory, all test data
    into the evaluator's.

    Each owner's test share is what it evaluates on in service mode (federated evaluation: the metrics of
    all shares); the evaluator task evaluates the chief's checkpoints on the whole test set.

    Returns:
      owner directory name -> number of training rows written there.
    """
    counts = {}
    for i, owner in enumerate(owners):
        rows = np.arange(i, len(x_train), len(owners))
        counts[owner] = _write_csv(os.path.join(workdir, owner, TRAIN_FILE), x_train[rows], y_train[rows])
        test_rows = np.arange(i, len(x_test), len(owners))
        _write_csv(os.path.join(workdir, owner, TEST_FILE), x_test[test_rows], y_test[test_rows])
    _write_csv(os.path.join(workdir, "evaluator-0", TEST_FILE), x_test, y_test)
    return counts


def _write_csv(path, x, y) -> int:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    np.savetxt(path, np.column_stack([x, y]), delimiter=",", fmt="%.8g")
    return len(x)


def run_cluster_demo(
    steps: int = 300, workers: int = 1, protocol: str = "pond",
    workdir: Optional[str] = None, out: TextIO = sys.stdout, isolate_tls: bool = False,
    data: Optional[Tuple] = None, task_args: Sequence[str] = (), audit: bool = False,
) -> Dict[str, Dict]:
    """Trains secure and plaintext twins on a loopback cluster; returns both results.

    With `isolate_tls`, every task runs in its own network namespace behind a mutual-TLS
    sidecar (`tfe-estimator launch --isolate --tls`; root, stunnel4, iptables).

    Args:
      steps: training steps of each run.
      workers: data owners besides the chief.
      protocol: the secure run's protocol ("pond" or "aby3").
      workdir: where the owners' directories, model directories and logs go (default: a new temporary one).
      out: where the one line per run (where its task logs are) goes.
      isolate_tls: see above.
      data: `(x_train, y_train, x_test, y_test, feature_names)` with the columns of `COLUMNS` (default:
        `load_diabetes_split()`); training row i goes to owner ``i % (workers + 1)`` (the chief first).
      task_args: more arguments for every task's `main` (e.g. ``["--save-checkpoints-steps", "50"]``).
      audit: the secure run's chief audits its graphs (`main`'s ``--audit``; the plaintext twin has no servers).

    Returns:
      ``{"secure": ..., "plaintext": ..., "feature_names": ..., "workdir": ...}``; each run's entry holds its
      learned weights, bias, test metrics, ``model_dir``, ``log_dir`` and the ``launcher`` that ran it (its
      tasks, all ended).

    Example::

        >>> results = run_cluster_demo(steps=30, workdir="/tmp/demo")  # doctest: +SKIP
        >>> results["secure"]["weights"] - results["plaintext"]["weights"]  # doctest: +SKIP
    """
    workdir = os.path.abspath(workdir or tempfile.mkdtemp(prefix="tfe-estimator-cluster-demo-"))
    x_train, y_train, x_test, y_test, names = load_diabetes_split() if data is None else data
    owners = ["chief-0"] + [f"worker-{i}" for i in range(workers)]
    write_owner_data(workdir, owners, x_train, y_train, x_test, y_test)
    results = {"feature_names": names, "workdir": workdir}
    for mode in ("secure", "plaintext"):
        model_dir = os.path.join(workdir, f"model-{mode}")
        log_dir = os.path.join(workdir, f"logs-{mode}")
        os.makedirs(log_dir, exist_ok=True)
        command = [sys.executable, "-m", "tfe_estimator.tools.demo_cluster", "--mode", mode,
                   "--model-dir", model_dir, "--steps", str(steps), *task_args]
        if audit and mode == "secure":
            command.append("--audit")
        out.write(f"{mode}: training on the cluster; task logs in {log_dir}/\n")
        out.flush()
        # Task output goes to one file per task and the launcher's own lines to launch.log,
        # so the comparison table is not buried; a failing task's last lines are shown.
        with open(os.path.join(log_dir, "launch.log"), "w", encoding="utf-8") as launch_log:
            launcher = Launcher(command, workers=workers, evaluator=True, protocol=protocol,
                                task_cwd=os.path.join(workdir, "{job}-{index}"), out=launch_log,
                                log_dir=log_dir, cluster_mode="in-graph", isolate=isolate_tls,
                                tls=isolate_tls)
            status = launcher.run()
        if status != 0:
            with open(os.path.join(log_dir, "launch.log"), encoding="utf-8") as launch_log:
                out.write("".join(launch_log.readlines()[-40:]))
            raise RuntimeError(f"the {mode} cluster run failed with status {status}; task logs are in {log_dir}")
        results[mode] = _read_result(model_dir, x_test, y_test)
        results[mode].update(model_dir=model_dir, log_dir=log_dir, launcher=launcher)
    return results


def _read_result(model_dir, x_test, y_test) -> Dict:
    checkpoint = tf.train.latest_checkpoint(model_dir)
    weights = np.array([tf.train.load_variable(checkpoint, f"linear/linear_model/{name}/weights")[0, 0]
                        for name in COLUMNS[:-1]])
    bias = float(tf.train.load_variable(checkpoint, "linear/linear_model/bias_weights")[0])
    predictions = x_test @ weights + bias
    mse = float(np.mean((predictions - y_test) ** 2))
    r2 = 1.0 - np.sum((y_test - predictions) ** 2) / np.sum((y_test - y_test.mean()) ** 2)
    eval_dir = os.path.join(model_dir, "eval")
    return {
        "weights": weights, "bias": bias, "test_mse": mse, "test_r2": float(r2), "train_seconds": float("nan"),
        "global_step": int(tf.train.load_variable(checkpoint, "global_step")),
        "eval_summaries": sorted(os.listdir(eval_dir)) if os.path.isdir(eval_dir) else [],
    }


def _parse_args(argv):
    parser = argparse.ArgumentParser(description="One task of the cluster demo (reads TF_CONFIG).")
    parser.add_argument("--mode", choices=["secure", "plaintext"], default="secure")
    parser.add_argument("--model-dir", required=True)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--learning-rate", type=float, default=0.05)
    parser.add_argument("--save-checkpoints-steps", type=int, default=100)
    parser.add_argument("--keep-checkpoint-max", type=int, default=5)
    parser.add_argument("--start-delay-secs", type=int, default=0, help="EvalSpec.start_delay_secs")
    parser.add_argument("--step-seconds", type=float, default=0.0,
                        help="sleep this long after each training step (fault tests: time to kill a task mid-training)")
    parser.add_argument("--audit", action="store_true",
                        help="audit the training graph (requested placement) and the partitioned graphs of "
                             "the first step on every task (what each tfe party really receives)")
    return parser.parse_args(argv)


class _SlowStepsHook(tf.compat.v1.train.SessionRunHook):
    """Sleeps after each step, so that a test can act between checkpoints."""

    def __init__(self, seconds):
        self._seconds = seconds

    def after_run(self, run_context, run_values):
        time.sleep(self._seconds)


class AuditHook(tf.compat.v1.train.SessionRunHook):
    """Runs `assert_no_plaintext_on_servers` on the finished training graph."""

    def begin(self):
        count = assert_no_plaintext_on_servers(tf.compat.v1.get_default_graph())
        if count == 0:
            raise RuntimeError("audit: the training graph places nothing on the tfe servers")
        print(f"audit: {count} ops on the tfe servers, none takes or produces a float tensor", flush=True)


def _config(args):
    kwargs = dict(model_dir=args.model_dir, tf_random_seed=0, save_checkpoints_steps=args.save_checkpoints_steps,
                  keep_checkpoint_max=args.keep_checkpoint_max)
    if args.mode == "secure":
        protocol = os.environ.get(LAUNCH_PROTOCOL_ENV, "pond")
        # In-graph: the chief trains every owner's replica and writes the one model_dir the evaluator reads.
        return TfeRunConfig(protocol=protocol, cluster_mode="in-graph", **kwargs)  # tfe_estimator
    cluster = TfeCluster.from_environment()
    devices = cluster.replica_devices() if not cluster.is_evaluator else ["/cpu:0"]
    return plaintext_twin_config(devices, **kwargs)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Runs this task's part of `tf.estimator.train_and_evaluate`."""
    args = _parse_args(argv)
    tf.compat.v1.logging.set_verbosity(tf.compat.v1.logging.INFO)
    features = COLUMNS[:-1]
    columns = [tf.feature_column.numeric_column(name) for name in features]
    est = tf.estimator.LinearRegressor(
        feature_columns=columns, config=_config(args),
        optimizer=lambda: keras_optimizers().SGD(args.learning_rate))
    # Relative paths: each owner's pipeline runs in its own process and directory.
    train = csv_input_fn(TRAIN_FILE, "target", args.batch_size, column_names=COLUMNS, seed=0)
    test = csv_input_fn(TEST_FILE, "target", 90, column_names=COLUMNS, num_epochs=1, shuffle=False)
    hooks = []
    if args.audit:
        # The requested placement of the whole graph, and the partitioned
        # graphs the first training step really ran on every task.
        hooks += [AuditHook(), PartyAuditHook(print_report=True)]
    if args.step_seconds > 0:
        hooks.append(_SlowStepsHook(args.step_seconds))
    tf.estimator.train_and_evaluate(
        est,
        tf.estimator.TrainSpec(train, max_steps=args.steps, hooks=hooks),
        tf.estimator.EvalSpec(test, steps=None, start_delay_secs=args.start_delay_secs, throttle_secs=1),
    )
    gc.collect()  # a plaintext MirroredStrategy's thread pool, before interpreter exit
    return 0


if __name__ == "__main__":
    sys.exit(main())
