"""What the launcher prints: TensorFlow's deprecation noise hidden (with an opt-out), the first failure first."""
import io

import pytest

from tfe_estimator.cluster.launcher import Launcher
from test_faults import _fake
from test_launch import _assert_all_gone

pytestmark = [pytest.mark.multiprocess]

NOISE = ("print('WARNING:tensorflow:From /x/estimator.py:12: Estimator.__init__ (from tensorflow) is deprecated and "
         "will be removed in a future version.'); print('Instructions for updating:'); print('Use tf.keras instead.'); "
         "print('E external/local_xla/xla/stream_executor/cuda/cuda_dnn.cc:9261] Unable to register cuDNN factory: x'); "
         "print('/x/dataset_ops.py:462: UserWarning: To make it possible to preserve tf.data options across ...'); "
         "print('  warnings.warn(\"To make it possible to preserve tf.data options across \"'); "
         "print('step 10: loss 0.5')")


@pytest.mark.parametrize("tf_warnings", [False, True])
def test_tensorflows_deprecation_warnings_are_hidden_unless_asked_for(tf_warnings, monkeypatch):
    monkeypatch.delenv("TF_CPP_MIN_LOG_LEVEL", raising=False)  # a user's own level is never changed
    out = io.StringIO()
    launcher = Launcher(_fake(NOISE), workers=0, out=out, server_command=_fake("s = serve(); time.sleep(600)"),
                        tf_warnings=tf_warnings)
    for task in launcher.tasks:  # TensorFlow's C++ INFO lines: hidden in every task unless asked for
        assert task.env.get("TF_CPP_MIN_LOG_LEVEL") == (None if tf_warnings else "1"), task.name
        assert (task.env.get("TFE_ESTIMATOR_TF_WARNINGS") == "1") == tf_warnings, task.name
    assert launcher.run() == 0, out.getvalue()
    log = "\n".join(line for line in out.getvalue().splitlines() if line.startswith("[chief:0]"))  # its output
    assert "[chief:0] step 10: loss 0.5" in log
    for noise in ("is deprecated", "Instructions for updating", "Use tf.keras instead.", "cuDNN factory",
                  "preserve tf.data options"):
        assert (noise in log) == tf_warnings, (noise, log)
    _assert_all_gone(launcher)


def test_a_worker_and_the_chief_failing_of_one_cause_are_both_named_the_first_first():
    out = io.StringIO()
    launcher = Launcher(_fake("time.sleep(1.0 if t['task']['type'] == 'worker' else 1.5); sys.exit(3)"),
                        workers=1, out=out, server_command=_fake("s = serve(); time.sleep(600)"))
    assert launcher.run() == 3
    assert ("worker:0 died with status 3 while the chief was training; chief:0 died too, after it, with status 3; "
            "stopping the cluster") in out.getvalue(), out.getvalue()
    _assert_all_gone(launcher)


def test_the_tutorials_multiworkermirroredstrategy_line_gets_a_hint_to_delete_it():
    """TensorFlow's refusal of the 'tfe' job is named with the line to delete (issue 35: tutorials under launch)."""
    out = io.StringIO()
    refusal = "print('ValueError: Disallowed task type: tfe', file=sys.stderr); sys.exit(1)"
    launcher = Launcher(_fake(refusal), workers=0, out=out, server_command=_fake("s = serve(); time.sleep(600)"))
    assert launcher.run() == 1
    lines = [line for line in out.getvalue().splitlines() if line.startswith("[chief:0]")]  # its output
    error = next(i for i, line in enumerate(lines) if "Disallowed task type" in line and "hint" not in line)
    assert "delete the script's MultiWorkerMirroredStrategy() line" in lines[error + 1], out.getvalue()
    assert out.getvalue().count("hint: this is TensorFlow's MultiWorkerMirroredStrategy") == 1
    _assert_all_gone(launcher)


def test_an_owner_run_by_hand_hides_tf_datas_options_warning_unless_asked_for(monkeypatch):
    """Issue 41: a hand-started owner printed what the launcher drops (TfeRunConfig calls this on a cluster)."""
    import warnings

    from tfe_estimator.cluster import quiet

    for asked in (False, True):
        monkeypatch.setenv(quiet.TF_WARNINGS_ENV, "1" if asked else "0")
        with warnings.catch_warnings(record=True) as caught:  # restores the filters afterwards
            warnings.simplefilter("always")
            quiet.hide_deprecation_warnings()
            warnings.warn(f"{quiet.TF_DATA_OPTIONS_WARNING} across ...", UserWarning, stacklevel=1)
            warnings.warn("a warning of the user's own", UserWarning, stacklevel=1)
        shown = [str(w.message).split(" across")[0] for w in caught]
        assert shown == [quiet.TF_DATA_OPTIONS_WARNING] * asked + ["a warning of the user's own"], (asked, shown)
