"""The Kubernetes renderer: every task's TF_CONFIG validates, agrees and matches its Service."""
import json
import pathlib
import shlex

import pytest
import yaml

from tfe_estimator.cluster import k8s_common, kubernetes, peers
from tfe_estimator.cluster import tfjob as tfjob_lib
from tfe_estimator.cluster.spec import TfeCluster

ROOT = pathlib.Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "deploy" / "kubernetes" / "example-1-worker.yaml"
IMAGE = "registry.example.com/train:1.0"
SHAPES = [(w, e) for w in (0, 1, 3) for e in (True, False)]


def _render(workers, evaluator, **kwargs):
    kwargs.setdefault("command", ["python", "train.py"])
    kwargs.setdefault("cluster_mode", "in-graph")  # the TensorFlow-runtime layout: 3 tfe servers, sidecars
    return kubernetes.render_manifests("demo", IMAGE, workers, evaluator=evaluator, namespace="ml", **kwargs)


def _expected_tasks(workers, evaluator):
    tasks = [("chief", 0)] + [("worker", i) for i in range(workers)]
    if evaluator:
        tasks.append(("evaluator", 0))
    return tasks + [("tfe", i) for i in range(3)]


def _pod_template(workload):
    return workload["spec"]["template"]


def _container(workload):
    (container,) = _pod_template(workload)["spec"]["containers"]
    return container


def _tf_config(workload):
    (value,) = [e["value"] for e in _container(workload)["env"] if e["name"] == "TF_CONFIG"]
    return value


def _task_of(obj):
    labels = obj["metadata"]["labels"]
    return labels[kubernetes.JOB_LABEL], int(labels[kubernetes.INDEX_LABEL])


def _by_kind(manifests):
    kinds = {}
    for m in manifests:
        kinds.setdefault(m["kind"], []).append(m)
    return kinds


def _matches(selector, labels):
    return all(labels.get(k) == v for k, v in selector.items())


@pytest.mark.parametrize("workers,evaluator", SHAPES)
def test_one_service_and_one_workload_per_task(workers, evaluator):
    manifests = _render(workers, evaluator)
    kinds = _by_kind(manifests)
    assert set(kinds) <= {"Service", "Job", "Deployment", "NetworkPolicy"}
    expected = _expected_tasks(workers, evaluator)
    services = [_task_of(s) for s in kinds["Service"]]
    workloads = [_task_of(w) for w in kinds.get("Job", []) + kinds["Deployment"]]
    assert sorted(services) == sorted(expected)
    assert sorted(workloads) == sorted(expected)
    for w in kinds.get("Job", []):
        assert _task_of(w)[0] in ("chief", "worker", "evaluator")
        assert _pod_template(w)["spec"]["restartPolicy"] == "OnFailure"
    for d in kinds["Deployment"]:
        assert _task_of(d)[0] == "tfe"
        assert d["spec"]["replicas"] == 1
        assert d["spec"]["strategy"]["type"] == "Recreate"
        assert _matches(d["spec"]["selector"]["matchLabels"], _pod_template(d)["metadata"]["labels"])
    for m in manifests:
        assert m["metadata"]["namespace"] == "ml"
        assert m["metadata"]["labels"][kubernetes.CLUSTER_LABEL] == "demo"
    assert sorted(_task_of(p) for p in kinds["NetworkPolicy"]) == sorted(expected)  # one per task
    assert len(manifests) == 3 * len(expected)


@pytest.mark.parametrize("workers,evaluator", SHAPES)
def test_every_tf_config_validates_and_all_agree(workers, evaluator):
    manifests = _render(workers, evaluator)
    workloads = [m for m in manifests if m["kind"] in ("Job", "Deployment")]
    clusters = []
    for w in workloads:
        text = _tf_config(w)
        parsed = TfeCluster.from_json(text)
        assert parsed is not None
        assert (parsed.task_type, parsed.task_index) == _task_of(w)
        assert (parsed.task_type, parsed.task_index) == _task_of(_pod_template(w))
        parsed.check_protocol("pond")
        parsed.check_protocol("aby3")
        clusters.append(json.loads(text)["cluster"])
    assert all(c == clusters[0] for c in clusters)
    cluster = clusters[0]
    assert ("evaluator" in cluster) == evaluator
    assert ("worker" in cluster) == (workers > 0)
    assert len(cluster.get("worker", [])) == workers
    assert len(cluster["chief"]) == 1 and len(cluster["tfe"]) == 3


