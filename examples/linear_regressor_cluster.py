"""The canned LinearRegressor on a cluster, each data owner reading its own files.

This is the `train.py` that every chief, worker and evaluator task runs; the
`tfe` tasks run `tfe-estimator server`. Each task runs in its own directory,
where the owner's rows are in ``data/train.csv`` and ``data/test.csv`` (the
evaluator's: the whole test set), with the columns of `COLUMNS` and no header.
On one machine, try it with the loopback launcher (service mode, the default:
each owner trains alone, keeps its own checkpoints and evaluates its own test
rows, the metrics summed over all owners; the evaluator evaluates the chief's
checkpoints on the whole test set)::

    python -c "from tfe_estimator.tools.demo_cluster import *; from tfe_estimator.tools.demo import *; \
        write_owner_data('owners', ['chief-0', 'worker-0'], *load_diabetes_split()[:4])"
    tfe-estimator launch --workers 1 --evaluator --task-cwd 'owners/{job}-{index}' -- \
        python $PWD/examples/linear_regressor_cluster.py

Without ``--model-dir`` each owner checkpoints into the directory the launcher
gives it (``owners/chief-0/model``, ``owners/worker-0/model``), and the
evaluator, which belongs to the chief's organisation, reads the chief's.

Lines specific to tfe_estimator are marked `# tfe_estimator:`.
"""
import argparse
import os

import tensorflow as tf

import input_fns
import tfe_estimator
from model_fns import keras_optimizers  # tf.keras.optimizers.legacy where Estimator needs it (TF >= 2.11)

COLUMNS = ["age", "sex", "bmi", "bp", "s1", "s2", "s3", "s4", "s5", "s6", "target"]


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model-dir", default=None,
                        help="this owner's own directory (default: the one `tfe-estimator launch` gives each owner; "
                        "the evaluator reads its owner's)")
    parser.add_argument("--steps", type=int, default=300, help="training steps")
    return parser.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    config = tfe_estimator.TfeRunConfig(  # tfe_estimator: reads TF_CONFIG (chief/worker/evaluator + tfe job)
        model_dir=args.model_dir, protocol=os.environ.get("TFE_ESTIMATOR_PROTOCOL", "pond"),
        save_checkpoints_steps=100)
    est = tf.estimator.LinearRegressor(
        feature_columns=[tf.feature_column.numeric_column(name) for name in COLUMNS[:-1]],
        optimizer=lambda: keras_optimizers().SGD(0.05), config=config)
    # Relative paths, read by dataset ops in each owner's own process.
    train = input_fns.csv_input_fn("data/train.csv", "target", 32, column_names=COLUMNS)
    test = input_fns.csv_input_fn("data/test.csv", "target", 90, column_names=COLUMNS, num_epochs=1, shuffle=False)
    tf.estimator.train_and_evaluate(
        est, tf.estimator.TrainSpec(train, max_steps=args.steps),
        # Every owner evaluates the same checkpoints (throttle_secs=0): in service mode the metrics are summed
        # over every owner's own test rows (federated evaluation).
        tf.estimator.EvalSpec(test, steps=None, start_delay_secs=0, throttle_secs=0))
    return 0


if __name__ == "__main__":
    tf.compat.v1.logging.set_verbosity(tf.compat.v1.logging.INFO)
    raise SystemExit(main())
