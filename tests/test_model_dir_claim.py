"""One model_dir per data owner: a second owner is refused before anything is written."""
import json
import os

import pytest

from tfe_estimator import TfeRunConfig
from tfe_estimator.cluster import model_dir_claim
from tfe_estimator.cluster.model_dir_claim import CLAIM_FILE, claim_model_dir

CLUSTER = {"chief": ["localhost:1"], "worker": ["localhost:2"], "evaluator": ["localhost:6"],
           "tfe": ["localhost:3", "localhost:4"]}  # service mode, the default: two aggregation servers
#: In-graph mode's cluster: Pond's three TensorFlow servers.
IN_GRAPH_CLUSTER = dict(CLUSTER, tfe=["localhost:3", "localhost:4", "localhost:5"])


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    for name in ("TF_CONFIG", "TFE_ESTIMATOR_PROTOCOL", "TFE_ESTIMATOR_CLUSTER_MODE", model_dir_claim.MODEL_DIR_ENV,
                 model_dir_claim.OWNER_CWD_ENV):
        monkeypatch.delenv(name, raising=False)


def _as_task(monkeypatch, job, index=0, cluster=None):
    monkeypatch.setenv("TF_CONFIG", json.dumps({"cluster": cluster or CLUSTER, "task": {"type": job, "index": index}}))
    monkeypatch.setenv("TFE_ESTIMATOR_TLS_DIR", "/unused/certs")  # service mode: read when a sum first runs


def _files(directory):
    return sorted(os.path.relpath(os.path.join(root, name), directory)
                  for root, _, names in os.walk(directory) for name in names)


def test_a_second_owner_is_refused_naming_the_directory_both_owners_and_the_fix(monkeypatch, tmp_path):
    shared = str(tmp_path / "model")
    _as_task(monkeypatch, "chief")
    TfeRunConfig(model_dir=shared)
    claimed = json.loads((tmp_path / "model" / CLAIM_FILE).read_text())
    assert claimed["owner"] == "chief:0" and len(claimed["cluster_id"]) == 16
    before = _files(shared)

    _as_task(monkeypatch, "worker")
    with pytest.raises(ValueError, match=r"model_dir='.*/model' belongs to data owner chief:0 .* this is data owner "
                                         r"worker:0 .*Give every owner its own model_dir, e.g. "
                                         r"model_dir=f'/data/\{task\}'"):
        TfeRunConfig(model_dir=shared)
    assert _files(shared) == before == [CLAIM_FILE]  # nothing written by the refused owner
    assert json.loads((tmp_path / "model" / CLAIM_FILE).read_text()) == claimed  # nor overwritten


def test_the_same_owner_restarting_is_accepted_also_on_a_replanned_cluster(monkeypatch, tmp_path):
    _as_task(monkeypatch, "worker")
    TfeRunConfig(model_dir=str(tmp_path))
    TfeRunConfig(model_dir=str(tmp_path))
    _as_task(monkeypatch, "worker", cluster=dict(CLUSTER, worker=["localhost:9"]))  # new ports, same owner
    TfeRunConfig(model_dir=str(tmp_path))
    assert json.loads((tmp_path / CLAIM_FILE).read_text())["owner"] == "worker:0"


def test_the_evaluator_and_an_in_graph_worker_claim_nothing(monkeypatch, tmp_path):
    _as_task(monkeypatch, "chief")
    TfeRunConfig(model_dir=str(tmp_path))
    _as_task(monkeypatch, "evaluator")
    TfeRunConfig(model_dir=str(tmp_path))  # reads its owner's directory
    _as_task(monkeypatch, "worker", cluster=IN_GRAPH_CLUSTER)
    TfeRunConfig(model_dir=str(tmp_path), cluster_mode="in-graph")  # only the chief writes in-graph
    assert _files(str(tmp_path)) == [CLAIM_FILE]
    assert json.loads((tmp_path / CLAIM_FILE).read_text())["owner"] == "chief:0"


def test_replace_claims_the_new_model_dir(monkeypatch, tmp_path):
    _as_task(monkeypatch, "chief")
    TfeRunConfig(model_dir=str(tmp_path / "a"))
    _as_task(monkeypatch, "worker")
    config = TfeRunConfig(model_dir=str(tmp_path / "b"))
    with pytest.raises(ValueError, match="belongs to data owner chief:0"):
        config.replace(model_dir=str(tmp_path / "a"))


def test_without_a_cluster_nothing_is_claimed(tmp_path):
    TfeRunConfig(model_dir=str(tmp_path))
    assert not (tmp_path / CLAIM_FILE).exists()


def test_the_model_dir_defaults_to_the_launchers_per_task_directory(monkeypatch, tmp_path):
    _as_task(monkeypatch, "worker")
    monkeypatch.setenv(model_dir_claim.MODEL_DIR_ENV, str(tmp_path / "worker-0"))
    assert TfeRunConfig().model_dir == str(tmp_path / "worker-0")
    assert TfeRunConfig(model_dir=str(tmp_path / "mine")).model_dir == str(tmp_path / "mine")  # an explicit one wins
    assert (tmp_path / "worker-0" / CLAIM_FILE).exists()