@pytest.mark.parametrize("workers,evaluator", SHAPES)
def test_addresses_are_unique_and_name_the_services(workers, evaluator):
    manifests = _render(workers, evaluator, port=4444)
    cluster = json.loads(_tf_config(next(m for m in manifests if m["kind"] == "Job")))["cluster"]
    addresses = [a for job in cluster.values() for a in job]
    assert len(addresses) == len(set(addresses))
    services = {s["metadata"]["name"]: s for s in manifests if s["kind"] == "Service"}
    assert len(services) == len(addresses)
    for job, job_addresses in cluster.items():
        for index, address in enumerate(job_addresses):
            host, port = address.rsplit(":", 1)
            service_name, namespace, svc = host.split(".")
            assert (service_name, namespace, svc) == (f"demo-{job}-{index}", "ml", "svc")
            service = services[service_name]
            assert service["spec"]["clusterIP"] == "None"  # headless: DNS names the pod itself
            assert [p["port"] for p in service["spec"]["ports"]] == [int(port)] == [4444]
            # The Service's selector picks exactly this task's pod template.
            picked = [
                _task_of(_pod_template(w))
                for w in manifests
                if w["kind"] in ("Job", "Deployment")
                and _matches(service["spec"]["selector"], _pod_template(w)["metadata"]["labels"])
            ]
            assert picked == [(job, index)]
    for w in manifests:
        if w["kind"] in ("Job", "Deployment"):
            assert [p["containerPort"] for p in _container(w)["ports"]] == [4444]


def test_tfe_pods_run_the_server_and_others_the_training_command():
    command = ["python", "-m", "my_trainer", "--steps", "5"]
    manifests = _render(2, True, command=command, data_claim="{name}-data-{job}-{index}", model_claim="{name}-model",
                        cluster_mode="service")
    for w in manifests:
        if w["kind"] not in ("Job", "Deployment"):
            continue
        container, spec = _container(w), _pod_template(w)["spec"]
        assert container["image"] == IMAGE
        assert spec["automountServiceAccountToken"] is False
        job, index = _task_of(w)
        if job == "tfe":
            assert container["command"] == ["tfe-estimator", "server", "--data-port", "2223",  # service mode
                                            "--metrics-port", "9100"]
            claims = [v for v in spec.get("volumes", []) if "persistentVolumeClaim" in v]
            assert not claims, claims  # servers never see data (only their certificate Secret)
        else:
            assert container["command"] == command
            data = {"claimName": f"demo-data-{job}-{index}", "readOnly": True}
            # The evaluator writes model_dir/eval: the model volume is read-write for it too.
            model = {"claimName": "demo-model", "readOnly": False}
            volumes = {v["name"]: v["persistentVolumeClaim"] for v in spec["volumes"] if "persistentVolumeClaim" in v}
            mounts = {m["name"]: (m["mountPath"], m["readOnly"]) for m in container["volumeMounts"]
                      if m["name"] in volumes}
            # Service mode (the default) every owner checkpoints its own copy; the evaluator reads the chief's.
            assert volumes == {"data": data, "model": model}
            assert mounts == {"data": ("/data", True), "model": ("/model", False)}


def test_in_graph_mounts_the_model_in_the_chief_and_evaluator_only_and_service_mode_per_owner():
    in_graph = _render(1, True, model_claim="{name}-model", cluster_mode="in-graph")
    (worker,) = [w for w in in_graph if w["kind"] == "Job" and _task_of(w) == ("worker", 0)]
    assert "model" not in {v["name"] for v in _pod_template(worker)["spec"].get("volumes", [])}
    own = _render(1, True, model_claim="{name}-model-{job}-{index}", cluster_mode="service")
    claims = {_task_of(w): {v["name"]: v["persistentVolumeClaim"]["claimName"] for v in _pod_template(w)["spec"]["volumes"]
                            if "persistentVolumeClaim" in v}
              for w in own if w["kind"] == "Job"}
    assert claims[("chief", 0)]["model"] == "demo-model-chief-0"
    assert claims[("worker", 0)]["model"] == "demo-model-worker-0"
    assert claims[("evaluator", 0)]["model"] == "demo-model-chief-0"  # its organisation's checkpoints
    for w in own + in_graph:
        if w["kind"] in ("Job", "Deployment"):
            env = {e["name"]: e["value"] for e in _container(w)["env"]}
            assert env["TFE_ESTIMATOR_CLUSTER_MODE"] in ("service", "in-graph")


def test_no_volumes_without_claims():
    for w in _render(1, True):
        if w["kind"] in ("Job", "Deployment"):
            assert "volumes" not in _pod_template(w)["spec"]
            assert "volumeMounts" not in _container(w)


def _pod_labels(manifests):
    return {_task_of(w): _pod_template(w)["metadata"]["labels"] for w in manifests if w["kind"] in ("Job", "Deployment")}


def _selects(selector, labels):
    """Whether a Kubernetes label selector (matchLabels and In expressions) picks `labels`."""
    ok = _matches(selector.get("matchLabels", {}), labels)
    for expression in selector.get("matchExpressions", []):
        assert expression["operator"] == "In", expression
        ok = ok and labels.get(expression["key"]) in expression["values"]
    return ok


