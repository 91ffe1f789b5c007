"""`launch`: a whole secure-aggregation cluster as local processes on loopback ports.

The embedded default a user runs before owning a cluster: the chief, N
workers and optionally an evaluator run the user's command, each with its own
TF_CONFIG; the three ``tfe`` tasks run `tfe-estimator server`. Every line a
task prints is prefixed with the task (or, with ``log_dir``, written to that
task's own log file, whose path is printed).

Policy, task by task:

- **chief**: the run's status is the chief's. If it dies it is restarted (it
  resumes from the last checkpoint) up to ``max_restarts`` times; otherwise
  the cluster is stopped and the chief named.
- **worker, tfe**: the chief needs them for every step. One that dies is
  restarted at the same address up to ``max_restarts`` times (after
  ``restart_delay`` s); otherwise the cluster is stopped and the task named.
  One that is not serving (its port does not accept connections) for
  ``down_timeout`` s, at start or after a restart, also stops the cluster:
  a task that never comes back ends the run in bounded time.
- **evaluator**: never stops training. One that dies is restarted (it
  evaluates the newest checkpoint) up to ``evaluator_restarts`` times; if it
  cannot recover, training still finishes and the run fails naming it. After
  the chief finishes, it has ``final_eval_timeout`` s to evaluate the final
  checkpoint.

In service mode each aggregation server also opens its data plane
(``tfe-estimator server --data-port``) on a port picked like the others, so
local runs put their large calls on it (the owners ask each server for its
port); ``data_plane=False`` leaves every call on gRPC.

Free ports come from `portpicker`; if a task cannot bind its port because
another process took it meanwhile, the whole cluster is re-planned on new
ports and started again (up to ``port_retries`` times). Each task runs in its
own process group, and every group is terminated (then killed) on the way
out, Ctrl-C included, so no process is left behind.

Example::

    $ tfe-estimator launch --workers 1 --evaluator -- python train.py
    [launch] cluster (pond): chief:0=127.0.0.1:41231 worker:0=127.0.0.1:39811 ...
    [tfe:0] ... TFE party 0 of 3 serving /job:tfe/task:0 at 127.0.0.1:44085 ...
    [chief:0] ...
"""
import dataclasses
import json
import os
import signal
import socket
import subprocess
import shutil
import sys
import tempfile
import threading
import time
from typing import Dict, List, Optional, Sequence, TextIO

from tfe_estimator.cluster.isolation import TF_PORT_BASE, IsolatedCluster
from tfe_estimator.cluster.model_dir_claim import MODEL_DIR_ENV, OWNER_CWD_ENV
from tfe_estimator.cluster.peers import IN_GRAPH, SERVICE, validate_mode
from tfe_estimator.cluster.quiet import TF_DATA_OPTIONS_WARNING, task_env
from tfe_estimator.cluster.spec import (LAUNCH_CLUSTER_MODE_ENV, LAUNCH_PROTOCOL_ENV, NUM_TFE_TASKS, TFE_JOB,
                                        STATE_DIR_ENV, TLS_DIR_ENV, TfeCluster, cluster_jobs, cluster_tasks)
from tfe_estimator.secure.protocols import validate_protocol
from tfe_estimator.cluster.huge_pages import with_huge_pages
from tfe_estimator.cluster.server import server_command
from tfe_estimator.validation import is_int, is_number

__all__ = ["Launcher", "plan_cluster", "free_ports", "SERVER_COMMAND", "PortTakenError"]

#: How a ``tfe`` task is started on this machine: this interpreter, the one server command.
SERVER_COMMAND = server_command(sys.executable)

#: What a task prints when its port was taken between planning and binding.
_BIND_FAILURES = ("Could not start gRPC server", "Address already in use")
#: A line of a task's output that TensorFlow prints for a script line that must change, and what to tell the user.
KNOWN_FAILURES = {
    "Disallowed task type": (
        "hint: this is TensorFlow's MultiWorkerMirroredStrategy refusing the 'tfe' job of TF_CONFIG. Under "
        "`tfe-estimator launch` TfeRunConfig distributes the training: delete the script's "
        "MultiWorkerMirroredStrategy() line and its RunConfig(train_distribute=...) (keep only "
        "TfeRunConfig(...) as the config)."),
}
#: Jobs the chief waits for in every step (restartable, watched by `down_timeout`).
_SERVING_JOBS = ("worker", TFE_JOB)
#: How long the launcher waits, after a task failed, for the chief to fail of the same cause (named after it).
_SAME_FAILURE_SECS = 2.0
#: Service mode: only the aggregation servers serve; an owner accepts no connection.
_SERVICE_SERVING_JOBS = (TFE_JOB,)
#: Service mode: the aggregation service's two servers (Pond's server0 and server1; no crypto producer).
SERVICE_TFE_TASKS = 2


