"""`tfe-estimator k8s --party`: one organisation's part of a federation, each schema-valid, no key in any."""
import base64
import ipaddress
import json
import os
import re
import shlex
import subprocess
import sys

import pytest
import yaml

from tfe_estimator.cluster import k8s_site, kubernetes
from tfe_estimator.cluster.spec import TfeCluster
from tfe_estimator.identity.federation import Federation
from tfe_estimator.tools import cli

from federation_helpers import PARTIES, make_federation, run_cli as _cli, stem as _stem

IMAGE = "registry.example.com/train:1.0"
SERVERS = {"tfe:0": ("203.0.113.10", 7000), "tfe:1": ("198.51.100.7", 7001)}
OWNER_CIDR = "192.0.2.0/24"


@pytest.fixture(scope="module")
def sites(tmp_path_factory):
    """docs/deployment.md's flow: a CA per organisation, a key per party, the federation file installed."""
    root = tmp_path_factory.mktemp("sites")
    return root, make_federation(root, SERVERS)


def _render(capsys, fed, party, *extra):
    argv = ["--name", "demo", "--namespace", "ml", "--image", IMAGE, "--federation", fed, "--party", party, *extra]
    if not party.startswith("tfe"):
        argv += ([] if "--model-claim" in extra else ["--model-claim", "{name}-model"]) + ["--", "python", "train.py"]
    assert kubernetes.main(argv) == 0
    text = capsys.readouterr().out
    return text, list(yaml.safe_load_all(text))


def _private_pems(root, parties=len(PARTIES)):
    """Every private key made for the federation (the CAs' and the parties'), as PEM bodies."""
    keys = []
    for dirpath, _, files in os.walk(root):
        keys += [open(os.path.join(dirpath, f)).read() for f in files if f.endswith(".key")]
    assert len(keys) == 2 * parties
    return [k.split("-----")[2].strip().splitlines()[0] for k in keys]  # a line of each key's base64


def _no_key(text, keys):
    """No private key in the stream: neither as PEM text nor base64-encoded (as a Secret's data holds it)."""
    blobs = [text]
    for doc in yaml.safe_load_all(text):
        for value in (doc.get("data") or {}).values() if isinstance(doc, dict) else ():
            blobs.append(base64.b64decode(value).decode("latin-1"))
    return not any("PRIVATE KEY" in b or any(k in b for k in keys) for b in blobs)


def _in(cidr, ip):
    return ipaddress.ip_address(ip) in ipaddress.ip_network(cidr)


def _policy(objs):
    (policy,) = [o for o in objs if o["kind"] == "NetworkPolicy"]
    return policy["spec"]


def _schema_validator():
    try:
        from kubernetes_validate import utils
    except ImportError:
        pytest.skip("kubernetes-validate is not installed (the test extra): no schema check")
    return utils


def test_each_organisations_part_is_schema_valid_and_holds_no_key(sites, capsys):
    root, fed = sites
    utils = _schema_validator()
    keys = _private_pems(root)
    configs, digests = {}, set()
    for org, (identity, _) in PARTIES.items():
        extra = ["--allow-from", OWNER_CIDR] if identity.startswith("tfe") else []
        text, objs = _render(capsys, fed, identity, *extra)
        # The party's Secret as its organisation makes it, applied beside the rendered objects.
        _cli("certs", "secret", "--dir", str(root / org / _stem(identity)), "--identity", identity,
             "--name", "demo")
        secret = yaml.safe_load(capsys.readouterr().out)
        for manifest in objs + [secret]:
            utils.validate(manifest, utils.latest_version(), strict=True)
        assert _no_key(text, keys)
        job, index = identity.split(":")
        workloads = [o for o in objs if o["kind"] in ("Job", "Deployment")]
        assert [o["metadata"]["name"] for o in workloads] == [f"demo-{job}-{index}"]  # only its own party
        digests.add(workloads[0]["metadata"]["annotations"][k8s_site.DIGEST_ANNOTATION])
        spec = workloads[0]["spec"]["template"]["spec"]
        volumes = {v["name"]: v for v in spec["volumes"]}
        assert volumes["tls-certs"]["secret"]["secretName"] == secret["metadata"]["name"]
        (container,) = spec["containers"]
        configs[identity] = json.loads([e["value"] for e in container["env"] if e["name"] == "TF_CONFIG"][0])
        TfeCluster.from_json(json.dumps(configs[identity]))
    clusters = {json.dumps(c["cluster"], sort_keys=True) for c in configs.values()}
    assert len(clusters) == 1  # every site the same cluster: the owners' initial weights agree
    assert len(digests) == 1  # and the annotation the sites compare says so
    assert configs["chief:0"]["cluster"]["tfe"] == [f"{h}:{p}" for h, p in SERVERS.values()]