def _reachable(manifests, port):
    """(caller, callee) pairs the NetworkPolicies let connect on `port`, as Kubernetes evaluates them."""
    pods = _pod_labels(manifests)
    policies = [m for m in manifests if m["kind"] == "NetworkPolicy"]
    pairs = set()
    for callee, callee_labels in pods.items():
        mine = [p["spec"] for p in policies if _selects(p["spec"]["podSelector"], callee_labels)]
        assert mine, f"no policy isolates {callee}: every pod could reach it"
        for caller, caller_labels in pods.items():
            if caller != callee and any(
                    any(_selects(peer["podSelector"], caller_labels) for peer in rule.get("from", []))
                    and any(p["port"] == port for p in rule.get("ports", []))
                    for spec in mine for rule in spec["ingress"]):
                pairs.add((caller, callee))
    return pairs


def _table(tasks, mode):
    return {(a, b) for a in tasks for b in tasks if a != b and a[0] in peers.allowed_callers(mode, b[0])}


@pytest.mark.parametrize("mode", ["in-graph"])
@pytest.mark.parametrize("tls", [False, True])
@pytest.mark.parametrize("workers,evaluator", [(1, True), (3, False)])
def test_network_policies_let_through_exactly_the_peer_table(mode, tls, workers, evaluator):
    manifests = _render(workers, evaluator, cluster_mode=mode, tls=tls)
    port = kubernetes.TLS_PORT if tls else 2222
    assert _reachable(manifests, port) == _table(_expected_tasks(workers, evaluator), mode)
    assert not any(caller == ("evaluator", 0) for caller, _ in _reachable(manifests, port))  # it calls nobody


def test_the_policy_check_catches_a_policy_that_lets_the_evaluator_reach_the_chief():
    """Mutation: the chief's policy also admits the evaluator; the comparison with the peer table must fail."""
    manifests = _render(1, True, tls=True)
    (chief,) = [m for m in manifests if m["kind"] == "NetworkPolicy" and _task_of(m) == ("chief", 0)]
    chief["spec"]["ingress"][0]["from"][0]["podSelector"]["matchExpressions"][0]["values"].append("evaluator")
    with pytest.raises(AssertionError):
        assert _reachable(manifests, kubernetes.TLS_PORT) == _table(_expected_tasks(1, True), "in-graph")


def test_with_tls_tensorflow_ports_are_exposed_nowhere_and_every_pod_has_its_sidecar():
    from tfe_estimator.cluster.sidecar import stunnel_config

    manifests = _render(1, True, tls=True, tls_secret="{name}-{job}-{index}-certs")
    tf_ports = set()
    for w in manifests:
        if w["kind"] not in ("Job", "Deployment"):
            continue
        job, index = _task_of(w)
        spec = _pod_template(w)["spec"]
        (sidecar,) = spec["initContainers"]
        assert sidecar["restartPolicy"] == "Always"  # a native sidecar: the Job still completes
        assert sidecar["command"][0] == "stunnel4"
        secret = {v["name"]: v for v in spec["volumes"]}["tls-certs"]["secret"]["secretName"]
        assert secret == f"demo-{job}-{index}-certs"
        tf_ports |= {p["containerPort"] for p in _container(w)["ports"]}
        cluster = json.loads(_tf_config(w))["cluster"]
        assert all(a.startswith("localhost:") for addresses in cluster.values() for a in addresses)
    assert len(tf_ports) == len(_expected_tasks(1, True))  # task k at port + k
    for m in manifests:
        if m["kind"] == "Service":
            assert [p["port"] for p in m["spec"]["ports"]] == [kubernetes.TLS_PORT]
        if m["kind"] == "NetworkPolicy":
            ports = {p["port"] for rule in m["spec"]["ingress"] for p in rule["ports"]}
            assert not ports & tf_ports and ports <= {kubernetes.TLS_PORT}
    configs = {_task_of(m): m["data"]["stunnel.conf"] for m in manifests if m["kind"] == "ConfigMap"}
    assert sorted(configs) == sorted(_expected_tasks(1, True))
    assert "checkHost = worker-0.demo" in configs[("chief", 0)]  # in-graph: the chief calls the workers
    assert "checkHost = evaluator-0.demo" not in configs[("chief", 0)]  # the evaluator calls nobody
    assert "checkHost = tfe-0.demo" in configs[("chief", 0)]


@pytest.mark.parametrize("workers,evaluator", SHAPES)
def test_yaml_stream_parses(workers, evaluator):
    manifests = _render(workers, evaluator, data_claim="{name}-data-{job}-{index}", model_claim="{name}-model")
    text = kubernetes.to_yaml(manifests)
    assert list(yaml.safe_load_all(text)) == manifests
    assert "\n{" not in text  # real YAML, not JSON documents
    assert text.count("\n---\n") + text.startswith("---\n") == len(manifests)


def _schema_validator():
    try:
        from kubernetes_validate import utils
    except ImportError:
        pytest.skip("kubernetes-validate is not installed (pip install kubernetes-validate; it is in the "
                    "test extra): the manifests are not checked against the Kubernetes schemas")
    return utils


