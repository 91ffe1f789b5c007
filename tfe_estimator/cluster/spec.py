"""Reading and validating TF_CONFIG for secure aggregation on a cluster.

The cluster has the usual Estimator jobs plus one job, ``tfe``, whose tasks
are the TFE parties::

    {"cluster": {"chief": ["h0:2222"], "worker": ["h1:2222", "h2:2222"],
                 "evaluator": ["h3:2222"],
                 "tfe": ["s0:2222", "s1:2222", "s2:2222"]},
     "task": {"type": "worker", "index": 0}}

Training is in-graph: the chief builds one graph over the chief's and every
worker's device (each is one replica, one data owner with its own input
pipeline) and places the parties on ``/job:tfe/task:0..2``. Workers and
``tfe`` tasks only serve; the evaluator evaluates checkpoints on its own.

Example::

    cluster = TfeCluster.from_environment()      # None without a cluster
    if cluster is not None:
        cluster.check_protocol("pond")
        cluster.replica_devices()   # ('/job:chief/replica:0/task:0/device:CPU:0', ...)
"""
import contextlib
import dataclasses
import hashlib
import json
import os
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

from tfe_estimator.secure.protocols import PROTOCOLS
from tfe_estimator.validation import check_int, is_int

__all__ = [
    "TfeCluster", "TFE_JOB", "NUM_TFE_TASKS", "DATA_OWNER_JOBS", "KNOWN_JOBS", "LAUNCH_PROTOCOL_ENV",
    "LAUNCH_CLUSTER_MODE_ENV", "TLS_DIR_ENV", "DATA_DIR_ENV", "STATE_DIR_ENV",
    "cluster_tasks", "cluster_jobs", "tf_config_json", "cluster_digest", "tf_config_hidden", "task_from_tf_config",
]

TFE_JOB = "tfe"
#: The TFE parties: server0, server1 and a third (Pond's crypto producer, ABY3's server2).
NUM_TFE_TASKS = 3
DATA_OWNER_JOBS = ("chief", "worker")
KNOWN_JOBS = ("chief", "worker", "evaluator", TFE_JOB)
#: Set by `tfe-estimator launch` in every task's environment: the protocol the cluster was started for.
LAUNCH_PROTOCOL_ENV = "TFE_ESTIMATOR_PROTOCOL"
#: Set by `tfe-estimator launch` likewise: the cluster mode ("service" or "in-graph") it runs.
LAUNCH_CLUSTER_MODE_ENV = "TFE_ESTIMATOR_CLUSTER_MODE"
#: Service mode: the directory with ``ca.crt`` and this task's ``<job>-<index>.crt``/``.key``.
TLS_DIR_ENV = "TFE_ESTIMATOR_TLS_DIR"
#: Service mode, server0: where it records its releases' blind keys for a restart (`service.release_log`).
STATE_DIR_ENV = "TFE_ESTIMATOR_STATE_DIR"
#: Set by `tfe-estimator k8s --data-claim` in a task's pod: where the task's own data claim is mounted.
DATA_DIR_ENV = "TFE_ESTIMATOR_DATA_DIR"
_SOURCE = "Note that these values come from the TF_CONFIG environment variable."


def _device(job: str, index: int) -> str:
    return f"/job:{job}/replica:0/task:{index}/device:CPU:0"