def _server_ports(port):
    """A server's two ports across organisations: its address's port (gRPC) and its data port, the next one."""
    return (port, port + 1)


def test_node_port_and_grpc_only_servers_are_schema_valid(sites, capsys):
    _, fed = sites
    utils = _schema_validator()
    for extra in (["--expose", "NodePort", "--server-address", "tfe:1=198.51.100.7:30701"], ["--no-data-plane"],
                  ["--expose", "ClusterIP"]):
        for manifest in _render(capsys, fed, "tfe:1", *extra)[1]:
            utils.validate(manifest, utils.latest_version(), strict=True)


def _check_owner(objs):
    """An owner: no Service, no port, no ingress rule, egress only to the two servers' two ports each (every rule
    has `to`), and to every one of them: the data port too, or the owner's client would wait on it."""
    assert sorted(o["kind"] for o in objs) == ["Job", "NetworkPolicy"]  # no Service: nothing to reach
    policy = _policy(objs)
    assert policy["policyTypes"] == ["Ingress", "Egress"] and policy["ingress"] == []
    reached = set()
    for rule in policy["egress"]:
        if rule.get("ports") and all(p["port"] == 53 for p in rule["ports"]) and "to" not in rule:
            continue  # DNS (only when a server's address is a host name)
        assert rule.get("to"), rule  # no rule open to every destination
        for peer in rule["to"]:
            assert set(peer) == {"ipBlock"}
            assert ipaddress.ip_network(peer["ipBlock"]["cidr"]).num_addresses <= 16, peer  # a server's range only
            for port in rule["ports"]:
                reached |= {(s, port["port"]) for s, (host, p) in SERVERS.items() if _in(peer["ipBlock"]["cidr"], host)}
                assert any(_in(peer["ipBlock"]["cidr"], h) and port["port"] in _server_ports(p)
                           for h, p in SERVERS.values())
    assert reached == {(s, q) for s, (_, p) in SERVERS.items() for q in _server_ports(p)}
    (job,) = [o for o in objs if o["kind"] == "Job"]
    assert "ports" not in job["spec"]["template"]["spec"]["containers"][0]


@pytest.mark.parametrize("owner", ["chief:0", "worker:0"])
def test_an_owner_admits_nothing_and_reaches_only_the_two_servers(sites, capsys, owner):
    _, fed = sites
    _, objs = _render(capsys, fed, owner)
    _check_owner(objs)
    assert all(rule.get("to") for rule in _policy(objs)["egress"])  # IP addresses: not even DNS


@pytest.mark.parametrize("plant", ["egress anywhere", "egress elsewhere", "ingress", "service", "no data port",
                                   "another port"])
def test_mutation_an_owner_open_to_more_is_caught(sites, capsys, plant):
    """Plant a rule that opens the owner further (or drops a data port it must reach): the owner check must fail."""
    _, fed = sites
    _, objs = _render(capsys, fed, "chief:0")
    policy = _policy(objs)
    if plant == "egress anywhere":
        policy["egress"].append({"ports": [{"protocol": "TCP", "port": 443}]})
    elif plant == "egress elsewhere":
        policy["egress"][0]["to"].append({"ipBlock": {"cidr": "0.0.0.0/0"}})
    elif plant == "ingress":
        policy["ingress"].append({"ports": [{"protocol": "TCP", "port": 7000}]})
    elif plant == "no data port":  # the per-site rendering before the data port: gRPC only
        policy["egress"][1]["ports"] = policy["egress"][1]["ports"][:1]
    elif plant == "another port":
        policy["egress"][0]["ports"].append({"protocol": "TCP", "port": 7002})
    else:
        objs.append({"kind": "Service"})
    with pytest.raises(AssertionError):
        _check_owner(objs)


def test_mutation_a_key_in_a_manifest_is_caught(sites, capsys):
    """Plant the party's own Secret (its key) in the rendered stream: the no-key check must fail."""
    root, fed = sites
    text, _ = _render(capsys, fed, "worker:0")
    _cli("certs", "secret", "--dir", str(root / "hospital-b" / "worker-0"), "--identity", "worker:0", "--name", "demo")
    leaked = text + capsys.readouterr().out
    keys = _private_pems(root)
    assert _no_key(text, keys)
    assert not _no_key(leaked, keys)
    assert not _no_key(text + "# " + keys[0] + "\n", keys)  # a key's base64 in a comment too


