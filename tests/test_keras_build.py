"""Keras 3 builds the model from shapes before fit's first step (`keras_build`): under an owner's service-mode
strategy with 2 local replicas, those reads across replicas are answered inside the owner and nothing is sent
before step 1; a user's own eager reduce still goes across owners (and is refused there: no agreed model). With
the mutations: sending the build's reads across owners, or answering every reduce locally, each fails its check.
And Keras 3's BackupAndRestore within an epoch is refused (it restores no step within an epoch).
No cluster: one subprocess, nothing listens on the servers' addresses."""
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_FIT = """
import json, sys
import numpy as np
import tensorflow as tf
import tfe_estimator
from tfe_estimator.owner import keras_build, keras_fit, service_strategy

sent, fired = [], []
fused_sum = service_strategy.ServiceAggregation._fused_sum
def spy(self, *args, **kwargs):
    sent.append(tf.executing_eagerly())
    return fused_sum(self, *args, **kwargs)
service_strategy.ServiceAggregation._fused_sum = spy
for rule in ("_first_batch_mean", "_scratch_graph", "_discarded_read_back"):
    def recorded(*args, _rule=rule, _f=getattr(keras_build, rule)):
        answer = _f(*args)
        fired.extend([_rule] if answer else [])
        return answer
    setattr(keras_build, rule, recorded)
class FirstStep(Exception):
    pass
def first_step(*args, **kwargs):
    raise FirstStep()
call_for_each_replica = keras_fit.call_for_each_replica
keras_fit.call_for_each_replica = first_step  # fit's step 1 is traced: stop before its handshake

from tfe_estimator.distribute.logical_devices import configure_logical_cpus

configure_logical_cpus(2)  # the owner's 2 local replicas (its service-mode strategy makes no devices itself)
strategy = tfe_estimator.TfeStrategy(num_replicas=2)
answered_locally = keras_build.answered_locally
cases = {}
for mutation in ("none", "send across owners", "answer every reduce locally"):
    keras_build.answered_locally = {"none": answered_locally, "send across owners": lambda value: False,
                                    "answer every reduce locally": lambda value: True}[mutation]
    sent.clear(); fired.clear()
    tf.keras.backend.clear_session()
    with strategy.scope():
        model = tf.keras.Sequential([tf.keras.Input((2,)), tf.keras.layers.Dense(1)])
        model.compile(tf.keras.optimizers.SGD(0.1), "mse", metrics=["mae"])
    x = np.arange(64, dtype=np.float32).reshape(32, 2)
    case = cases[mutation] = {}
    try:
        model.fit(tf.data.Dataset.from_tensor_slices((x, x[:, :1])).repeat().batch(16), steps_per_epoch=1,
                  verbose=0)
        case["fit"] = "ran"
    except FirstStep:
        case["fit"] = "reached step 1"
    except Exception as e:  # noqa: BLE001
        case["fit"] = f"{type(e).__name__}: {e}"
    case.update({"sent before step 1": len(sent), "built": model.built, "fired": sorted(set(fired))})
    sent.clear()
    try:  # the user's own eager reduce of per-replica values: never answered locally
        values = strategy.run(lambda: tf.constant([1.0, 2.0]))  # one value per local replica
        strategy.reduce("SUM", values, axis=None)
        case["user reduce"] = "answered"
    except Exception as e:  # noqa: BLE001
        case["user reduce"] = f"{type(e).__name__}: {e}"
    case["user reduce sent"] = len(sent)
# Keras 3's BackupAndRestore within an epoch: refused at the handshake, before anything is sent.
import tempfile
keras_fit.call_for_each_replica, keras_build.answered_locally = call_for_each_replica, answered_locally
tf.keras.backend.clear_session()
with strategy.scope():
    model = tf.keras.Sequential([tf.keras.Input((2,)), tf.keras.layers.Dense(1)])
    model.compile(tf.keras.optimizers.SGD(0.1), "mse")
try:
    model.fit(tf.data.Dataset.from_tensor_slices((x, x[:, :1])).repeat().batch(16), steps_per_epoch=1, verbose=0,
              callbacks=[tf.keras.callbacks.BackupAndRestore(tempfile.mkdtemp(), save_freq=3)])
    cases["backup within an epoch"] = "trained"
except Exception as e:  # noqa: BLE001
    cases["backup within an epoch"] = f"{type(e).__name__}: {e}"
print(json.dumps(cases))
"""


@pytest.fixture(scope="module")
def fits(tmp_path_factory):
    import keras  # pylint: disable=import-outside-toplevel

    if not keras.__version__.startswith("3."):
        pytest.skip(f"Keras 3 builds models from shapes before fit's first step; this stack has Keras "
                    f"{keras.__version__} (it builds them in the step)")
    cluster = {"chief": ["localhost:1"], "worker": ["localhost:2"], "tfe": ["localhost:3", "localhost:4"]}
    env = {k: v for k, v in os.environ.items() if k not in ("TF_CONFIG", "TFE_ESTIMATOR_CLUSTER_MODE")}
    env.update(TF_CONFIG=json.dumps({"cluster": cluster, "task": {"type": "chief", "index": 0}}),
               TFE_ESTIMATOR_TLS_DIR=str(tmp_path_factory.mktemp("tls")))
    out = subprocess.run([sys.executable, "-c", _FIT], capture_output=True, text=True, timeout=300, cwd=ROOT,
                         env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_keras3_builds_the_model_inside_the_owner_and_sends_nothing_before_step_1(fits):
    case = fits["none"]
    assert case["fit"] == "reached step 1" and case["built"], case
    assert case["sent before step 1"] == 0, case
    # Each of Keras 3's reads was the one recognised: the first batch's mean (2 local replicas), the metrics'
    # reads in compute_output_spec's scratch graph, the read-back of reset_metrics' assignments.
    assert case["fired"] == ["_discarded_read_back", "_first_batch_mean", "_scratch_graph"], case
    # Another eager reduce goes across owners, where it is refused: no model agreed, no step to key it by.
    assert case["user reduce sent"] == 1, case
    assert "a sum across owners outside a Keras model.fit step (read eagerly)" in case["user reduce"], case


def test_mutation_the_build_sent_across_owners_or_every_reduce_answered_locally_fails_the_checks(fits):
    sent = fits["send across owners"]
    assert sent["sent before step 1"] > 0 and sent["fit"] != "reached step 1", sent
    local = fits["answer every reduce locally"]
    assert local["user reduce"] == "answered" and local["user reduce sent"] == 0, local


def test_keras3_backup_and_restore_within_an_epoch_is_refused_with_the_fix(fits):
    # Keras 3 restores no step within an epoch: a restarted owner would train past the other owners.
    refused = fits["backup within an epoch"]
    assert refused.startswith("NotImplementedError: tf.keras.callbacks.BackupAndRestore(save_freq=3) across owners "
                              "on Keras 3: Keras 3 restores the epoch but not the step within it"), refused
    assert "save_freq='epoch' (the default)" in refused, refused
