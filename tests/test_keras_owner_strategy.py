"""`tfe_estimator.TfeStrategy()` under a TF_CONFIG cluster: the data owner's service-mode strategy for Keras, and
the Keras model record the owners' handshake compares (no cluster: quick)."""
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_PICK = """
import json, os, sys, tfe_estimator
from tfe_estimator.owner.keras_fit import OwnerStrategy
cases = {}
for name, env in json.loads(sys.argv[1]).items():
    replicas = env.pop("NUM_REPLICAS", None)
    os.environ.update(env)
    if not env.get("TFE_ESTIMATOR_TLS_DIR"):
        os.environ.pop("TFE_ESTIMATOR_TLS_DIR", None)
    try:
        s = tfe_estimator.TfeStrategy() if replicas is None else tfe_estimator.TfeStrategy(num_replicas=int(replicas))
        cases[name] = [type(s).__name__, isinstance(s, tfe_estimator.TfeStrategy), s.num_replicas_in_sync,
                       list(s.secure_aggregation.binding.owners), s.secure_aggregation.binding.owner]
        if replicas is not None:  # after TensorFlow's runtime started with one CPU (the cases before ran ops)
            import tensorflow as tf
            with s.scope():
                pass
            cases[name].append([len(tf.config.list_logical_devices("CPU")), list(s.extended.worker_devices)])
    except Exception as e:  # noqa: BLE001
        cases[name] = [type(e).__name__, str(e)]
        continue
    if name == "service":  # custom loops that no optimizer keys: refused when traced (or run), before anything is sent
        import tensorflow as tf
        with s.scope():
            v = tf.Variable(1.0)
            opt = tf.keras.optimizers.SGD(0.1)

        def sum_first():  # a sum across owners before the step's apply_gradients
            total = tf.distribute.get_replica_context().all_reduce("SUM", v * 2.0)
            opt.apply_gradients([(total, v)])
            return total

        loops = {"custom loop": tf.function(lambda: s.reduce("SUM", s.run(lambda: tf.constant(1.0)), axis=None)),
                 "sum before apply": tf.function(lambda: s.run(sum_first)),
                 "eager run": lambda: s.run(sum_first),
                 "eager reduce first": lambda: s.reduce("SUM", tf.constant(1.0), axis=None)}
        for case, loop in loops.items():
            try:
                loop()
                cases[case] = ["ran"]
            except Exception as e:  # noqa: BLE001
                cases[case] = [type(e).__name__, str(e)]
        # evaluate before fit: refused when traced, before anything is sent; predict: local, every row.
        import numpy as np
        with s.scope():
            model = tf.keras.Sequential([tf.keras.layers.Dense(1, input_shape=(2,))])
            model.compile(tf.keras.optimizers.SGD(0.1), "mse")
        x = np.arange(40, dtype=np.float32).reshape(20, 2)
        try:
            model.evaluate(x, x[:, :1], batch_size=16, verbose=0)
        except Exception as e:  # noqa: BLE001
            cases["evaluate first"] = [type(e).__name__, str(e)]
        w, b = model.get_weights()
        cases["predict"] = float(np.max(np.abs(model.predict(x, batch_size=16, verbose=0) - (x @ w + b))))
print(json.dumps(cases))
"""


