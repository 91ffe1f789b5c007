"""A bounded wait across data owners: poll, give up after a time.

An owner that must wait for the others and then report who was missing (the
service handshake) polls server0 from Python (``poll``) and decides itself,
before the step's own deadline (``step_timeout_secs``) ends the run.

Example::

    arrived = poll(lambda: session.run(size) == 2, timeout_secs=120.0)
    if not arrived:
        raise RuntimeError("the other owners did not arrive")
"""
import time
from typing import Callable

__all__ = ["poll", "POLL_SECONDS", "HANDSHAKE_POLL_SECONDS", "DEFAULT_STEP_TIMEOUT_SECS"]

#: How long one contribution may wait for the other owners (TfeRunConfig(step_timeout_secs)).
DEFAULT_STEP_TIMEOUT_SECS = 300.0
#: Pause between two polls of a server while the owners are incomplete.
POLL_SECONDS = 0.005
#: Pause between two handshake calls to server0 (each is a TLS round trip; the server logs them at DEBUG).
HANDSHAKE_POLL_SECONDS = 0.1


def poll(probe: Callable[[], bool], timeout_secs: float, interval: float = POLL_SECONDS) -> bool:
    """Whether `probe()` became true within `timeout_secs` (called at least once, then every `interval` s)."""
    deadline = time.monotonic() + timeout_secs
    while not probe():
        if time.monotonic() >= deadline:
            return False
        time.sleep(interval)
    return True