@pytest.mark.parametrize("job", ["chief", "worker"])
def test_a_service_owner_without_a_model_dir_is_refused_before_the_kernels_load(monkeypatch, tmp_path, job):
    """Issue 41: an owner run by hand without a model_dir trained into /tmp/tmpXXXX; a restart lost the model."""
    from tfe_estimator.distribute import run_config

    def no_backend():
        raise AssertionError("the kernels loaded (maybe compiled) before the model_dir was checked")

    monkeypatch.setattr(run_config, "load_backend", no_backend)
    monkeypatch.chdir(tmp_path)
    _as_task(monkeypatch, job)
    with pytest.raises(ValueError, match=rf"Data owner {job}:0 has no model_dir: TfeRunConfig got no model_dir and "
                                         r"TFE_ESTIMATOR_MODEL_DIR is not set.*temporary directory.*restarted owner "
                                         r"resumes.*Pass TfeRunConfig\(model_dir=...\) \(e.g. from `python train.py "
                                         r"--model-dir hospital-a/model`\) or set TFE_ESTIMATOR_MODEL_DIR"):
        TfeRunConfig(tf_random_seed=1)
    assert not os.listdir(tmp_path)  # nothing written


def test_without_a_service_owner_a_missing_model_dir_stays_estimators_choice(monkeypatch):
    assert TfeRunConfig().model_dir is None  # one machine, no TF_CONFIG: Estimator's temporary directory, as ever
    _as_task(monkeypatch, "evaluator")
    assert TfeRunConfig().model_dir is None
    _as_task(monkeypatch, "worker", cluster=IN_GRAPH_CLUSTER)
    assert TfeRunConfig(cluster_mode="in-graph").model_dir is None


def test_an_evaluators_relative_model_dir_resolves_in_its_owners_directory(monkeypatch, tmp_path):
    _as_task(monkeypatch, "evaluator")
    monkeypatch.setenv(model_dir_claim.OWNER_CWD_ENV, str(tmp_path / "chief-0"))
    assert TfeRunConfig(model_dir="model").model_dir == str(tmp_path / "chief-0" / "model")
    assert TfeRunConfig(model_dir="/abs/model").model_dir == "/abs/model"


def test_a_claim_file_that_is_not_ours_is_named(tmp_path):
    (tmp_path / CLAIM_FILE).write_text("garbage")
    with pytest.raises(ValueError, match=rf"{CLAIM_FILE} is not a tfe_estimator owner claim"):
        claim_model_dir(str(tmp_path), "chief:0", "x")


def test_the_launcher_gives_each_owner_its_own_model_dir_and_the_evaluator_the_chiefs(tmp_path, monkeypatch):
    from tfe_estimator.cluster.launcher import Launcher

    owners = str(tmp_path / "owners" / "{job}-{index}")
    launcher = Launcher(["python", "train.py"], workers=2, evaluator=True, task_cwd=owners)  # plans, starts nothing
    env = {t.name: t.env for t in launcher.tasks}
    chief_cwd = str(tmp_path / "owners" / "chief-0")
    assert env["chief:0"][model_dir_claim.MODEL_DIR_ENV] == f"{chief_cwd}/model"
    assert [env[f"worker:{i}"][model_dir_claim.MODEL_DIR_ENV] for i in (0, 1)] == [
        str(tmp_path / "owners" / f"worker-{i}" / "model") for i in (0, 1)]
    assert env["evaluator:0"][model_dir_claim.MODEL_DIR_ENV] == f"{chief_cwd}/model"
    assert env["evaluator:0"][model_dir_claim.OWNER_CWD_ENV] == chief_cwd  # a relative model_dir is the chief's
    assert launcher.task("evaluator").cwd == str(tmp_path / "owners" / "evaluator-0")  # its own files stay its own
    assert all(model_dir_claim.MODEL_DIR_ENV not in t.env for t in launcher.tasks if t.job == "tfe")

    monkeypatch.chdir(tmp_path)
    plain = {t.name: t.env for t in Launcher(["python", "train.py"], workers=1, evaluator=True).tasks}
    assert plain["worker:0"][model_dir_claim.MODEL_DIR_ENV] == str(tmp_path / "model" / "worker-0")
    assert plain["evaluator:0"][model_dir_claim.MODEL_DIR_ENV] == str(tmp_path / "model" / "chief-0")
    assert model_dir_claim.OWNER_CWD_ENV not in plain["evaluator:0"]


def test_the_evaluator_under_launch_with_task_cwd_reads_the_chiefs_relative_model_dir(monkeypatch, tmp_path):
    # What used to hang: --task-cwd 'owners/{job}-{index}' and model_dir="model" in the script.
    from tfe_estimator.cluster.launcher import Launcher

    launcher = Launcher(["python", "train.py"], workers=1, evaluator=True, task_cwd=str(tmp_path / "{job}-{index}"))
    model_dirs = {}
    for task in (launcher.task("chief"), launcher.task("evaluator")):
        for key in ("TF_CONFIG", "TFE_ESTIMATOR_CLUSTER_MODE", "TFE_ESTIMATOR_TLS_DIR", model_dir_claim.MODEL_DIR_ENV,
                    model_dir_claim.OWNER_CWD_ENV):
            if key in task.env:
                monkeypatch.setenv(key, task.env[key])
            else:
                monkeypatch.delenv(key, raising=False)
        os.makedirs(task.cwd, exist_ok=True)
        monkeypatch.chdir(task.cwd)
        model_dirs[task.name] = os.path.abspath(TfeRunConfig(model_dir="model").model_dir)
    assert model_dirs["evaluator:0"] == model_dirs["chief:0"] == str(tmp_path / "chief-0" / "model")
