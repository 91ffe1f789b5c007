"""The demos: the cluster demo's output is the table, not the tasks' logs; both say where models are kept."""
import io
import os

import numpy as np
import pytest

from tfe_estimator.tools.demo import format_comparison


def _result(weights):
    return {"weights": np.array(weights), "bias": 1.0, "test_mse": 2.0, "test_r2": 0.5,
            "train_seconds": float("nan")}


def test_the_table_says_where_the_model_directories_are():
    text = format_comparison({"secure": _result([1.0]), "plaintext": _result([1.0]), "feature_names": ["age"],
                              "workdir": "/tmp/tfe-estimator-demo-x"}, "title")
    assert "model directories (checkpoints, eval summaries) are kept under /tmp/tfe-estimator-demo-x" in text


@pytest.mark.multiprocess
def test_cluster_demo_prints_its_table_not_the_task_logs(tmp_path):
    from tfe_estimator.tools.demo_cluster import run_cluster_demo

    out = io.StringIO()
    results = run_cluster_demo(steps=30, workdir=str(tmp_path), out=out)
    printed = out.getvalue().splitlines()
    assert len(printed) == 2, printed  # one line per run: where its task logs are
    assert printed[0] == f"secure: training on the cluster; task logs in {tmp_path}/logs-secure/"
    for mode in ("secure", "plaintext"):
        logs = sorted(os.listdir(tmp_path / f"logs-{mode}"))
        assert logs == ["chief-0.log", "evaluator-0.log", "launch.log", "tfe-0.log", "tfe-1.log", "tfe-2.log",
                        "worker-0.log"]
        assert "Saving dict for global step 30" in (tmp_path / f"logs-{mode}" / "evaluator-0.log").read_text()
        assert results[mode]["model_dir"] == str(tmp_path / f"model-{mode}")
    np.testing.assert_allclose(results["secure"]["weights"], results["plaintext"]["weights"], atol=1e-2)
