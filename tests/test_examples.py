"""Smoke tests: the examples run end to end with a few steps.

Each example trains a secure model and its plaintext twin and returns both
sets of test metrics; with the same batches and initial weights they agree.
"""
import importlib.util
import math
import pathlib

import pytest

from launch_log import report

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


def _documented_launch(name):
    """The `tfe-estimator launch` command in an example's docstring, parsed by the CLI's own parser."""
    import shlex

    from tfe_estimator.tools.cli import parse_args

    doc = load_example(name).__doc__.replace("\\\n", " ")
    (line,) = [l.strip() for l in doc.splitlines() if l.strip().startswith("tfe-estimator launch")]
    return parse_args(shlex.split(line)[1:])


@pytest.mark.multiprocess
def test_linear_regressor_cluster_example_runs_as_documented(tmp_path, monkeypatch):
    import io
    import json
    import sys

    from tfe_estimator.tools.demo import load_diabetes_split
    from tfe_estimator.tools.demo_cluster import write_owner_data
    from tfe_estimator.cluster.launcher import Launcher

    args = _documented_launch("linear_regressor_cluster")  # the default mode, no --model-dir, no seed
    monkeypatch.chdir(tmp_path)
    write_owner_data("owners", ["chief-0", "worker-0"], *load_diabetes_split()[:4])
    command = [sys.executable if a == "python" else a.replace("$PWD", str(EXAMPLES.parent)) for a in args.cmd[1:]]
    out = io.StringIO()
    launcher = Launcher(command + ["--steps", "30"], workers=args.workers, evaluator=args.evaluator,
                        task_cwd=args.task_cwd, cluster_mode=args.cluster_mode, out=out, final_eval_timeout=120)
    assert launcher.run() == 0, report(out.getvalue())
    assert "Saving dict for global step 30" in out.getvalue()  # the evaluator read the chief's model_dir
    for owner in ("chief-0", "worker-0"):  # each owner its own checkpoints, claimed
        model_dir = tmp_path / "owners" / owner / "model"
        assert (model_dir / "model.ckpt-30.index").exists(), owner
        assert json.loads((model_dir / "tfe_owner.json").read_text())["owner"] == owner.replace("-", ":")
