"""Multi-process loopback clusters: train_and_evaluate, data locality, faults, cleanup."""
import io
import json
import re
import os
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import tensorflow as tf

from tfe_estimator.tools.demo_cluster import COLUMNS, TEST_FILE, TRAIN_FILE
from tfe_estimator.cluster.launcher import Launcher
from launch_log import report

pytestmark = pytest.mark.multiprocess

FEATURES = COLUMNS[:-1]
TRUE = {"age": 10.0, "sex": -7.0}  # the chief's data teaches age, the worker's sex


def _write(path, x, y):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    np.savetxt(path, np.column_stack([x, y]), delimiter=",", fmt="%.8g")


def _owner_data(workdir, rows=256):
    """Each owner's folder holds data only it can teach the model from."""
    rng = np.random.RandomState(0)
    for owner, feature in (("chief-0", "age"), ("worker-0", "sex")):
        x = np.zeros((rows, len(FEATURES)), np.float32)
        x[:, FEATURES.index(feature)] = rng.randn(rows)
        _write(os.path.join(workdir, owner, TRAIN_FILE), x, x @ _true_weights() + 3.0)
    x = np.zeros((90, len(FEATURES)), np.float32)
    x[:, :2] = rng.randn(90, 2)
    _write(os.path.join(workdir, "evaluator-0", TEST_FILE), x, x @ _true_weights() + 3.0)


def _true_weights():
    return np.array([TRUE.get(name, 0.0) for name in FEATURES], np.float32)


def _weights(model_dir):
    checkpoint = tf.train.latest_checkpoint(model_dir)
    return np.array([tf.train.load_variable(checkpoint, f"linear/linear_model/{n}/weights")[0, 0] for n in FEATURES])


def _launcher(workdir, mode, steps, extra=(), **kwargs):
    command = [sys.executable, "-m", "tfe_estimator.tools.demo_cluster", "--mode", mode,
               "--model-dir", os.path.join(workdir, f"model-{mode}"), "--steps", str(steps),
               "--learning-rate", "0.1", *extra] + (["--audit"] if mode == "secure" else [])
    return Launcher(command, workers=1, evaluator=True, task_cwd=os.path.join(workdir, "{job}-{index}"),
                    out=kwargs.pop("out", io.StringIO()), cluster_mode="in-graph", **kwargs)


def _assert_all_gone(launcher):
    for task in launcher.tasks:
        assert task.process.poll() is not None, f"{task.name} is still running"
        assert not _alive(task.process.pid)


def _interleaved_owner_data(rows=256):
    """`_owner_data`'s rows in `run_cluster_demo`'s layout (training row i goes to owner i % 2, the chief
    first): the chief's rows teach only age, the worker's only sex."""
    rng = np.random.RandomState(0)
    x = np.zeros((2 * rows, len(FEATURES)), np.float32)
    for owner, feature in enumerate(("age", "sex")):
        x[owner::2, FEATURES.index(feature)] = rng.randn(rows)
    x_test = np.zeros((90, len(FEATURES)), np.float32)
    x_test[:, :2] = rng.randn(90, 2)
    return x, x @ _true_weights() + 3.0, x_test, x_test @ _true_weights() + 3.0, FEATURES


