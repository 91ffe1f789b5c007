"""TfeRunConfig and TfeStrategy: settings, validation, replace(), devices."""
import json
import subprocess
import sys

import pytest
import tensorflow as tf

from tfe_estimator import TfeRunConfig, TfeStrategy


@pytest.fixture(autouse=True)
def _no_tf_config(monkeypatch):
    monkeypatch.delenv("TF_CONFIG", raising=False)


def test_defaults_are_two_local_replicas_with_their_own_server_devices():
    config = TfeRunConfig(model_dir="/tmp/unused")
    assert isinstance(config, tf.estimator.RunConfig)
    assert (config.tfe_protocol, config.precision, config.num_replicas) == ("pond", "low", 2)
    for strategy in (config.train_distribute, config.eval_distribute):
        assert isinstance(strategy, TfeStrategy)
        replicas = set(strategy.extended.worker_devices)
        servers = set(strategy.secure_aggregation.server_devices)
        assert len(replicas) == 2 and len(servers) == 3 and not replicas & servers
    assert config.session_config.device_count["CPU"] == 5
    assert config.protocol is None  # RunConfig's gRPC protocol keeps its meaning


def test_run_config_kwargs_pass_through_and_grpc_protocol_is_separate():
    config = TfeRunConfig(protocol="pond", num_replicas=3, save_checkpoints_steps=7,
                          tf_random_seed=3, grpc_protocol="grpc")
    assert config.save_checkpoints_steps == 7 and config.tf_random_seed == 3
    assert config.protocol == "grpc" and config.tfe_protocol == "pond"
    assert config.num_replicas == 3 and config.session_config.device_count["CPU"] == 6


def test_replace_keeps_and_changes_tfe_settings():
    config = TfeRunConfig(num_replicas=3, model_dir="/tmp/a")
    moved = config.replace(model_dir="/tmp/b")
    assert isinstance(moved, TfeRunConfig)
    assert moved.model_dir == "/tmp/b" and moved.num_replicas == 3 and moved.tfe_protocol == "pond"
    fewer = config.replace(num_replicas=2, precision="high")
    assert fewer.num_replicas == 2 and fewer.precision == "high"
    assert fewer.train_distribute.secure_aggregation.precision.name == "high"
    assert config.num_replicas == 3  # the original is untouched


def test_estimator_accepts_the_config():
    est = tf.estimator.LinearRegressor(
        feature_columns=[tf.feature_column.numeric_column("x")], config=TfeRunConfig(), model_dir="/tmp/unused2"
    )
    assert isinstance(est.config, TfeRunConfig) and est.config.num_replicas == 2


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(protocol="spdz"), ValueError, r"Unknown protocol 'spdz': use one of \['aby3', 'pond'\]"),
        (dict(precision="ultra"), ValueError, r"Unknown precision 'ultra': use one of \['high', 'low'\]"),
        (dict(num_replicas=0), ValueError, "num_replicas must be >= 1, got 0"),
        (dict(num_replicas=-3), ValueError, "num_replicas must be >= 1, got -3"),
        (dict(num_replicas=2.5), TypeError, "num_replicas must be an int >= 1, got 2.5"),
        (dict(num_replicas=True), TypeError, "num_replicas must be an int >= 1, got True"),
        (dict(num_replicas=200), ValueError, "cannot sum 200 replicas.*at most 128"),
        (dict(train_distribute=tf.distribute.OneDeviceStrategy("/cpu:0")), ValueError, "sets train_distribute itself"),
        (dict(grpc_protocol="carrier-pigeon"), ValueError, "protocol should be grpc"),
    ],
)
def test_bad_arguments_are_refused(kwargs, error, match):
    with pytest.raises(error, match=match):
        TfeRunConfig(**kwargs)


def test_strategy_can_be_used_directly():
    strategy = TfeStrategy(protocol="pond")
    assert strategy.num_replicas_in_sync == 2
    proto = strategy.update_config_proto(tf.compat.v1.ConfigProto())
    assert proto.device_count["CPU"] == 5


