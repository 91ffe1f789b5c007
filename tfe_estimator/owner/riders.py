"""Small sums that ride in a larger contribution of the same step: one call per owner per server per step.

An Estimator step sums the gradients (an update, ring 32, 64 or 128) and then
the reported loss (a read, on the 128-bit ring): two contributions, two calls
per owner and server, the fixed cost of a call paid twice. A small sum (at
most `MAX_ELEMENTS` elements) built after a contribution of the same step
chain (`contribution`) rides in it instead:

- its own mask op still encodes it (range check, fraction bits) and masks it
  with a key of its own; its contribution op (`ride`) runs before the host's
  contribution, unmasks it in memory and leaves its ring elements, split into
  limbs of ``host_ring / 2`` bits (nonnegative, so the owners' sum of a limb
  never wraps the host's ring: `sum_check.MAX_OWNERS`), to the host;
- the host's call appends the limbs to its masked share, masked with the
  host's key at the elements after its own (`sum_check.SumCheck.extend`): the
  servers see one masked vector, the integrity checks cover every element;
- the revealed limbs come back in the host's answer; the rider's answer op
  (`finish`) recombines them into its ring's words, exactly the sum of every
  owner's encoded value modulo ``2**ring``, and decodes them as before.

Example::

    host = Host(ring_bits=64)
    ticket = ride(host, 0, 128, 1, key, share)          # the loss's contribution op, before the host's
    limbs, settle = host.take()                          # the host's call: limbs ride after its n elements
    settle(revealed_words, n, None)                      # the host's answer: each rider's words
    words = finish(ticket)                               # the loss's answer op
"""
import itertools
import threading
from typing import Callable, Dict, List, Optional, Tuple

import numpy as np

from tfe_estimator.service import ring

__all__ = ["Host", "ride", "finish", "to_limbs", "from_limbs", "MAX_ELEMENTS", "limbs_per_element"]

#: Elements a sum may have to ride (the reported loss has one): each costs a few host elements.
MAX_ELEMENTS = 16
_IDS = itertools.count(1)
_LOCK = threading.Lock()
#: ticket -> the rider's answer, while not collected
_RIDES: Dict[int, "_Ride"] = {}


class _Ride:
    """One rider's answer: its ring words, or the host call's error."""

    def __init__(self, host: "Host", index: int, ring_bits: int, n: int):
        self.host, self.index, self.ring_bits, self.n = host, index, ring_bits, n
        self.words: Optional[np.ndarray] = None
        self.error: Optional[BaseException] = None
        self.done = threading.Event()


def limbs_per_element(rider_ring: int, host_ring: int) -> int:
    """How many host elements carry one element of a `rider_ring` sum (limbs of ``host_ring / 2`` bits)."""
    return rider_ring // (host_ring // 2)


def to_limbs(words: np.ndarray, n: int, rider_ring: int, host_ring: int) -> List[int]:
    """The `n` elements of ring vector `words` as nonnegative limbs of ``host_ring / 2`` bits, low limb first."""
    return _split(ring.elements(words, 0, n, rider_ring), rider_ring, host_ring)


def _split(values: List[int], rider_ring: int, host_ring: int) -> List[int]:
    """`to_limbs` of elements given as integers below 2**rider_ring."""
    bits = host_ring // 2
    per, mask = limbs_per_element(rider_ring, host_ring), (1 << bits) - 1
    return [(value >> (bits * k)) & mask for value in values for k in range(per)]


def from_limbs(limbs: List[int], n: int, rider_ring: int, host_ring: int) -> np.ndarray:
    """The `rider_ring` ring words (int64) of `n` elements from their limbs' sums (`to_limbs`), modulo the ring."""
    bits = host_ring // 2
    per = limbs_per_element(rider_ring, host_ring)
    words = np.zeros(ring.ring_words(n, rider_ring), np.uint64)
    ring.set_elements(words, 0, [sum(int(s) << (bits * k) for k, s in enumerate(limbs[i * per:(i + 1) * per]))
                                 % (1 << rider_ring) for i in range(n)], rider_ring)
    return words.view(np.int64)


