"""A bounded wait across data owners in between-graph mode: poll, give up after a time.

``QueueDequeueV2`` ignores its ``timeout_ms`` attribute, so an owner that must
wait for the others and then report who was missing (the handshake) polls the
servers from Python instead (``poll``) and decides itself, before the
session's own deadline (``step_timeout_secs``) ends the run with a bare
"Operation timed out".

Example::

    arrived = poll(lambda: session.run(size) == 2, timeout_secs=120.0)
    if not arrived:
        raise RuntimeError("the other owners did not arrive")
"""
import time
from typing import Callable

__all__ = ["poll", "POLL_SECONDS", "DEFAULT_STEP_TIMEOUT_SECS"]

#: How long one between-graph session run may wait for the other owners (TfeRunConfig(step_timeout_secs)).
DEFAULT_STEP_TIMEOUT_SECS = 300.0
#: Pause between two polls of a server while the owners are incomplete.
POLL_SECONDS = 0.005


def poll(probe: Callable[[], bool], timeout_secs: float) -> bool:
    """Whether `probe()` became true within `timeout_secs` (called at least once, then every `POLL_SECONDS`)."""
    deadline = time.monotonic() + timeout_secs
    while not probe():
        if time.monotonic() >= deadline:
            return False
        time.sleep(POLL_SECONDS)
    return True
