"""Estimators trained with TfeRunConfig against their plaintext twin, step for step.

The twin (`tfe_estimator.plaintext_twin_config`) is `MirroredStrategy` with
`ReductionToOneDevice` on the same replica devices, the same seed and the same
input, so both start from the same variables and see the same batches. After a
few steps their variables must agree to 1e-6: the secure sum is exact in the
ring (encoding truncates at 2**-32 per value) and is rounded once to float32,
where the twin rounds each float32 addition, so they differ by float32
rounding only. A factor-2 bug, a dropped replica or a stale update moves the
variables by the size of a step (asserted to be > 1e-2), far beyond 1e-6.
"""
import numpy as np
import pytest
import tensorflow as tf

import tfe_estimator
from model_fns import keras_optimizers
from tfe_estimator.distribute import aggregation
from tfe_estimator.secure.protocols import supported_combinations

pytestmark = pytest.mark.slow

DEVICES = [f"/job:localhost/replica:0/task:0/device:CPU:{i}" for i in range(3)]
STEPS = 4
TOL = 1e-6
MOVED = 1e-2  # every model's variables move by more than this in STEPS steps
COLS = [tf.feature_column.numeric_column("x", shape=[3])]
# Pond and ABY3 at "low", Pond at "high" (ABY3 at "high" where the stack has it: TF 2.9).
SETTINGS = [s for s in [("pond", "low"), ("aby3", "low"), ("pond", "high"), ("aby3", "high")]
            if s in supported_combinations()]


def _input_fn(features, y, batch=32, repeat=True):
    def input_fn():
        dataset = tf.data.Dataset.from_tensor_slices((features, y))
        return (dataset.repeat() if repeat else dataset).batch(batch)

    return input_fn


def _secure_config(model_dir, protocol="pond", precision="low", num_replicas=2):
    return tfe_estimator.TfeRunConfig(model_dir=model_dir, protocol=protocol, precision=precision,
                                      num_replicas=num_replicas, tf_random_seed=7)


def _plain_config(model_dir, num_replicas=2):
    return tfe_estimator.plaintext_twin_config(DEVICES[:num_replicas], model_dir=model_dir, tf_random_seed=7)


def _variables(est):
    return {n: est.get_variable_value(n) for n in est.get_variable_names()}


def _assert_twins(secure_vars, plain_vars, steps=STEPS):
    assert secure_vars.keys() == plain_vars.keys()
    for name in secure_vars:
        np.testing.assert_allclose(secure_vars[name], plain_vars[name], rtol=TOL, atol=TOL, err_msg=name)
    assert secure_vars["global_step"] == steps


# ---------------------------------------------------------------- canned estimators

def _linear(config):
    return tf.estimator.LinearRegressor(feature_columns=COLS, config=config,
                                        optimizer=lambda: keras_optimizers().SGD(0.05))


def _dnn_regressor(config):
    return tf.estimator.DNNRegressor(hidden_units=[8, 4], feature_columns=COLS, config=config,
                                     optimizer=lambda: keras_optimizers().SGD(0.05))


def _dnn_classifier(config):
    return tf.estimator.DNNClassifier(hidden_units=[8], feature_columns=COLS, n_classes=3, config=config,
                                      optimizer=lambda: keras_optimizers().Adagrad(0.1))


CANNED = {"LinearRegressor": _linear, "DNNRegressor": _dnn_regressor, "DNNClassifier": _dnn_classifier}
_PLAIN_CACHE = {}


def _canned_data(name, linear_data):
    x, y, _ = linear_data
    if name == "DNNClassifier":
        y = np.digitize(y, [-1.0, 1.0]).astype(np.int64)  # 3 classes
    return _input_fn({"x": x}, y)


def _plain_variables(name, linear_data, tmp_path_factory):
    """The twin's variables after 1 and after STEPS steps (trained once per model)."""
    if name not in _PLAIN_CACHE:
        est = CANNED[name](_plain_config(str(tmp_path_factory.mktemp(f"plain-{name}"))))
        est.train(_canned_data(name, linear_data), steps=1)
        after_one = _variables(est)
        est.train(_canned_data(name, linear_data), steps=STEPS - 1)
        _PLAIN_CACHE[name] = (after_one, _variables(est))
    return _PLAIN_CACHE[name]


def _assert_moved(after_one, after_all):
    """Training moved the weights by far more than TOL after the first step."""
    moved = max(float(np.max(np.abs(after_all[n] - after_one[n]))) for n in after_all if n != "global_step")
    assert moved > MOVED, moved


@pytest.mark.parametrize("protocol, precision", SETTINGS, ids=[f"{p}-{q}" for p, q in SETTINGS])
@pytest.mark.parametrize("name", sorted(CANNED))
def test_canned_estimator_matches_its_plaintext_twin_step_for_step(name, protocol, precision, tmp_path,
                                                                   tmp_path_factory, linear_data):
    # Prepare
    plain_one, plain_all = _plain_variables(name, linear_data, tmp_path_factory)
    secure = CANNED[name](_secure_config(str(tmp_path), protocol, precision))
    # Execute
    secure.train(_canned_data(name, linear_data), steps=1)
    secure_one = _variables(secure)
    secure.train(_canned_data(name, linear_data), steps=STEPS - 1)
    # Assert: after one step and after STEPS, the same variables as the twin, which moved.
    _assert_twins(secure_one, plain_one, steps=1)
    _assert_twins(_variables(secure), plain_all)
    _assert_moved(plain_one, plain_all)


