"""Keras `model.fit`, `model.evaluate` and a custom training loop across organisations: `tfe-estimator launch
--workers 1 -- python train.py` where train.py builds `tfe_estimator.TfeStrategy()` with no arguments
(tests/scripts/keras_owner.py).

Each owner reads only its own rows (`owner_data`, 64 per owner) with `repeat().batch(16)`: the global batch,
so each owner feeds 8 of its rows per step, in order; both owners must end bit-identical and equal to one
plaintext Keras model trained with SGD on, per step, the concatenation of each owner's next 8 rows.
"""
import importlib.util
import io
import json
import os
import re
import sys

import numpy as np
import pytest

from keras_dp_check import check_dp_noise, clipped_plaintext
from launch_log import report
from owner_data import _owner_data
from tfe_estimator.cluster.launcher import Launcher
from tfe_estimator.owner import model_record

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]

SCRIPT = os.path.join(os.path.dirname(__file__), "scripts", "keras_owner.py")
OWNERS = ("chief-0", "worker-0")
STEPS = 10
LEARNING_RATE = 0.1
DP_NOISE = 1.0  # the DP model's noise multiplier (tests/scripts/keras_owner.py --then-dp)
#: Keras DP (make_dp_optimizer) needs tensorflow-privacy: the TensorFlow 2.21 stack has none.
_HAS_PRIVACY = importlib.util.find_spec("tensorflow_privacy") is not None


def _launch(workdir, *flags, max_restarts=0):
    out = io.StringIO()
    launcher = Launcher([sys.executable, SCRIPT, str(STEPS), str(LEARNING_RATE), *flags], workers=1,
                        task_cwd=os.path.join(workdir, "{job}-{index}"), out=out, cluster_mode="service",
                        down_timeout=120, max_restarts=max_restarts)
    status = launcher.run()
    assert not [t.name for t in launcher.tasks if t.process.poll() is None]
    return status, out.getvalue()


def _plaintext_keras(data, initial, worker_batch=lambda step: step):
    """One plaintext Keras model from the owners' initial weights, SGD on each step's 8 + 8 rows (the worker's
    ``worker_batch(step)``-th 8 rows)."""
    import tensorflow as tf  # pylint: disable=import-outside-toplevel

    model = tf.keras.Sequential([tf.keras.layers.Dense(1, input_shape=(2,))])
    model.compile(tf.keras.optimizers.SGD(LEARNING_RATE), "mse")
    model.set_weights([np.array(w, np.float32) for w in initial])
    for step in range(STEPS):
        batch = {"chief-0": step, "worker-0": worker_batch(step)}
        rows = np.concatenate([np.take(data[o], range(8 * batch[o], 8 * batch[o] + 8), axis=0, mode="wrap")
                               for o in OWNERS])
        model.train_on_batch(rows[:, :2], rows[:, 2:])
    return model.get_weights()


def _ended(log, name):
    """``[(step, fingerprint)]`` of owner `name`'s "training ended" lines (keras_progress), in order."""
    return re.findall(rf"^\[{name}\] tfe_estimator: training ended at step (\d+); weights fingerprint ([0-9a-f]{{16}}) "
                      r"\(equal on every owner of one model\)$", log, re.M)


def _fingerprint(weights):
    """What an owner prints for these trained weights (its model's trainable weights, in order: kernel, bias)."""
    return model_record.format_fingerprint(model_record.weights_fingerprint([np.array(w, np.float32) for w in weights]))


def _check_progress(log, trained, keras_major):
    """The progress lines TfeStrategy() adds to fit (the user passed none): the first step's loss, labelled with
    whose rows it covers (Keras 2: every owner's, summed securely, so equal on both owners; Keras 3: each owner's
    own), and a last line on each owner with the same fingerprint, that of the trained weights."""
    whose = "every owner's rows: a secure sum" if keras_major == 2 else "this owner's rows"
    first = {name: re.findall(rf"^\[{name}\] tfe_estimator: step 0, loss (\S+) \(this epoch's mean so far, "
                              rf"{re.escape(whose)}\)$", log, re.M) for name in ("chief:0", "worker:0")}
    assert len(first["chief:0"]) == len(first["worker:0"]) == 1, (first, report(log))
    assert (first["chief:0"] == first["worker:0"]) == (keras_major == 2), first
    assert "[worker:0] tfe_estimator: step 4, loss " in log, report(log)  # the restarted worker's first step
    ended = {name: _ended(log, name) for name in ("chief:0", "worker:0")}
    assert ended["chief:0"][0] == ended["worker:0"][0] == (str(STEPS), _fingerprint(trained)), (ended, report(log))