@pytest.mark.parametrize("workers,evaluator", SHAPES)
def test_every_manifest_is_valid_against_the_kubernetes_schemas(workers, evaluator):
    utils = _schema_validator()
    for mode, tls in (("in-graph", False), ("in-graph", True)):
        manifests = _render(workers, evaluator, data_claim="{name}-data-{job}-{index}", model_claim="{name}-model",
                            cluster_mode=mode, tls=tls)
        for manifest in yaml.safe_load_all(kubernetes.to_yaml(manifests)):
            utils.validate(manifest, utils.latest_version(), strict=True)  # strict: unknown fields fail too


def test_the_schema_check_catches_a_broken_manifest():
    utils = _schema_validator()
    (job,) = [m for m in _render(1, True, model_claim="m") if m["kind"] == "Job" and _task_of(m) == ("evaluator", 0)]
    _container(job)["volumeMounts"][0]["readOnly"] = "no"
    with pytest.raises(utils.ValidationError, match="not of type 'boolean'"):
        utils.validate(job, utils.latest_version(), strict=True)
    _container(job)["volumeMounts"][0]["readOnly"] = False
    _container(job)["mountpath"] = "/x"  # a typo Kubernetes would silently drop
    with pytest.raises(utils.ValidationError):
        utils.validate(job, utils.latest_version(), strict=True)


def test_evaluator_can_write_model_dir_eval():
    # Estimator's evaluator writes summaries to model_dir/eval on the model volume.
    manifests = _render(1, True, model_claim="{name}-model")
    (evaluator,) = [m for m in manifests if m["kind"] == "Job" and _task_of(m)[0] == "evaluator"]
    (mount,) = [m for m in _container(evaluator)["volumeMounts"] if m["name"] == "model"]
    (volume,) = [v for v in _pod_template(evaluator)["spec"]["volumes"] if v["name"] == "model"]
    assert mount["readOnly"] is False and volume["persistentVolumeClaim"]["readOnly"] is False


def test_readme_describes_the_worker_placeholder_as_the_code_substitutes_it():
    # input_fns replace {worker} with the input pipeline id (0 = chief, 1 = worker-0), not a task name.
    import tensorflow as tf
    from input_fns.sharding import resolve_pattern

    readme = " ".join((ROOT / "deploy" / "kubernetes" / "README.md").read_text().split())
    for pipeline, task in ((0, "chief"), (1, "`worker-0`")):
        ctx = tf.distribute.InputContext(num_input_pipelines=2, input_pipeline_id=pipeline)
        read = resolve_pattern("/data/{worker}/part-*.csv", ctx)
        assert f"`{read}` on {'the ' if task == 'chief' else ''}{task}" in readme, (read, task)
    assert "`worker` set to `chief-0`" not in readme


def test_help_names_the_program_users_type(capsys):
    with pytest.raises(SystemExit) as e:
        kubernetes.main(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: tfe-estimator k8s ")
    assert "python -m tfe_estimator.cluster.kubernetes" not in out


def test_tfe_pods_run_the_one_server_command():
    from tfe_estimator.cluster.server import server_command

    (deployment, *_) = [m for m in _render(0, False) if m["kind"] == "Deployment"]
    assert tuple(_container(deployment)["command"]) == server_command() == kubernetes.SERVER_COMMAND
    for deployment in [m for m in _render(0, False, cluster_mode="service") if m["kind"] == "Deployment"]:
        assert _container(deployment)["command"] == [*server_command(), "--data-port", "2223",  # port + 1
                                                     "--metrics-port", "9100"]


def test_committed_example_equals_a_fresh_render(capsys):
    text = EXAMPLE.read_text()
    (line,) = [l for l in text.splitlines() if l.startswith(f"# $ {kubernetes.PROG} ")]
    args = shlex.split(line[len(f"# $ {kubernetes.PROG} ") :])
    assert "-o" not in args and "--output" not in args
    assert kubernetes.main(args) == 0
    fresh = capsys.readouterr().out
    header = text[: text.index("---\n")]
    assert text == header + fresh, (
        f"{EXAMPLE} is stale: regenerate it with the command in its header "
        "(tfe-estimator k8s ... >> the file, after the comment lines)."
    )
    assert header.strip() and all(l.startswith("#") for l in header.splitlines())
    kinds = [m["kind"] for m in yaml.safe_load_all(fresh)]
    assert kinds.count("Job") == 2 and kinds.count("Deployment") == 2  # chief, 1 worker; 2 aggregation servers


def test_main_writes_a_file(tmp_path):
    out = tmp_path / "cluster.yaml"
    assert kubernetes.main(["--name", "x1", "--image", IMAGE, "--workers", "0", "--no-evaluator", "-o", str(out)]) == 0
    assert out.read_text() == kubernetes.to_yaml(
        kubernetes.render_manifests("x1", IMAGE, 0, evaluator=False, command=kubernetes.DEFAULT_COMMAND)
    )


def test_main_reports_bad_arguments(capsys):
    with pytest.raises(SystemExit) as e:
        kubernetes.main(["--name", "Bad_Name", "--image", IMAGE])
    assert e.value.code == 2
    assert "DNS-1123" in capsys.readouterr().err


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"workers": -1}, "workers=-1 must be an integer >= 0"),
        ({"workers": 1.5}, "workers=1.5 must be an integer"),
        ({"workers": True}, "workers=True must be an integer"),
        ({"image": ""}, "image='' must be a non-empty container image"),
        ({"image": "   "}, "must be a non-empty container image"),
        ({"image": "a b"}, "without spaces"),
        ({"name": "Demo"}, "not a valid cluster name: it must be a DNS-1123 label"),
        ({"name": "my_cluster"}, "DNS-1123"),
        ({"name": "-demo"}, "DNS-1123"),
        ({"name": "demo-"}, "DNS-1123"),
        ({"name": "1demo"}, "starts with a letter"),
        ({"name": ""}, "DNS-1123"),
        ({"name": "a" * 60}, "too long"),
        ({"namespace": "My NS"}, "namespace='My NS' is not a valid Kubernetes namespace"),
        ({"command": []}, "command=[] must be a non-empty list"),
        ({"command": "python train.py"}, "a list, not one shell string"),
        ({"port": 0}, "port=0 must be an integer TCP port"),
        ({"port": 70000}, "port=70000"),
        ({"data_claim": "data-{owner}"}, "placeholders"),
        ({"data_claim": "Data_{job}"}, "not a valid PersistentVolumeClaim name"),
        ({"data_mount_path": "data"}, "data_mount_path='data' must be an absolute path"),
        ({"model_claim": "{name}_model"}, "model_claim='{name}_model' gives 'demo_model'"),
        ({"model_mount_path": "/data/"}, "data_mount_path and model_mount_path are both"),
        ({"active_deadline_seconds": 0}, "active_deadline_seconds=0 must be an integer >= 1"),
    ],
)
def test_bad_arguments_raise_clear_value_errors(kwargs, message):
    args = {"name": "demo", "image": IMAGE, "workers": 1} | kwargs
    with pytest.raises(ValueError) as e:
        kubernetes.render_manifests(**args)
    assert message in str(e.value)


