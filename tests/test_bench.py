"""Smoke test of the benchmark: every case runs and is reported (timings are never asserted)."""
import json
import math

import pytest

from tfe_estimator.tools import bench

pytestmark = pytest.mark.slow


def test_quick_benchmark_reports_every_case(tmp_path):
    # Execute
    status = bench.main(["--quick", "--out", str(tmp_path)])
    # Assert: every case has positive times, a ratio and a measured upload figure.
    assert status == 0
    results = json.loads((tmp_path / "results.json").read_text())
    names = [c["name"] for c in results["cases"]]
    assert names == [c.name for c in bench.quick_cases()]
    for case in results["cases"]:
        assert case["secure_ms_per_step"] > 0 and case["plaintext_ms_per_step"] > 0, case["name"]
        assert math.isfinite(case["ratio"]) and case["ratio"] > 0, case["name"]
        upload = case["upload_bytes_per_param_per_replica_per_step"]
        assert math.isfinite(upload) and upload > 0, case["name"]
        assert case["params"] > 0 and case["upload_edges"] > 0
    assert results["secure_sum"] and all(r["secure_params_per_s"] > 0 for r in results["secure_sum"])
    assert (tmp_path / "benchmark.png").stat().st_size > 0
    assert "| case |" in (tmp_path / "BENCHMARKS.md").read_text()
    assert results["machine"]["cores"] >= 1
