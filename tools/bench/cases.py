"""One benchmark case: build both twins, alternate their steps, measure traffic."""
import dataclasses
import json
import os
import sys
from typing import Dict

from tools.bench import timing, traffic
from tools.bench.workloads import Workload, input_fn, make_estimator, plaintext_config, secure_config

__all__ = ["measure", "run_local_case", "run_cluster_case"]


def measure(workload: Workload, settings: Dict, secure_cfg, plain_cfg) -> Dict:
    """Alternates the two twins' training steps; returns timings, traffic and sizes."""
    strategy = secure_cfg.train_distribute
    replicas = list(strategy.extended.worker_devices)
    servers = list(strategy.secure_aggregation.server_devices)
    graphs = {}

    def on_begin(name):
        def record(graph):
            graphs[name] = {"ops": len(graph.get_operations()), "params": traffic.trainable_parameters(graph)}
            if name == "secure":
                up, up_edges = traffic.cross_device_bytes(graph, replicas, servers)
                down, _ = traffic.cross_device_bytes(graph, servers, replicas)
                graphs[name].update(upload=up, upload_edges=up_edges, download=down)
        return record

    estimators = {"secure": make_estimator(workload, secure_cfg), "plaintext": make_estimator(workload, plain_cfg)}
    data = input_fn(workload.features, settings["batch_size"])

    def train_fn(name):
        return lambda hooks, steps: estimators[name].train(data, steps=steps, hooks=hooks)

    times = timing.run_alternating({n: train_fn(n) for n in estimators}, settings["warmup"], settings["rounds"],
                                   settings["steps"], on_begin={n: on_begin(n) for n in estimators})
    row = dict(dataclasses.asdict(workload), description=workload.describe())
    row.update(timing.summarize(times))
    params = graphs["secure"]["params"]
    assert params == graphs["plaintext"]["params"], graphs
    row.update(
        params=params,
        upload_bytes_per_step=graphs["secure"]["upload"],
        upload_edges=graphs["secure"]["upload_edges"],
        download_bytes_per_step=graphs["secure"]["download"],
        upload_bytes_per_param_per_replica_per_step=graphs["secure"]["upload"] / len(replicas) / params,
        download_bytes_per_param_per_replica_per_step=graphs["secure"]["download"] / len(replicas) / params,
        graph_ops={"secure": graphs["secure"]["ops"], "plaintext": graphs["plaintext"]["ops"]},
        replica_devices=replicas, server_devices=servers,
    )
    return row


def run_local_case(workload: Workload, settings: Dict, workdir: str) -> Dict:
    """A case on local replicas: both twins in this process."""
    secure = secure_config(os.path.join(workdir, "secure"), workload.replicas, settings["protocol"])
    replicas = secure.train_distribute.extended.worker_devices
    plain = plaintext_config(os.path.join(workdir, "plaintext"), replicas)
    return measure(workload, settings, secure, plain)


def run_cluster_case(workload: Workload, settings: Dict, workdir: str) -> Dict:
    """A case on a loopback cluster (chief + workers + 3 tfe servers) via `Launcher`.

    The chief runs both twins (in-graph replication over the same chief and
    worker devices) and writes its row to a JSON file; workers only serve.
    """
    from tfe_estimator.cluster.launcher import Launcher  # pylint: disable=import-outside-toplevel

    os.makedirs(workdir, exist_ok=True)
    result = os.path.join(workdir, "result.json")
    task = {"workload": dataclasses.asdict(workload), "settings": settings, "workdir": workdir, "result": result}
    command = [sys.executable, "-m", "tools.bench", "--cluster-task", json.dumps(task)]
    log_path = os.path.join(workdir, "launch.log")
    with open(log_path, "w") as log:
        status = Launcher(command, workers=workload.replicas - 1, evaluator=False,
                          protocol=settings["protocol"], out=log, cluster_mode="in-graph").run()
    if status != 0 or not os.path.exists(result):
        with open(log_path) as f:
            tail = "".join(f.readlines()[-40:])
        raise RuntimeError(f"the cluster case {workload.name} failed with status {status}:\n{tail}")
    with open(result) as f:
        return json.load(f)
