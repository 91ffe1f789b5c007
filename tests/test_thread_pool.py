"""`tfe_estimator.service.thread_pool`: a job runs at once, on an idle thread when there is one."""
import threading
import time

from tfe_estimator.service.thread_pool import ThreadPool


def _pool_threads(name):
    return [t for t in threading.enumerate() if t.name == name]


def _wait_until(predicate, secs=5.0):
    deadline = time.monotonic() + secs
    while not predicate() and time.monotonic() < deadline:
        time.sleep(0.01)
    return predicate()


def test_a_job_after_another_runs_on_the_thread_it_left_idle():
    pool = ThreadPool("test-pool-reuse")
    ran = []
    try:
        for _ in range(3):
            done = threading.Event()
            pool.run(lambda done=done: (ran.append(threading.get_ident()), done.set()))
            assert done.wait(5)
            assert _wait_until(lambda: pool._idle == 1)  # pylint: disable=protected-access
        assert len(set(ran)) == 1
        assert len(_pool_threads("test-pool-reuse")) == 1
    finally:
        pool.close()
    assert _wait_until(lambda: not _pool_threads("test-pool-reuse"))


def test_a_job_never_waits_for_a_running_one():
    """Puts that wait for the other owners must not queue behind each other: a busy pool starts a thread."""
    pool = ThreadPool("test-pool-busy")
    release, second = threading.Event(), threading.Event()
    try:
        pool.run(lambda: release.wait(10))
        pool.run(second.set)
        assert second.wait(5), "the second job waited for the first"
    finally:
        release.set()
        pool.close()
    assert _wait_until(lambda: not _pool_threads("test-pool-busy"))


def test_an_idle_thread_ends_after_its_idle_time():
    pool = ThreadPool("test-pool-idle", idle_secs=0.05)
    done = threading.Event()
    pool.run(done.set)
    assert done.wait(5)
    assert _wait_until(lambda: not _pool_threads("test-pool-idle"))
    again = threading.Event()
    pool.run(again.set)  # a job after the idle thread ended gets a new one
    assert again.wait(5)
    pool.close()