def test_tfe_strategy_is_the_owners_service_strategy_under_a_service_cluster_and_says_what_is_missing(tmp_path):
    cluster = {"chief": ["localhost:1"], "worker": ["localhost:2"], "tfe": ["localhost:3", "localhost:4"]}
    tf_config = json.dumps({"cluster": cluster, "task": {"type": "worker", "index": 0}})
    cases = {
        "service": {"TF_CONFIG": tf_config, "TFE_ESTIMATOR_TLS_DIR": str(tmp_path), "TFE_ESTIMATOR_CLUSTER_MODE": ""},
        "no certificates": {"TF_CONFIG": tf_config, "TFE_ESTIMATOR_TLS_DIR": ""},
        "in-graph": {"TF_CONFIG": tf_config, "TFE_ESTIMATOR_TLS_DIR": str(tmp_path),
                     "TFE_ESTIMATOR_CLUSTER_MODE": "in-graph"},
        "two replicas": {"TF_CONFIG": tf_config, "TFE_ESTIMATOR_TLS_DIR": str(tmp_path),
                         "TFE_ESTIMATOR_CLUSTER_MODE": "", "NUM_REPLICAS": "2"},
    }
    env = {k: v for k, v in os.environ.items() if k not in ("TF_CONFIG", "TFE_ESTIMATOR_CLUSTER_MODE")}
    out = subprocess.run([sys.executable, "-c", _PICK, json.dumps(cases)], capture_output=True, text=True,
                         timeout=300, cwd=ROOT, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    # Service mode (what launch gives): this owner's part, its one replica and every owner's in sync.
    assert got["service"] == ["OwnerStrategy", True, 2, ["chief:0", "worker:0"], "worker:0"]
    assert got["no certificates"][0] == "ValueError" and "TFE_ESTIMATOR_TLS_DIR" in got["no certificates"][1]
    assert got["in-graph"][0] == "NotImplementedError" and "--cluster-mode service" in got["in-graph"][1]
    # TfeStrategy(num_replicas=2) in service mode makes the logical CPUs its two local replicas need, as on one machine
    # (here after TensorFlow's runtime started with one), so Keras' scope opens.
    cpus, devices = got["two replicas"].pop()
    assert got["two replicas"] == ["OwnerStrategy", True, 4, ["chief:0", "worker:0"], "worker:0"], got["two replicas"]
    assert cpus >= 2 and [d.rsplit("/", 1)[-1] for d in devices] == ["device:CPU:0", "device:CPU:1"], (cpus, devices)
    # A custom loop's sums across owners are keyed by the step of the optimizer that applies its gradients: a sum in a
    # tf.function with no apply_gradients, or before it, is refused; so is strategy.run summing eagerly, and an eager
    # strategy.reduce before any model trained.
    for case in ("custom loop", "sum before apply"):
        assert got[case][0] == "NotImplementedError", got[case]
        assert "before any optimizer.apply_gradients in it (or in a function with none)" in got[case][1], got[case]
        assert "strategy.reduce(SUM, strategy.run(step_fn, args=...), axis=None)" in got[case][1], got[case]
    assert got["eager run"][0] == "NotImplementedError", got["eager run"]
    assert "strategy.run summed across owners eagerly (outside tf.function)" in got["eager run"][1]
    assert got["eager reduce first"][0] == "ValueError", got["eager reduce first"]
    assert "or run a step of the loop, first" in got["eager reduce first"][1]
    assert got["evaluate first"][0] == "NotImplementedError", got["evaluate first"]
    assert "call model.fit on this model first (on every owner), then evaluate" in got["evaluate first"][1]
    assert got["predict"] < 1e-5  # all 20 rows (not the half a split over both owners' replicas would give)


def _compiled(learning_rate, units=1):
    import tensorflow as tf  # pylint: disable=import-outside-toplevel

    tf.keras.backend.clear_session()  # the same layer names, as every owner's fresh process has
    tf.keras.utils.set_random_seed(3)
    model = tf.keras.Sequential([tf.keras.layers.Dense(units, input_shape=(2,))])
    model.compile(tf.keras.optimizers.SGD(learning_rate), "mse")
    return model


def test_the_keras_record_names_a_different_learning_rate_with_both_values_and_equal_models_share_an_id():
    from tfe_estimator.owner import model_record  # pylint: disable=import-outside-toplevel

    settings = {"precision": "low", "training run": 0}
    chief = model_record.keras_record(_compiled(0.1), settings, 2)
    same = model_record.keras_record(_compiled(0.1), settings, 2)
    worker = model_record.keras_record(_compiled(0.5), settings, 2)
    wider = model_record.keras_record(_compiled(0.1, units=2), settings, 2)
    assert chief[0] == 0 and chief[1] == same[1]  # step 0, the same seeded initial weights
    assert model_record.model_id(chief[2]) == model_record.model_id(same[2])
    assert model_record.model_id(chief[2]) != model_record.model_id(worker[2])
    row = model_record.make_row(*worker)
    assert model_record.differences(chief[2], "chief:0", row, "worker:0") == [
        "learning rate of the optimizer (SGD learning_rate): 0.5 on worker:0, 0.1 on chief:0"]
    differ = model_record.differences(chief[2], "chief:0", model_record.make_row(*wider), "worker:0")
    assert any("structure of the trainable variables" in d for d in differ), differ


def test_a_custom_loops_record_names_a_different_learning_rate_and_differs_from_fits():
    from tfe_estimator.owner import model_record  # pylint: disable=import-outside-toplevel

    model = _compiled(0.1)
    chief = model_record.loop_record(model.optimizer, model.trainable_variables, {}, 2)
    worker = model_record.loop_record(_compiled(0.5).optimizer, model.trainable_variables, {}, 2)
    assert chief[:2] == model_record.keras_record(model, {}, 2)[:2]  # the same step and initial weights
    assert model_record.differences(chief[2], "chief:0", model_record.make_row(*worker), "worker:0") == [
        "learning rate of the optimizer (SGD learning_rate): 0.5 on worker:0, 0.1 on chief:0"]
    fit = model_record.make_row(*model_record.keras_record(model, {}, 2))  # an owner fitting where another loops
    assert model_record.differences(chief[2], "chief:0", fit, "worker:0") == [
        "worker:0's model has 1 field(s) chief:0's has not (other variables, optimizer hyperparameters or feature "
        "constants)"]


@pytest.mark.parametrize("loss", ["mse", "mae"])
def test_the_keras_record_covers_the_compiled_loss(loss):
    import tensorflow as tf  # pylint: disable=import-outside-toplevel

    from tfe_estimator.owner import model_record  # pylint: disable=import-outside-toplevel

    model = _compiled(0.1)
    model.compile(tf.keras.optimizers.SGD(0.1), loss)
    fields = dict((label, value) for label, _, value in model_record.keras_record(model, {}, 2)[2])
    assert "the loss" in fields
    other = _compiled(0.1)
    other.compile(tf.keras.optimizers.SGD(0.1), "mae" if loss == "mse" else "mse")
    assert model_record.model_id(model_record.keras_record(other, {}, 2)[2]) != \
        model_record.model_id(model_record.keras_record(model, {}, 2)[2])


def test_under_dp_the_release_ledger_is_kept_where_backup_and_restore_keeps_the_model(tmp_path):
    """A Keras owner's DP release ledger lives in BackupAndRestore's directory (keras_fit.backup_dir), so a
    restarted owner reads the releases it had; without the callback there is none (and the owner warns)."""
    import tensorflow as tf  # pylint: disable=import-outside-toplevel

    from tfe_estimator.owner import keras_fit, training_run  # pylint: disable=import-outside-toplevel

    model = tf.keras.Sequential([tf.keras.layers.Dense(1, input_shape=(2,))])
    model.compile(tf.keras.optimizers.SGD(0.1), "mse")
    assert keras_fit.backup_dir(model) is None
    backup = tf.keras.callbacks.BackupAndRestore(str(tmp_path / "backup"))
    backup.set_model(model)
    backup.on_train_begin()
    directory = keras_fit.backup_dir(model)
    assert directory is not None and directory.startswith(str(tmp_path / "backup"))
    training_run.ReleaseLedger(directory, fresh=True).released("chief:0", "m/sum_0", 3)
    restarted = training_run.ReleaseLedger(directory, fresh=False)  # the restarted process's ledger
    with pytest.raises(ValueError, match="step 3"):
        restarted.released("chief:0", "m/sum_0", 3)