def _check_evaluation(workdir, data, trained, log):
    """model.evaluate across owners (tests/scripts/keras_owner.py --then-evaluate): the union's metrics, equal to
    NumPy's on the trained weights; each owner's own; fit's validation alike; predict local and whole."""
    weights = np.append(np.array(trained[0]).ravel(), trained[1]).astype(np.float64)

    def metrics(rows):
        error = np.column_stack([rows[:, :2], np.ones(len(rows))]) @ weights - rows[:, 2]
        return {"loss": float(np.mean(error ** 2)), "mae": float(np.mean(np.abs(error)))}

    evaluated = {"chief-0": data["chief-0"][:64], "worker-0": data["worker-0"][:40]}
    union = metrics(np.concatenate(list(evaluated.values())))
    results = {}
    for owner in OWNERS:
        with open(os.path.join(workdir, owner, "keras_evaluation.json")) as f:
            results[owner] = got = json.load(f)
        for name, want in union.items():
            assert got["union"][name] == pytest.approx(want, rel=1e-5), (owner, name, got["union"], union)
        own = metrics(evaluated[owner])
        for name, want in own.items():
            assert got["own"][name] == pytest.approx(want, rel=1e-5), (owner, name, got["own"], own)
        assert got["all_owners"] == got["union"] and got["again"] == got["union"], got
        assert got["val"] == {"val_loss": [got["union"]["loss"]], "val_mae": [got["union"]["mae"]]}, got
        x = np.column_stack([data[owner][:20, :2], np.ones(20)])
        np.testing.assert_allclose(np.array(got["predictions"]).ravel(), x @ weights, rtol=1e-5, atol=1e-6)
    assert results["chief-0"]["union"] == results["worker-0"]["union"]  # every owner reads the same numbers
    for whose in ("all owners' data", "this owner's data only"):  # OwnerMetrics' lines, once on each owner
        assert log.count(f"tfe_estimator: evaluation at step {STEPS}, {whose}: loss ") == 2, report(log)
    assert results["chief-0"]["own"] != results["worker-0"]["own"]


def _check_dp(workdir, data, log):
    """tests/scripts/keras_owner.py --then-dp: both owners bit-identical, off the clipped plaintext model by noise of
    the stated scale (2 owners, 1 colluding: the summed parts have variance 2 sigma**2), each owner's epsilon line
    equal to dp-accounting's RDP accountant's."""
    import dp_accounting  # pylint: disable=import-outside-toplevel

    sys.path.insert(0, os.path.dirname(SCRIPT))
    from keras_owner import DP_CLIP, DP_EXAMPLES, DP_STEPS  # pylint: disable=import-outside-toplevel

    results = {}
    for owner in OWNERS:
        with open(os.path.join(workdir, owner, "keras_dp.json")) as f:
            results[owner] = json.load(f)
    chief, worker = results["chief-0"], results["worker-0"]
    # Under DP the reported loss is not summed across owners (un-noised): each owner's is its own rows' alone.
    assert chief.pop("loss") != worker.pop("loss")
    assert chief == worker and chief["iterations"] == DP_STEPS, (chief, worker)
    for name in ("chief:0", "worker:0"):  # fit's last line under DP too: the fingerprint of the noised weights
        assert _ended(log, name)[1] == (str(DP_STEPS), _fingerprint(chief["trained"])), report(log)
        assert f"[{name}] tfe_estimator: step 0, loss " in log and "this epoch's mean so far, this owner's rows)" in log
    trained = np.append(np.array(chief["trained"][0]).ravel(), chief["trained"][1])
    expected = clipped_plaintext([data[o] for o in OWNERS], chief["initial"], DP_CLIP, DP_STEPS, LEARNING_RATE)
    check_dp_noise(trained, expected, LEARNING_RATE * DP_NOISE * DP_CLIP * np.sqrt(2) / 16 * np.sqrt(DP_STEPS))

    def epsilon(multiplier):
        event = dp_accounting.SelfComposedDpEvent(dp_accounting.PoissonSampledDpEvent(
            16 / DP_EXAMPLES, dp_accounting.GaussianDpEvent(multiplier)), DP_STEPS)
        return dp_accounting.rdp.RdpAccountant().compose(event).get_epsilon(1e-5)

    line = (f"tfe_estimator: step {DP_STEPS}, DP epsilon {epsilon(DP_NOISE):.4g} at delta 1e-05 (against 1 "
            f"colluding owner(s) of 2; {epsilon(DP_NOISE * np.sqrt(2)):.4g} against outsiders)")
    for name in ("chief:0", "worker:0"):
        assert f"[{name}] {line}" in log, report(log)
        assert f"[{name}] tfe_estimator: step 1, DP epsilon " in log, report(log)
    assert log.count(f"DistributedDP: {DP_STEPS} steps of global batch 16 over {DP_EXAMPLES} examples: epsilon = "
                     f"{epsilon(DP_NOISE):.4g}") == 2, report(log)


