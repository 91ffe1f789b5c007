"""Smoke tests: the examples run end to end with a few steps.

Each example trains a secure model and its plaintext twin and returns both
sets of test metrics; with the same batches and initial weights they agree.
"""
import importlib.util
import math
import pathlib

import pytest

EXAMPLES = pathlib.Path(__file__).resolve().parent.parent / "examples"


def load_example(name):
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
@pytest.mark.parametrize("name,metrics", [
    ("logistic_regression_breast_cancer", ("accuracy", "auc", "average_loss")),
    ("dnn_digits", ("accuracy", "average_loss")),
])
def test_example_runs_and_twins_agree(name, metrics, tmp_path, capsys):
    example = load_example(name)

    results = example.main(["--steps", "20", "--model-dir", str(tmp_path)])

    assert set(results) == {"secure", "plaintext"}
    for run in ("secure", "plaintext"):
        assert results[run]["global_step"] == 20
        assert (tmp_path / run).is_dir(), f"no checkpoints for {run} under --model-dir"
        for metric in metrics:
            assert math.isfinite(results[run][metric]), (run, metric)
        assert results[run]["accuracy"] > 0.5, results[run]  # far above chance after 20 steps
    for metric in metrics:
        assert results["secure"][metric] == pytest.approx(results["plaintext"][metric], abs=0.02), metric
    printed = capsys.readouterr().out
    assert "secure" in printed and "plaintext" in printed and "accuracy" in printed


@pytest.mark.slow
def test_linear_regressor_example_twins_agree(tmp_path, capsys):
    results = load_example("linear_regressor").main(["--steps", "50", "--model-dir", str(tmp_path)])
    assert results["secure"]["global_step"] == results["plaintext"]["global_step"] == 50
    assert abs(results["secure"]["bias"] - results["plaintext"]["bias"]) < 1e-2
    assert max(abs(results["secure"]["weights"] - results["plaintext"]["weights"])) < 1e-2
    assert "average_loss" in capsys.readouterr().out


@pytest.mark.multiprocess
def test_linear_regressor_cluster_example_runs_under_launch(tmp_path):
    import io
    import sys

    from tfe_estimator.tools.demo import load_diabetes_split
    from tfe_estimator.tools.demo_cluster import write_owner_data
    from tfe_estimator.cluster.launcher import Launcher

    write_owner_data(str(tmp_path), ["chief-0", "worker-0"], *load_diabetes_split()[:4])
    out = io.StringIO()
    launcher = Launcher([sys.executable, str(EXAMPLES / "linear_regressor_cluster.py"),
                         "--model-dir", str(tmp_path / "model"), "--steps", "30"],
                        workers=1, evaluator=True, task_cwd=str(tmp_path / "{job}-{index}"), out=out,
                        cluster_mode="in-graph")
    assert launcher.run() == 0, out.getvalue()[-5000:]
    assert "Saving dict for global step 30" in out.getvalue()