def test_longest_valid_name_renders():
    name = "a" * (63 - len("-evaluator-0"))
    names = [m["metadata"]["name"] for m in kubernetes.render_manifests(name, IMAGE, 3, cluster_mode="in-graph")
             if m["kind"] == "Service"]
    assert max(len(n) for n in names) == 63


def test_active_deadline_bounds_every_job_and_validates():
    utils = _schema_validator()
    manifests = _render(1, True, active_deadline_seconds=3600)
    jobs = [m for m in manifests if m["kind"] == "Job"]
    assert len(jobs) == 3 and all(j["spec"]["activeDeadlineSeconds"] == 3600 for j in jobs)
    for job in jobs:
        utils.validate(job, utils.latest_version(), strict=True)
    assert all("activeDeadlineSeconds" not in m["spec"] for m in _render(1, True) if m["kind"] == "Job")


@pytest.mark.parametrize("claim", ["{name}-model", "{name}-model-{job}-{index}"])
def test_each_owner_pod_gets_its_own_model_dir_and_the_evaluator_the_chiefs(claim):
    for mode, owners in (("service", {("chief", 0), ("worker", 0), ("worker", 1)}), ("in-graph", {("chief", 0)})):
        model_dirs = {_task_of(w): {e["name"]: e["value"] for e in _container(w)["env"]}.get("TFE_ESTIMATOR_MODEL_DIR")
                      for w in _render(2, True, model_claim=claim, cluster_mode=mode) if w["kind"] == "Job"}
        expected = {task: f"/model/{task[0]}-{task[1]}" for task in owners}
        expected[("evaluator", 0)] = "/model/chief-0"  # the evaluator reads its organisation's (the chief's)
        assert {t: d for t, d in model_dirs.items() if d is not None} == expected, mode
    assert all("TFE_ESTIMATOR_MODEL_DIR" not in json.dumps(w) for w in _render(1, True))  # no claim, no default


