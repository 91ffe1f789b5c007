"""One data owner of a between-graph test cluster that audits its own training steps (PartyAuditHook).

Run by `tfe-estimator launch` in each owner's own directory (tests/test_between_graph_audit.py); prints
"audit passed: <report>" after training, or exits non-zero with the PartyAuditError.
Usage: between_graph_audit_owner.py STEPS [--plant-foreign-channel]
"""
import sys

import numpy as np
import tensorflow as tf

import tfe_estimator


def main(argv):
    steps = int(argv[1])
    if "--plant-foreign-channel" in argv:  # a planted leak: the servers' resources under another name scheme
        from tfe_estimator.audit import step_channels  # noqa: F401  the audit keeps step_sum's own scheme
        from tfe_estimator.distribute import step_sum
        step_sum.SHARED_NAME_PREFIX = "foreign_channel"
    data = np.loadtxt("data.csv", delimiter=",", dtype=np.float32)  # this owner's file only
    x, y = data[:, :-1], data[:, -1:]

    def input_fn():
        return tf.data.Dataset.from_tensors(({"x": x}, y)).repeat()

    config = tfe_estimator.TfeRunConfig(model_dir="model", tf_random_seed=7, save_checkpoints_steps=steps)
    estimator = tf.compat.v1.estimator.LinearRegressor(
        feature_columns=[tf.feature_column.numeric_column("x", shape=[x.shape[1]])],
        optimizer=lambda: tf.compat.v1.train.GradientDescentOptimizer(0.1),
        loss_reduction=tf.compat.v1.losses.Reduction.SUM_OVER_BATCH_SIZE, config=config)
    hook = tfe_estimator.PartyAuditHook(steps=2)
    tf.estimator.train_and_evaluate(estimator, tf.estimator.TrainSpec(input_fn, max_steps=steps, hooks=[hook]),
                                    tf.estimator.EvalSpec(input_fn, steps=1))
    assert hook.audited_runs == 2, hook.audited_runs
    print("audit passed:", hook.report, flush=True)


if __name__ == "__main__":
    main(sys.argv)
