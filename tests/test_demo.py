"""The demos' table says where the models are kept (the cluster demo's own output: see the comment below)."""
import numpy as np

from tfe_estimator.tools.demo import format_comparison


def _result(weights):
    return {"weights": np.array(weights), "bias": 1.0, "test_mse": 2.0, "test_r2": 0.5,
            "train_seconds": float("nan")}


def test_the_table_says_where_the_model_directories_are():
    text = format_comparison({"secure": _result([1.0]), "plaintext": _result([1.0]), "feature_names": ["age"],
                              "workdir": "/tmp/tfe-estimator-demo-x"}, "title")
    assert "model directories (checkpoints, eval summaries) are kept under /tmp/tfe-estimator-demo-x" in text


# The cluster demo's own output (one line per run, each task's log in its own file, the twins' weights) is
# checked by tests/test_launch.py::test_train_and_evaluate_on_loopback_cluster_matches_plaintext_and_keeps_data_local,
# whose secure and plaintext clusters `run_cluster_demo` launches: one launch serves both tests' assertions.
