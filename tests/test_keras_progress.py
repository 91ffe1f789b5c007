"""Keras' progress lines (`tfe_estimator.ProgressCallback`): Estimator's line format, and a last line whose fingerprint
is that of the trained weights in the order the owners' weight checks compare (in process, no cluster: quick; Keras 2
and Keras 3). The service-mode launch (tests/test_keras_service.py) checks the lines every owner prints."""
import io
import re

import numpy as np
import pytest
import tensorflow as tf

import tfe_estimator
from tfe_estimator.owner import keras_progress, model_record

STEP = re.compile(r"^tfe_estimator: step (\d+), loss (\S+) \(this epoch's mean so far\)(?:, (\S+) steps/s)?$", re.M)
END = re.compile(r"^tfe_estimator: training ended at step (\d+); weights fingerprint ([0-9a-f]{16}) "
                 r"\(equal on every owner of one model\)$", re.M)


def _fit(callback, steps=5):
    tf.keras.utils.set_random_seed(1)
    model = tf.keras.Sequential([tf.keras.layers.Dense(2, input_shape=(3,)), tf.keras.layers.Dense(1)])
    model.compile(tf.keras.optimizers.SGD(0.05), "mse")
    rows = np.random.RandomState(0).normal(size=(40, 4)).astype(np.float32)
    data = tf.data.Dataset.from_tensor_slices((rows[:, :3], rows[:, 3:])).repeat().batch(8)
    history = model.fit(data, steps_per_epoch=steps, epochs=1, verbose=0, callbacks=[callback])
    return model, history


def _check_end_line(text, model):
    """The last line names the step and the fingerprint of `model.trainable_weights`, in that order."""
    (step, fingerprint), = END.findall(text)
    assert int(step) == int(model.optimizer.iterations.numpy())
    want = model_record.weights_fingerprint([v.numpy() for v in model.trainable_weights])
    assert fingerprint == model_record.format_fingerprint(want), text


def test_fit_prints_the_step_the_loss_and_at_its_end_the_trained_weights_fingerprint():
    out = io.StringIO()
    model, history = _fit(tfe_estimator.ProgressCallback(every_n_steps=2, stream=out))
    lines = STEP.findall(out.getvalue())
    # Batches 1, 3 and 5 print, each naming the step its loss was computed at (before its update), as Estimator's.
    assert [int(s) for s, _, _ in lines] == [0, 2, 4], out.getvalue()
    assert lines[0][2] == "" and all(float(rate) > 0 for _, _, rate in lines[1:])
    assert float(lines[-1][1]) == pytest.approx(history.history["loss"][-1], rel=1e-5)  # Keras' own running mean
    _check_end_line(out.getvalue(), model)


def test_mutation_a_fingerprint_over_another_variable_order_fails_the_check(monkeypatch):
    """Owners compare the fingerprint with their weight checks' (`keras_fit`: ``model.trainable_weights`` in order):
    one over the same values in another order is another fingerprint, and the check catches it."""
    out = io.StringIO()
    original = keras_progress.progress.end_line
    monkeypatch.setattr(keras_progress.progress, "end_line", lambda step, values: original(step, values[::-1]))
    model, _ = _fit(tfe_estimator.ProgressCallback(stream=out), steps=2)
    with pytest.raises(AssertionError):
        _check_end_line(out.getvalue(), model)


def test_attached_to_a_running_fits_callbacks_it_prints_like_one_passed_to_fit_and_only_once(monkeypatch):
    """`attach` adds the callback to Keras' own CallbackList once fit has made it (and its first batch has begun):
    the list then calls its batch hooks although none of its callbacks had them when it was made."""
    out = io.StringIO()
    monkeypatch.setattr(keras_progress.progress, "write_line", lambda line, stream=None: out.write(line + "\n"))
    model, _ = _fit(tf.keras.callbacks.History(), steps=1)
    callbacks = tf.keras.callbacks.CallbackList([], add_history=True, model=model)
    callbacks.on_train_begin()
    callbacks.on_train_batch_begin(0)
    assert keras_progress.attach(callbacks, model) and keras_progress.attach(callbacks, model)
    assert sum(isinstance(c, tfe_estimator.ProgressCallback) for c in callbacks.callbacks) == 1
    callbacks.on_train_batch_end(1, {"loss": 0.25})
    callbacks.on_train_end()
    assert STEP.findall(out.getvalue()) == [("0", "0.25", "")], out.getvalue()
    _check_end_line(out.getvalue(), model)
    assert not keras_progress.attach(None, model)  # no running fit found: nothing attached (keras_fit says so)


@pytest.mark.parametrize("every", [0, -3, 1.5, True])
def test_a_bad_interval_is_refused_naming_it(every):
    with pytest.raises(ValueError, match=rf"ProgressCallback\(every_n_steps={re.escape(repr(every))}\): give a"):
        tfe_estimator.ProgressCallback(every_n_steps=every)