def test_pods_run_non_root_without_capabilities_and_with_resources():
    objs = kubernetes.render_manifests("demo", "example.com/train:1", workers=1, tls=True, read_only_root=True,
                                       cluster_mode="in-graph")
    for obj in objs:
        if obj["kind"] not in ("Job", "Deployment"):
            continue
        spec = obj["spec"]["template"]["spec"]
        assert spec["securityContext"]["runAsNonRoot"] is True and spec["securityContext"]["runAsUser"] == 1000
        assert spec["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
        for container in spec["containers"] + spec.get("initContainers", []):
            context = container["securityContext"]
            assert context["allowPrivilegeEscalation"] is False and context["capabilities"] == {"drop": ["ALL"]}
            assert context["readOnlyRootFilesystem"] is True
        (tf_container,) = spec["containers"]
        assert tf_container["resources"] == k8s_common.DEFAULT_RESOURCES
        assert {"name": "tmp", "mountPath": "/tmp"} in tf_container["volumeMounts"]


def test_resources_and_user_are_configurable_and_root_is_refused(capsys):
    assert kubernetes.main(["--name", "demo", "--image", "example.com/train:1", "--requests", "cpu=2",
                            "--limits", "", "--run-as-user", "4242"]) == 0
    objs = list(yaml.safe_load_all(capsys.readouterr().out))
    job = next(o for o in objs if o["kind"] == "Job")
    assert job["spec"]["template"]["spec"]["containers"][0]["resources"] == {"requests": {"cpu": "2"}}
    assert job["spec"]["template"]["spec"]["securityContext"]["runAsUser"] == 4242
    with pytest.raises(ValueError, match=r"run_as_user=0 must be an integer user id >= 1 \(not root\)"):
        kubernetes.render_manifests("demo", "example.com/train:1", workers=1, run_as_user=0)


@pytest.mark.parametrize("tfjob", [False, True])
def test_teardown_deletes_every_rendered_kind(capsys, tfjob):
    objs = (tfjob_lib.render_tfjob("demo", "example.com/train:1", workers=1) if tfjob else
            kubernetes.render_manifests("demo", "example.com/train:1", workers=1, tls=True, cluster_mode="in-graph"))
    assert kubernetes.main(["--name", "demo", "--namespace", "ml", "--teardown"] + (["--tfjob"] if tfjob else [])) == 0
    command = capsys.readouterr().out.split()
    assert command[:4] == ["kubectl", "-n", "ml", "delete"] and "tfe-estimator/cluster=demo" in command
    kinds = {k.split(".")[0] for k in command[4].split(",")}
    plural = {"NetworkPolicy": "networkpolicies"}
    assert {plural.get(o["kind"], o["kind"].lower() + "s") for o in objs} <= kinds


# ------------------------------------------------------------------ service mode (across organisations)

def _service_tasks(workers, evaluator):
    return [t for t in _expected_tasks(workers, evaluator) if t != ("tfe", 2)]


def _egress(manifests, port):
    """(caller, callee) pairs the callers' egress rules let connect on `port` (rules without `to`: anyone)."""
    pods = _pod_labels(manifests)
    policies = [m for m in manifests if m["kind"] == "NetworkPolicy"]
    pairs = set()
    for caller, caller_labels in pods.items():
        mine = [p["spec"] for p in policies if _selects(p["spec"]["podSelector"], caller_labels)]
        assert mine and all("Egress" in spec["policyTypes"] for spec in mine), caller
        for callee, callee_labels in pods.items():
            if caller != callee and any(
                    ("to" not in rule or any(_selects(peer["podSelector"], callee_labels) for peer in rule["to"]))
                    and any(p["port"] == port for p in rule.get("ports", []))
                    for spec in mine for rule in spec["egress"]):
                pairs.add((caller, callee))
    return pairs


@pytest.mark.parametrize("workers,evaluator", [(1, True), (3, False), (0, True)])
def test_service_mode_owners_accept_nothing_and_servers_only_owners_and_server0(workers, evaluator):
    manifests = _render(workers, evaluator, cluster_mode="service", port=7000)
    tasks = _service_tasks(workers, evaluator)
    owners = [t for t in tasks if t[0] in ("chief", "worker")]
    workloads = [w for w in manifests if w["kind"] in ("Job", "Deployment")]
    assert sorted(_task_of(w) for w in workloads) == sorted(tasks)  # exactly 2 tfe pods
    assert sorted(_task_of(w) for w in workloads if w["kind"] == "Deployment") == [("tfe", 0), ("tfe", 1)]
    # Only the servers have a Service; nobody else has an address anyone could resolve.
    assert sorted(_task_of(s) for s in _by_kind(manifests)["Service"]) == [("tfe", 0), ("tfe", 1)]
    # Each server's service port and its data port (`tfe-estimator server --data-port 7001`), both mutual TLS.
    assert all([(p["name"], p["port"], p["targetPort"]) for p in s["spec"]["ports"]] == [
        ("grpc", 7000, 7000), ("data", 7001, 7001)] for s in _by_kind(manifests)["Service"])
    expected = {(o, ("tfe", k)) for o in owners for k in (0, 1)} | {(("tfe", 0), ("tfe", 1))}
    for port in (7000, 7001, kubernetes.TLS_PORT, 2222, 7002, 9100):  # the metrics port: nobody by default
        assert _reachable(manifests, port) == (expected if port in (7000, 7001) else set()), port
    for port in (7000, 7001):
        assert _egress(manifests, port) == expected  # server1 calls nobody, owners only the servers
    for w in workloads:
        if _task_of(w)[0] == "tfe":
            assert _container(w)["command"][-4:] == ["--data-port", "7001", "--metrics-port", "9100"]
            assert [p["containerPort"] for p in _container(w)["ports"]] == [7000, 7001, 9100]
    for policy in _by_kind(manifests)["NetworkPolicy"]:
        if _task_of(policy)[0] != "tfe":  # owners and the evaluator: deny all ingress
            assert policy["spec"]["ingress"] == [] and "Ingress" in policy["spec"]["policyTypes"]
    for w in workloads:
        job, index = _task_of(w)
        spec = _pod_template(w)["spec"]
        assert "initContainers" not in spec and len(spec["containers"]) == 1  # no stunnel sidecar
        env = {e["name"]: e["value"] for e in _container(w)["env"]}
        assert env["TFE_ESTIMATOR_CLUSTER_MODE"] == "service"
        assert env["TFE_ESTIMATOR_TLS_DIR"] == "/etc/tfe-tls/certs"
        assert env["GLIBC_TUNABLES"] == "glibc.malloc.hugetlb=1"  # the service's large messages (cluster.huge_pages)
        (mount,) = [m for m in _container(w)["volumeMounts"] if m["name"] == "tls-certs"]
        assert mount == {"name": "tls-certs", "mountPath": "/etc/tfe-tls/certs", "readOnly": True}
        volumes = {v["name"]: v for v in spec["volumes"]}
        assert volumes["tls-certs"]["secret"]["secretName"] == f"demo-{job}-{index}-tls"  # one Secret per task
        assert ("ports" in _container(w)) == (job == "tfe")  # only the servers listen
        cluster = json.loads(_tf_config(w))["cluster"]
        assert cluster["tfe"] == ["demo-tfe-0.ml.svc:7000", "demo-tfe-1.ml.svc:7000"]
        TfeCluster.from_json(_tf_config(w))


def test_service_mode_refuses_a_port_without_room_for_the_data_port():
    with pytest.raises(ValueError, match=r"port=65535 in service mode: each aggregation server's data plane listens "
                                         r"on the next port \(65536\).* Use e.g. --port 2222"):
        _render(1, False, cluster_mode="service", port=65535)
    assert _render(1, False, cluster_mode="in-graph", port=65535)  # in-graph mode has no data plane


def test_service_mode_without_a_data_plane_opens_the_service_port_only(capsys):
    """`data_plane=False` (``--no-data-plane``): the servers run without --data-port, and neither their Services,
    their containers nor any NetworkPolicy open port + 1."""
    manifests = _render(1, True, cluster_mode="service", port=7000, data_plane=False)
    expected = {(("chief", 0), ("tfe", k)) for k in (0, 1)} | {(("worker", 0), ("tfe", k)) for k in (0, 1)} | {
        (("tfe", 0), ("tfe", 1))}
    assert _reachable(manifests, 7000) == _egress(manifests, 7000) == expected
    assert _reachable(manifests, 7001) == _egress(manifests, 7001) == set()
    assert all([p["port"] for p in s["spec"]["ports"]] == [7000] for s in _by_kind(manifests)["Service"])
    for deployment in _by_kind(manifests)["Deployment"]:
        assert "--data-port" not in _container(deployment)["command"]
        assert [p["containerPort"] for p in _container(deployment)["ports"]] == [7000, 9100]  # gRPC, metrics
    assert _render(1, False, cluster_mode="service", port=65535, data_plane=False)  # no data port, no room needed
    assert kubernetes.main(["--name", "demo", "--image", IMAGE, "--namespace", "ml", "--no-data-plane", "--port",
                            "7000", "--evaluator", "--", "python", "train.py"]) == 0
    assert list(yaml.safe_load_all(capsys.readouterr().out)) == manifests
    with pytest.raises(TypeError, match="data_plane=1 must be True"):
        _render(1, False, cluster_mode="service", data_plane=1)


def test_the_service_policy_check_catches_an_owner_that_accepts_a_server():
    """Mutation: the chief's policy admits the servers (as in-graph's does); the check must fail."""
    manifests = _render(1, True, cluster_mode="service")
    (chief,) = [m for m in manifests if m["kind"] == "NetworkPolicy" and _task_of(m) == ("chief", 0)]
    chief["spec"]["ingress"] = [{"from": [{"podSelector": {"matchLabels": {kubernetes.JOB_LABEL: "tfe"}}}],
                                 "ports": [{"protocol": "TCP", "port": 2222}]}]
    assert (("tfe", 0), ("chief", 0)) in _reachable(manifests, 2222)


@pytest.mark.parametrize("workers,evaluator", [(0, False), (2, True)])
def test_service_mode_manifests_are_valid_against_the_kubernetes_schemas(workers, evaluator):
    utils = _schema_validator()
    for tls in (False, True):  # --tls changes nothing in service mode: the service speaks TLS itself
        manifests = _render(workers, evaluator, data_claim="{name}-data-{job}-{index}", model_claim="{name}-model",
                            cluster_mode="service", tls=tls, read_only_root=True)
        assert manifests == _render(workers, evaluator, data_claim="{name}-data-{job}-{index}",
                                    model_claim="{name}-model", cluster_mode="service", read_only_root=True)
        for manifest in yaml.safe_load_all(kubernetes.to_yaml(manifests)):
            utils.validate(manifest, utils.latest_version(), strict=True)


def test_service_mode_from_the_command_line_and_its_teardown(capsys):
    assert kubernetes.main(["--name", "demo", "--image", IMAGE, "--cluster-mode", "service", "--evaluator",
                            "--tls-secret", "{name}-tls-{job}-{index}", "--", "python", "train.py"]) == 0
    objs = list(yaml.safe_load_all(capsys.readouterr().out))
    secrets = {v["secret"]["secretName"] for o in objs if o["kind"] in ("Job", "Deployment")
               for v in _pod_template(o)["spec"]["volumes"] if "secret" in v}
    assert secrets == {"demo-tls-chief-0", "demo-tls-worker-0", "demo-tls-evaluator-0", "demo-tls-tfe-0",
                       "demo-tls-tfe-1"}
    assert kubernetes.main(["--name", "demo", "--namespace", "ml", "--teardown"]) == 0
    kinds = {k.split(".")[0] for k in capsys.readouterr().out.split()[4].split(",")}
    plural = {"NetworkPolicy": "networkpolicies"}
    assert {plural.get(o["kind"], o["kind"].lower() + "s") for o in objs} <= kinds
    with pytest.raises(SystemExit):
        kubernetes.main(["--name", "demo", "--image", IMAGE, "--cluster-mode", "service", "--tfjob"])
    err = capsys.readouterr().err
    assert "cannot be rendered as a TFJob" in err and "without --tfjob" in err


def test_service_mode_servers_have_their_image_probes_state_and_closed_metrics(capsys):
    """The whole-cluster rendering's two servers, with every server flag, from the command line: schema-valid,
    in the namespace, on the server image (owners on the training image), probed with `tfe-estimator health`,
    server0 with its state directory, the metrics port admitted only from the named monitoring."""
    utils = _schema_validator()
    server_image = "registry.example.com/tfe-server:1.0"
    assert kubernetes.main(["--name", "demo", "--namespace", "ml", "--image", IMAGE, "--server-image", server_image,
                            "--metrics-port", "9300", "--metrics-pod-label", "app=prometheus", "--workers", "1",
                            "--", "python", "train.py"]) == 0
    manifests = list(yaml.safe_load_all(capsys.readouterr().out))
    for manifest in manifests:
        utils.validate(manifest, utils.latest_version(), strict=True)
        assert manifest["metadata"]["namespace"] == "ml", manifest["kind"]
    for workload in _by_kind(manifests)["Job"] + _by_kind(manifests)["Deployment"]:
        job, index = _task_of(workload)
        container = _container(workload)
        env = {e["name"]: e["value"] for e in container["env"]}
        assert container["image"] == (server_image if job == "tfe" else IMAGE)
        assert ("livenessProbe" in container) == ("readinessProbe" in container) == (job == "tfe")
        assert ("TFE_ESTIMATOR_STATE_DIR" in env) == ((job, index) == ("tfe", 0))
        if job != "tfe":
            continue
        assert container["readinessProbe"]["exec"]["command"] == ["tfe-estimator", "health"]
        assert container["command"][-2:] == ["--metrics-port", "9300"]
        assert {"name": "metrics", "containerPort": 9300, "protocol": "TCP"} in container["ports"]
        if index == 0:
            volumes = {v["name"]: v for v in _pod_template(workload)["spec"]["volumes"]}
            (mount,) = [m for m in container["volumeMounts"] if m["name"] == "state"]
            assert "emptyDir" in volumes["state"] and env["TFE_ESTIMATOR_STATE_DIR"].startswith(mount["mountPath"])
    assert all(9300 not in [p["port"] for p in s["spec"]["ports"]] for s in _by_kind(manifests)["Service"])
    assert _reachable(manifests, 9300) == set()  # no pod of the cluster reaches it
    for policy in _by_kind(manifests)["NetworkPolicy"]:
        rules = [r for r in policy["spec"]["ingress"] if any(p["port"] == 9300 for p in r["ports"])]
        if _task_of(policy)[0] == "tfe":
            assert rules == [{"from": [{"podSelector": {"matchLabels": {"app": "prometheus"}}}],
                              "ports": [{"protocol": "TCP", "port": 9300}]}]
        else:
            assert rules == []


@pytest.mark.parametrize("argv,message", [
    (["--cluster-mode", "in-graph", "--metrics-port", "9100"], "--metrics-port: only service mode's aggregation "
                                                               "servers serve metrics"),
    (["--model-claim", "m", "--model-claim-size", "1Gi"], "use them with --party chief:0 or worker:K"),
    (["--tfjob", "--server-image", "x:1"], "--server-image cannot be used with --tfjob"),
    (["--port", "9099"], "--metrics-port 9100 is the server's data port"),
    (["--metrics-namespace", "NS"], "'NS' is not a namespace name"),
])
def test_server_options_that_do_not_fit_are_refused(capsys, argv, message):
    with pytest.raises(SystemExit):
        kubernetes.main(["--name", "demo", "--image", IMAGE, *argv])
    assert message in capsys.readouterr().err
