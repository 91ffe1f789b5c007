"""The progress line: step, this owner's loss and steps/s every log_step_count_steps, on by default."""
import io
import re

import numpy as np
import pytest
import tensorflow as tf

from tfe_estimator import TfeRunConfig
from tfe_estimator.distribute.progress import ProgressHook

LINE = re.compile(r"^tfe_estimator: step (\d+), loss (\S+) \(this owner's first replica\)(?:, (\S+) steps/s)?$", re.M)


@pytest.fixture(autouse=True)
def _no_tf_config(monkeypatch):
    monkeypatch.delenv("TF_CONFIG", raising=False)


def test_the_hook_prints_the_step_and_the_loss_it_read_every_n_runs():
    out = io.StringIO()
    with tf.Graph().as_default():
        step = tf.compat.v1.train.get_or_create_global_step()
        read = tf.compat.v1.get_default_graph().as_graph_element(step)  # the op a fetch of the step runs
        loss = tf.cast(read, tf.float32) * 0.5 + 1.0  # the loss at the step each run reads
        with tf.control_dependencies([read]):  # else a run may read the step after its own update (1 in ~150)
            train_op = tf.compat.v1.assign_add(step, 1)
        with tf.compat.v1.train.MonitoredSession(hooks=[ProgressHook(loss, every_n_steps=3, stream=out)]) as sess:
            for _ in range(9):
                sess.run(train_op)
    lines = LINE.findall(out.getvalue())
    # Runs 1, 4 and 7 print; each fetches the step before its own update: steps 0, 3, 6.
    assert [int(s) for s, _, _ in lines] == [0, 3, 6], out.getvalue()
    assert [float(value) for _, value, _ in lines] == [1.0, 2.5, 4.0]
    assert lines[0][2] == "" and all(float(rate) > 0 for _, _, rate in lines[1:])  # a rate from the second on
    assert re.search(r"^tfe_estimator: training ended at step 9; weights fingerprint [0-9a-f]{16} ", out.getvalue(),
                     re.M), out.getvalue()


@pytest.mark.parametrize("every", [0, -1, 2.5, True, "10"])
def test_a_bad_interval_is_refused_naming_it(every):
    with pytest.raises(ValueError, match=rf"every_n_steps={re.escape(repr(every))}: give a positive int"):
        ProgressHook(tf.constant(1.0), every_n_steps=every)


def _train(tmp_path, linear_data, capfd, **config_kwargs):
    x, y, _ = linear_data
    config = TfeRunConfig(model_dir=str(tmp_path), tf_random_seed=1, **config_kwargs)
    est = tf.estimator.LinearRegressor([tf.feature_column.numeric_column("x", shape=[3])], config=config)
    est.train(lambda: tf.data.Dataset.from_tensor_slices(({"x": x}, y)).repeat().batch(16), steps=10)
    return LINE.findall(capfd.readouterr().err)


@pytest.mark.slow
def test_an_estimator_under_tfe_run_config_prints_progress_by_default_interval(tmp_path, linear_data, capfd):
    lines = _train(tmp_path, linear_data, capfd, log_step_count_steps=5)
    assert [int(s) for s, _, _ in lines] == [0, 5], lines
    assert all(np.isfinite(float(loss)) and float(loss) > 0 for _, loss, _ in lines)


@pytest.mark.slow
def test_no_progress_line_when_log_step_count_steps_is_none(tmp_path, linear_data, capfd):
    assert _train(tmp_path, linear_data, capfd, log_step_count_steps=None) == []
