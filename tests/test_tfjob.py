"""The Kubeflow TFJob rendering: what the training operator needs, and what it will write into TF_CONFIG."""
import json

import pytest
import yaml

from tfe_estimator.cluster import kubernetes, peers, tfjob
from tfe_estimator.cluster.spec import TfeCluster

IMAGE = "registry.example.com/train:1.0"
#: Service mode is refused (per-owner certificates need per-task pods: plain manifests).
TFJOB_MODES = [m for m in peers.CLUSTER_MODES if m != peers.SERVICE]


def _render(workers=2, evaluator=True, **kwargs):
    return tfjob.render_tfjob("demo", IMAGE, workers, evaluator=evaluator, namespace="ml", **kwargs)


def _operator_tf_config(job, replica_type, index):
    """The TF_CONFIG the training operator writes into a replica's pod (its genClusterSpec/genTFConfigJSONStr:
    every replica type lowercased, ``<job>-<type>-<i>.<namespace>.svc:<the tfjob-port>``)."""
    cluster = {}
    for rtype, spec in job["spec"]["tfReplicaSpecs"].items():
        (container,) = spec["template"]["spec"]["containers"]
        (port,) = [p["containerPort"] for p in container["ports"] if p["name"] == tfjob.PORT_NAME]
        cluster[rtype.lower()] = [f"{job['metadata']['name']}-{rtype.lower()}-{i}.{job['metadata']['namespace']}"
                                  f".svc:{port}" for i in range(spec["replicas"])]
    return json.dumps({"cluster": cluster, "task": {"type": replica_type.lower(), "index": index},
                       "environment": "cloud"})


@pytest.mark.parametrize("workers,evaluator", [(0, False), (2, True)])
def test_the_operator_writes_a_tf_config_every_task_accepts(workers, evaluator):
    job, *policies = _render(workers, evaluator)
    assert (job["apiVersion"], job["kind"]) == ("kubeflow.org/v1", "TFJob")
    specs = job["spec"]["tfReplicaSpecs"]
    assert set(specs) == {"Chief", "TFE"} | ({"Worker"} if workers else set()) | ({"Evaluator"} if evaluator else set())
    for rtype, spec in specs.items():
        for index in range(spec["replicas"]):
            cluster = TfeCluster.from_json(_operator_tf_config(job, rtype, index))
            assert (cluster.task_type, cluster.task_index) == (rtype.lower(), index)
            cluster.check_protocol("pond")
            assert len(cluster.jobs["tfe"]) == 3  # replica type TFE becomes the servers' job "tfe"
    assert len(policies) == len(specs)


def test_every_replica_is_what_the_operator_and_its_webhook_expect():
    job = _render()[0]
    assert job["spec"]["runPolicy"]["cleanPodPolicy"] == "All"  # the servers never exit on their own
    for rtype, spec in job["spec"]["tfReplicaSpecs"].items():
        (container,) = spec["template"]["spec"]["containers"]
        assert container["name"] == "tensorflow" and container["image"] == IMAGE
        assert [p["name"] for p in container["ports"]] == ["tfjob-port"]
        assert isinstance(spec["replicas"], int) and spec["replicas"] >= 1
        assert spec["restartPolicy"] == ("Always" if rtype == "TFE" else "OnFailure")
        expected = list(kubernetes.SERVER_COMMAND) if rtype == "TFE" else ["python", "train.py"]
        assert container["command"] == expected
        assert {"name": "TFE_ESTIMATOR_CLUSTER_MODE", "value": "in-graph"} in container["env"]
        assert not any(e["name"] == "TF_CONFIG" for e in container["env"])  # the operator writes it


def test_pod_templates_and_policies_are_valid_kubernetes():
    try:
        from kubernetes_validate import utils
    except ImportError:
        pytest.skip("kubernetes-validate is not installed (it is in the test extra)")
    for mode in TFJOB_MODES:
        job, *policies = _render(cluster_mode=mode, active_deadline_seconds=600)
        for spec in job["spec"]["tfReplicaSpecs"].values():
            template = {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "t"},
                        "template": spec["template"]}
            utils.validate(template, utils.latest_version(), strict=True)
        for policy in yaml.safe_load_all(kubernetes.to_yaml(policies)):
            utils.validate(policy, utils.latest_version(), strict=True)


def _admitted(policies, caller, callee):
    (policy,) = [p for p in policies if p["spec"]["podSelector"]["matchLabels"][kubernetes.JOB_LABEL] == callee]
    return any(caller in peer["podSelector"]["matchExpressions"][0]["values"]
               for rule in policy["spec"]["ingress"] for peer in rule["from"])


@pytest.mark.parametrize("mode", TFJOB_MODES)
def test_policies_admit_exactly_the_peer_table_per_replica_type(mode):
    _, *policies = _render(cluster_mode=mode)
    jobs = ["chief", "worker", "evaluator", "tfe"]
    got = {(a, b) for a in jobs for b in jobs if _admitted(policies, a, b)}
    assert got == {(a, b) for a in jobs for b in jobs if a in peers.allowed_callers(mode, b)}
    assert not any(_admitted(policies, "evaluator", job) for job in jobs)  # the evaluator calls nobody


def test_tfjob_refuses_what_one_shared_pod_template_cannot_do(capsys):
    for flags in (["--tls"], ["--data-claim", "{name}-data-{job}-{index}"]):
        with pytest.raises(SystemExit):
            kubernetes.main(["--name", "demo", "--image", IMAGE, "--tfjob", *flags])
        assert "cannot be used with --tfjob" in capsys.readouterr().err
    assert kubernetes.main(["--name", "demo", "--image", IMAGE, "--tfjob", "--workers", "2", "--evaluator"]) == 0
    kinds = [m["kind"] for m in yaml.safe_load_all(capsys.readouterr().out)]
    assert kinds == ["TFJob"] + ["NetworkPolicy"] * 4


def test_service_mode_is_refused_naming_the_plain_manifests():
    with pytest.raises(ValueError, match=r"cannot be rendered as a TFJob.*--cluster-mode service` without --tfjob"):
        _render(cluster_mode="service")