def test_train_and_evaluate_on_loopback_cluster_matches_plaintext_and_keeps_data_local(tmp_path):
    # Prepare: two owners, different data in their own folders, one relative pattern. The run is also the
    # evaluator's issue setting: checkpoints every 50 steps, keep_checkpoint_max=5 (the default), 300 steps,
    # EvalSpec(start_delay_secs=1, throttle_secs=1). A secure evaluation graph takes seconds to build; the chief
    # trains all 300 steps meanwhile and deletes model.ckpt-0.
    # Execute: the secure cluster and its plaintext in-graph twin, launched by the cluster demo
    # (`tfe-estimator demo --cluster`), whose own output is checked here too (one launch serves both).
    from tfe_estimator.tools.demo_cluster import run_cluster_demo

    out = io.StringIO()
    results = run_cluster_demo(
        steps=300, workdir=str(tmp_path), out=out, data=_interleaved_owner_data(), audit=True,
        task_args=["--learning-rate", "0.1", "--save-checkpoints-steps", "50", "--keep-checkpoint-max", "5",
                   "--start-delay-secs", "1"])
    logs = {}
    for mode in ("secure", "plaintext"):
        log_dir = tmp_path / f"logs-{mode}"
        _assert_all_gone(results[mode]["launcher"])
        logs[mode] = {name: (log_dir / name).read_text() for name in os.listdir(log_dir)}
        # The demo prints one line per run (where its task logs are), not the tasks' logs: each task's own file.
        assert sorted(logs[mode]) == ["chief-0.log", "evaluator-0.log", "launch.log", "tfe-0.log", "tfe-1.log",
                                      "tfe-2.log", "worker-0.log"]
        assert results[mode]["model_dir"] == str(tmp_path / f"model-{mode}")
        assert results[mode]["log_dir"] == str(log_dir)
        assert "Saving dict for global step 300" in logs[mode]["evaluator-0.log"]
    printed = out.getvalue().splitlines()
    assert len(printed) == 2, printed  # one line per run: where its task logs are
    assert printed[0] == f"secure: training on the cluster; task logs in {tmp_path}/logs-secure/"
    log = logs["secure"]
    assert "none takes or produces a float tensor" in log["chief-0.log"]  # the chief audited its graph
    assert "audit of the partitioned graphs of run 1" in log["chief-0.log"]  # and what the parties received
    # Assert: the same model, learned from both owners' files.
    secure, plaintext = results["secure"]["weights"], results["plaintext"]["weights"]
    np.testing.assert_allclose(secure, plaintext, atol=1e-2)
    np.testing.assert_allclose(secure, _true_weights(), atol=0.5)
    eval_dir = os.path.join(results["secure"]["model_dir"], "eval")
    assert any(f.startswith("events.out.tfevents") for f in os.listdir(eval_dir)), "no eval summaries"
    # The secure evaluator survived checkpoint rotation and a chief that finished first.
    assert "evaluator:0 died" not in log["launch.log"]  # no hiccup was papered over by a restart
    # Which checkpoint the evaluator finds first is a race with the chief (step 0 on a quiet machine, 100 under
    # load, 300 if it starts late); whatever it chose it evaluated (or said that rotation took it away, which
    # the evaluator's own tests cover), in order, and it ended on the last one.
    evaluated = [int(s) for s in re.findall(r"Saving dict for global step (\d+)", log["evaluator-0.log"])]
    assert evaluated and evaluated == sorted(evaluated), report(log["evaluator-0.log"], 6000)
    assert evaluated[-1] == 300, report(log["evaluator-0.log"], 6000)


def test_aby3_cluster_trains_and_keeps_plaintext_off_the_servers(tmp_path):
    workdir = str(tmp_path)
    _owner_data(workdir)
    launcher = _launcher(workdir, "secure", steps=120, protocol="aby3")
    status = launcher.run()
    log = launcher._out.getvalue()
    assert status == 0, report(log)
    assert "cluster (aby3)" in log
    assert "none takes or produces a float tensor" in log  # the chief's audit of its training graph
    assert "audit of the partitioned graphs of run 1" in log  # and what the parties received
    np.testing.assert_allclose(_weights(os.path.join(workdir, "model-secure")), _true_weights(), atol=0.5)
    _assert_all_gone(launcher)


# One case, for the tf29 subset (the Makefile names its id): test_faults.py's restart test, not in that subset,
# kills every role of one cluster, tfe servers and the data owner among them, each restarted after a delay.
@pytest.mark.parametrize("job, delay", [("tfe", 0.0)])
def test_a_dead_task_is_restarted_and_training_resumes(job, delay, tmp_path, monkeypatch):
    # A tfe server dies mid-training and is restarted at once; training resumes from the last checkpoint.
    monkeypatch.setenv("TF_CPP_MIN_LOG_LEVEL", "0")  # TensorFlow's "still waiting" is an INFO line
    workdir = str(tmp_path)
    _owner_data(workdir)
    launcher = _launcher(workdir, "secure", steps=400, max_restarts=1, restart_delay=delay)
    status = []
    runner = threading.Thread(target=lambda: status.append(launcher.run()))
    runner.start()
    try:
        model_dir = os.path.join(workdir, "model-secure")
        deadline = time.monotonic() + 240
        while not os.path.exists(os.path.join(model_dir, "model.ckpt-100.index")):
            assert time.monotonic() < deadline and runner.is_alive(), report(launcher._out.getvalue())
            time.sleep(0.2)
        victim = launcher.task(job, 1 if job == "tfe" else 0)
        os.killpg(victim.process.pid, signal.SIGKILL)
    finally:
        runner.join(timeout=600)
    log = launcher._out.getvalue()
    assert status == [0], report(log)
    assert f"{victim.name} died with status -9 (killed by SIGKILL); restarting it" in log
    assert "Saving dict for global step 400" in log
    np.testing.assert_allclose(_weights(model_dir), _true_weights(), atol=0.5)
    _assert_all_gone(launcher)