def _check_server(objs, ports, node_ports=False):
    """A server: every port it binds (its gRPC port, its ``--data-port``: the one it announces) is its container's,
    exposed on its Service at the same number (on every node too with `node_ports`), and the only ports its
    NetworkPolicy admits, all from the same sources; returns the policy's spec."""
    (deployment,) = [o for o in objs if o["kind"] == "Deployment"]
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    command = container["command"]
    bound = (ports[0],) + ((int(command[command.index("--data-port") + 1]),) if "--data-port" in command else ())
    assert bound == tuple(ports)
    # Its metrics port (`--metrics-port`) is a container port too, but on no Service and in its own rule.
    metrics = [int(command[command.index("--metrics-port") + 1])] if "--metrics-port" in command else []
    assert [p["containerPort"] for p in container["ports"]] == list(ports) + metrics
    (service,) = [o for o in objs if o["kind"] == "Service"]
    for p in service["spec"]["ports"]:
        assert p["port"] == p["targetPort"] and p.get("nodePort", p["port"]) == p["port"]
        assert ("nodePort" in p) == node_ports
    assert [p["port"] for p in service["spec"]["ports"]] == list(ports)
    policy = _policy(objs)
    federation_rules = [r for r in policy["ingress"] if not any(p["port"] in metrics for p in r["ports"])]
    assert len(federation_rules) == 1  # one rule: every federation port admits exactly the same callers
    (rule,) = federation_rules
    assert rule["ports"] == [{"protocol": "TCP", "port": p} for p in ports]
    return policy


@pytest.mark.parametrize("server", ["tfe:0", "tfe:1"])
def test_a_server_is_exposed_and_admits_only_its_two_ports(sites, capsys, server):
    _, fed = sites
    host, port = SERVERS[server]
    _, objs = _render(capsys, fed, server, "--allow-from", OWNER_CIDR)
    (service,) = [o for o in objs if o["kind"] == "Service"]
    assert service["spec"]["type"] == "LoadBalancer" and service["spec"]["externalTrafficPolicy"] == "Local"
    assert service["spec"]["loadBalancerSourceRanges"] == [OWNER_CIDR]
    policy = _check_server(objs, _server_ports(port))
    assert policy["ingress"][0]["from"] == [{"ipBlock": {"cidr": OWNER_CIDR}}]
    if server == "tfe:1":
        assert policy["egress"] == []  # server1 calls nobody
    else:  # server0 reaches server1's service port and its data port (server0's forward), nothing else
        h1, p1 = SERVERS["tfe:1"]
        assert policy["egress"] == [{"to": [{"ipBlock": {"cidr": f"{h1}/32"}}],
                                     "ports": [{"protocol": "TCP", "port": p} for p in _server_ports(p1)]}]


@pytest.mark.parametrize("plant", ["another port", "data port open to all", "data port not bound"])
def test_mutation_a_server_open_to_more_is_caught(sites, capsys, plant):
    """Plant a port the server does not announce, a data port admitted from anywhere, or a data port the server
    does not bind (the Service says 7002, the server announces 7001): the server check must fail."""
    _, fed = sites
    _, objs = _render(capsys, fed, "tfe:1", "--allow-from", OWNER_CIDR)
    rules = _policy(objs)["ingress"]
    if plant == "another port":
        rules[0]["ports"].append({"protocol": "TCP", "port": 7003})
    elif plant == "data port open to all":
        rules[0]["ports"].pop()
        rules.append({"ports": [{"protocol": "TCP", "port": 7002}]})
    else:
        (deployment,) = [o for o in objs if o["kind"] == "Deployment"]
        command = deployment["spec"]["template"]["spec"]["containers"][0]["command"]
        command[command.index("--data-port") + 1] = "7001"
    with pytest.raises(AssertionError):
        _check_server(objs, _server_ports(7001))


def test_without_a_data_plane_a_server_runs_grpc_only_and_owners_may_not_opt_out(sites, capsys):
    _, fed = sites
    _, objs = _render(capsys, fed, "tfe:0", "--no-data-plane", "--allow-from", OWNER_CIDR)
    policy = _check_server(objs, (7000,))
    h1, p1 = SERVERS["tfe:1"]  # server1's data port is its own operator's choice: server0 may still reach it
    assert policy["egress"][0]["ports"] == [{"protocol": "TCP", "port": p} for p in _server_ports(p1)]
    with pytest.raises(SystemExit):
        _render(capsys, fed, "worker:0", "--no-data-plane")
    assert "its egress must admit them" in capsys.readouterr().err
    with pytest.raises(TypeError, match="data_plane='no'"):
        k8s_site.render_party(Federation.load(fed), "tfe:1", "demo", IMAGE, data_plane="no")


