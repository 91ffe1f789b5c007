"""`launch`: a whole secure-aggregation cluster as local processes on loopback ports.

The embedded default a user runs before owning a cluster: the chief, N
workers and optionally an evaluator run the user's command, each with its own
TF_CONFIG; the three ``tfe`` tasks run `tfe-estimator server`. Every line a
task prints is prefixed with the task. The launcher exits with the chief's
status once the chief (and the evaluator) finish; if another task dies first
it restarts it at the same address (up to ``max_restarts`` times) or stops
the rest and reports which task died. Each task runs in its own process
group, and every group is terminated (then killed) on the way out, Ctrl-C
included, so no process is left behind.

Example::

    $ tfe-estimator launch --workers 1 --evaluator -- python train.py
    [launch] cluster: chief:0=127.0.0.1:41231 worker:0=127.0.0.1:39811 ...
    [tfe:0] TFE party 0 of 3 serving /job:tfe/task:0 at 127.0.0.1:44085 ...
    [chief:0] ...
"""
import dataclasses
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Dict, List, Optional, Sequence, TextIO

from tfe_estimator.cluster import TFE_JOB, TfeCluster
from tfe_estimator.protocols import PROTOCOLS, validate_protocol

__all__ = ["Launcher", "plan_cluster", "free_ports", "SERVER_COMMAND"]

#: How a ``tfe`` task is started.
SERVER_COMMAND = (sys.executable, "-m", "tfe_estimator.cli", "server")


def free_ports(count: int, host: str = "127.0.0.1") -> List[int]:
    """`count` distinct TCP ports that are free on `host` right now."""
    sockets = []
    try:
        for _ in range(count):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind((host, 0))
            sockets.append(s)
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def plan_cluster(workers: int, evaluator: bool, protocol: str = "pond", host: str = "127.0.0.1") -> TfeCluster:
    """A cluster of one chief, `workers` workers, an optional evaluator and the ``tfe`` tasks."""
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 0:
        raise ValueError(f"--workers must be an integer >= 0, got {workers!r}.")
    sizes = {"chief": 1, "worker": workers, "evaluator": int(bool(evaluator)), TFE_JOB: PROTOCOLS[validate_protocol(protocol)]}
    ports = iter(free_ports(sum(sizes.values()), host))
    jobs = {job: tuple(f"{host}:{next(ports)}" for _ in range(n)) for job, n in sizes.items() if n}
    return TfeCluster(jobs=jobs, task_type="chief", task_index=0)


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
    reader: Optional[threading.Thread] = None

    @property
    def name(self) -> str:
        return f"{self.job}:{self.index}"


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
      max_restarts: how often a worker or ``tfe`` task that dies is restarted
        at the same address before the launch is given up.
      restart_delay: seconds to wait before such a restart.
      out: where the prefixed log lines go.
      grace_seconds: how long a task may take to exit after SIGTERM before SIGKILL.
      host: the address every task binds to (loopback).
      server_command: argv of the ``tfe`` tasks (default `SERVER_COMMAND`).

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
        server_command: Sequence[str] = SERVER_COMMAND,
    ) -> None:
        if not command:
            raise ValueError("launch needs a command to run, e.g. `tfe-estimator launch --workers 1 -- python train.py`.")
        if isinstance(max_restarts, bool) or not isinstance(max_restarts, int) or max_restarts < 0:
            raise ValueError(f"--max-restarts must be an integer >= 0, got {max_restarts!r}.")
        self.cluster = plan_cluster(workers, evaluator, protocol, host)
        self.protocol = protocol
        self.max_restarts = max_restarts
        self.restart_delay = float(restart_delay)
        self.grace_seconds = grace_seconds
        self._out = out
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.tasks: List[_Task] = []
        for job, addresses in self.cluster.jobs.items():
            for index in range(len(addresses)):
                env = dict(os.environ)
                env.update(
                    TF_CONFIG=self.cluster.to_tf_config(job, index),
                    TFE_ESTIMATOR_PROTOCOL=protocol,
                    PYTHONUNBUFFERED="1",
                )
                if job == TFE_JOB:
                    argv, cwd = list(server_command), None
                else:
                    argv = list(command)
                    cwd = task_cwd.format(job=job, index=index) if task_cwd else None
                    if cwd:
                        os.makedirs(cwd, exist_ok=True)
                self.tasks.append(_Task(job, index, argv, env, cwd))

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
        """Starts every task, waits for the chief, stops everything; returns the exit status."""
        handlers = {}
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                handlers[sig] = signal.signal(sig, lambda signum, frame: self._stop.set())
        try:
            layout = " ".join(f"{t.name}={self.cluster.jobs[t.job][t.index]}" for t in self.tasks)
            self.say(f"cluster ({self.protocol}): {layout}")
            for task in sorted(self.tasks, key=lambda t: t.job != TFE_JOB):  # servers first
                self._start(task)
            return self._supervise()
        finally:
            self._terminate_all()
            for sig, handler in handlers.items():
                signal.signal(sig, handler)

    def _start(self, task: _Task) -> None:
        task.process = subprocess.Popen(
            task.argv, env=task.env, cwd=task.cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL, start_new_session=True, text=True, errors="replace",
        )
        self.say(f"started {task.name} (pid {task.process.pid}): {' '.join(task.argv)}")
        task.reader = threading.Thread(target=self._pump, args=(task, task.process), daemon=True)
        task.reader.start()

    def _pump(self, task: _Task, process: subprocess.Popen) -> None:
        for line in process.stdout:
            self.say(line.rstrip("\n"), task.name)

    def _supervise(self) -> int:
        chief = self.task("chief")
        evaluators = [t for t in self.tasks if t.job == "evaluator"]
        chief_status = None
        while True:
            if self._stop.wait(0.2):
                self.say("interrupted: stopping the cluster")
                return 130
            if chief_status is None and chief.process.poll() is not None:
                chief_status = chief.process.returncode
                self.say(f"chief finished with status {chief_status}")
                if chief_status != 0:
                    return chief_status
            if chief_status is not None:
                running = [t for t in evaluators if t.process.poll() is None]
                if not running:
                    failed = [t for t in evaluators if t.process.returncode != 0]
                    if failed:
                        self.say(f"{failed[0].name} failed with status {failed[0].process.returncode}")
                        return failed[0].process.returncode
                    return chief_status
                continue
            for task in self.tasks:
                if task is chief or task.process.poll() is None:
                    continue
                if task.restart_at is not None:
                    if time.monotonic() >= task.restart_at:
                        task.restart_at = None
                        self._start(task)
                    continue
                status = task.process.returncode
                if task.job == "evaluator":
                    if status != 0:
                        self.say(f"{task.name} died with status {status} while the chief was training; stopping the cluster")
                        return status
                    continue
                if task.restarts < self.max_restarts:
                    task.restarts += 1
                    self.say(f"{task.name} died with status {status}; restarting it at "
                             f"{self.cluster.jobs[task.job][task.index]} in {self.restart_delay:g} s "
                             f"({task.restarts}/{self.max_restarts})")
                    task.restart_at = time.monotonic() + self.restart_delay
                    continue
                self.say(f"{task.name} died with status {status} while the chief was training; stopping the cluster")
                return status or 1

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