#: Lines every TensorFlow 2.15 process prints that mean nothing for a CPU cluster (hidden with the deprecations):
#: the CUDA plugins registered twice (printed at ERROR level on machines without a GPU).
_BENIGN_NOISE = ("Unable to register cuDNN factory", "Unable to register cuFFT factory",
                 "Unable to register cuBLAS factory")


class _DeprecationFilter:
    """Drops TensorFlow's deprecation warnings and known benign noise from a task's terminal output
    (`Launcher(tf_warnings=True)` keeps them).

    TensorFlow 1.x-style APIs (Estimator) print, per deprecated call site, a
    ``WARNING:tensorflow:From <file>: <name> ... is deprecated ...`` line, then
    ``Instructions for updating:`` and one line of advice: about a third of a
    short run's output. Log files (``log_dir``) keep every line.
    """

    def __init__(self):
        self._skip = 0

    def keep(self, line: str) -> bool:
        if self._skip:
            self._skip -= 1
            return False
        if "is deprecated" in line and ("WARNING:tensorflow:From" in line or "deprecation.py" in line):
            return False
        if any(noise in line for noise in _BENIGN_NOISE):
            return False
        if f"UserWarning: {TF_DATA_OPTIONS_WARNING}" in line:
            self._skip = 1  # and the `warnings.warn(...)` source line Python prints after it
            return False
        if line.startswith("Instructions for updating"):
            self._skip = 1  # and its one line of advice
            return False
        return True


class PortTakenError(RuntimeError):
    """A task could not bind the port planned for it, more often than allowed."""


def free_ports(count: int, host: str = "127.0.0.1") -> List[int]:
    """`count` distinct TCP ports that `portpicker` finds free on `host` right now."""
    import portpicker  # pylint: disable=import-outside-toplevel

    ports: List[int] = []
    while len(ports) < count:
        port = portpicker.pick_unused_port()
        if port not in ports and portpicker.is_port_free(port):
            ports.append(port)
    del host  # portpicker checks every local address, loopback included
    return ports


def plan_cluster(workers: int, evaluator: bool, protocol: str = "pond", host: str = "127.0.0.1",
                 num_tfe: int = NUM_TFE_TASKS) -> TfeCluster:
    """A cluster of one chief, `workers` workers, an optional evaluator and `num_tfe` ``tfe`` tasks, on free ports."""
    if not is_int(workers, minimum=0):
        raise ValueError(f"--workers must be an integer >= 0, got {workers!r}.")
    validate_protocol(protocol)
    tasks = cluster_tasks(workers, evaluator, num_tfe)
    ports = dict(zip(tasks, free_ports(len(tasks), host)))
    return TfeCluster(jobs=cluster_jobs(tasks, lambda job, i: f"{host}:{ports[(job, i)]}"),
                      task_type="chief", task_index=0)


@dataclasses.dataclass
class _Task:
    job: str
    index: int
    argv: Sequence[str]
    env: Dict[str, str]
    cwd: Optional[str]
    process: Optional[subprocess.Popen] = None
    restarts: int = 0
    restart_at: Optional[float] = None
    down_since: Optional[float] = None
    reader: Optional[threading.Thread] = None
    bind_failed: bool = False
    log_path: Optional[str] = None

    @property
    def name(self) -> str:
        return f"{self.job}:{self.index}"


def _describe(status: int) -> str:
    if status is not None and status < 0:
        try:
            return f"status {status} (killed by {signal.Signals(-status).name})"
        except ValueError:
            pass
    return f"status {status}"


def _write_json(path: str, value) -> None:
    """Writes `value` to `path` whole or not at all (a reader polling for the file never sees half of it)."""
    partial = f"{path}.{os.getpid()}.partial"
    with open(partial, "w", encoding="utf-8") as f:
        json.dump(value, f, indent=1)
    os.replace(partial, path)


