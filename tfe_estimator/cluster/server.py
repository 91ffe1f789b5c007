"""`run_server`: this task's TFE party as a TensorFlow server, from TF_CONFIG.

A ``tfe`` task holds one party of the secure sum. It is a plain
`tf.distribute.Server` of the cluster, started after tf-encrypted's op
library is loaded: the chief places share-adding ops on it, and without the
library remote execution fails with "Op type not registered
'SecureSeededRandomUniform'".

Example::

    $ TF_CONFIG='{"cluster": {...}, "task": {"type": "tfe", "index": 0}}' tfe-estimator server
"""
import logging
import signal
import threading
from typing import Mapping, Optional, Tuple

from tfe_estimator.cluster.spec import TFE_JOB, TfeCluster
from tfe_estimator.secure.protocols import load_backend

__all__ = ["run_server", "start_server", "server_command", "SERVER_SUBCOMMAND"]

log = logging.getLogger("tfe_estimator")

#: The `tfe-estimator` subcommand that runs a ``tfe`` task.
SERVER_SUBCOMMAND = "server"


def server_command(python: Optional[str] = None) -> Tuple[str, ...]:
    """The command line that runs a ``tfe`` task: the one definition.

    Args:
      python: None for the installed console script (a container image, a
        cluster node); an interpreter path to run this installation's module
        with it (the loopback launcher uses ``sys.executable``).

    Example::

        >>> server_command()
        ('tfe-estimator', 'server')
        >>> server_command("/usr/bin/python3")
        ('/usr/bin/python3', '-m', 'tfe_estimator.tools.cli', 'server')
    """
    if python is None:
        return ("tfe-estimator", SERVER_SUBCOMMAND)
    return (python, "-m", "tfe_estimator.tools.cli", SERVER_SUBCOMMAND)


def start_server(cluster: TfeCluster):
    """Starts the `tf.distribute.Server` of a ``tfe`` task and returns it."""
    if cluster.task_type != TFE_JOB:
        raise ValueError(
            f"`tfe-estimator server` runs the '{TFE_JOB}' tasks, but TF_CONFIG says this task "
            f"is {cluster.task_type}:{cluster.task_index}. Chief, worker and evaluator tasks "
            "run the training script."
        )
    load_backend()  # registers tf-encrypted's ops before the server starts
    import tensorflow as tf  # pylint: disable=import-outside-toplevel

    return tf.distribute.Server(
        cluster.cluster_spec(without=("evaluator",)),
        job_name=TFE_JOB,
        task_index=cluster.task_index,
        protocol="grpc",
        start=True,
    )


def run_server(environ: Optional[Mapping[str, str]] = None, stop: Optional[threading.Event] = None) -> int:
    """Serves this ``tfe`` task until SIGTERM or SIGINT (or `stop` is set).

    Returns:
      0, the exit status.

    Raises:
      ValueError: without a TF_CONFIG cluster, or when this task is not a ``tfe`` task.
    """
    cluster = TfeCluster.from_environment(environ)
    if cluster is None:
        raise ValueError(
            "`tfe-estimator server` needs TF_CONFIG with a cluster and this task, e.g. "
            '{"cluster": {"chief": [...], "tfe": ["s0:2222", "s1:2222", "s2:2222"]}, '
            '"task": {"type": "tfe", "index": 0}}.'
        )
    server = start_server(cluster)
    stop = stop or threading.Event()
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda signum, frame: stop.set())
    address = cluster.jobs[TFE_JOB][cluster.task_index]
    log.info(
        "TFE party %d of %d serving /job:%s/task:%d at %s (target %s); holds only "
        "ring elements; stop with SIGTERM or Ctrl-C",
        cluster.task_index, len(cluster.jobs[TFE_JOB]), TFE_JOB, cluster.task_index, address, server.target,
    )
    while not stop.wait(0.5):
        pass
    log.info("TFE party %d stopping", cluster.task_index)
    return 0
