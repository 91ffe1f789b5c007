"""The `tfe-estimator` command line: parsing and clear errors."""
import json
import os
import subprocess
import sys
import time

import pytest

from tfe_estimator.tools import cli


def test_launch_arguments_are_parsed():
    args = cli.parse_args(["launch", "--workers", "2", "--evaluator", "--protocol", "aby3",
                           "--task-cwd", "o/{job}-{index}", "--max-restarts", "1", "--", "python", "t.py", "--x"])
    assert (args.command, args.workers, args.evaluator, args.protocol) == ("launch", 2, True, "aby3")
    assert args.cmd == ["--", "python", "t.py", "--x"] and args.max_restarts == 1


def test_pass_through_commands_keep_their_arguments():
    assert cli.parse_args(["bench", "--quick"]).args == ["--quick"]
    assert cli.parse_args(["k8s", "--help"]).args == ["--help"]


def _run(*argv, env=None):
    return subprocess.run([sys.executable, "-m", "tfe_estimator.tools.cli", *argv], capture_output=True, text=True,
                          timeout=120, env=env)


def test_server_without_tf_config_is_a_clear_error(monkeypatch):
    monkeypatch.delenv("TF_CONFIG", raising=False)
    out = _run("server")
    assert out.returncode == 2
    assert "`tfe-estimator server` needs TF_CONFIG with a cluster" in out.stderr


def test_server_for_a_chief_task_is_refused(monkeypatch):
    cluster = {"chief": ["127.0.0.1:1"], "tfe": ["127.0.0.1:2", "127.0.0.1:3", "127.0.0.1:4"]}
    monkeypatch.setenv("TF_CONFIG", json.dumps({"cluster": cluster, "task": {"type": "chief", "index": 0}}))
    out = _run("server")
    assert out.returncode == 2 and "runs the 'tfe' tasks, but TF_CONFIG says this task is chief:0" in out.stderr


def test_launch_without_a_command_is_a_clear_error():
    out = _run("launch", "--workers", "1")
    assert out.returncode == 2 and "launch needs a command" in out.stderr


@pytest.mark.parametrize("bad", ["--workers=-2", "--protocol=spdz"])
def test_launch_with_bad_values_is_a_clear_error(bad):
    out = _run("launch", bad, "--", "true")
    assert out.returncode == 2 and ("--workers must be" in out.stderr or "Unknown protocol 'spdz'" in out.stderr)


def test_k8s_help_names_the_program_users_type(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["k8s", "--help"])
    assert e.value.code == 0
    assert capsys.readouterr().out.startswith("usage: tfe-estimator k8s ")


def test_launch_fault_options_are_parsed():
    args = cli.parse_args(["launch", "--evaluator-restarts", "0", "--down-timeout", "30", "--final-eval-timeout", "60",
                           "--log-dir", "logs", "--", "python", "t.py"])
    assert (args.evaluator_restarts, args.down_timeout, args.final_eval_timeout, args.log_dir) == (0, 30.0, 60.0, "logs")


def test_the_one_server_command_is_what_the_cli_runs():
    from tfe_estimator.cluster.launcher import SERVER_COMMAND
    from tfe_estimator.cluster.server import server_command

    assert SERVER_COMMAND == server_command(sys.executable)
    assert cli.parse_args([server_command()[-1]]).command == SERVER_COMMAND[-1] == "server"


@pytest.mark.parametrize("missing", [None, "root (network namespaces need CAP_NET_ADMIN)"])
def test_the_cluster_demo_uses_isolate_tls_when_it_can_and_says_why_not(missing, monkeypatch, capsys):
    from tfe_estimator.cluster.isolation import IsolatedCluster
    from tfe_estimator.tools import demo, demo_cluster

    calls = []
    monkeypatch.setattr(IsolatedCluster, "missing", staticmethod(lambda tls: missing))
    monkeypatch.setattr(demo_cluster, "run_cluster_demo", lambda **kwargs: calls.append(kwargs) or {})
    monkeypatch.setattr(demo, "format_comparison", lambda results, title: title)
    assert cli.main(["demo", "--cluster", "--steps", "3"]) == 0
    out = capsys.readouterr().out
    assert calls[0]["isolate_tls"] is (missing is None)
    if missing is None:
        assert "every link mutual TLS (--isolate --tls)" in out and "cluster (namespaces with mutual TLS)" in out
    else:
        assert f"without --isolate --tls (it needs {missing})" in out


