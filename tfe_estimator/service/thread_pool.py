"""Threads kept for the next call: a call's blocking work runs on an idle thread, or a new one if none is idle.

A contribution puts on both servers at once, each put blocking in its own
thread for up to the call's timeout. Starting a thread per put cost a clone,
the start handshake (`threading.Thread.start` waits until the new thread
runs) and an exit, twice per call; here a put runs on a thread that the
previous put left idle. A job never waits for another to end (a thread is
started when none is idle: puts that wait for the other owners can never
queue behind each other), and a thread idle for `IDLE_SECS` ends.

Example::

    pool = ThreadPool("tfe-put")
    pool.run(lambda: print("on a pool thread"))
    pool.close()                       # idle threads end; running jobs finish
"""
import queue
import threading
from typing import Callable, Optional, TypeVar

__all__ = ["ThreadPool", "IDLE_SECS", "next_job"]

#: A pool thread ends after this long without a job.
IDLE_SECS = 60.0


_Job = TypeVar("_Job")


def next_job(jobs: "queue.SimpleQueue[_Job]", idle_secs: float, lock: threading.Lock,
             retire: Callable[[], None]) -> Optional[_Job]:
    """An idle worker thread's wait: the next item of `jobs`; None once none came for `idle_secs` and none is
    waiting, after `retire()` ran under `lock` (whoever hands jobs over holds it: one handed over meanwhile keeps
    the thread). `ThreadPool`'s threads and `tfe_estimator.owner.in_flight`'s channel workers wait here.

    Example::

        while (job := next_job(jobs, 60.0, lock, lambda: workers.remove(me))) is not None:
            job()
    """
    while True:
        try:
            return jobs.get(timeout=idle_secs)
        except queue.Empty:
            with lock:
                if jobs.empty():
                    retire()
                    return None


class ThreadPool:
    """Daemon threads that run jobs at once, each on an idle thread or a new one (module docstring).

    Args:
      name: the threads' name.
      idle_secs: how long an idle thread waits for a job before it ends.
    """

    def __init__(self, name: str, idle_secs: float = IDLE_SECS):
        self._name, self._idle_secs = name, float(idle_secs)
        self._lock = threading.Lock()
        self._jobs: "queue.SimpleQueue[Optional[Callable[[], None]]]" = queue.SimpleQueue()
        self._idle = 0  # threads waiting for a job (each job put on `_jobs` has claimed one of them)
        self._closed = False

    def run(self, job: Callable[[], None]) -> None:
        """Runs `job()` on an idle thread of the pool, or on a new one; returns at once. `job` handles its own
        errors (one that escapes ends its thread after the threading module reports it)."""
        with self._lock:
            if self._idle and not self._closed:
                self._idle -= 1
                self._jobs.put(job)
                return
        threading.Thread(target=self._loop, args=(job,), name=self._name, daemon=True).start()

    def _loop(self, job: Optional[Callable[[], None]]) -> None:
        while job is not None:
            job()
            job = None  # no reference to a finished job's arguments while idle
            with self._lock:
                if self._closed:
                    return
                self._idle += 1
            job = next_job(self._jobs, self._idle_secs, self._lock, self._retire)  # None: idle too long, or closed

    def _retire(self) -> None:
        self._idle -= 1  # no job is waiting for an idle thread: this one ends (under the lock)

    def close(self) -> None:
        """Ends the idle threads; jobs running finish on theirs, later jobs each get a thread of their own."""
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, 0
        for _ in range(idle):
            self._jobs.put(None)
