"""Service mode's checkpoints of a model with on-read variables (batch normalization), in the owner's graph.

The checkpoint saver reads each on-read variable (a batch normalization's moving
mean and variance) as a sum across owners (`saver`). That run must do
nothing else: no batch-norm update, no input read, no contribution of the
training step (issue 41: a save ran them, before the input's initializer:
``GetNext() failed because the iterator has not been initialized``). The graph
is built under a `ServiceStrategy` whose servers are never called (training
stops in a hook's ``begin``, before any session); the end-to-end run is
tests/test_tutorials.py's service-mode test.
"""
import numpy as np
import pytest
import tensorflow as tf

from test_tutorials import batch_norm_input_fn, batch_norm_model_fn
from tfe_estimator.owner.estimator import EstimatorServiceStrategy
from tfe_estimator.owner.service_strategy import ServiceBinding
from tfe_estimator.owner.contribution import ANSWER_OP_NAME, CONTRIBUTE_OP_NAME, ancestors

pytestmark = pytest.mark.slow

BINDING = ServiceBinding(addresses=("127.0.0.1:1", "127.0.0.1:2"), tls_dir="/nonexistent", owner="chief:0",
                         owners=("chief:0", "worker:0"))


def keras_batch_norm_model_fn(features, labels, mode):
    """`batch_norm_model_fn` with Keras layers (their moving-statistics updates in the layer's ``updates``)."""
    inputs = tf.stack([features["age"] / 80.0, features["fare"] / 50.0], axis=1)
    norm = tf.keras.layers.BatchNormalization()
    hidden = norm(tf.keras.layers.Dense(4)(inputs), training=mode == tf.estimator.ModeKeys.TRAIN)
    prediction = tf.keras.layers.Dense(1)(tf.nn.relu(hidden))
    loss = tf.compat.v1.losses.mean_squared_error(tf.cast(tf.reshape(labels, [-1, 1]), tf.float32), prediction)
    with tf.control_dependencies(norm.updates):
        train_op = tf.compat.v1.train.GradientDescentOptimizer(0.2).minimize(
            loss, global_step=tf.compat.v1.train.get_global_step())
    return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)


class _Built(Exception):
    """Stops training once the graph is built (no session, no server)."""


class _SaverGraph(tf.estimator.SessionRunHook):
    """Builds the checkpoint saver Estimator made (as the session's scaffold would), records what its save op
    runs and which hooks the training has, then stops."""

    def __init__(self):
        self.save_runs, self.step_contributions = None, None

    def begin(self):
        graph = tf.compat.v1.get_default_graph()
        saver = tf.compat.v1.get_collection(tf.compat.v1.GraphKeys.SAVERS)[0]
        training_ops = set(graph.get_operations())
        saver.build()
        save = graph.get_tensor_by_name(saver.saver_def.save_tensor_name).op
        self.save_runs = ancestors(save)
        self.step_contributions = {op for op in training_ops if CONTRIBUTE_OP_NAME in op.name}
        raise _Built()


def _train(tmp_path, hooks, listeners=(), model_fn=batch_norm_model_fn, **config):
    rng = np.random.RandomState(0)
    frame = ({"age": rng.uniform(1, 80, 64).astype(np.float32), "fare": rng.uniform(1, 90, 64).astype(np.float32)},
             rng.randint(0, 2, 64))
    run_config = tf.estimator.RunConfig(model_dir=str(tmp_path), train_distribute=EstimatorServiceStrategy(BINDING),
                                        tf_random_seed=7, **config)
    estimator = tf.estimator.Estimator(model_fn, config=run_config)
    estimator.train(lambda: batch_norm_input_fn(frame), max_steps=2, hooks=hooks, saving_listeners=list(listeners))


@pytest.mark.parametrize("model_fn", [batch_norm_model_fn, keras_batch_norm_model_fn], ids=["v1_layers", "keras"])
def test_a_checkpoint_save_sums_the_moving_statistics_and_runs_nothing_of_the_training_step(model_fn, tmp_path):
    hook = _SaverGraph()
    with pytest.raises(_Built):
        _train(tmp_path, [hook], model_fn=model_fn, save_checkpoints_steps=1, save_checkpoints_secs=None)
    types = {op.type for op in hook.save_runs}
    # The moving statistics go through the service (their checkpointed value is the mean over every owner).
    assert any(CONTRIBUTE_OP_NAME in op.name for op in hook.save_runs)
    assert any(ANSWER_OP_NAME in op.name for op in hook.save_runs)
    # ... and nothing of the step: no input read, no batch-norm update, no gradient or loss contribution.
    assert not types & {"IteratorGetNext", "MultiDeviceIteratorGetNextFromShard", "AssignSubVariableOp"}, types
    assert hook.step_contributions and not hook.save_runs & hook.step_contributions


def test_time_based_checkpoints_of_a_model_with_moving_statistics_are_refused_before_the_first_step(tmp_path):
    with pytest.raises(ValueError, match=r"batch_normalization/moving_mean.*save_checkpoints_secs=600.*"
                                         r"save_checkpoints_steps=N"):
        _train(tmp_path, [], save_checkpoints_secs=600)


def test_the_checkpoint_saver_runs_after_the_owners_handshake_and_the_input_initializer(tmp_path, monkeypatch):
    from tensorflow_estimator.python.estimator import estimator as estimator_lib  # pylint: disable=import-outside-toplevel

    from tfe_estimator.owner.estimator import ServiceHandshakeHook  # pylint: disable=import-outside-toplevel

    seen = {}

    def session(**kwargs):  # MonitoredTrainingSession: chief-only hooks first, then the others
        seen["hooks"] = [*kwargs["chief_only_hooks"], *kwargs["hooks"]]
        raise _Built()

    monkeypatch.setattr(estimator_lib.training, "MonitoredTrainingSession", session)
    listener = tf.compat.v1.train.CheckpointSaverListener()
    with pytest.raises(_Built):
        _train(tmp_path, [], [listener], save_checkpoints_steps=3, save_checkpoints_secs=None)
    kinds = [type(h).__name__ for h in seen["hooks"]]
    savers = [i for i, h in enumerate(seen["hooks"]) if isinstance(h, tf.compat.v1.train.CheckpointSaverHook)]
    handshake = next(i for i, h in enumerate(seen["hooks"]) if isinstance(h, ServiceHandshakeHook))
    initializer = kinds.index("DistributedIteratorInitializerHook")
    assert len(savers) == 1 and savers[0] > max(handshake, initializer), kinds
    # It is Estimator's (the RunConfig's schedule, the saving listeners: train_and_evaluate's evaluations).
    saver = seen["hooks"][savers[0]]
    assert saver._timer._every_steps == 3 and saver._listeners == [listener]  # pylint: disable=protected-access