def test_version_prints_the_package_version(capsys):
    from tfe_estimator._version import __version__

    with pytest.raises(SystemExit) as e:
        cli.main(["--version"])
    assert e.value.code == 0
    assert capsys.readouterr().out.strip() == f"tfe-estimator {__version__}"


def test_k8s_renders_without_tensorflow_in_under_3_seconds(tmp_path):
    # Prepare: the real command, then a check that TensorFlow was never imported.
    code = ("import sys\nfrom tfe_estimator.tools import cli\n"
            "rc = cli.main(sys.argv[1:])\n"
            "assert 'tensorflow' not in sys.modules, 'tfe-estimator k8s imported TensorFlow'\n"
            "sys.exit(rc)\n")
    out_file = tmp_path / "cluster.yaml"
    argv = ["k8s", "--name", "demo", "--image", "example.com/train:1", "--workers", "2", "--tls",
            "-o", str(out_file), "--", "python", "train.py"]
    # Execute
    start = time.monotonic()
    out = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, timeout=60)
    elapsed = time.monotonic() - start
    # Assert
    assert out.returncode == 0, out.stderr[-2000:]
    assert "kind: NetworkPolicy" in out_file.read_text()
    assert elapsed < 3.0, f"tfe-estimator k8s took {elapsed:.1f} s"


def test_bench_and_attack_come_from_the_checkout_not_the_package():
    # The developer tools live in tools/ (not installed); from a checkout the CLI finds them.
    import pathlib

    root = pathlib.Path(cli.__file__).resolve().parents[2]
    for name in ("bench", "attack"):
        assert pathlib.Path(cli._checkout_tool(name).__file__).resolve().is_relative_to(root / "tools")


def _service_server_env(tmp_path, task_type="tfe", index=1, mode="service"):
    from tfe_estimator.cluster import certs

    import portpicker

    certs.make_cluster_certs(str(tmp_path), [("chief", 0), ("worker", 0), ("tfe", 0), ("tfe", 1)], cluster="t")
    ports = [portpicker.pick_unused_port() for _ in range(2)]
    cluster = {"chief": ["127.0.0.1:1"], "worker": ["127.0.0.1:2"], "tfe": [f"127.0.0.1:{p}" for p in ports]}
    return {**os.environ, "TF_CONFIG": json.dumps({"cluster": cluster, "task": {"type": task_type, "index": index}}),
            "TFE_ESTIMATOR_CLUSTER_MODE": mode, "TFE_ESTIMATOR_TLS_DIR": str(tmp_path)}, cluster


def test_server_limits_reach_the_aggregation_server_and_bad_ones_are_named(tmp_path):
    import threading

    from tfe_estimator.cluster.server import run_server
    from tfe_estimator.service import OwnerClient, ServiceError, TlsFiles

    env, cluster = _service_server_env(tmp_path)
    out = _run("server", "--max-elements", "0", env=env)
    assert out.returncode == 2 and "max_elements=0 must be an integer >= 1" in out.stderr, out.stderr
    out = _run("server", "--max-channels", "2", env={**env, "TFE_ESTIMATOR_CLUSTER_MODE": "between-graph"})
    assert out.returncode == 2 and "between-graph mode is retired. Use 'service'" in out.stderr, out.stderr
    out = _run("server", "--max-channels", "2", env={**env, "TFE_ESTIMATOR_CLUSTER_MODE": "in-graph"})
    assert out.returncode == 2 and "--max-channels configure the aggregation service" in out.stderr, out.stderr
    stop = threading.Event()
    server = threading.Thread(target=run_server, args=(env, stop, {"max_elements": 4}))
    server.start()
    client = OwnerClient(cluster["tfe"], TlsFiles.from_dir(str(tmp_path), "chief", 0), timeout_secs=30)
    try:
        import numpy as np

        with pytest.raises(ServiceError) as e:  # server1 alone: the share's size is checked before any wait
            client._call(1, "Contribute", client._messages["ContributeRequest"](  # pylint: disable=protected-access
                channel="c", step=0, ring_bits=64, num_elements=5, payload=np.zeros(5, "<i8").tobytes()))
        assert "num_elements=5 is above this server's max_elements=4" in e.value.details
    finally:
        client.close()
        stop.set()
        server.join(timeout=30)
    assert not server.is_alive()


