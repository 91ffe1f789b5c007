"""Smoke test of the benchmark: every case runs and is reported (timings are never asserted)."""
import json
import math

import pytest

from tools import bench

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
    # The owner's kernels beside the AES-CTR floor (the floor's own row first, at 1.0x).
    kernels = results["owner_kernels"]
    assert kernels and kernels[0]["x_aes_floor"] == 1.0 and all(r["ns_per_param"] > 0 for r in kernels)
    assert {"verify (unmask + checks)", "hand-off + decode (one part)"} <= {r["stage"] for r in kernels}
    assert (tmp_path / "benchmark.png").stat().st_size > 0
    report = (tmp_path / "BENCHMARKS.md").read_text()
    assert "| case |" in report and "| stage | 10,000 params: ns/param (x AES) |" in report
    # The service-mode case beside both plaintext anchors: MWMS and the in-graph MirroredStrategy of linear-1e2.
    assert "| in-graph MirroredStrategy ms/step |" in report and "(linear-1e2) |" in report, report
    assert results["machine"]["cores"] >= 1
    # The service case beside this machine's floors, from per-byte costs measured in the same run.
    (service,) = [c for c in results["cases"] if c.get("service")]
    floors = service["floors"]
    assert all(v > 0 for v in floors["ns_per_byte"].values()) and floors["cores"] >= 1, floors
    for kind in ("cipher", "transport"):
        assert floors[kind]["step_ratio"] >= 1.0 and floors[kind]["owner_ratio"] > 1.0, floors
        assert floors[kind]["cpu_ratio"] > 1.0 and floors[kind]["ns_per_param"]["server1"] > 0, floors
    assert "| step CPU x MWMS (floors) |" in report and f"| {service['name']} | {floors['cores']} |" in report