def _plaintext_loop(data, initial, steps):
    """NumPy's SGD from `initial` on, per step, the concatenation of each owner's next 8 rows: (weights, the mean
    loss of each step's 16 rows before its update)."""
    w, b = np.array(initial[0], np.float64), np.array(initial[1], np.float64)
    losses = []
    for step in range(steps):
        rows = np.concatenate([np.take(data[o], range(8 * step, 8 * step + 8), axis=0, mode="wrap")
                               for o in OWNERS]).astype(np.float64)
        error = rows[:, :2] @ w + b - rows[:, 2:]
        losses.append(float(np.mean(error ** 2)))
        w, b = w - LEARNING_RATE * 2 * rows[:, :2].T @ error / 16, b - LEARNING_RATE * 2 * error.sum(axis=0) / 16
    return [w, b], losses


def _check_loop(data, results, variant):
    """A custom loop's results (tests/scripts/keras_owner.py --then-loop): owners bit-identical and equal to NumPy's
    SGD on each step's 8 + 8 rows; the reduced loss (in the tf.function and eagerly) every owner's mean loss."""
    from keras_owner import LOOP_STEPS  # pylint: disable=import-outside-toplevel

    chief, worker = results["chief-0"][variant], results["worker-0"][variant]
    assert chief["initial"] == worker["initial"] and chief["iterations"] == LOOP_STEPS, (chief, worker)
    assert chief["trained"] == worker["trained"], (variant, chief["trained"], worker["trained"])
    expected, losses = _plaintext_loop(data, chief["initial"], LOOP_STEPS)
    for got, want in zip(chief["trained"], expected):
        np.testing.assert_allclose(np.array(got), want, rtol=1e-5, atol=0)
    for owner in (chief, worker):
        np.testing.assert_allclose(owner["loss"], losses, rtol=1e-5)  # the SUM of each owner's loss / 16
        np.testing.assert_allclose(owner["eager_loss"], losses, rtol=1e-5)
        assert owner["rows"] == [8.0] * LOOP_STEPS  # MEAN over every owner's replica of its 8 rows


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    """One launch (CI time) for the handshake's refusal, fit, a restart, evaluate and, where tensorflow-privacy
    is installed, DP, then custom training loops: ``(workdir, data, log)``.

    worker-0 fits in epochs of 2 steps with BackupAndRestore (a backup at each epoch's end) and dies after step 5;
    restarted, it restores step 4 (weights, optimizer.iterations and the epoch), takes step 4's sums from the
    servers' replay window (the chief is already waiting in step 5) and goes on. Keras does not restore the
    dataset's position: the restarted worker reads its rows from the start again, one batch of them consumed by
    the replayed step. Then both owners evaluate (fit's validation_data, evaluate, predict: _check_evaluation).
    """
    workdir = str(tmp_path_factory.mktemp("keras_service"))
    data = _owner_data(workdir, OWNERS)
    dp = ("--then-dp", str(DP_NOISE)) if _HAS_PRIVACY else ()
    # Keys put when the step starts, as at a distance (on loopback "auto" puts them with the shares): the launch
    # covers that path in tf.function steps, through the worker's restart and replay.
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TFE_ESTIMATOR_EARLY_KEY", "on")
        status, log = _launch(workdir, "--refused-first", "worker-0", "0.5", "--crash-in", "worker-0", "5", "2",
                              "--then-evaluate", *dp, "--then-loop", max_restarts=1)
    assert status == 0, report(log)
    return workdir, data, log