@dataclasses.dataclass(frozen=True)
class TfeCluster:
    """A validated TF_CONFIG cluster with a ``tfe`` job.

    Attributes:
      jobs: job name -> task addresses.
      task_type: this process's job.
      task_index: this process's index in its job.
    """

    jobs: Mapping[str, Tuple[str, ...]]
    task_type: str
    task_index: int

    @classmethod
    def from_environment(cls, environ: Optional[Mapping[str, str]] = None) -> Optional["TfeCluster"]:
        """Parses ``TF_CONFIG`` from the environment; None when it is unset or names no cluster.

        Raises:
          ValueError: for a TF_CONFIG that is set but blank (Estimator's own
            `RunConfig` would fail on it with a bare JSONDecodeError) or invalid.
        """
        environ = os.environ if environ is None else environ
        if "TF_CONFIG" not in environ:
            return None
        text = environ["TF_CONFIG"]
        if not text.strip():
            raise ValueError(
                f"TF_CONFIG is set but empty ({text!r}). For training on this machine unset it "
                "(`unset TF_CONFIG`, or `del os.environ['TF_CONFIG']`); on a cluster set it to a JSON "
                'object like {"cluster": {...}, "task": {"type": "chief", "index": 0}}.'
            )
        return cls.from_json(text)

    @classmethod
    def from_json(cls, text: str) -> Optional["TfeCluster"]:
        """Parses and validates a TF_CONFIG JSON string; None when it names no cluster.

        Raises:
          ValueError: naming TF_CONFIG, the bad value and the fix.
        """
        try:
            config = json.loads(text)
        except (TypeError, ValueError) as e:
            raise ValueError(
                f"TF_CONFIG is not valid JSON ({e}): {text[:200]!r}. Set it to a JSON "
                'object like {"cluster": {...}, "task": {"type": "chief", "index": 0}}.'
            ) from None
        if not isinstance(config, dict):
            raise ValueError(f"TF_CONFIG must be a JSON object, got {type(config).__name__}: {text[:200]!r}.")
        cluster = config.get("cluster") or {}
        if not cluster:
            return None
        return cls.from_dict(cluster, config.get("task") or {})

    @classmethod
    def from_dict(cls, cluster: Mapping, task: Mapping) -> "TfeCluster":
        """Validates a TF_CONFIG ``cluster`` and ``task``.

        Raises:
          ValueError: naming TF_CONFIG, the bad value and the fix.
        """
        if not isinstance(cluster, Mapping):
            raise ValueError(f'TF_CONFIG "cluster" must be an object of job -> addresses, got {cluster!r}. {_SOURCE}')
        jobs: Dict[str, Tuple[str, ...]] = {}
        for job, addresses in cluster.items():
            if job not in KNOWN_JOBS:
                raise ValueError(
                    f"TF_CONFIG has a job {job!r} that secure aggregation cannot serve: "
                    f"use only {list(KNOWN_JOBS)} (data owners are 'chief' and 'worker', "
                    f"TFE parties are '{TFE_JOB}'; there are no parameter servers). {_SOURCE}"
                )
            if isinstance(addresses, Mapping):  # sparse form {"0": "host:port"}
                try:
                    addresses = [addresses[k] for k in sorted(addresses, key=int)]
                except (TypeError, ValueError):
                    raise ValueError(f"TF_CONFIG job {job!r} has bad task indices: {addresses!r}. {_SOURCE}") from None
            if not isinstance(addresses, (list, tuple)) or not all(
                isinstance(a, str) and a.strip() for a in addresses
            ):
                raise ValueError(
                    f'TF_CONFIG job {job!r} must list "host:port" strings, got {addresses!r}. {_SOURCE}'
                )
            jobs[job] = tuple(addresses)
        if TFE_JOB not in jobs:
            raise ValueError(
                f"TF_CONFIG has no '{TFE_JOB}' job: secure aggregation needs the TFE parties "
                f'as tasks of a job named "{TFE_JOB}" (3 tasks, each running '
                f"`tfe-estimator server`). Cluster was {dict(cluster)!r}. {_SOURCE}"
            )
        if not jobs.get("chief"):
            raise ValueError(
                "TF_CONFIG has no 'chief' job: in-graph secure training needs exactly one "
                f"chief task, which builds the graph. {_SOURCE}"
            )
        if len(jobs["chief"]) != 1:
            raise ValueError(f"TF_CONFIG must have exactly one 'chief' task, got {list(jobs['chief'])}. {_SOURCE}")
        seen: Dict[str, str] = {}
        for job, addresses in jobs.items():
            for i, address in enumerate(addresses):
                where = f"{job}:{i}"
                if address in seen:
                    raise ValueError(
                        f"TF_CONFIG gives the address {address!r} to both {seen[address]} and "
                        f"{where}: each task needs its own host:port. {_SOURCE}"
                    )
                seen[address] = where
        if not isinstance(task, Mapping) or "type" not in task:
            raise ValueError(f'TF_CONFIG has a cluster but no "task" with a "type": {task!r}. {_SOURCE}')
        task_type = task["type"]
        task_index = task.get("index", 0)
        if isinstance(task_index, str) and task_index.isdigit():
            task_index = int(task_index)
        if task_type not in jobs:
            raise ValueError(f"TF_CONFIG task type {task_type!r} is not a job of the cluster {sorted(jobs)}. {_SOURCE}")
        if not is_int(task_index, 0, len(jobs[task_type]) - 1):
            raise ValueError(
                f"TF_CONFIG task index {task_index!r} is out of range for job {task_type!r}, "
                f"which has {len(jobs[task_type])} tasks. {_SOURCE}"
            )
        return cls(jobs=jobs, task_type=task_type, task_index=task_index)

    def check_protocol(self, protocol: str) -> None:
        """Refuses a protocol that needs more ``tfe`` tasks than the cluster has.

        Raises:
          ValueError: naming the counts and the fix.
        """
        need, have = PROTOCOLS[protocol], len(self.jobs[TFE_JOB])
        if have != need:
            raise ValueError(
                f"protocol={protocol!r} needs exactly {need} '{TFE_JOB}' tasks "
                f"(server0, server1, {'crypto producer' if protocol == 'pond' else 'server2'}), "
                f"but TF_CONFIG lists {have}: {list(self.jobs[TFE_JOB])}. {_SOURCE}"
            )

    @property
    def is_evaluator(self) -> bool:
        """True for the evaluator task, which evaluates locally."""
        return self.task_type == "evaluator"

    def replica_devices(self) -> Tuple[str, ...]:
        """One replica device per data owner: the chief, then each worker."""
        return tuple(_device(job, i) for job in DATA_OWNER_JOBS for i in range(len(self.jobs.get(job, ()))))

    def server_devices(self) -> Tuple[str, ...]:
        """The devices of the TFE parties, in protocol order."""
        return tuple(_device(TFE_JOB, i) for i in range(len(self.jobs[TFE_JOB])))

    def data_owners(self) -> List[Tuple[str, int]]:
        """`(job, index)` of each data owner, in replica order."""
        return [(job, i) for job in DATA_OWNER_JOBS for i in range(len(self.jobs.get(job, ())))]

    def cluster_spec(self, without: Tuple[str, ...] = ()):
        """The `tf.train.ClusterSpec` of all jobs but those in `without`."""
        import tensorflow as tf  # pylint: disable=import-outside-toplevel

        return tf.train.ClusterSpec({job: list(a) for job, a in self.jobs.items() if job not in without})

    def to_tf_config(self, task_type: str, task_index: int) -> str:
        """The TF_CONFIG JSON of task `task_type:task_index` of this cluster."""
        return tf_config_json(self.jobs, task_type, task_index)


