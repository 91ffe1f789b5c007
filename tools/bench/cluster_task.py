"""A chief or worker task of the benchmark's loopback cluster (reads TF_CONFIG).

The chief starts its TensorFlow server (as `train_and_evaluate` would), runs
both twins with in-graph replication over the chief's and workers' devices
and writes its result row to the path it was given; a worker loads
tf-encrypted's ops, starts its server and serves until the launcher stops it.
"""
import json
import os
from typing import Dict

__all__ = ["run_task"]


def run_task(task: Dict) -> int:
    import tensorflow as tf  # pylint: disable=import-outside-toplevel

    from tools.bench.cases import measure  # pylint: disable=import-outside-toplevel
    from tools.bench.workloads import Workload, plaintext_config, secure_config  # pylint: disable=import-outside-toplevel
    from tfe_estimator.cluster.spec import TfeCluster  # pylint: disable=import-outside-toplevel
    from tfe_estimator.secure.protocols import load_backend  # pylint: disable=import-outside-toplevel

    tf.compat.v1.logging.set_verbosity(tf.compat.v1.logging.ERROR)
    cluster = TfeCluster.from_environment()
    load_backend()  # tf-encrypted's ops must be registered before this task's server starts
    server = tf.distribute.Server(cluster.cluster_spec(), job_name=cluster.task_type,
                                  task_index=cluster.task_index, protocol="grpc", start=True)
    if cluster.task_type != "chief":
        server.join()
        return 0
    workload = Workload(**{k: tuple(v) if isinstance(v, list) else v for k, v in task["workload"].items()})
    settings, workdir = task["settings"], task["workdir"]
    secure = secure_config(os.path.join(workdir, "secure"), None, settings["protocol"])
    plain = plaintext_config(os.path.join(workdir, "plaintext"), cluster.replica_devices())
    for config in (secure, plain):
        # With a TF_CONFIG cluster, Estimator.train() hands training to the
        # distribute coordinator, which only `train_and_evaluate` drives and
        # which starts this task's server itself, once per call: the two
        # twins' calls would both bind the chief's port. Without the
        # coordinator, train() runs the same in-graph training against
        # the chief server started above (the coordinator would set the
        # master the same way).
        config._distribute_coordinator_mode = None  # pylint: disable=protected-access
        config._master = server.target  # pylint: disable=protected-access
    row = measure(workload, settings, secure, plain)
    with open(task["result"], "w") as f:
        json.dump(row, f)
    return 0