def test_server_data_port_opens_the_data_plane_on_the_service_host_and_bad_ones_are_named(tmp_path):
    import socket
    import threading

    from tfe_estimator.cluster.server import run_server
    from tfe_estimator.service import OwnerClient, TlsFiles

    env, cluster = _service_server_env(tmp_path)
    service_port = int(cluster["tfe"][1].rsplit(":", 1)[1])
    for bad, says in (("70000", "--data-port 70000 is not a TCP port: pass 1..65535 (or 0 for any free port)"),
                      ("-1", "--data-port -1 is not a TCP port"),
                      (str(service_port), f"--data-port {service_port} is this server's service port")):
        out = _run("server", "--data-port", bad, env=env)
        assert out.returncode == 2 and says in out.stderr, out.stderr
    out = _run("server", "--data-port", "0", env={**env, "TFE_ESTIMATOR_CLUSTER_MODE": "in-graph"})
    assert out.returncode == 2 and "--data-port configure the aggregation service" in out.stderr, out.stderr
    assert cli.parse_args(["server"]).data_port is None  # no data plane unless the operator opens one
    for data_port in (None, 0):
        stop = threading.Event()
        server = threading.Thread(target=run_server, args=(env, stop), kwargs={"data_port": data_port})
        server.start()
        client = OwnerClient(cluster["tfe"], TlsFiles.from_dir(str(tmp_path), "chief", 0), timeout_secs=30)
        try:  # what every owner asks each server (`OwnerClient._plane`)
            port = client._call(1, "DataPlane", client._messages["DataPlaneRequest"]()).port  # pylint: disable=protected-access
            if data_port is None:
                assert port == 0
            else:
                assert port not in (0, service_port)
                with socket.create_connection(("127.0.0.1", port), timeout=5):  # the service port's host
                    pass
        finally:
            client.close()
            stop.set()
            server.join(timeout=30)
        assert not server.is_alive()


def test_a_restarted_server_binds_its_data_port_again_despite_time_wait(tmp_path):
    """`launch --max-restarts` restarts a server at the same ports: the connections the old one closed first
    (FIN_WAIT2, then TIME_WAIT on its side) must not keep its data port (else the launcher re-plans the cluster on
    new ports). Here the owner keeps its end open across the restart."""
    import socket
    import threading

    import portpicker

    from tfe_estimator.cluster.server import run_server
    from tfe_estimator.service import TlsFiles, frames, wire
    from tfe_estimator.service.tls import server_name

    env, _ = _service_server_env(tmp_path)
    owner = TlsFiles.from_dir(str(tmp_path), "chief", 0)
    head = wire.messages()["ForwardRequest"](channel="c", step=0, ring_bits=64).SerializeToString()
    data_port = portpicker.pick_unused_port()
    kept = []
    for attempt in range(2):
        stop, failed = threading.Event(), []

        def serve(stop=stop, failed=failed):
            try:
                run_server(env, stop, data_port=data_port)
            except Exception as e:  # pylint: disable=broad-except
                failed.append(e)

        server = threading.Thread(target=serve)
        server.start()
        conn = None
        try:
            deadline = time.monotonic() + 30
            while conn is None and not failed and time.monotonic() < deadline:
                try:
                    raw = socket.create_connection(("127.0.0.1", data_port), timeout=5)
                except ConnectionRefusedError:
                    time.sleep(0.05)
                    continue
                conn = owner.ssl_client_context(1).wrap_socket(raw, server_hostname=server_name(owner, 1))
            assert conn is not None and not failed, (attempt, failed)
            # An owner's refused call without payload: answered, and the connection stays open for the next one.
            conn.sendall(frames.request_header("ForwardBlinded", len(head), 0, 0) + head)
            code, _, length = frames.parse_reply(frames.read_exact(conn, frames.REPLY.size))
            message = frames.read_exact(conn, length)
            assert code.name == "PERMISSION_DENIED" and b"may not call ForwardBlinded" in message
        finally:
            stop.set()  # the server closes the connection first; the owner has not closed its end yet
            server.join(timeout=30)
            if conn is not None:
                kept.append(conn)
        assert not server.is_alive()
    for conn in kept:
        conn.close()