def cluster_tasks(workers: int, evaluator: bool, num_tfe: int = NUM_TFE_TASKS) -> List[Tuple[str, int]]:
    """`(job, index)` of every task of a cluster, in TF_CONFIG order: the one layout.

    One chief, `workers` workers, an optional evaluator and the ``tfe`` parties.
    The launcher, the Kubernetes renderer and `TfeCluster` all derive from it.

    Example::

        >>> cluster_tasks(1, evaluator=True)
        [('chief', 0), ('worker', 0), ('evaluator', 0), ('tfe', 0), ('tfe', 1), ('tfe', 2)]
    """
    check_int(workers, f"workers={workers!r} must be an integer >= 0 (the data owners besides the chief).", minimum=0)
    tasks = [("chief", 0)] + [("worker", i) for i in range(workers)]
    if evaluator:
        tasks.append(("evaluator", 0))
    return tasks + [(TFE_JOB, i) for i in range(num_tfe)]


def cluster_jobs(tasks: Sequence[Tuple[str, int]], address) -> Dict[str, Tuple[str, ...]]:
    """job -> addresses for `tasks` (from `cluster_tasks`), with `address(job, index)` -> "host:port"."""
    jobs: Dict[str, List[str]] = {}
    for job, index in tasks:
        jobs.setdefault(job, []).append(address(job, index))
    return {job: tuple(addresses) for job, addresses in jobs.items()}


def tf_config_json(jobs: Mapping[str, Sequence[str]], task_type: str, task_index: int) -> str:
    """The compact TF_CONFIG JSON of task `task_type:task_index` of a cluster of `jobs`."""
    cluster = {job: list(addresses) for job, addresses in jobs.items()}
    return json.dumps({"cluster": cluster, "task": {"type": task_type, "index": task_index}}, separators=(",", ":"))


def cluster_digest(jobs: Mapping[str, Sequence[str]]) -> bytes:
    """SHA-256 of a cluster's canonical JSON (jobs sorted, no spaces): alike on every task of one cluster.

    Every task's TF_CONFIG lists the same cluster, so each derives the same
    digest without talking to the others (`TfeRunConfig`'s derived seed, the
    cluster identity of a model_dir claim).
    """
    text = json.dumps({job: list(addresses) for job, addresses in jobs.items()}, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode("utf-8")).digest()


@contextlib.contextmanager
def tf_config_hidden(hide: bool = True):
    """Hides TF_CONFIG from the environment while in the block (when `hide`), then restores it.

    A `tf.estimator.RunConfig` built inside is a local one (no cluster, no
    master), as each service-mode owner's Estimator and an owner's own local
    evaluation need.

    Example::

        with tf_config_hidden():
            config = tf.estimator.RunConfig(model_dir=model_dir)
    """
    saved = os.environ.pop("TF_CONFIG", None) if hide else None
    try:
        yield
    finally:
        if saved is not None:
            os.environ["TF_CONFIG"] = saved


def task_from_tf_config(environ: Optional[Mapping[str, str]] = None) -> Tuple[str, int]:
    """This task's ``(type, index)`` from ``TF_CONFIG``, validated like the whole cluster.

    What a training script needs to name its own files (``f"{job}-{index}"``),
    with the clear errors of `TfeCluster.from_environment` for a blank,
    malformed or inconsistent ``TF_CONFIG`` instead of a bare
    ``JSONDecodeError`` or ``KeyError``.

    Example::

        job, index = task_from_tf_config()  # ("worker", 0)
        owner = f"{job}-{index}"

    Raises:
      ValueError: when ``TF_CONFIG`` is unset or names no cluster (this is a
        cluster task's helper), or is invalid, naming the value and the fix.
    """
    cluster = TfeCluster.from_environment(environ)
    if cluster is None:
        raise ValueError(
            "task_from_tf_config() needs TF_CONFIG with a cluster and this task, e.g. "
            '{"cluster": {"chief": [...], "worker": [...], "tfe": [...]}, "task": {"type": "worker", "index": 0}}: '
            "run the script under `tfe-estimator launch`, or set TF_CONFIG (one per task).")
    return cluster.task_type, cluster.task_index