def test_a_factor_of_two_in_the_secure_sum_fails_the_twin_comparison(monkeypatch, tmp_path, tmp_path_factory,
                                                                     linear_data):
    # Mutation: the tolerance is tight enough to catch a doubled sum.
    from tfe_estimator.secure import fused_sum  # pylint: disable=import-outside-toplevel

    real = fused_sum.pond_sum
    monkeypatch.setattr(fused_sum, "pond_sum", lambda *a, **k: [[2 * t for t in parts] for parts in real(*a, **k)])
    secure = _linear(_secure_config(str(tmp_path)))
    secure.train(_canned_data("LinearRegressor", linear_data), steps=STEPS)
    with pytest.raises(AssertionError):
        _assert_twins(_variables(secure), _plain_variables("LinearRegressor", linear_data, tmp_path_factory)[1])


# ---------------------------------------------------------------- MEAN over 3 replicas

def _mean_model_fn(features, labels, mode, params):
    """Linear regression whose update is a MEAN: `assign_sub` on MEAN-aggregated variables.

    In a replica context, assigning a per-replica value to a mirrored variable
    reduces it with the variable's aggregation, here
    `strategy.extended.reduce_to(MEAN, ...)`: the secure MEAN.
    """
    del params
    mean = tf.VariableAggregation.MEAN
    w = tf.compat.v1.get_variable("w", [3, 1], initializer=tf.compat.v1.zeros_initializer(), aggregation=mean)
    b = tf.compat.v1.get_variable("b", [1], initializer=tf.compat.v1.zeros_initializer(), aggregation=mean)
    predictions = tf.matmul(features["x"], w) + b
    loss = tf.reduce_mean(tf.square(predictions[:, 0] - labels))
    grad_w, grad_b = tf.gradients(loss, [w, b])
    train_op = tf.group(w.assign_sub(0.1 * grad_w), b.assign_sub(0.1 * grad_b),
                        tf.compat.v1.assign_add(tf.compat.v1.train.get_global_step(), 1))
    return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)


def test_mean_over_three_replicas_matches_its_plaintext_twin(tmp_path, linear_data):
    x, y, _ = linear_data
    input_fn = _input_fn({"x": x}, y, batch=30)  # 10 examples per replica, different on each
    results = []
    for config in (_secure_config(str(tmp_path / "secure"), num_replicas=3),
                   _plain_config(str(tmp_path / "plain"), num_replicas=3)):
        est = tf.estimator.Estimator(_mean_model_fn, config=config)
        est.train(input_fn, steps=1)
        one = _variables(est)
        est.train(input_fn, steps=STEPS - 1)
        results.append((one, _variables(est)))
    (secure_one, secure_all), (plain_one, plain_all) = results
    _assert_twins(secure_one, plain_one, steps=1)
    _assert_twins(secure_all, plain_all)
    _assert_moved(plain_one, plain_all)


# ---------------------------------------------------------------- IndexedSlices

def test_embedding_gradients_as_indexed_slices_through_a_real_optimizer(monkeypatch, tmp_path):
    # An embedding column's gradient is an IndexedSlices; SecureAggregation sums it dense
    # (its indices would reveal which rows a replica's batch touched).
    seen = []
    real = aggregation._densify  # pylint: disable=protected-access

    def spy(value):
        seen.append(isinstance(value, tf.IndexedSlices))
        return real(value)

    monkeypatch.setattr(aggregation, "_densify", spy)
    rng = np.random.RandomState(0)
    ids = rng.randint(0, 20, size=(256, 1)).astype(np.int64)
    y = (np.sin(ids[:, 0]) + 0.1 * ids[:, 0]).astype(np.float32)
    column = tf.feature_column.embedding_column(
        tf.feature_column.categorical_column_with_identity("id", num_buckets=20), dimension=4)

    def make(config):
        return tf.estimator.DNNRegressor(hidden_units=[4], feature_columns=[column], config=config,
                                         optimizer=lambda: keras_optimizers().SGD(0.1))

    input_fn = _input_fn({"id": ids}, y)
    results = []
    for config in (_secure_config(str(tmp_path / "secure")), _plain_config(str(tmp_path / "plain"))):
        est = make(config)
        est.train(input_fn, steps=1)
        one = _variables(est)
        est.train(input_fn, steps=STEPS - 1)
        results.append((one, _variables(est)))
    assert any(seen), "no IndexedSlices reached SecureAggregation"
    (secure_one, secure_all), (plain_one, plain_all) = results
    _assert_twins(secure_one, plain_one, steps=1)
    _assert_twins(secure_all, plain_all)
    _assert_moved(plain_one, plain_all)


# ---------------------------------------------------------------- the audit in training

@pytest.mark.parametrize("protocol", ["pond", "aby3"])
def test_the_training_step_passes_the_party_audit(protocol, tmp_path, linear_data):
    x, y, _ = linear_data
    config = _secure_config(str(tmp_path), protocol)
    servers = config.train_distribute.extended._cross_device_ops.server_devices  # pylint: disable=protected-access
    hook = tfe_estimator.PartyAuditHook(servers, steps=2)
    _linear(config).train(_input_fn({"x": x}, y), steps=3, hooks=[hook])
    assert hook.audited_runs == 2
    assert hook.report.party_ops > 0 and hook.report.edges
    # The parties receive only masked shares and seeds of the replicas' values, and (fused Pond)
    # server1 receives server0's blinded part.
    assert {e.producer_type for e in hook.report.edges} <= {"TfeMaskShare", "TfeAesSeed", "Sub", "TfeServerSum"}


# ---------------------------------------------------------------- refusals and checkpoints

def test_nan_in_the_data_fails_loudly(tmp_path, linear_data):
    x, y, _ = linear_data
    y = y.copy()
    y[5] = np.nan
    est = _linear(_secure_config(str(tmp_path)))
    with pytest.raises(tf.errors.InvalidArgumentError, match="NaN or infinite"):
        est.train(_input_fn({"x": x}, y), steps=3)


def test_huge_features_are_refused_without_the_value(tmp_path, linear_data):
    x, y, _ = linear_data
    est = _linear(_secure_config(str(tmp_path)))
    with pytest.raises(tf.errors.InvalidArgumentError, match="not below the fixed-point limit") as error:
        est.train(_input_fn({"x": x * 1e7}, y), steps=3)
    # The message reaches the chief: it names the replica and the limit, no value of the data.
    assert "replica 0" in error.value.message or "replica 1" in error.value.message
    assert "largest" not in error.value.message


def test_checkpoints_move_between_secure_and_plain_configs(tmp_path, linear_data):
    x, y, _ = linear_data
    model_dir = str(tmp_path)
    input_fn, eval_fn = _input_fn({"x": x}, y), _input_fn({"x": x}, y, batch=128, repeat=False)
    secure = _linear(_secure_config(model_dir))
    secure.train(input_fn, steps=10)
    s_eval = secure.evaluate(eval_fn)
    plain = _linear(tf.estimator.RunConfig(model_dir=model_dir))
    p_eval = plain.evaluate(eval_fn)
    assert p_eval["global_step"] == s_eval["global_step"] == 10
    np.testing.assert_allclose(p_eval["average_loss"], s_eval["average_loss"], rtol=1e-5)
    plain.train(input_fn, steps=5)
    secure.train(input_fn, steps=5)  # and back: the secure config continues from the plain checkpoint
    final = secure.evaluate(eval_fn)
    assert final["global_step"] == 20
    assert final["average_loss"] < s_eval["average_loss"]


# ---------------------------------------------------------------- what TensorBoard shows

def _first_event_loss(model_dir):
    """The first value TensorBoard would show as `loss`."""
    for path in tf.io.gfile.glob(f"{model_dir}/events.out.tfevents.*"):
        for event in tf.compat.v1.train.summary_iterator(path):
            for value in event.summary.value:
                if value.tag == "loss":
                    return value.simple_value
    raise AssertionError(f"no loss summary in {model_dir}")


def test_the_loss_written_for_tensorboard_is_the_secure_sum_not_replica_0s(tmp_path, linear_data):
    # Prepare: the linear model starts at zero, so each replica's first loss is the mean of y**2
    # over its own batch of 32 (replica 0 rows 0-31, replica 1 rows 32-63).
    x, y, _ = linear_data
    config = _secure_config(str(tmp_path)).replace(save_summary_steps=1)
    # Execute
    _linear(config).train(_input_fn({"x": x}, y, repeat=False), steps=1)
    # Assert: Estimator's reported (summed) loss, not the head's summary of replica 0's batch.
    replica0, replica1 = float(np.mean(y[:32] ** 2)), float(np.mean(y[32:64] ** 2))
    assert _first_event_loss(str(tmp_path)) == pytest.approx(replica0 + replica1, rel=1e-5)


def test_the_loss_check_sees_replica_0s_summary(monkeypatch, tmp_path, linear_data):
    """Mutation: TensorFlow's own replica-0 summaries are kept; the test above must fail."""
    from tensorflow.python.distribute import mirrored_strategy  # pylint: disable=import-outside-toplevel
    from tfe_estimator.distribute import strategy as strategy_lib  # pylint: disable=import-outside-toplevel

    monkeypatch.setattr(strategy_lib._TfeExtended, "_call_for_each_replica",  # pylint: disable=protected-access
                        mirrored_strategy.MirroredExtended._call_for_each_replica)
    with pytest.raises(AssertionError):
        test_the_loss_written_for_tensorboard_is_the_secure_sum_not_replica_0s(tmp_path, linear_data)