def _sleeper(seconds):
    return [sys.executable, "-c", f"import time; time.sleep({seconds})"]


def test_a_dying_worker_stops_the_cluster_and_is_named():
    out = io.StringIO()
    launcher = Launcher([sys.executable, "-c", "import os, time, json; "
                         "t = json.loads(os.environ['TF_CONFIG'])['task']; "
                         "time.sleep(60 if t['type'] == 'chief' else 1); raise SystemExit(3)"],
                        workers=1, out=out, server_command=_sleeper(60))
    start = time.monotonic()
    assert launcher.run() == 3
    assert time.monotonic() - start < 30
    assert "worker:0 died with status 3 while the chief was training; stopping the cluster" in out.getvalue()
    _assert_all_gone(launcher)


def test_exit_status_is_the_chiefs_and_every_line_is_prefixed():
    out = io.StringIO()
    launcher = Launcher([sys.executable, "-c", "import os, json; t = json.loads(os.environ['TF_CONFIG'])['task'];"
                         "print('hello from', t['type']); raise SystemExit(5 if t['type'] == 'chief' else 0)"],
                        workers=2, out=out, server_command=_sleeper(60))
    assert launcher.run() == 5
    text = out.getvalue()
    assert "[chief:0] hello from chief" in text and "[worker:1] hello from worker" in text
    _assert_all_gone(launcher)