class Host:
    """A contribution that carries riders: their limbs this run, until its call takes them (`take`).

    Args:
      ring_bits: the host's ring.
    """

    def __init__(self, ring_bits: int):
        self.ring_bits = ring_bits
        self.riders = 0  # riders built on this host (their indices: 0 .. riders - 1)
        self.limbs = 0  # the host elements they take in every call (after the host's own)
        self._pending: Dict[int, Tuple[List[int], _Ride]] = {}
        self._latest: Dict[int, int] = {}  # rider index -> its latest ticket (an earlier one was never collected)
        self._lock = threading.Lock()

    def add(self, limbs: int = 0) -> int:
        """Registers one more rider (graph construction) of `limbs` host elements; returns its index."""
        self.riders += 1
        self.limbs += limbs
        return self.riders - 1

    def _put(self, index: int, limbs: List[int], answer: _Ride, ticket: int) -> None:
        with self._lock:
            self._pending[index] = (limbs, answer)
            stale = self._latest.get(index)
            self._latest[index] = ticket
        if stale is not None:  # a run that did not collect its rider's answer (it fetched no reported loss)
            with _LOCK:
                _RIDES.pop(stale, None)

    def take(self) -> Tuple[List[int], Callable[[Optional[np.ndarray], int, Optional[BaseException]], None]]:
        """The riders' limbs of this run, in order, and ``settle(revealed, n, error)``: hands each rider its part
        of the host's revealed words (elements ``n, n + 1, ...``) or the call's error.

        Raises:
          RuntimeError: a rider of this host did not run before it (the graph's edges make it run first).
        """
        with self._lock:
            taken = [self._pending.pop(i, None) for i in range(self.riders)]
        if any(t is None for t in taken):
            raise RuntimeError(f"a contribution carries {self.riders} riders, but only "
                               f"{sum(t is not None for t in taken)} ran before it in this session run: the "
                               "graph's control edges run them first; report this as a bug.")
        limbs = [limb for t in taken for limb in t[0]]
        answers = [t[1] for t in taken]

        def settle(revealed: Optional[np.ndarray], n: int, error: Optional[BaseException]) -> None:
            start = n
            for answer in answers:
                count = answer.n * limbs_per_element(answer.ring_bits, self.ring_bits)
                if error is None:
                    sums = ring.elements(revealed, start, count, self.ring_bits)
                    answer.words = from_limbs(sums, answer.n, answer.ring_bits, self.ring_bits)
                answer.error = error
                start += count
                answer.done.set()

        return limbs, settle


def ride(host: Host, index: int, ring_bits: int, n: int, key: np.ndarray, share: np.ndarray) -> int:
    """The rider's contribution: its plain ring elements (``share + AES(key)``, never sent as they are) left as
    limbs for `host`'s call; returns its ticket for `finish`."""
    # a few elements: one keystream of n elements and Python integers, no vector arithmetic
    modulus = 1 << ring_bits
    plain = [(v + pad) % modulus for v, pad in zip(ring.elements(share, 0, n, ring_bits),
                                                    ring.keystream_elements(key, 0, n, ring_bits))]
    answer = _Ride(host, index, ring_bits, n)
    with _LOCK:
        ticket = next(_IDS)
        _RIDES[ticket] = answer
    host._put(index, _split(plain, ring_bits, host.ring_bits), answer, ticket)  # pylint: disable=W0212
    return ticket


def finish(ticket: int) -> np.ndarray:
    """Waits for the host's answer; returns the rider's revealed ring words (int64), or raises the host call's
    error."""
    with _LOCK:
        answer = _RIDES.pop(int(ticket), None)
    if answer is None:
        raise KeyError(f"rider ticket {ticket} is not in flight in this process (collected already, or dropped "
                       "when a later run's rider started).")
    answer.done.wait()
    if answer.error is not None:
        raise answer.error
    return answer.words