def test_node_port_and_host_names(sites, capsys):
    _, fed = sites
    address = ["--server-address", "tfe:1=198.51.100.7:30701"]
    _, objs = _render(capsys, fed, "tfe:1", "--expose", "NodePort", *address)
    _check_server(objs, (30701, 30702), node_ports=True)  # announced 30702: the node port other sites reach
    # Every other site reaches exactly those node ports: the owners' and server0's egress.
    for party in ("worker:0", "tfe:0"):
        _, objs = _render(capsys, fed, party, *address)
        (rule,) = [r for r in _policy(objs)["egress"] if r["to"] == [{"ipBlock": {"cidr": "198.51.100.7/32"}}]]
        assert [p["port"] for p in rule["ports"]] == [30701, 30702], party
    with pytest.raises(SystemExit):
        _render(capsys, fed, "tfe:1", "--expose", "NodePort")
    assert "7001 is no node port" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # the data port would be 32768, no node port
        _render(capsys, fed, "tfe:1", "--expose", "NodePort", "--server-address", "tfe:1=198.51.100.7:32767")
    assert "data port 32768 (its address port 32767 + 1) is no node port" in capsys.readouterr().err
    _, objs = _render(capsys, fed, "tfe:1", "--expose", "NodePort", "--server-address", "tfe:1=198.51.100.7:32767",
                      "--no-data-plane")
    _check_server(objs, (32767,), node_ports=True)
    # A server at a host name: the owner needs its IP range, and then may resolve it (DNS).
    names = ["--server-address", "tfe:0=tfe0.operator-x.example:7000"]
    with pytest.raises(SystemExit):
        _render(capsys, fed, "worker:0", *names)
    assert "--server-cidr tfe:0=CIDR" in capsys.readouterr().err
    _, objs = _render(capsys, fed, "worker:0", *names, "--server-cidr", "tfe:0=203.0.113.0/28")
    egress = _policy(objs)["egress"]
    assert egress[0]["to"] == [{"ipBlock": {"cidr": "203.0.113.0/28"}}]
    assert egress[-1] == {"ports": [{"protocol": "UDP", "port": 53}, {"protocol": "TCP", "port": 53}]}


@pytest.mark.parametrize("argv,message", [
    (["--party", "worker:0"], "needs --federation FILE"),
    (["--party", "worker:7", "--federation", "{fed}"], "has no such party"),
    (["--party", "worker:0", "--federation", "{fed}", "--tls"], "--tls cannot be used with --party"),
    (["--party", "worker:0", "--federation", "{fed}", "--allow-from", OWNER_CIDR], "Drop --allow-from"),
    (["--party", "tfe:0", "--federation", "{fed}", "--allow-from", "hospital"], "is not an IP range"),
    (["--party", "tfe:0", "--federation", "{fed}", "--server-address", "tfe:0=localhost:7000"], "loopback"),
    (["--party", "tfe:0", "--federation", "/nonexistent.json"], "cannot read it"),
    (["--party", "tfe:1", "--federation", "{fed}", "--server-address", "tfe:1=198.51.100.7:65535"],
     "leaves no room for its data port"),
    (["--party", "tfe:0", "--federation", "{fed}", "--server-address", "tfe:0=198.51.100.7:7000",
      "--server-address", "tfe:1=198.51.100.7:7001"], "give the two servers ports at least 2 apart"),
    (["--federation", "{fed}"], "only with --party"),
])
def test_bad_party_arguments_name_the_value_and_the_fix(sites, capsys, argv, message):
    _, fed = sites
    with pytest.raises(SystemExit):
        kubernetes.main(["--name", "demo", "--image", IMAGE] + [a.format(fed=fed) for a in argv])
    assert message in capsys.readouterr().err


def test_owners_not_a_chief_and_workers_are_refused(sites):
    _, fed = sites
    data = Federation.load(fed).to_dict()
    data["parties"]["worker:3"] = data["parties"]["worker:0"]
    with pytest.raises(ValueError, match=r"needs exactly \['chief:0', 'worker:0', 'worker:1'"):
        k8s_site.render_party(Federation.from_dict(data), "worker:0", "demo", IMAGE)