def test_importing_the_package_neither_imports_tf_encrypted_nor_starts_the_runtime():
    code = (
        "import sys, tfe_estimator, model_fns, input_fns\n"
        "from tensorflow.python.eager import context\n"
        "assert 'tf_encrypted' not in sys.modules, 'tf_encrypted imported'\n"
        "assert context.context()._context_handle is None, 'runtime started'\n"
        "assert tfe_estimator.__version__\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]


def test_tfe_task_is_told_to_run_the_server(monkeypatch):
    cluster = {"chief": ["localhost:1"], "tfe": ["localhost:2", "localhost:3", "localhost:4"]}
    monkeypatch.setenv("TF_CONFIG", json.dumps({"cluster": cluster, "task": {"type": "tfe", "index": 0}}))
    with pytest.raises(ValueError, match="run `tfe-estimator server`"):
        TfeRunConfig()


def test_protocol_other_than_the_launched_one_is_refused(monkeypatch):
    monkeypatch.setenv("TFE_ESTIMATOR_PROTOCOL", "aby3")
    with pytest.raises(ValueError, match="TfeRunConfig\\(protocol='pond'\\) but this task was launched for protocol 'aby3'"):
        TfeRunConfig(protocol="pond")
    assert TfeRunConfig(protocol="aby3").tfe_protocol == "aby3"


@pytest.mark.parametrize("protocol", ["pond", "aby3"])
@pytest.mark.parametrize("precision", ["low", "high"])
def test_every_protocol_and_precision_builds_or_is_refused_by_name(protocol, precision):
    from tfe_estimator.secure.protocols import supported_combinations

    if (protocol, precision) not in supported_combinations():  # ABY3 "high" on TensorFlow >= 2.10
        with pytest.raises(NotImplementedError, match=f"protocol={protocol!r} with precision={precision!r}"):
            TfeRunConfig(protocol=protocol, precision=precision)
        return
    config = TfeRunConfig(protocol=protocol, precision=precision)
    ops = config.train_distribute.secure_aggregation
    assert (ops.protocol, ops.precision.name) == (protocol, precision)


def test_the_secure_aggregation_summary_is_logged_once(caplog, monkeypatch):
    # Prepare: nothing logged yet in this process.
    from tfe_estimator.distribute import strategy as strategy_lib

    monkeypatch.setattr(strategy_lib, "_LOGGED", set())
    # Execute: a config builds a train and an eval strategy; replace() builds both again.
    with caplog.at_level("INFO", logger="tfe_estimator"):
        TfeRunConfig(num_replicas=3, model_dir="/tmp/unused").replace(save_checkpoints_steps=5)
    # Assert
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("secure aggregation: protocol=")]
    assert len(lines) == 1, lines


def test_the_retired_between_graph_mode_is_refused_everywhere_naming_service_and_in_graph(monkeypatch):
    from tfe_estimator.cluster import kubernetes
    from tfe_estimator.cluster.launcher import Launcher

    retired = r"between-graph mode is retired\. Use 'service'.*'in-graph'"
    cluster = {"chief": ["localhost:1"], "worker": ["localhost:2"], "tfe": ["localhost:3", "localhost:4"]}
    monkeypatch.setenv("TF_CONFIG", json.dumps({"cluster": cluster, "task": {"type": "worker", "index": 0}}))
    with pytest.raises(ValueError, match=retired):
        TfeRunConfig(cluster_mode="between-graph", tf_random_seed=1)
    monkeypatch.setenv("TFE_ESTIMATOR_CLUSTER_MODE", "between-graph")  # a task an older launcher started
    with pytest.raises(ValueError, match=retired):
        TfeRunConfig(tf_random_seed=1)
    with pytest.raises(ValueError, match=r"--cluster-mode='between-graph': the " + retired):
        Launcher(["true"], cluster_mode="between-graph")
    with pytest.raises(ValueError, match=retired):
        kubernetes.render_manifests("demo", "example.com/train:1", 1, cluster_mode="between-graph")


def test_a_model_dir_the_script_gives_the_estimator_wins_over_the_launchers_default(monkeypatch, tmp_path):
    """Issue 35: `Estimator(model_dir=...)` under `launch` (TFE_ESTIMATOR_MODEL_DIR set) clashed with our default."""
    monkeypatch.setenv("TFE_ESTIMATOR_MODEL_DIR", str(tmp_path / "default"))
    columns = [tf.feature_column.numeric_column("x")]
    config = TfeRunConfig(tf_random_seed=1)
    assert config.model_dir == str(tmp_path / "default")
    assert tf.estimator.LinearRegressor(columns, config=config).model_dir == str(tmp_path / "default")
    mine = tf.estimator.LinearRegressor(columns, model_dir=str(tmp_path / "mine"), config=config)
    assert mine.model_dir == str(tmp_path / "mine") and mine.config.model_dir == str(tmp_path / "mine")
    # A model_dir the script passed to TfeRunConfig itself is its choice too: Estimator's clash check stays.
    with pytest.raises(ValueError, match="`model_dir` are set both in constructor and `RunConfig`"):
        tf.estimator.LinearRegressor(columns, model_dir=str(tmp_path / "mine"),
                                     config=TfeRunConfig(tf_random_seed=1, model_dir=str(tmp_path / "other")))


def test_a_model_dir_with_a_checkpoint_is_named_before_it_is_restored(tmp_path, caplog):
    """Issue 35: an earlier run's checkpoint was restored silently."""
    with caplog.at_level("WARNING", logger="tfe_estimator"):
        TfeRunConfig(tf_random_seed=1, model_dir=str(tmp_path))
    assert "already holds checkpoint" not in caplog.text  # an empty directory: nothing to say
    (tmp_path / "model.ckpt-7.index").write_text("")
    tf.compat.v1.train.update_checkpoint_state(str(tmp_path), str(tmp_path / "model.ckpt-7"))
    with caplog.at_level("WARNING", logger="tfe_estimator"):
        TfeRunConfig(tf_random_seed=1, model_dir=str(tmp_path))
    assert f"model_dir {tmp_path} already holds checkpoint model.ckpt-7: Estimator restores it" in caplog.text