def test_the_service_alone_reports_cpu_per_parameter_and_leaves_no_server(capsys):
    import re
    import subprocess

    from tools.bench import service_alone

    assert service_alone.main(["--elements", "1000", "--steps", "3", "--owners", "3"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 2, lines  # the data plane and gRPC side by side
    for line, path in zip(lines, ("data plane", "gRPC")):
        assert line.startswith(f"[service-alone] 1,000 elements, 3 owners, {path} "), line
        figures = [float(v) for v in re.findall(r"(?:server0|server1|clients?) (\d+\.\d+)", line)]
        assert len(figures) == 6 and all(v > 0 for v in figures), line
        floors = re.search(r"transport floor \(.*\) s0 (\d+\.\d+), s1 (\d+\.\d+), owner (\d+\.\d+)", line)
        assert floors and all(float(v) > 0 for v in floors.groups()), line
        pids = re.search(r"server pids (\d+), (\d+)", line).groups()
        assert subprocess.run(["ps", "-p", ",".join(pids)], capture_output=True, check=False).returncode == 1


def test_the_link_cost_reports_both_links_per_byte(capsys):
    import re

    from tools.bench import link_cost

    assert link_cost.main(["--megabytes", "1", "--repeats", "1"]) == 0
    line = capsys.readouterr().out.strip()
    figures = re.search(r"python link (\d+\.\d+) ns/B, c link (\d+\.\d+) ns/B, c/python (\d+\.\d+)", line)
    assert figures and all(float(v) > 0 for v in figures.groups()), line


def test_the_flower_comparison_names_the_missing_virtualenv_and_the_make_target(tmp_path):
    from tools.bench import flower_compare

    with pytest.raises(FileNotFoundError, match=r"make bench-flower"):
        flower_compare.flower([1000], 2, 1, python=str(tmp_path / "no-such-python"))


def test_flower_secagg_plus_runs_in_flowers_own_virtualenv_and_decodes_the_mean():
    # Runs only where `make bench-flower` built .venv-flower (CI does not: the bench is not a test); the
    # driver itself checks Flower's decoded mean against the plain mean to Flower's quantization step.
    import os

    from tools.bench import flower_compare

    if not os.path.exists(flower_compare.FLOWER_PYTHON):
        pytest.skip(f"{flower_compare.FLOWER_PYTHON} is not built (make bench-flower builds it)")
    (row,) = flower_compare.flower([2000], 3, 1)
    assert row["elements"] == 2000 and row["clients"] == 3 and row["clients_cpu_ms"] > 0 and row["server_cpu_ms"] > 0
    assert row["max_error"] < 0.01, row


def test_the_deployed_flower_bench_stops_every_descendant_even_in_its_own_session():
    # Flower's SuperLink starts its SuperExec in a new session; the bench's stop must still end it.
    import os
    import subprocess
    import sys
    import time

    from tools.bench import flower_deployed

    script = ("import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'], "
              "start_new_session=True); time.sleep(60)")
    parent = subprocess.Popen([sys.executable, "-c", script])
    deadline = time.monotonic() + 20
    while len(flower_deployed._descendants([parent.pid])) < 2 and time.monotonic() < deadline:  # pylint: disable=W0212
        time.sleep(0.05)
    tree = flower_deployed._descendants([parent.pid])  # pylint: disable=protected-access
    assert len(tree) == 2, tree
    assert flower_deployed._stop([parent], set()) == []  # pylint: disable=protected-access
    assert not [pid for pid in tree if flower_deployed._alive(pid)]  # pylint: disable=protected-access
    assert parent.returncode is not None and not os.path.exists(f"/proc/{parent.pid}/status")


def test_the_deployed_flower_bench_certificates_serve_tls_for_127_0_0_1(tmp_path):
    import ssl

    from tools.bench import flower_deployed

    paths = flower_deployed.make_tls(str(tmp_path))
    server = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server.load_cert_chain(paths["cert"], paths["key"])
    client = ssl.create_default_context(cafile=paths["ca"])
    import socket
    import threading

    with socket.create_server(("127.0.0.1", 0)) as listener:
        port = listener.getsockname()[1]

        def serve():
            conn, _ = listener.accept()
            with server.wrap_socket(conn, server_side=True) as tls:
                tls.sendall(b"ok")

        thread = threading.Thread(target=serve, daemon=True)
        thread.start()
        with socket.create_connection(("127.0.0.1", port), timeout=10) as raw:
            with client.wrap_socket(raw, server_hostname="127.0.0.1") as tls:
                assert tls.recv(2) == b"ok"
        thread.join(timeout=10)


def test_flower_secagg_plus_on_its_deployment_runtime_reports_a_round_and_leaves_no_process(capsys):
    # Flower's own SuperLink and SuperNodes with TLS on loopback (only where `make bench-flower` built
    # .venv-flower): one SecAgg+ round at 1e3 elements, 2 clients, beside our service; the printed JSON
    # parses, the released mean is checked by the ServerApp, and every Flower process is gone afterwards.
    import os

    from tools.bench import flower_deployed

    if not os.path.exists(os.path.join(flower_deployed.FLOWER_VENV, "bin", "flower-superlink")):
        pytest.skip(f"{flower_deployed.FLOWER_VENV} is not built (make bench-flower builds it)")
    assert flower_deployed.main(["--elements", "1000", "--clients", "2", "--rounds", "1", "--steps", "3",
                                 "--timeout", "180", "--json"]) == 0
    (row,) = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    (flower_round,) = row["flower"]["rounds"]
    assert flower_round["wall_s"] > 0 and flower_round["cpu_s"] > 0, row
    assert flower_round["max_error"] < flower_deployed.max_error(2), row
    assert row["ours"]["wall_ms"] > 0 and row["ours"]["cpu_ms"] > 0, row
    assert len(row["flower"]["pids"]) >= 3 and row["flower"]["left_alive"] == [], row
    assert not [pid for pid in row["flower"]["pids"] if os.path.exists(f"/proc/{pid}")
                and open(f"/proc/{pid}/stat", encoding="ascii").read().rsplit(")", 1)[1].split()[0] != "Z"], row