def _doc_commands(path):
    """docs/deployment.md's `tfe-estimator certs`/`k8s` commands (continuations joined, $VARS expanded), with
    their `> file` redirection; the processes of step 4 and kubectl are left out."""
    text = open(path, encoding="utf-8").read()
    variables, commands = {}, []
    for block in text.split("```sh\n")[1:]:
        body = block.split("```")[0].replace("\\\n", " ")
        for line in body.splitlines():
            name, sep, value = line.partition("=")
            if sep and name.isidentifier() and name.isupper() and name not in ("CLUSTER", "TF_CONFIG"):
                variables[name] = shlex.split(value)[0]
                continue
            if not line.startswith(("tfe-estimator certs ", "tfe-estimator k8s ")):
                continue
            for name, value in variables.items():
                line = line.replace(f"${name}", value)
            argv = shlex.split(line)[1:]
            out = argv[argv.index(">") + 1] if ">" in argv else None
            commands.append((argv[:argv.index(">")] if out else argv, out))
    return commands


def test_the_deployment_pages_commands_render_schema_valid_parts_without_keys(tmp_path, monkeypatch, capsys):
    """The three-hospital page, steps 1-3 and 5, run as written: every rendered file is schema-valid, names
    only its own party, holds no key but its own Secret's."""
    utils = _schema_validator()
    monkeypatch.chdir(tmp_path)
    commands = _doc_commands(os.path.join(os.path.dirname(__file__), "..", "docs", "deployment.md"))
    assert sum(a[0] == "k8s" for a, _ in commands) == 5  # 3 owners and 2 servers
    for argv, out in commands:
        capsys.readouterr()  # the earlier commands' messages
        assert cli.main(argv) == 0, argv
        if out:
            (tmp_path / out).write_text(capsys.readouterr().out)
    keys = _private_pems(tmp_path, parties=5)
    digests = set()
    for identity in ("chief:0", "worker:0", "worker:1", "tfe:0", "tfe:1"):
        stem = _stem(identity)
        text = (tmp_path / f"{stem}.yaml").read_text()
        objs = list(yaml.safe_load_all(text))
        secret = yaml.safe_load((tmp_path / f"{stem}-secret.yaml").read_text())
        for manifest in objs + [secret]:
            utils.validate(manifest, utils.latest_version(), strict=True)
        assert _no_key(text, keys)
        claims = {o["metadata"]["name"] for o in objs if o["kind"] == "PersistentVolumeClaim"}  # its model claim
        assert {o["metadata"]["name"] for o in objs} - claims <= {f"demo-{stem}", f"demo-{stem}-peers"}
        digests |= {o["metadata"]["annotations"][k8s_site.DIGEST_ANNOTATION] for o in objs
                    if o["kind"] in ("Job", "Deployment")}
        own = base64.b64decode(secret["data"][f"{stem}.key"]).decode()
        assert sum(k in own for k in keys) == 1 and set(secret["data"]) == {f"{stem}.crt", f"{stem}.key",
                                                                            "federation.json"}
    assert len(digests) == 1  # the five sites render one cluster
    # One set of ports: each server's rendered data port is the one step 4 runs it with (`server --data-port`).
    text = open(os.path.join(os.path.dirname(__file__), "..", "docs", "deployment.md"), encoding="utf-8").read()
    step4 = dict(re.findall(r'"index\\": (\d)}}" TFE_ESTIMATOR_CLUSTER_MODE=service \\\n'
                            r'  TFE_ESTIMATOR_TLS_DIR=\S+ tfe-estimator server --data-port (\d+)', text))
    assert sorted(step4) == ["0", "1"], step4
    for index, port in step4.items():
        (deployment,) = [o for o in yaml.safe_load_all((tmp_path / f"tfe-{index}.yaml").read_text())
                         if o["kind"] == "Deployment"]
        command = deployment["spec"]["template"]["spec"]["containers"][0]["command"]
        assert command[command.index("--data-port") + 1] == port, (index, command)


def test_a_party_renders_without_tensorflow(sites, tmp_path):
    _, fed = sites
    code = ("import sys\nfrom tfe_estimator.tools import cli\nrc = cli.main(sys.argv[1:])\n"
            "assert 'tensorflow' not in sys.modules, 'tfe-estimator k8s --party imported TensorFlow'\n"
            "sys.exit(rc)\n")
    out_file = tmp_path / "tfe-0.yaml"
    argv = ["k8s", "--name", "demo", "--image", IMAGE, "--federation", fed, "--party", "tfe:0", "-o", str(out_file)]
    out = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "kind: NetworkPolicy" in out_file.read_text()


# ------------------------------------------------------------------ what a site applies (issue 41, item 4)