def test_ctrl_c_leaves_no_process_behind(tmp_path):
    pid_dir = tmp_path / "pids"
    pid_dir.mkdir()
    # Each task records its pid and starts a grandchild, which must die too.
    script = (f"import os, subprocess, sys, time, json; t = json.loads(os.environ['TF_CONFIG'])['task'];"
              f"c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)']);"
              f"open(os.path.join({str(pid_dir)!r}, t['type'] + str(t['index'])), 'w').write(f'{{os.getpid()}} {{c.pid}}');"
              f"time.sleep(120)")
    proc = subprocess.Popen([sys.executable, "-m", "tfe_estimator.tools.cli", "launch", "--workers", "1", "--evaluator",
                             "--", sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 60
    while len(os.listdir(pid_dir)) < 3:
        assert time.monotonic() < deadline, "tasks did not start"
        time.sleep(0.2)
    time.sleep(1)
    proc.send_signal(signal.SIGINT)
    output, _ = proc.communicate(timeout=60)
    assert proc.returncode == 130, output[-3000:]
    assert "interrupted: stopping the cluster" in output
    pids = [int(p) for f in os.listdir(pid_dir) for p in (pid_dir / f).read_text().split()]
    assert len(pids) == 6
    deadline = time.monotonic() + 10
    while any(_alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not [pid for pid in pids if _alive(pid)]


def _alive(pid):
    """True if `pid` runs; a zombie (dead, waiting for its reaper) does not count."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_launch_refuses_bad_arguments():
    with pytest.raises(ValueError, match="--workers must be an integer >= 0, got -1"):
        Launcher(["true"], workers=-1)
    with pytest.raises(ValueError, match="launch needs a command"):
        Launcher([], workers=1)
    with pytest.raises(ValueError, match="Unknown protocol 'spdz'"):
        Launcher(["true"], protocol="spdz")
    with pytest.raises(ValueError, match=r"--tls adds stunnel sidecars to the TensorFlow-runtime modes; in service "
                                         r"mode .* Drop --tls \(--isolate alone runs the service cluster"):
        Launcher(["true"], cluster_mode="service", isolate=True, tls=True)


def _server_flags(launcher):
    """tfe index -> the argv after the server command (its --data-port, if any)."""
    return {t.index: t.argv[t.argv.index("server") + 1:] for t in launcher.tasks if t.job == "tfe"}


def test_service_mode_plans_a_data_port_and_a_metrics_port_per_server_and_in_graph_none():
    launcher = Launcher(["true"], workers=1, cluster_mode="service")
    flags = _server_flags(launcher)
    ports = {k: int(argv[1]) for k, argv in flags.items()}
    metrics = {k: int(argv[3]) for k, argv in flags.items()}
    assert all(argv[0::2] == ["--data-port", "--metrics-port"] for argv in flags.values()), flags
    assert ports == launcher.data_ports and metrics == launcher.metrics_ports, flags
    tf_ports = {int(a.rsplit(":", 1)[1]) for addresses in launcher.cluster.jobs.values() for a in addresses}
    planned = set(ports.values()) | set(metrics.values())
    assert len(planned) == 4 and not planned & tf_ports, (ports, metrics, tf_ports)
    assert [argv[0] for argv in _server_flags(Launcher(["true"], workers=1, cluster_mode="service",
                                                       data_plane=False)).values()] == ["--metrics-port"] * 2
    assert all(argv == [] for argv in _server_flags(Launcher(["true"], workers=1, cluster_mode="in-graph")).values())
    isolated = Launcher(["true"], workers=1, cluster_mode="service", isolate=True)  # planned, never started
    tf_ports = set(isolated.isolation.tf_ports.values())
    assert isolated.data_ports == {0: max(tf_ports) + 1, 1: max(tf_ports) + 2}
    assert [isolated.task("tfe", k).argv[-2:] for k in (0, 1)] == [["--data-port", "7004"], ["--data-port", "7005"]]
    assert isolated.metrics_ports == {}  # an isolated server opens only the ports owners call


_OWNER_PROBES = """
import json, os, subprocess, sys, urllib.request
from tfe_estimator.service import OwnerClient, TlsFiles
network = json.load(open(sys.argv[1]))
jobs = json.loads(os.environ["TF_CONFIG"])["cluster"]
c = OwnerClient(jobs["tfe"], TlsFiles.from_dir(os.environ["TFE_ESTIMATOR_TLS_DIR"], "chief", 0), timeout_secs=60)
print("data ports", [c._call(k, "DataPlane", c._messages["DataPlaneRequest"]()).port for k in (0, 1)], flush=True)
c.close()
cli = [sys.executable, "-m", "tfe_estimator.tools.cli"]
print("status exit", subprocess.run(cli + ["status"]).returncode, flush=True)  # as this owner
for k in (0, 1):  # each server's own probe, in that server's environment
    env = dict(os.environ, TF_CONFIG=json.dumps({"cluster": jobs, "task": {"type": "tfe", "index": k}}),
               TFE_ESTIMATOR_TLS_DIR=network["cert_dirs"]["tfe:%d" % k])
    print("health exit", subprocess.run(cli + ["health"], env=env).returncode, flush=True)
for name, port in sorted(network["metrics_ports"].items()):
    page = urllib.request.urlopen("http://127.0.0.1:%d/metrics" % port, timeout=10).read().decode()
    print("metrics", name, [line for line in page.splitlines() if line.startswith("tfe_aggregation_owners ")])
"""


def test_a_launched_service_cluster_serves_a_data_plane_health_and_metrics(tmp_path):
    """End to end: launch -> `tfe-estimator server --data-port --metrics-port` -> the DataPlane call an owner
    makes, `tfe-estimator status` as that owner, `tfe-estimator health` as each server, each server's metrics."""
    out, network_file = io.StringIO(), str(tmp_path / "net.json")
    script = tmp_path / "probes.py"
    script.write_text(_OWNER_PROBES)
    launcher = Launcher([sys.executable, str(script), network_file], workers=0, out=out, cluster_mode="service",
                        network_file=network_file, down_timeout=60)
    assert launcher.run() == 0, out.getvalue()
    text = out.getvalue()
    ports = [launcher.data_ports[k] for k in (0, 1)]
    assert f"[chief:0] data ports {ports}" in text, text
    assert f"aggregation servers' data planes: tfe:0=port {ports[0]} tfe:1=port {ports[1]}" in text
    with open(network_file, encoding="utf-8") as f:
        network = json.load(f)
    metrics = [launcher.metrics_ports[k] for k in (0, 1)]
    assert network["data_ports"] == {"tfe:0": ports[0], "tfe:1": ports[1]}
    assert network["metrics_ports"] == {"tfe:0": metrics[0], "tfe:1": metrics[1]} and len(set(metrics + ports)) == 4
    servers = launcher.cluster.jobs["tfe"]
    for k in (0, 1):
        assert re.search(rf"\[chief:0\] tfe:{k} +{re.escape(servers[k])} +SERVING", text), text
        host, port = servers[k].rsplit(":", 1)
        assert f"[chief:0] tfe:{k} at {host}:{port}: SERVING" in text, text
        assert f"[chief:0] metrics tfe:{k} ['tfe_aggregation_owners 1.0']" in text, text
    assert text.count("[chief:0] status exit 0") == 1 and text.count("[chief:0] health exit 0") == 2, text