def test_keras_owners_are_refused_then_fit_to_the_plaintext_model_through_a_restart(launched):
    workdir, data, log = launched
    # First each owner fits a model whose learning rates differ (plain MultiWorkerMirroredStrategy would train with
    # the chief's): both are refused before its first step, naming the rate, with the handshake's own error.
    assert log.count("keras owner: first model refused: OwnersDisagreeError: Service handshake at step 0") == 2, \
        report(log)
    assert "StagingError" not in log and "keras owner: first model trained" not in log, report(log)
    assert log.count("refused before the first step") >= 2, report(log)
    assert "learning rate of the optimizer (SGD learning_rate): 0.5 on worker:0, 0.1 on chief:0" in log, report(log)
    assert "keras owner crashing after step 5" in log and "worker:0 died with status 3; restarting" in log
    assert "[worker:0] tfe_estimator: service handshake at step 4: every owner trains model" in log, report(log)
    assert f"[chief:0] keras owner finished at step {STEPS}; 0 answers replayed" in log, report(log)
    # Step 4's sums, replayed: Keras 2 sums 5 values per step (gradients, loss, ...), Keras 3 1 (the gradients).
    import keras  # pylint: disable=import-outside-toplevel

    replayed = 5 if keras.__version__.startswith("2.") else 1
    assert f"[worker:0] keras owner finished at step {STEPS}; {replayed} answers replayed" in log, report(log)
    results = {}
    for owner in OWNERS:
        with open(os.path.join(workdir, owner, "keras_weights.json")) as f:
            results[owner] = json.load(f)
    chief, worker = results["chief-0"], results["worker-0"]
    # Bit-identical owners (weights and the last epochs' loss, read across owners), the restarted one too (its
    # history starts at the restored epoch).
    assert chief["trained"] == worker["trained"] and chief["initial"] == worker["initial"]
    assert len(chief["loss"]) == STEPS // 2 and chief["loss"][-len(worker["loss"]):] == worker["loss"], (chief, worker)
    # Equal to one plaintext Keras model on each step's concatenated 8 + 8 rows, and it learned.
    expected = _plaintext_keras(data, chief["initial"], lambda step: step if step < 5 else step - 4)
    for got, want in zip(chief["trained"], expected):
        np.testing.assert_allclose(np.array(got), want, rtol=1e-5, atol=0)
    assert not np.allclose(np.array(chief["trained"][0]), np.array(chief["initial"][0]), atol=0.5)
    _check_progress(log, chief["trained"], int(keras.__version__.split(".")[0]))
    # The owners agreed once at step 0 on the second model (one rewind each on both servers, although tf.function
    # may trace fit's step twice), the restarted worker once more at step 4; their sums are checked under the
    # handshake's check seed. The DP model (--then-dp) is one more model: one more rewind each (on both servers), one
    # more handshake each; so is each of the three custom loops that train (--then-loop).
    models = (2 if _HAS_PRIVACY else 1) + 3
    for name in ("chief:0", "worker:0"):
        assert log.count(f"{name} rewound to step 0") == 2 * models, report(log)
    assert log.count("sums checked (check seed") == 2 * models + 1, report(log)


def test_keras_owners_evaluate_the_union_and_their_own_data(launched):
    workdir, data, log = launched
    with open(os.path.join(workdir, "chief-0", "keras_weights.json")) as f:
        trained = json.load(f)["trained"]
    _check_evaluation(workdir, data, trained, log)


@pytest.mark.skipif(not _HAS_PRIVACY, reason="Keras DP needs tensorflow-privacy (make_dp_optimizer), which this "
                    "stack does not install (TensorFlow 2.21 / Keras 3: requirements/tf221.txt)")
def test_keras_owners_train_with_distributed_dp_and_print_epsilon(launched):
    workdir, data, log = launched
    _check_dp(workdir, data, log)


def test_keras_owners_train_a_custom_loop_like_one_plaintext_model(launched):
    workdir, data, log = launched
    _check_custom_loops(workdir, data, log)


def _check_custom_loops(workdir, data, log):
    """--then-loop: a loop whose owners' learning rates differ is refused before its first step, naming the rate;
    then the custom loop trains like one plaintext model on each step's rows of both owners, its reduced loss every
    owner's; each planted leak (strategy.reduce answered by the owner alone, the gradients summed over the owner's
    replicas only) fails that check."""
    refused = [line for line in log.splitlines() if "keras owner: custom loop refused: " in line]
    assert len(refused) == 2 and "refused loop trained" not in log, refused or report(log)
    assert all("OwnersDisagreeError: Service handshake at step 0" in line for line in refused), refused
    assert any(line.startswith("[chief:0]") and "learning rate of the optimizer (SGD learning_rate): 0.5 on "
               "worker:0, 0.1 on chief:0" in line for line in refused), refused
    sys.path.insert(0, os.path.dirname(SCRIPT))
    results = {}
    for owner in OWNERS:
        with open(os.path.join(workdir, owner, "keras_loop.json")) as f:
            results[owner] = json.load(f)
    _check_loop(data, results, "secure")
    # The owner's sum kept local: the weights still agree (the gradients were summed), the losses do not.
    with pytest.raises(AssertionError):
        _check_loop(data, results, "reduce_local")
    # The gradients summed over the owner's replicas only: the owners' weights diverge, and the library's own
    # weight check (at the first value read across owners after a step) stops both owners, naming the step.
    for owner in OWNERS:
        stopped = results[owner]["gradients_local"].get("stopped", "")
        assert stopped.startswith("OwnersDisagreeError: Weight check at step 1: the owners' weights differ"), (
            owner, results[owner]["gradients_local"])