SERVER_IMAGE = "registry.operator-x.example/tfe-server:1.0"
NAMESPACED = {"Job", "Deployment", "Service", "NetworkPolicy", "PersistentVolumeClaim", "Secret", "ConfigMap"}


def _workload(objs):
    (workload,) = [o for o in objs if o["kind"] in ("Job", "Deployment")]
    spec = workload["spec"]["template"]["spec"]
    (container,) = spec["containers"]
    return spec, container, {e["name"]: e["value"] for e in container["env"]}


def _metrics_rules(objs, port):
    """The ingress rules that admit `port` (the metrics port): each with its `from`."""
    return [r for r in _policy(objs)["ingress"] if any(p["port"] == port for p in r["ports"])]


def _check_metrics_closed(objs, port, sources):
    """The metrics port: a container port on no Service, admitted only from `sources` (none: from nobody), in a
    rule of its own that opens nothing else."""
    _, container, _ = _workload(objs)
    assert {"name": "metrics", "containerPort": port, "protocol": "TCP"} in container["ports"]
    (service,) = [o for o in objs if o["kind"] == "Service"]
    assert port not in [p["port"] for p in service["spec"]["ports"]]
    rules = _metrics_rules(objs, port)
    if not sources:
        assert rules == []
        return
    assert len(rules) == 1, rules
    assert rules[0] == {"from": sources, "ports": [{"protocol": "TCP", "port": port}]}


