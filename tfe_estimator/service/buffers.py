"""Ring-word buffers an aggregation server keeps across steps, counted in its memory budget.

A step's accumulator (both servers) and server0's expansion of a key are
vectors of the sum's size (80 MB at 1e7 parameters). Allocating them afresh
every step costs more than the arithmetic (the kernel maps and zeroes every
page again), so a released step hands its buffers back here and the next step
of that size takes them. A buffer in use is charged to whoever the put charges
(`steps.StepChannel`, the key expansion in `server.py`); a spare one here stays
charged to the owner whose put left it (`give`'s `owner`: its key expansion,
its received share, the accumulator of a step it opened that was aborted), or
to the server itself (owner None) when a release left it. A spare is dropped
when that charge does not fit, or when a reservation of its owner (or, at the
server's limit, of anyone) needs the room (`MemoryBudget.reclaim` calls
`BufferPool.reclaim`), so spares never make the server refuse a put, and one
owner's puts of ever new sizes cannot fill the server with spares beyond that
owner's budget.

A buffer comes out with stale contents: its taker overwrites it (the first
put copies into an accumulator, a keystream is written over).

Server0 also stocks here, per channel, the accumulator of that channel's next
step already holding ``-AES(blind)`` under a fresh blind key (`stock`, drawn
in the background after a release: masks do not depend on data), so a step's
release only forwards. A stocked accumulator is taken by exactly one step
(`take_ready`); a step aborted after taking it gives its buffer back as a plain
spare, and its blind key is forgotten. It is charged and reclaimed like a spare.

Example::

    pool = BufferPool(budget)
    acc = pool.take(words)        # uninitialised uint64[words]
    ...
    pool.give(acc, "worker:0")    # kept (charged to worker:0) or dropped
"""
import threading
from typing import Dict, Hashable, List, Optional, Tuple

import numpy as np

from tfe_estimator.service.budget import EVERYONE, BudgetExceeded, MemoryBudget

__all__ = ["BufferPool"]


class BufferPool:
    """Spare uint64 buffers by size (thread-safe; its lock is taken before the budget's, never inside it).

    Args:
      budget: the server's `MemoryBudget`; a spare is reserved in it for owner None.
      per_size: how many spares of one size it keeps (a step needs an accumulator and, on server0, one
        expansion per owner putting at once).
    """

    def __init__(self, budget: MemoryBudget, per_size: int = 4):
        self._budget, self._per_size = budget, int(per_size)
        self._lock = threading.Lock()
        self._spares: Dict[int, List[Tuple[np.ndarray, Optional[str]]]] = {}  # size -> [(spare, charged to)]
        self._ready: Dict[Hashable, Tuple[np.ndarray, bytes]] = {}  # channel -> (acc = -AES(blind), blind)
        self.held = 0  # bytes of spares and stocked accumulators (reserved in the budget)

    def take(self, words: int) -> np.ndarray:
        """A writable contiguous uint64[words] with stale contents: a spare if one fits, else a new one."""
        with self._lock:
            spares = self._spares.get(int(words))
            array, owner = spares.pop() if spares else (None, None)
            if array is not None:
                self.held -= array.nbytes
        if array is None:
            return np.empty(int(words), np.uint64)
        self._budget.free(owner, array.nbytes)
        return array

    def give(self, array: np.ndarray, owner: Optional[str] = None) -> None:
        """Keeps `array` for a later `take` of its size, charged to `owner` (None: the server's own, a release
        left it), if that budget has room; else drops it."""
        if not isinstance(array, np.ndarray) or array.dtype != np.uint64 or array.base is not None or \
                not array.flags.writeable or not array.flags.c_contiguous:
            return  # only buffers this pool could have made (a view of received bytes is never kept)
        with self._lock:
            spares = self._spares.setdefault(array.size, [])
            if len(spares) >= self._per_size or any(s is array for s, _ in spares):
                return
            try:
                self._budget.reserve(owner, array.nbytes, f"a spare buffer of {array.size} ring words",
                                     reclaim=False)  # never drop spares to keep one
            except BudgetExceeded:
                return
            spares.append((array, owner))
            self.held += array.nbytes

    def stock(self, holder: Hashable, array: np.ndarray, blind: bytes) -> bool:
        """Keeps `array` (prepared under the key `blind`) for `holder`'s next `take_ready`; False if not kept
        (one is stocked already, or the server's budget has no room): the caller drops it."""
        with self._lock:
            if holder in self._ready:
                return False
            try:
                self._budget.reserve(None, array.nbytes, f"a prepared accumulator of {array.size} ring words",
                                     reclaim=False)
            except BudgetExceeded:
                return False
            self._ready[holder] = (array, blind)
            self.held += array.nbytes
        return True

    def take_ready(self, holder: Hashable, words: int) -> Optional[Tuple[np.ndarray, bytes]]:
        """`holder`'s stocked ``(array, blind)`` if it has one of `words` words (it leaves the pool), else None."""
        with self._lock:
            ready = self._ready.get(holder)
            if ready is None or ready[0].size != int(words):
                return None
            del self._ready[holder]
            self.held -= ready[0].nbytes
        self._budget.free(None, ready[0].nbytes)
        return ready

    def unstock(self, holder: Hashable) -> None:
        """Drops `holder`'s stocked accumulator, if any (the server forgets the channel)."""
        with self._lock:
            ready = self._ready.pop(holder, None)
            if ready is not None:
                self.held -= ready[0].nbytes
        if ready is not None:
            self._budget.free(None, ready[0].nbytes)

    def reclaim(self, owner: Optional[str] = EVERYONE) -> int:
        """Drops the spares charged to `owner` (`budget.EVERYONE`: every spare and stocked accumulator);
        returns the bytes it gave back to the budget."""
        freed: Dict[Optional[str], int] = {}
        with self._lock:
            for size, spares in self._spares.items():
                kept = []
                for array, charged in spares:
                    if owner == EVERYONE or charged == owner:
                        freed[charged] = freed.get(charged, 0) + array.nbytes
                    else:
                        kept.append((array, charged))
                self._spares[size] = kept
            if owner == EVERYONE:
                freed[None] = freed.get(None, 0) + sum(a.nbytes for a, _ in self._ready.values())
                self._ready = {}
            self.held -= sum(freed.values())
        for charged, nbytes in freed.items():
            if nbytes:
                self._budget.free(charged, nbytes)
        return sum(freed.values())
