"""What one aggregation server may hold: a memory budget in bytes, per server and per owner.

Every byte a put makes the server hold is reserved here before it is
allocated: an owner's held payload (server1: its masked share's ring words;
server0: its key), the accumulator of a step it opens, and server0's
expansion of its key into ring words (8 bytes per ring word: a 128-bit ring
counts two words per element). A reservation that would pass either limit is
refused with ``RESOURCE_EXHAUSTED`` naming the limit, what holds it and the
flag that raises it, so one owner cannot exhaust a server (the others' steps
keep their share of the budget). Spare buffers the server keeps across steps
(`buffers.BufferPool`) stay charged to the owner whose put left them (an
expansion, a received share, the accumulator of a step it opened that was
aborted), to owner None when a release left them (every owner's doing); a
reservation that does not fit first drops the spares charged to whoever hit
the limit (`MemoryBudget.reclaim`), so they never cause a refusal, and one
owner's puts cannot make the server hold more than its budget in spares.

Example::

    budget = MemoryBudget(server_bytes=4 << 30, owner_bytes=768 << 20)
    budget.reserve("worker:0", 8 * words, "the accumulator of channel 'sum_0' step 5")   # may raise
    budget.free("worker:0", 8 * words)
"""
import threading
from typing import Callable, Dict, Optional

__all__ = ["MemoryBudget", "BudgetExceeded", "SERVER_FLAG", "OWNER_FLAG", "EVERYONE"]

SERVER_FLAG = "--memory-budget-bytes"
OWNER_FLAG = "--owner-memory-budget-bytes"
#: What `MemoryBudget.reclaim` is asked to free when the server's limit (not one owner's) was hit.
EVERYONE = "*"


class BudgetExceeded(Exception):
    """A refused reservation: `message` names the limit, the holder and the flag (``RESOURCE_EXHAUSTED``)."""

    def __init__(self, message: str, whole: bool = False):
        super().__init__(message)
        self.code, self.message = "RESOURCE_EXHAUSTED", message
        self.whole = whole  # the server's limit (not one owner's) was passed


def _mib(nbytes: int) -> str:
    return f"{nbytes / 2**20:.1f} MiB"


class MemoryBudget:
    """Bytes held per owner and in all, against two limits (thread-safe; a leaf lock).

    Args:
      server_bytes: what the server may hold for all callers together.
      owner_bytes: what one owner's puts may make it hold (its payloads, the steps it opened, key expansion).
      name: the server, for messages (e.g. ``"aggregation server0"``).
    """

    def __init__(self, server_bytes: int, owner_bytes: int, name: str = "this aggregation server"):
        self.server_bytes, self.owner_bytes, self.name = int(server_bytes), int(owner_bytes), name
        self._lock = threading.Lock()
        self._held: Dict[Optional[str], int] = {}
        self.total = 0
        #: Called (outside the lock) when a reservation does not fit: ``reclaim(owner)`` frees what the server
        #: keeps only to be fast (spare buffers) charged to `owner` (`EVERYONE`: all of them, when the server's
        #: limit was hit) and returns the bytes freed; the reservation is then tried once more.
        self.reclaim: Optional[Callable[[Optional[str]], int]] = None

    def held(self, owner: Optional[str]) -> int:
        """Bytes held for `owner` (None: the server's own parts, e.g. server0's forwarded part on server1)."""
        with self._lock:
            return self._held.get(owner, 0)

    def reserve(self, owner: Optional[str], nbytes: int, what: str, reclaim: bool = True) -> None:
        """Reserves `nbytes` for `owner` (None: counted against the server's limit only) or raises `BudgetExceeded`.

        With `reclaim` (default), a reservation that does not fit calls `self.reclaim` (if set) for the spares
        charged to whoever hit the limit (the owner, or `EVERYONE` for the server's) and tries again.
        """
        for attempt in range(3):  # the owner's spares may free its limit, and the server's then be the one hit
            try:
                self._reserve(owner, int(nbytes), what)
                return
            except BudgetExceeded as e:
                if attempt == 2 or not reclaim or self.reclaim is None or \
                        not self.reclaim(EVERYONE if e.whole else owner):
                    raise

    def _reserve(self, owner: Optional[str], nbytes: int, what: str) -> None:
        with self._lock:
            mine = self._held.get(owner, 0)
            if owner is not None and mine + nbytes > self.owner_bytes:
                raise BudgetExceeded(
                    f"Service mode: {self.name} refuses {what} of {owner}: {_mib(nbytes)} more would make it hold "
                    f"{_mib(mine + nbytes)} for {owner}, above its per-owner memory budget of "
                    f"{_mib(self.owner_bytes)} ({OWNER_FLAG}={self.owner_bytes}). A model this large needs the "
                    f"servers started with a larger {OWNER_FLAG}; otherwise this owner holds unreleased steps on "
                    "many channels (it is ahead of the others, or misbehaves).")
            if self.total + nbytes > self.server_bytes:
                raise BudgetExceeded(
                    f"Service mode: {self.name} refuses {what}" + (f" of {owner}" if owner else "") +
                    f": {_mib(nbytes)} more would make it hold {_mib(self.total + nbytes)}, above its memory "
                    f"budget of {_mib(self.server_bytes)} ({SERVER_FLAG}={self.server_bytes}). Start the servers "
                    f"with a larger {SERVER_FLAG} (the machine's memory allowing) or train fewer models at once.",
                    whole=True)
            self._held[owner] = mine + nbytes
            self.total += nbytes

    def free(self, owner: Optional[str], nbytes: int) -> None:
        """Returns `nbytes` reserved for `owner`."""
        with self._lock:
            left = self._held.get(owner, 0) - int(nbytes)
            if left > 0:
                self._held[owner] = left
            else:
                self._held.pop(owner, None)
            self.total -= int(nbytes)