def test_a_sites_whole_part_is_what_it_applies(sites, capsys):
    """Every new flag at once, at every party: schema-valid, every object in the namespace, the owner's data and
    model claims where train.py reads them, the servers on their own image with probes, server0 with its state."""
    _, fed = sites
    utils = _schema_validator()
    monitoring = ["--metrics-namespace", "monitoring", "--metrics-pod-label", "app.kubernetes.io/name=prometheus"]
    for party in ("chief:0", "worker:0", "tfe:0", "tfe:1"):
        job, index = party.split(":")
        if job == "tfe":
            extra = ["--server-image", SERVER_IMAGE, "--metrics-port", "9200", "--allow-from", OWNER_CIDR, *monitoring]
        else:
            extra = ["--data-claim", "{name}-data-{job}-{index}", "--model-claim", "{name}-model",
                     "--model-claim-size", "10Gi", "--storage-class", "fast-ssd", "--data-mount-path", "/srv/data"]
        _, objs = _render(capsys, fed, party, *extra)
        for manifest in objs:
            utils.validate(manifest, utils.latest_version(), strict=True)
            assert manifest["kind"] in NAMESPACED and manifest["metadata"]["namespace"] == "ml", manifest["kind"]
        spec, container, env = _workload(objs)
        volumes = {v["name"]: v for v in spec["volumes"]}
        mounts = {m["name"]: m for m in container.get("volumeMounts", [])}
        if job != "tfe":
            assert container["image"] == IMAGE
            assert volumes["data"]["persistentVolumeClaim"] == {"claimName": f"demo-data-{job}-{index}",
                                                                "readOnly": True}
            assert mounts["data"]["mountPath"] == env["TFE_ESTIMATOR_DATA_DIR"] == "/srv/data"
            assert mounts["data"]["readOnly"] is True
            assert volumes["model"]["persistentVolumeClaim"] == {"claimName": "demo-model", "readOnly": False}
            assert env["TFE_ESTIMATOR_MODEL_DIR"] == f"/model/{job}-{index}"
            assert env["TFE_ESTIMATOR_MODEL_DIR"].startswith(mounts["model"]["mountPath"] + "/")
            (claim,) = [o for o in objs if o["kind"] == "PersistentVolumeClaim"]
            assert claim["metadata"]["name"] == "demo-model"
            assert claim["spec"] == {"accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": "10Gi"}},
                                     "storageClassName": "fast-ssd"}
            assert not any(k.startswith(("readiness", "liveness")) for k in container)
            continue
        assert container["image"] == SERVER_IMAGE  # the operator's image, not the hospitals'
        assert not [v for v in spec["volumes"] if "persistentVolumeClaim" in v]  # no owner's data or model
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert container[probe]["exec"]["command"] == ["tfe-estimator", "health"], probe
        started = container["startupProbe"]
        assert started["periodSeconds"] * started["failureThreshold"] >= 120  # a slow start is no failure
        live = container["livenessProbe"]
        assert live["periodSeconds"] * live["failureThreshold"] >= 60  # nor one slow answer
        command = container["command"]
        assert command[command.index("--metrics-port") + 1] == "9200"
        _check_metrics_closed(objs, 9200, [{
            "podSelector": {"matchLabels": {"app.kubernetes.io/name": "prometheus"}},
            "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}])
        _check_server(objs, _server_ports(SERVERS[party][1]))  # the federation ports as before, metrics apart
        if index == "0":  # its release log survives a container restart
            state = env["TFE_ESTIMATOR_STATE_DIR"]
            assert volumes["state"] == {"name": "state", "emptyDir": {}}
            assert state.startswith(mounts["state"]["mountPath"] + "/")  # a directory the server makes 0700
        else:
            assert "TFE_ESTIMATOR_STATE_DIR" not in env and "state" not in volumes


def test_a_servers_metrics_are_closed_by_default_and_a_server_needs_no_training_image(sites, capsys):
    _, fed = sites
    argv = ["--name", "demo", "--namespace", "ml", "--federation", fed, "--party", "tfe:1"]
    assert kubernetes.main(argv + ["--server-image", SERVER_IMAGE]) == 0  # no --image at all
    captured = capsys.readouterr()
    objs = list(yaml.safe_load_all(captured.out))
    assert _workload(objs)[1]["image"] == SERVER_IMAGE
    _check_metrics_closed(objs, 9100, [])  # the default port, admitted from nobody
    assert "metrics on port 9100 admit nobody" in captured.err
    _, objs = _render(capsys, fed, "tfe:1", "--no-metrics")
    assert "--metrics-port" not in _workload(objs)[1]["command"]
    assert [p["name"] for p in _workload(objs)[1]["ports"]] == ["grpc", "data"]


@pytest.mark.parametrize("plant", ["metrics in the federation rule", "metrics from anywhere", "metrics on the service"])
def test_mutation_a_metrics_port_open_to_more_is_caught(sites, capsys, plant):
    """Plant the metrics port where the owners (or anyone) may reach it: the metrics check must fail."""
    _, fed = sites
    _, objs = _render(capsys, fed, "tfe:0", "--allow-from", OWNER_CIDR, "--metrics-namespace", "monitoring")
    sources = [{"podSelector": {}, "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}]
    _check_metrics_closed(objs, 9100, sources)
    rules = _policy(objs)["ingress"]
    if plant == "metrics in the federation rule":
        rules[0]["ports"].append({"protocol": "TCP", "port": 9100})
    elif plant == "metrics from anywhere":
        del rules[1]["from"]
    else:
        (service,) = [o for o in objs if o["kind"] == "Service"]
        service["spec"]["ports"].append({"name": "metrics", "port": 9100, "targetPort": 9100, "protocol": "TCP"})
    with pytest.raises(AssertionError):
        _check_metrics_closed(objs, 9100, sources)


def _notes(capsys, fed, party, *extra, namespace=("--namespace", "ml")):
    """What `tfe-estimator k8s --party` tells the site on stderr."""
    argv = ["--name", "demo", *namespace, "--image", IMAGE, "--federation", fed, "--party", party, *extra]
    assert kubernetes.main(argv) == 0
    return capsys.readouterr().err


def test_a_site_is_told_what_to_create_before_applying(sites, capsys):
    _, fed = sites
    err = _notes(capsys, fed, "worker:0", "--data-claim", "{name}-data", "--model-claim", "{name}-model-{job}-{index}")
    for needed in ("kubectl create namespace ml", "Secret 'demo-worker-0-tls'", "--namespace ml",
                   "PersistentVolumeClaim 'demo-data' holding this owner's data",
                   "PersistentVolumeClaim 'demo-model-worker-0' for the checkpoints", "--model-claim-size SIZE"):
        assert needed in err, (needed, err)
    err = _notes(capsys, fed, "chief:0", "--model-claim", "m", "--model-claim-size", "1Gi")
    assert "no --data-claim: the training script must find its data in the image" in err
    assert "'m' for the checkpoints (TFE_ESTIMATOR_MODEL_DIR; rendered with them)" in err
    err = _notes(capsys, fed, "tfe:0", "--metrics-namespace", "monitoring")
    assert "release log is on an emptyDir" in err and "no --server-image" in err and "admit nobody" not in err
    err = _notes(capsys, fed, "tfe:1", "--server-image", IMAGE, namespace=())
    assert "namespace 'default': give this party a namespace of its own" in err and "release log" not in err


@pytest.mark.parametrize("argv,message", [
    (["--party", "tfe:0", "--data-claim", "{name}-data"], "--data-claim: tfe:0 is an aggregation server, which never "
                                                          "sees an owner's data or model"),
    (["--party", "tfe:1", "--model-claim", "m", "--model-claim-size", "1Gi"], "--model-claim, --model-claim-size: "
                                                                              "tfe:1 is an aggregation server"),
    (["--party", "worker:0", "--model-claim", "m", "--server-image", "x:1"],
     "--server-image: worker:0 is a data owner"),
    (["--party", "chief:0", "--model-claim", "m", "--metrics-namespace", "monitoring"],
     "--metrics-namespace: chief:0 is a data owner"),
    (["--party", "worker:0", "--", "python", "train.py"], "--party worker:0 needs --model-claim NAME"),
    (["--party", "worker:0", "--model-claim", "m", "--model-claim-size", "lots"], "'lots' is not a storage quantity"),
    (["--party", "worker:0", "--model-claim", "m", "--storage-class", "fast"], "add --model-claim-size SIZE"),
    (["--party", "tfe:0", "--metrics-port", "7000"], "--metrics-port 7000 is the server's service port"),
    (["--party", "tfe:0", "--metrics-port", "7001"], "--metrics-port 7001 is the server's data port"),
    (["--party", "tfe:0", "--metrics-port", "70000"], "must be a TCP port in 1..65535"),
    (["--party", "tfe:0", "--metrics-namespace", "Monitoring_NS"], "'Monitoring_NS' is not a namespace name"),
    (["--party", "tfe:0", "--metrics-pod-label", "app=prom etheus"], "not a Kubernetes label"),
    (["--party", "tfe:0", "--metrics-pod-label", "app"], "expected KEY=VALUE"),
    (["--party", "tfe:0", "--no-metrics", "--metrics-port", "9100"], "contradict each other"),
    (["--party", "tfe:0", "--server-image", "bad image"], "--server-image='bad image' must be a non-empty"),
])
def test_options_that_do_not_fit_the_party_are_refused(sites, capsys, argv, message):
    _, fed = sites
    with pytest.raises(SystemExit):
        kubernetes.main(["--name", "demo", "--namespace", "ml", "--image", IMAGE, "--federation", fed] + argv)
    assert message in capsys.readouterr().err


def _table_ports(text):
    """The docs' table of the servers' ports: ``tfe:K`` -> (service port, data port, metrics port)."""
    rows = re.findall(r"^\| `(tfe:\d)` \| [^|]+ \| (\d+) \| (\d+) \| (\d+) \|$", text, re.M)
    return {party: tuple(int(p) for p in ports) for party, *ports in rows}


#: The pages whose `tfe-estimator k8s --party` commands and server-port table must agree with the renderer.
PORT_PAGES = ("kubernetes.md",)


@pytest.mark.parametrize("page", PORT_PAGES)
def test_the_docs_ports_are_the_renderers(tmp_path_factory, monkeypatch, capsys, page):
    """The page's commands, run as written, render each server on exactly the ports its table names (service,
    data = service + 1, metrics), and each owner's egress reaches exactly those federation ports."""
    path = os.path.join(os.path.dirname(__file__), "..", "docs", page)
    text = open(path, encoding="utf-8").read()
    table = _table_ports(text)
    assert sorted(table) == ["tfe:0", "tfe:1"], table
    root = tmp_path_factory.mktemp("docs-ports")
    servers = {"tfe:0": ("203.0.113.10", table["tfe:0"][0]), "tfe:1": ("198.51.100.7", table["tfe:1"][0])}
    fed = make_federation(root, servers)
    monkeypatch.chdir(root)
    os.replace(fed, root / "federation.json")
    rendered = {}
    for argv, _ in _doc_commands(path):
        if argv[0] == "k8s" and "--party" in argv:
            capsys.readouterr()  # the federation's messages
            assert cli.main(argv) == 0, argv
            rendered[argv[argv.index("--party") + 1]] = list(yaml.safe_load_all(capsys.readouterr().out))
    assert sorted(rendered) == ["chief:0", "tfe:0", "tfe:1", "worker:0"]
    for party, (service, data, metrics) in table.items():
        _, container, _ = _workload(rendered[party])
        assert {p["name"]: p["containerPort"] for p in container["ports"]} == {
            "grpc": service, "data": data, "metrics": metrics}, party
        command = container["command"]
        assert int(command[command.index("--data-port") + 1]) == data
        assert int(command[command.index("--metrics-port") + 1]) == metrics
    federation_ports = {p for service, data, _ in table.values() for p in (service, data)}
    for owner in ("chief:0", "worker:0"):
        reached = {p["port"] for rule in _policy(rendered[owner])["egress"] for p in rule["ports"]}
        assert reached == federation_ports, owner