class Launcher:
    """Runs `command` as the chief, workers and evaluator of a loopback cluster.

    Args:
      command: argv of the training program (it reads TF_CONFIG).
      workers: workers besides the chief.
      evaluator: whether to run an evaluator task.
      protocol: tf-encrypted protocol; passed to tasks as TFE_ESTIMATOR_PROTOCOL.
      task_cwd: working directory of each chief/worker/evaluator task, with
        ``{job}`` and ``{index}`` replaced (e.g. ``"owners/{job}-{index}"``), so
        each data owner reads its own files through one relative path.
        Each owner gets its own model_dir by default: ``TFE_ESTIMATOR_MODEL_DIR``
        is ``<its task_cwd>/model`` (without `task_cwd`, ``./model/<job>-<index>``),
        which `TfeRunConfig` uses when the script passes no model_dir. The
        evaluator belongs to the chief's organisation: its
        ``TFE_ESTIMATOR_MODEL_DIR`` is the chief's, and a relative model_dir
        resolves in the chief's directory (``TFE_ESTIMATOR_OWNER_CWD``), not in
        its own, where it would watch an empty directory.
      max_restarts: how often the chief, a worker or a ``tfe`` task that dies
        is restarted at the same address before the launch is given up.
      restart_delay: seconds to wait before such a restart.
      out: where the launcher's lines (and, without `log_dir`, the tasks'
        prefixed lines) go.
      grace_seconds: how long a task may take to exit after SIGTERM before SIGKILL.
      host: the address every task binds to (loopback).
      server_command: argv of the ``tfe`` tasks (default `SERVER_COMMAND`).
      evaluator_restarts: how often a dying evaluator is restarted; it never
        stops training.
      down_timeout: seconds a worker or ``tfe`` task may be down (dead, or not
        accepting connections on its port) before the cluster is stopped.
      final_eval_timeout: seconds the evaluator may take after the chief finished.
      log_dir: if set, each task's output goes to ``<log_dir>/<job>-<index>.log``.
      port_retries: how often to re-plan the ports when one was taken meanwhile.
      cluster_mode: "service" (the default; `tfe_estimator.cluster.peers`: two
        ``tfe`` tasks run the aggregation service with certificates made for the
        run, every owner trains on its own and opens no port) or "in-graph"
        (workers serve the chief until it finishes). In service mode a worker
        that exits with status 0 has finished, and the run ends when the chief
        and every worker have finished, within `final_eval_timeout` s of the
        chief. The retired "between-graph" is refused naming both.
      isolate: run every task in its own network namespace on a private bridge
        (`tfe_estimator.cluster.isolation`; root).
      tls: with `isolate`, mutual TLS sidecars on every link, certificates for
        the run and a firewall that leaves TensorFlow's ports reachable only
        from their own namespace.
      link_rate: with `isolate`, each task's link sends at most this rate
        (tc's notation, e.g. ``"1gbit"``).
      network_file: with `isolate`, write the namespaces, addresses and ports
        there once they exist (`IsolatedCluster.describe`; read by
        `tfe-estimator attack`). In service mode (no `isolate`): write
        ``{"mode": "service", "cluster": "launch", "cert_dir": ..., "jobs":
        {job: [address, ...]}, "data_ports": {"tfe:k": port}, "metrics_ports":
        {"tfe:k": port}}`` there before the tasks start (every start, re-plans
        included): the run's certificate directory, TF_CONFIG's addresses, the
        servers' data ports and their Prometheus metrics' ports (each server
        serves ``http://<its host>:<port>/metrics``; none with `isolate`,
        where a server opens only the ports owners call), for `tfe-estimator
        attack` and the site's monitoring.
      data_plane: service mode: start each aggregation server with a data plane
        (``--data-port``): a free port on loopback, or with `isolate` the port
        after the cluster's TensorFlow ports in the server's own namespace.

    Example::

        status = Launcher(["python", "train.py"], workers=1, evaluator=True).run()
    """

    def __init__(
        self,
        command: Sequence[str],
        workers: int = 1,
        evaluator: bool = False,
        protocol: str = "pond",
        task_cwd: Optional[str] = None,
        max_restarts: int = 0,
        restart_delay: float = 0.0,
        out: TextIO = sys.stdout,
        grace_seconds: float = 10.0,
        host: str = "127.0.0.1",
        server_command: Sequence[str] = SERVER_COMMAND,  # pylint: disable=redefined-outer-name
        evaluator_restarts: int = 2,
        down_timeout: float = 300.0,
        final_eval_timeout: float = 600.0,
        log_dir: Optional[str] = None,
        port_retries: int = 3,
        cluster_mode: str = SERVICE,
        isolate: bool = False,
        tls: bool = False,
        network_file: Optional[str] = None,
        link_rate: Optional[str] = None,
        tf_warnings: bool = False,
        data_plane: bool = True,
    ) -> None:
        if not command:
            raise ValueError("launch needs a command to run, e.g. `tfe-estimator launch --workers 1 -- python train.py`.")
        for name, value in (("--max-restarts", max_restarts), ("--evaluator-restarts", evaluator_restarts),
                            ("port_retries", port_retries)):
            if not is_int(value, minimum=0):
                raise ValueError(f"{name} must be an integer >= 0, got {value!r}.")
        for name, value in (("--down-timeout", down_timeout), ("--final-eval-timeout", final_eval_timeout)):
            if not is_number(value) or not value > 0:
                raise ValueError(f"{name} must be a number of seconds > 0, got {value!r}.")
        self.protocol = validate_protocol(protocol)
        self.cluster_mode = validate_mode(cluster_mode, "--cluster-mode")
        self.workers, self.evaluator, self.host = workers, evaluator, host
        self.command, self.server_command, self.task_cwd = list(command), list(server_command), task_cwd
        self.max_restarts, self.evaluator_restarts = max_restarts, evaluator_restarts
        self.restart_delay = float(restart_delay)
        self.down_timeout, self.final_eval_timeout = float(down_timeout), float(final_eval_timeout)
        self.grace_seconds = grace_seconds
        self.log_dir = os.path.abspath(log_dir) if log_dir else None
        self.port_retries = port_retries
        if self.cluster_mode == SERVICE and tls:
            raise ValueError("--tls adds stunnel sidecars to the TensorFlow-runtime modes; in service mode the "
                             "aggregation servers speak mutual TLS themselves and the owners open no port. Drop "
                             "--tls (--isolate alone runs the service cluster in namespaces), or pass "
                             "--cluster-mode in-graph.")
        if tls and not isolate:
            raise ValueError("--tls needs --isolate: the sidecars and the firewall that closes TensorFlow's ports "
                             "live in each task's own network namespace. Pass --isolate --tls.")
        for flag, value in (("--network-file", network_file), ("--link-rate", link_rate)):
            if value and not isolate and not (flag == "--network-file" and self.cluster_mode == SERVICE):
                raise ValueError(f"{flag} applies to the namespaces of --isolate: pass --isolate too.")
        self.network_file = network_file
        self.isolation: Optional[IsolatedCluster] = None
        if isolate:
            tfe_tasks = SERVICE_TFE_TASKS if self.cluster_mode == SERVICE else NUM_TFE_TASKS
            self.isolation = IsolatedCluster(cluster_tasks(workers, evaluator, tfe_tasks), tls, self.cluster_mode,
                                             link_rate)
        self._out = out
        self.tf_warnings = bool(tf_warnings)
        self.data_plane = bool(data_plane) and self.cluster_mode == SERVICE
        #: Service mode with `data_plane`: each aggregation server's data port, by ``tfe`` index.
        self.data_ports: Dict[int, int] = {}
        #: Service mode: each aggregation server's Prometheus metrics port (``--metrics-port``), by ``tfe`` index.
        self.metrics_ports: Dict[int, int] = {}
        self._cert_dir: Optional[str] = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.tasks: List[_Task] = []
        self._plan()

    def _plan(self) -> None:
        if self.isolation is not None:  # every task has its own namespace: fixed ports cannot be taken
            validate_protocol(self.protocol)
            self.cluster = TfeCluster(jobs=self.isolation.jobs(), task_type="chief", task_index=0)
        else:
            self.cluster = plan_cluster(self.workers, self.evaluator, self.protocol, self.host,
                                        SERVICE_TFE_TASKS if self.cluster_mode == SERVICE else NUM_TFE_TASKS)
        self.data_ports = self._plan_server_ports(0) if self.data_plane else {}
        # Not with `isolate`: there every server's namespace is a host of its own, and its only open ports are
        # the ones owners call (`tfe-estimator attack` scans for any other); a site's monitoring scrapes its own.
        self.metrics_ports = self._plan_server_ports(2) if self.cluster_mode == SERVICE and \
            self.isolation is None else {}
        if self.cluster_mode == SERVICE:  # each task its own directory: its key, its certificate, public trust
            self._make_certs()
            if self.isolation is not None:  # ... and, in its own mount and PID namespaces, no other task's
                self.isolation.set_private_dirs({(job, index): self.task_tls_dir(job, index)
                                                 for job, addresses in self.cluster.jobs.items()
                                                 for index in range(len(addresses))})
        self.tasks = []
        for job, addresses in self.cluster.jobs.items():
            for index in range(len(addresses)):
                env = dict(os.environ)
                env.update({"TF_CONFIG": self.cluster.to_tf_config(job, index),
                            LAUNCH_PROTOCOL_ENV: self.protocol, LAUNCH_CLUSTER_MODE_ENV: self.cluster_mode,
                            "PYTHONUNBUFFERED": "1"})
                task_env(env, self.tf_warnings)  # TensorFlow's INFO lines and deprecation blocks off unless asked
                if self.cluster_mode == SERVICE:
                    env[TLS_DIR_ENV] = self.task_tls_dir(job, index)
                if self.cluster_mode == SERVICE and job == TFE_JOB:  # server0's release log: private, this run's
                    env[STATE_DIR_ENV] = os.path.join(self.task_tls_dir(job, index), "state")
                if self.cluster_mode == SERVICE:  # the service's 8 B/param messages: huge pages (cluster.huge_pages)
                    env = with_huge_pages(env)
                if job == TFE_JOB:
                    argv, cwd = list(self.server_command), None
                    if index in self.data_ports:
                        argv += ["--data-port", str(self.data_ports[index])]
                    if index in self.metrics_ports:
                        argv += ["--metrics-port", str(self.metrics_ports[index])]
                else:
                    argv = list(self.command)
                    cwd = self._task_dirs(job, index)[0]
                    if cwd:
                        os.makedirs(cwd, exist_ok=True)
                    env.update(self._model_dir_env(job, index))
                if self.isolation is not None:
                    argv = self.isolation.exec_argv((job, index), argv)
                task = _Task(job, index, argv, env, cwd)
                if self.log_dir:
                    task.log_path = os.path.join(self.log_dir, f"{job}-{index}.log")
                self.tasks.append(task)

    def _plan_server_ports(self, offset: int) -> Dict[int, int]:
        """Each aggregation server's data port (`offset` 0) or metrics port (2): with `isolate` the ports after
        every task's TensorFlow port (in its own namespace, where nothing else listens); else a free loopback
        port no task of the plan uses."""
        servers = range(len(self.cluster.jobs[TFE_JOB]))
        if self.isolation is not None:
            first = TF_PORT_BASE + len(self.isolation.tasks) + offset
            return {k: first + k for k in servers}
        taken = {int(address.rsplit(":", 1)[1]) for addresses in self.cluster.jobs.values() for address in addresses}
        taken.update(self.data_ports.values())
        ports: Dict[int, int] = {}
        while len(ports) < len(servers):
            port = free_ports(1, self.host)[0]
            if port not in taken:
                taken.add(port)
                ports[len(ports)] = port
        return ports

    def _make_certs(self) -> str:
        """Where this run's certificates go (service mode): made by `run`, removed at its end."""
        if self._cert_dir is None:
            self._cert_dir = os.path.join(tempfile.gettempdir(), f"tfe-launch-certs-{os.getpid()}-{id(self):x}")
        return self._cert_dir

    def task_tls_dir(self, job: str, index: int) -> str:
        """Task `job:index`'s TLS directory (service mode): only its own key and certificate and the public
        federation file (`tfe_estimator.identity.local`)."""
        return os.path.join(self._make_certs(), f"{job}-{index}")

    def _write_certs(self) -> None:
        """Each task its own organisation (a CA whose key is never written) and its own directory, under a
        directory only this user can read."""
        from tfe_estimator.identity.local import issue_task_dirs  # pylint: disable=import-outside-toplevel

        os.makedirs(self._cert_dir, mode=0o700, exist_ok=False)
        tasks = [(job, index) for job, addresses in self.cluster.jobs.items() for index in range(len(addresses))]
        issue_task_dirs(self._cert_dir, tasks, cluster="launch")

    @property
    def _serving_jobs(self):
        return _SERVICE_SERVING_JOBS if self.cluster_mode == SERVICE else _SERVING_JOBS

    def _task_dirs(self, job: str, index: int):
        """(working directory or None, default model_dir) of data owner or evaluator `job:index`."""
        if self.task_cwd:
            cwd = os.path.abspath(self.task_cwd.format(job=job, index=index))
            return cwd, os.path.join(cwd, "model")
        return None, os.path.abspath(os.path.join("model", f"{job}-{index}"))

    def _model_dir_env(self, job: str, index: int) -> Dict[str, str]:
        """Each owner's own default model_dir; the evaluator belongs to the chief's organisation and reads its."""
        if job != "evaluator":
            return {MODEL_DIR_ENV: self._task_dirs(job, index)[1]}
        owner_cwd, owner_model_dir = self._task_dirs("chief", 0)
        env = {MODEL_DIR_ENV: owner_model_dir}
        if owner_cwd:  # a relative model_dir means the chief's, not one under the evaluator's own cwd
            env[OWNER_CWD_ENV] = owner_cwd
        return env

    def say(self, line: str, task: str = "launch") -> None:
        """Writes one prefixed log line."""
        with self._lock:
            self._out.write(f"[{task}] {line}\n")
            self._out.flush()

    def task(self, job: str, index: int = 0) -> _Task:
        """The task `job:index`."""
        return next(t for t in self.tasks if t.job == job and t.index == index)

    def stop(self) -> None:
        """Asks `run` to stop the cluster (thread-safe)."""
        self._stop.set()

    def run(self) -> int:
        """Starts every task, supervises them, stops everything; returns the exit status."""
        handlers = {}
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                handlers[sig] = signal.signal(sig, lambda signum, frame: self._stop.set())
        try:
            if self._cert_dir is not None:
                self._write_certs()
            if self.isolation is not None:
                self.isolation.start()
                if self.network_file and self.cluster_mode != SERVICE:  # service mode: `_run_once` writes it
                    _write_json(self.network_file, self.isolation.describe())
                tls = " with mutual TLS sidecars and a firewall" if self.isolation.tls else ""
                self.say(f"each task in its own network namespace{tls}")
            for attempt in range(self.port_retries + 1):
                try:
                    return self._run_once()
                except PortTakenError as e:
                    self._terminate_all()
                    if attempt == self.port_retries:
                        self.say(f"{e}; gave up after {self.port_retries} re-plans")
                        return 1
                    self.say(f"{e}; re-planning all ports and starting again "
                             f"({attempt + 1}/{self.port_retries})")
                    self._plan()
            return 1  # not reached
        finally:
            self._terminate_all()
            if self.isolation is not None:
                self.isolation.close()
            if self._cert_dir is not None:
                shutil.rmtree(self._cert_dir, ignore_errors=True)
            for sig, handler in handlers.items():
                signal.signal(sig, handler)

    def _run_once(self) -> int:
        layout = " ".join(f"{t.name}={self.cluster.jobs[t.job][t.index]}" for t in self.tasks)
        self.say(f"cluster ({self.protocol}): {layout}")
        if self.data_ports:
            self.say("aggregation servers' data planes: " + " ".join(
                f"{TFE_JOB}:{k}=port {port}" for k, port in sorted(self.data_ports.items())))
        if self.network_file and self.cluster_mode == SERVICE:  # for `tfe-estimator attack`
            network = {"mode": SERVICE, "cluster": "launch", "cert_dir": self.task_tls_dir("chief", 0),
                       "cert_dirs": {f"{t.job}:{t.index}": self.task_tls_dir(t.job, t.index) for t in self.tasks},
                       "jobs": {job: list(addresses) for job, addresses in self.cluster.jobs.items()},
                       "data_ports": {f"{TFE_JOB}:{k}": port for k, port in sorted(self.data_ports.items())},
                       "metrics_ports": {f"{TFE_JOB}:{k}": port for k, port in sorted(self.metrics_ports.items())}}
            if self.isolation is not None:  # the namespaces, bridge addresses and IPv6 link-local addresses
                network["isolation"] = self.isolation.describe()
            _write_json(self.network_file, network)
        if self.log_dir:
            os.makedirs(self.log_dir, exist_ok=True)
            self.say(f"task logs: {os.path.join(self.log_dir, '<job>-<index>.log')} "
                     f"({', '.join(os.path.basename(t.log_path) for t in self.tasks)})")
        for task in sorted(self.tasks, key=lambda t: t.job != TFE_JOB):  # servers first
            self._start(task)
        return self._supervise()

    def _start(self, task: _Task) -> None:
        sink = None
        if task.log_path:
            sink = open(task.log_path, "a", encoding="utf-8")  # pylint: disable=consider-using-with
        task.bind_failed = False
        task.process = subprocess.Popen(
            task.argv, env=task.env, cwd=task.cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL, start_new_session=True, text=True, errors="replace",
        )
        if task.job in self._serving_jobs:
            task.down_since = time.monotonic()  # until its port accepts connections
        self.say(f"started {task.name} (pid {task.process.pid}): {' '.join(task.argv)}")
        task.reader = threading.Thread(target=self._pump, args=(task, task.process, sink), daemon=True)
        task.reader.start()

    def _pump(self, task: _Task, process: subprocess.Popen, sink) -> None:
        quiet = _DeprecationFilter() if sink is None and not self.tf_warnings else None
        said = set()
        try:
            for line in process.stdout:
                if any(marker in line for marker in _BIND_FAILURES):
                    task.bind_failed = True
                if sink is None:
                    if quiet is None or quiet.keep(line):
                        self.say(line.rstrip("\n"), task.name)
                else:
                    sink.write(line)
                    sink.flush()
                hints = [hint for marker, hint in KNOWN_FAILURES.items() if marker in line and hint not in said]
                for hint in hints:  # once per task run, to the terminal even when the output goes to a log file
                    said.add(hint)
                    self.say(hint, task.name)
        finally:
            if sink is not None:
                sink.close()

    @staticmethod
    def _exit_within(task: _Task, seconds: float) -> Optional[int]:
        """`task`'s exit status if it exits within `seconds`, else None."""
        try:
            return task.process.wait(seconds)
        except subprocess.TimeoutExpired:
            return None

    def _serving(self, task: _Task) -> bool:
        if self.isolation is not None:  # only reachable from inside its namespace
            probe = subprocess.run(self.isolation.probe_argv((task.job, task.index)), capture_output=True,
                                   timeout=10, check=False)
            return probe.returncode == 0
        host, port = self.cluster.jobs[task.job][task.index].rsplit(":", 1)
        try:
            with socket.create_connection((host, int(port)), timeout=0.2):
                return True
        except OSError:
            return False

    def _tail(self, task: _Task, lines: int = 15) -> None:
        """With log files, show the end of a failed task's log so the failure is visible."""
        if not task.log_path or not os.path.exists(task.log_path):
            return
        if task.reader is not None:
            task.reader.join(timeout=2)
        with open(task.log_path, encoding="utf-8", errors="replace") as f:
            tail = f.readlines()[-lines:]
        self.say(f"last lines of {task.log_path}:")
        for line in tail:
            self.say(line.rstrip("\n"), task.name)

    def _dead(self, task: _Task) -> Optional[int]:
        """The task's exit status if it has exited (raises PortTakenError for a bind failure)."""
        status = task.process.poll()
        if status is not None and task.reader is not None:
            task.reader.join(timeout=2)  # its last lines, which may name a bind failure
        if status is not None and task.restart_at is None and task.bind_failed:
            data = "".join(f" or its {what} port {ports[task.index]}" for what, ports in (
                ("data", self.data_ports), ("metrics", self.metrics_ports))
                if task.job == TFE_JOB and task.index in ports)
            raise PortTakenError(f"{task.name} could not bind {self.cluster.jobs[task.job][task.index]}{data}: "
                                 "another process took the port after it was planned")
        return status

    def _schedule_restart(self, task: _Task, status: int, budget: int, what: str) -> bool:
        if task.restarts >= budget:
            return False
        task.restarts += 1
        self.say(f"{task.name} died with {_describe(status)}; {what}restarting it at "
                 f"{self.cluster.jobs[task.job][task.index]} in {self.restart_delay:g} s "
                 f"({task.restarts}/{budget})")
        self._tail(task)
        task.restart_at = time.monotonic() + self.restart_delay
        if task.job in self._serving_jobs and task.down_since is None:
            task.down_since = time.monotonic()
        return True

    def _supervise(self) -> int:
        chief = self.task("chief")
        evaluators = [t for t in self.tasks if t.job == "evaluator"]
        others = [t for t in self.tasks if t is not chief and t.job != "evaluator"]
        chief_done_at = None
        evaluator_failure = None
        while True:
            if self._stop.wait(0.2):
                self.say("interrupted: stopping the cluster")
                return 130
            now = time.monotonic()
            for task in self.tasks:  # due restarts
                if task.restart_at is not None and now >= task.restart_at:
                    task.restart_at = None
                    self._start(task)
            if chief_done_at is None:
                status = self._dead(chief)
                if status is not None and chief.restart_at is None:
                    if status == 0:
                        chief_done_at = now
                        self.say("chief finished with status 0")
                    elif not self._schedule_restart(chief, status, self.max_restarts, ""):
                        self.say(f"chief:0 died with {_describe(status)}; stopping the cluster")
                        self._tail(chief)
                        return status
            for task in evaluators:
                status = self._dead(task)
                if status is None or task.restart_at is not None or status == 0 or task is evaluator_failure:
                    continue
                if not self._schedule_restart(task, status, self.evaluator_restarts, "training goes on; "):
                    self.say(f"{task.name} died with {_describe(status)} and has used its "
                             f"{self.evaluator_restarts} restarts (--evaluator-restarts); training goes on "
                             "without it")
                    self._tail(task)
                    evaluator_failure = task
            owners_running = []
            if self.cluster_mode == SERVICE:  # each owner finishes its own training
                finished = [t for t in others if t.job == "worker" and t.restart_at is None and t.process.poll() == 0]
                others = [t for t in others if t not in finished]
                owners_running = [t for t in others if t.job == "worker"]
            if chief_done_at is not None:
                for task in owners_running:
                    status = self._dead(task)
                    if status is not None:
                        self.say(f"{task.name} died with {_describe(status)} after the chief finished")
                        self._tail(task)
                        return status
                running = [t for t in evaluators if t.process.poll() is None or t.restart_at is not None]
                running += owners_running
                if not running:
                    if evaluator_failure is not None:
                        self.say(f"the chief finished, but {evaluator_failure.name} failed with "
                                 f"{_describe(evaluator_failure.process.returncode)}: the model is trained, "
                                 "its evaluation is incomplete")
                        return evaluator_failure.process.returncode or 1
                    return 0
                if now - chief_done_at > self.final_eval_timeout:
                    self.say(f"{running[0].name} did not finish within {self.final_eval_timeout:g} s after the "
                             "chief (--final-eval-timeout); stopping the cluster")
                    return 1
                continue
            for task in others:
                status = None if task.restart_at is not None else self._dead(task)
                if task.restart_at is not None:
                    pass  # waiting to be restarted
                elif status is None:
                    if task.down_since is not None and self._serving(task):
                        task.down_since = None
                elif not self._schedule_restart(task, status, self.max_restarts, ""):
                    # The chief often dies of the same error a moment later: name both, this task first.
                    chief_status = self._exit_within(chief, _SAME_FAILURE_SECS)
                    also = (f"; chief:0 died too, after it, with {_describe(chief_status)}"
                            if chief_status not in (None, 0) else "")
                    self.say(f"{task.name} died with {_describe(status)} while the chief was training{also}; "
                             "stopping the cluster")
                    self._tail(task)
                    return status or 1
                if task.down_since is not None and now - task.down_since > self.down_timeout:
                    self.say(f"{task.name} has been down for {self.down_timeout:g} s (not serving at "
                             f"{self.cluster.jobs[task.job][task.index]}; --down-timeout); the chief cannot "
                             "train without it: stopping the cluster")
                    self._tail(task)
                    return 1

    def _terminate_all(self) -> None:
        running = [t for t in self.tasks if t.process is not None and t.process.poll() is None]
        for task in running:
            _signal_group(task.process, signal.SIGTERM)
        deadline = time.monotonic() + self.grace_seconds
        for task in running:
            try:
                task.process.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                self.say(f"{task.name} did not stop after SIGTERM; killing it")
        for task in self.tasks:  # the whole group: also what a task started itself
            if task.process is not None:
                _signal_group(task.process, signal.SIGKILL)
                task.process.wait()
                if task.reader is not None:
                    task.reader.join(timeout=5)


def _signal_group(process: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(process.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass
