"""Integrity checks of a service sum: every owner detects a revealed sum that a server altered.

The aggregation servers only add ring words; nothing stops one of them from
adding something else to a released step (a bug, a bad disk, an operator).
Each owner therefore appends `CHECK_WORDS` check words to its masked vector,
and after the reveal recomputes them on the sum. The check coefficients come
from a seed the owners agree on without the servers (`check_seed`), per sum
and step, so a server cannot aim a change at them.

The check (``k = ROWS`` rows of coefficients, two primes ``p1, p2``): per
channel and step, AES-CTR under ``HKDF(seed, channel, step)`` gives each
element i and row m a coefficient ``r_mi`` in ``[0, 2**20)``. Every owner's
encoded vector is a vector of signed integers ``x_i`` (the ring word read as
two's complement), and the encodings' bounds and the ring's headroom
(`Precision.check_headroom`, `check_noise_headroom` under DP) make the honest
sum of all owners an integer vector that never wraps the ring. An owner
contributes, per row m and prime p, ``(sum_i r_mi x_i) mod p`` (inside its
masked share: the words after its n elements, masked with the same key's
keystream); the servers sum them like any element (fewer than ``2**b / p``
owners: no wrap). After the reveal an owner reads the sum's n elements as
signed integers ``s_i`` and compares ``(sum_i r_mi s_i) mod p`` with the
revealed check word mod p.

Why it catches any change (a server that adds ``e != 0`` to the n elements,
in any ring): the revealed signed sum changes by an integer vector ``e'`` with
``0 < max |e'_i| < 2**b < p1 * p2``, so ``e'`` is nonzero modulo p1 or p2;
for that prime a row passes only if ``sum_i r_mi e'_i`` equals the change the
server made to that check word modulo p, which, with every coefficient but one
(whose ``e'_i`` is nonzero mod p) fixed, holds for at most one of its 2**20
values: at most ``2**-20`` per row, ``2**-40`` for both rows, whatever the
change (a multiple of ``2**63`` included: a check of ring words modulo
``2**b`` itself would pass such a change half the time per check, since
``r * 2**63 = 0`` for every even r). Replaced blind keys, answers that differ
between owners, and answers of another step or channel are changes like any
other. The server sees neither the seed nor the owners' check values (each
masked like the vector), so its change is independent of the coefficients.

Cost: per contribution and answer one pass of the kernel library
(`tfe_estimator.secure.kernels.check_pass`, C++): per cache-sized block, the
AES expansions of the coefficients and of the key (to read the owner's own
vector back from its share, or the sum from its answer) and the exact
products (SSE2 lanes on the 32- and 64-bit rings, 128-bit integers on the
128-bit ring); the answer's pass also decodes a float sum into the arrays
TensorFlow takes (`checked_contribute`'s `decode`). About 3-5 ns per element
each on this project's 2-core machine, against 12 for the NumPy definition
below (`coefficients`, `values`), which the tests hold it to.
``python -m tools.bench.owner_kernels`` times each stage beside the AES-CTR floor;
``python -m tools.bench.check_cost``, a checked owner's step beside an unchecked one through real servers.

Example::

    check = SumCheck(seed, operators="tfe:0 (Operator A), tfe:1 (Operator B)")
    blind_key, w = checked_contribute(client.contribute, check, "sum_0", 7, 64, n, key, share)
"""
import contextlib
import hashlib
import logging
import sys
import threading
from typing import Callable, List, Optional, Sequence, Tuple

import numpy as np
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from tfe_estimator.secure.kernels.check_pass import check_pass
from tfe_estimator.service import ring

__all__ = ["SumCheck", "SumIntegrityError", "checked_contribute", "ROWS", "COEFFICIENT_BITS", "PRIMES",
           "CHECK_WORDS", "CHUNK", "BLOCK", "MAX_OWNERS"]

log = logging.getLogger("tfe_estimator")

#: Rows of check coefficients, each of `COEFFICIENT_BITS` bits: a change passes one row with probability at
#: most 2**-COEFFICIENT_BITS, all rows with at most 2**-(ROWS * COEFFICIENT_BITS) = 2**-40.
ROWS = 2
COEFFICIENT_BITS = 20
#: Per ring, two primes below 2**(ring_bits - 8 or - 16) whose product exceeds 2**ring_bits (the largest two
#: primes below 2**24, 2**48, 2**112; tests/test_sum_check.py checks that they are prime).
PRIMES = {32: (2**24 - 3, 2**24 - 17), 64: (2**48 - 59, 2**48 - 65), 128: (2**112 - 75, 2**112 - 189)}
#: Check words per sum (one element each, appended to the owner's vector).
CHECK_WORDS = ROWS * 2
#: Owners whose check words sum without wrapping the ring (each word is below the prime).
MAX_OWNERS = {32: 1 << 8, 64: 1 << 16, 128: 1 << 16}
#: Elements per exact float64 product at most: CHUNK * (2**16 - 1) * (2**20 - 1) < 2**53.
CHUNK = 1 << 17
#: Elements per product (below CHUNK: exact; its limbs and coefficients stay in the CPU's cache).
BLOCK = 1 << 14
_LIMB = 16


class SumIntegrityError(RuntimeError):
    """A revealed sum failed its integrity checks: a server altered it; nothing of it may be applied."""


def _derive(seed: bytes, channel: str, step: int) -> bytes:
    info = b"tfe-estimator sum check v1\0" + channel.encode() + b"\0" + int(step).to_bytes(8, "big", signed=True)
    return HKDF(algorithm=hashes.SHA256(), length=ring.KEY_BYTES, salt=None, info=info).derive(seed)


#: TensorFlow takes a `tf.numpy_function`'s result without a copy only if its data is aligned to this many bytes
#: (``EIGEN_MAX_ALIGN_BYTES``; NumPy's large arrays start 16 bytes into a page).
_TF_ALIGN = 64


#: Revealed sums' arrays a thread keeps for reuse (a step's answer is in use while the next one arrives only if
#: TensorFlow still holds it: then a new one).
_REUSED = 3


def _for_tensorflow(words: int) -> np.ndarray:
    """A new uint64 array of `words` words whose data TensorFlow can take as a tensor without copying it."""
    raw = np.empty(8 * words + _TF_ALIGN, np.uint8)
    start = -raw.ctypes.data % _TF_ALIGN
    return raw[start:start + 8 * words].view(np.uint64)


def _plus(a: np.ndarray, b: np.ndarray, ring_bits: int) -> np.ndarray:
    """The ring vector ``a + b`` (uint64 words) in a new array (`_for_tensorflow`), in one pass where the ring
    allows."""
    out = _for_tensorflow(a.size).reshape(a.shape)
    if ring_bits == 64:
        return np.add(a, b, out=out)
    if ring_bits == 32:
        np.add(a.view(np.uint32), b.view(np.uint32), out=out.view(np.uint32))
        return out
    out[...] = a
    return ring.add_into(out, b, ring_bits)


def _scratch(arrays: threading.local, name: str, words: int) -> np.ndarray:
    """The calling thread's reusable uint64 array `name` of `words` words in `arrays` (its contents are stale)."""
    array = arrays.__dict__.get(name)
    if array is None or array.size != words:
        array = arrays.__dict__[name] = np.empty(words, np.uint64)
    return array


def _unheld(pool: List[np.ndarray], size: int) -> np.ndarray:
    """A uint8 array of `size` bytes from `pool` that nothing else references (TensorFlow holds a reference to an
    array while a tensor uses its memory), else a new one added to it (at most `_REUSED` kept)."""
    for raw in pool:
        # references: the pool's, this loop's and getrefcount's argument; any view (a tensor's) adds one
        if raw.size == size and sys.getrefcount(raw) <= 3:
            return raw
    raw = np.empty(size, np.uint8)
    pool.append(raw)
    if len(pool) > _REUSED:
        pool.pop(0)
    return raw


class SumCheck:
    """The owners' integrity checks of their sums under one check seed (module docstring).

    Args:
      seed: the 32-byte check seed every owner of the model holds and no server (`check_seed`).
      operators: who runs the servers (named in the error), e.g. ``"tfe:0 (Operator A), tfe:1 (...)"``.
      num_owners: how many owners sum (refused above `MAX_OWNERS` of the ring, at the first sum).
    """

    def __init__(self, seed: bytes, operators: str = "tfe:0, tfe:1", num_owners: int = 2):
        if not isinstance(seed, bytes) or len(seed) < 16:
            raise ValueError(f"a check seed has at least 16 random bytes, got {type(seed).__name__} of "
                             f"{len(seed) if isinstance(seed, bytes) else '?'}: take it from check_seed.")
        self._seed, self.operators, self.num_owners = seed, operators, int(num_owners)
        # Per thread, arrays reused from one contribution to the next (fresh multi-megabyte arrays cost page
        # faults that doubled the checks' time at 1e5); never the arrays handed back to the caller.
        self._scratch_arrays = threading.local()

    def _coefficient_key(self, channel: str, step: int) -> bytes:
        """The AES key of `channel`'s coefficients at `step` (`_derive`), derived once per channel and step in a
        thread: a contribution's `extend` and its answer's `verify` run in the same thread (its channel's)."""
        arrays = self._scratch_arrays.__dict__
        cached = arrays.get("coefficient_key")
        if cached is None or cached[0] != (channel, step):
            cached = arrays["coefficient_key"] = ((channel, step), _derive(self._seed, channel, step))
        return cached[1]

    def _scratch(self, name: str, words: int) -> np.ndarray:
        """This thread's reusable uint64 array `name` of `words` words (its contents are stale)."""
        return _scratch(self._scratch_arrays, name, words)

    def _for_tensorflow(self, words: int) -> np.ndarray:
        """A uint64 array of `words` words for TensorFlow to take without a copy (`_for_tensorflow`): one of this
        thread's earlier ones that nothing references any more (TensorFlow holds a reference to the array while a
        tensor uses its memory, and drops it when the tensor dies), else a new one; at most `_REUSED` kept."""
        raw = _unheld(self._scratch_arrays.__dict__.setdefault("revealed", []), 8 * words + _TF_ALIGN)
        start = -raw.ctypes.data % _TF_ALIGN
        return raw[start:start + 8 * words].view(np.uint64)

    @property
    def fingerprint(self) -> str:
        """8 hex digits of SHA-256 of the seed (logs: equal on every owner; reveals nothing)."""
        return hashlib.sha256(b"tfe-estimator check seed fingerprint" + self._seed).hexdigest()[:8]

    def coefficients(self, channel: str, step: int, n: int) -> np.ndarray:
        """The ``(ROWS, n)`` uint32 coefficients of `channel`'s sum at `step`, integers below 2**20.

        The definition in NumPy, which `check_pass` computes block by block (tests compare them; a test
        server forges a change with it). Kept as uint32 (4 bytes each, shifted in place): `values` turns
        one cache-sized block at a time into float64, instead of a (ROWS, n) float64 array.
        The array is this thread's scratch: the next call in the thread overwrites it.
        """
        key = self._coefficient_key(channel, step)
        stream = ring.keystream_into(key, self._scratch("coefficients", (ROWS * n + 1) // 2)).view("<u4")[:ROWS * n]
        np.right_shift(stream, np.uint32(32 - COEFFICIENT_BITS), out=stream)
        return stream.reshape(ROWS, n)

    @staticmethod
    def values(coefficients: np.ndarray, words: np.ndarray, n: int, ring_bits: int) -> List[int]:
        """Per row, ``sum_i r_mi x_i`` over the first `n` elements of `words` read as signed integers, exactly.

        The definition in NumPy (`check_pass` computes the same in 128-bit integers; tests compare them).
        Per block of `BLOCK` elements (cache-sized; small products also keep BLAS single-threaded) the
        elements' 16-bit limbs, the top one signed, go to float64 and one product with the block's
        coefficients gives per row and limb an exact integer (below 2**53: `CHUNK`).
        """
        per = ring_bits // _LIMB
        unsigned = words.view("<u2")[:n * per].reshape(n, per)
        top = words.view("<i2")[:n * per].reshape(n, per)[:, per - 1]
        sums = [[0] * per for _ in range(ROWS)]
        buffer = np.empty((min(n, BLOCK), per), np.float64)
        rows = np.empty((ROWS, min(n, BLOCK)), np.float64)
        for start in range(0, n, BLOCK):
            stop = min(n, start + BLOCK)
            limbs = buffer[:stop - start]
            limbs[...] = unsigned[start:stop]
            limbs[:, per - 1] = top[start:stop]
            block = rows[:, :stop - start]
            block[...] = coefficients[:, start:stop]
            products = (block @ limbs).astype(np.int64).tolist()  # exact
            for m in range(ROWS):
                for limb in range(per):
                    sums[m][limb] += products[m][limb]
        return [sum(v << (_LIMB * limb) for limb, v in enumerate(row)) for row in sums]

    @staticmethod
    def residues(values: Sequence[int], ring_bits: int) -> List[int]:
        """The check words: each row's value modulo each prime of the ring."""
        return [v % p for v in values for p in PRIMES[ring_bits]]

    def _check_owners(self, ring_bits: int) -> None:
        if self.num_owners > MAX_OWNERS[ring_bits]:
            raise ValueError(f"the sums' integrity checks hold for at most {MAX_OWNERS[ring_bits]} owners in the "
                             f"{ring_bits}-bit ring, got {self.num_owners}: use a wider ring (update_ring_bits).")

    def extend(self, channel: str, step: int, ring_bits: int, n: int, key: np.ndarray, share: np.ndarray,
               riders: Sequence[int] = ()) -> np.ndarray:
        """The owner's masked share, then its `riders` masked, then its `CHECK_WORDS` check words
        (``n + len(riders) + CHECK_WORDS`` elements).

        Reads its own vector back (share + AES(key)), computes its check values and masks the rider and check
        words with the keystream of the same key at elements ``n, n + 1, ...`` (what server0 expands for the
        longer vector): one `check_pass` over the share, which also copies it and leaves that keystream in place.
        The checks cover the ``n + len(riders)`` elements (`riders`: plain ring elements, below 2**ring_bits,
        each read as a signed integer like any element; `tfe_estimator.owner.riders`).
        """
        self._check_owners(ring_bits)
        covered = n + len(riders)
        total = covered + CHECK_WORDS
        # reused per thread (the result is only sent: `contribute_checked`)
        out = self._scratch("out", ring.ring_words(total, ring_bits))
        key_c = self._coefficient_key(channel, step)
        # the pass reads the riders' elements as 0: it checks their keystream, corrected below to the riders
        values = check_pass(np.asarray(share).reshape(-1), n, total, covered, ring_bits, key, key_c, out, copy=True)
        modulus = 1 << ring_bits
        if riders:
            stream = self._rider_coefficients(key_c, n, covered)
            pads = ring.elements(out, n, len(riders), ring_bits)  # out's element n + i is AES(key)'s
            plain = [int(rider) % modulus for rider in riders]
            changes = [_signed(r, ring_bits) - _signed(pad, ring_bits) for r, pad in zip(plain, pads)]
            values = [v + sum(c * change for c, change in zip(row, changes)) for v, row in zip(values, stream)]
            ring.set_elements(out, n, [(r - pad) % modulus for r, pad in zip(plain, pads)], ring_bits)
        pads = ring.elements(out, covered, CHECK_WORDS, ring_bits)  # out's element covered + j is AES(key)'s
        ring.set_elements(out, covered, [(value - pad) % modulus for value, pad
                                         in zip(self.residues(values, ring_bits), pads)], ring_bits)
        return out.view(np.int64)

    @staticmethod
    def _rider_coefficients(coefficient_key: bytes, n: int, covered: int) -> List[List[int]]:
        """Per row, the coefficients of elements ``n .. covered - 1`` of a check over `covered` elements (those
        of `coefficients` there), without expanding the others."""
        count = covered - n
        rows = []
        for m in range(ROWS):
            rows.append([v >> (32 - COEFFICIENT_BITS)
                         for v in ring.keystream_elements(coefficient_key, m * covered + n, count, 32)])
        return rows

    def verify(self, channel: str, step: int, ring_bits: int, n: int, blind_key: np.ndarray,
               masked: np.ndarray, decoded: Sequence[np.ndarray] = (), factor: float = 1.0) -> np.ndarray:
        """Checks the revealed sum ``masked + AES(blind_key)`` (``n + CHECK_WORDS`` elements); returns it
        (uint64 ring words, its check words included).

        With `decoded` (`check_pass`'s: float arrays, `factor`), its first elements are decoded into them in the
        same pass instead: the words returned (this thread's scratch) hold only the elements after those.

        Raises:
          SumIntegrityError: naming the step, the channel, how many checks failed and the servers' operators.
        """
        total = n + CHECK_WORDS
        answer = np.asarray(masked).reshape(-1)
        if answer.size != ring.ring_words(total, ring_bits):
            raise SumIntegrityError(
                f"the sum released for step {step} on channel {channel} has {answer.size} ring words, not the "
                f"{ring.ring_words(total, ring_bits)} of {n} elements and {CHECK_WORDS} check words: a server "
                f"altered it (server operators: {self.operators}); training stopped, nothing of it applied.")
        # handed to TensorFlow (one nobody holds any more), unless decoded
        revealed = self._scratch("after_decoded", answer.size) if decoded else self._for_tensorflow(answer.size)
        values = check_pass(answer, total, total, n, ring_bits, blind_key, self._coefficient_key(channel, step),
                            revealed, copy=False, decoded=decoded, factor=factor)
        expected = self.residues(values, ring_bits)
        primes = PRIMES[ring_bits] * ROWS
        failed = sum(word % p != e for word, p, e in zip(ring.elements(revealed, n, CHECK_WORDS, ring_bits), primes,
                                                         expected))
        if failed:
            raise SumIntegrityError(
                f"the sum released for step {step} on channel {channel} failed {failed} of {CHECK_WORDS} integrity "
                f"checks (each passes a change with probability at most 2**-{COEFFICIENT_BITS}): a server altered "
                f"it (server operators: {self.operators}), or an owner contributed check words that do not match "
                "its own vector (a modified owner: the checks cannot tell which); training stopped, nothing of it "
                f"applied. This owner's check seed is {self.fingerprint}: each owner logs its own at the handshake "
                "('sums checked (check seed ...)'); if they differ, the first owner renewed its key while the others "
                "kept training: restart every owner. Otherwise the servers' logs and operators can say why; restart "
                "the owners once the cause is fixed (each resumes from its latest checkpoint).")
        return revealed


def checked_contribute(contribute: Callable, check: Optional[SumCheck], channel: str, step: int, ring_bits: int,
                       n: int, key: np.ndarray, share: np.ndarray, reveal: bool = False, riders: Sequence[int] = (),
                       decode: Optional[Tuple[np.dtype, float, Sequence[int]]] = None):
    """One contribution through `contribute` (`OwnerClient.contribute`'s signature), checked with `check`.

    Returns ``(blind_key, w)`` with w of the share's n elements (``ring_words(n)`` words), as without checks
    (with `check` None, exactly `contribute`'s answer); with `reveal`, the revealed sum ``w + AES(blind_key)``
    instead (int64, ``ring_words(n)`` words: what the check computed anyway, so the reveal needs no key).
    With `riders` (plain ring elements that ride in this contribution, masked with the same key after the
    share's n elements: `tfe_estimator.owner.riders`), the vector and what is returned have
    ``n + len(riders)`` elements; `reveal` is then required.
    With `decode` ``(dtype, factor, sizes)`` (`reveal` required; float32 or float64, `check_pass`'s factor, sizes
    summing to n), the revealed sum's n elements are decoded in the pass that unmasks and checks it, into arrays of
    those sizes TensorFlow takes without a copy; returns ``(arrays, words)``, `words` the revealed ring words of
    which only the elements after the n (the riders') are set (this thread's scratch: read before its next call).

    Raises:
      SumIntegrityError: the revealed sum fails its checks (`SumCheck.verify`).
    """
    if decode is not None and (not reveal or sum(decode[2]) != n):
        raise ValueError(f"a sum is decoded only where it is revealed (reveal={reveal}) and whole: sizes "
                         f"{list(decode[2])} for {n} elements; call checked_contribute with reveal=True and sizes "
                         "summing to n.")
    if not reveal:  # the answer is handed back: in a buffer of its own
        return _checked_contribute(contribute, check, channel, step, ring_bits, n, key, share, reveal, riders)
    # revealed here, into a new array: the answer's bytes can land in this thread's reused buffer
    with _reply_buffer(ring.ring_words(n + len(riders) + (CHECK_WORDS if check is not None else 0), ring_bits)):
        return _checked_contribute(contribute, check, channel, step, ring_bits, n, key, share, reveal, riders,
                                   decode)


#: Per thread, the buffer server1's answers land in (`client.reply_into`), reused from call to call.
_REPLIES = threading.local()


@contextlib.contextmanager
def _reply_buffer(words: int):
    """Lends this thread's reply buffer for answers of `words` ring words to the calls inside; a call that
    raised leaves it behind (a put of that call may still write into it)."""
    from tfe_estimator.service.client import REPLY_MARGIN_BYTES, reply_into  # pylint: disable=import-outside-toplevel

    size = 8 * words + REPLY_MARGIN_BYTES
    buffer = getattr(_REPLIES, "buffer", None)
    if buffer is None or len(buffer) != size:
        buffer = _REPLIES.buffer = bytearray(size)
    try:
        with reply_into(buffer):
            yield
    except BaseException:
        _REPLIES.buffer = None
        raise


def _checked_contribute(contribute, check, channel, step, ring_bits, n, key, share, reveal, riders, decode=None):
    if riders and not reveal:
        raise ValueError("riders come back only in a revealed sum: call checked_contribute with reveal=True.")
    arrays = [] if decode is None else _decoded_arrays(decode[0], decode[2])
    factor = 1.0 if decode is None else decode[1]
    if riders and check is None:
        share, n = _with_riders(key, share, n, ring_bits, riders), n + len(riders)
    elif riders:
        extended = check.extend(channel, step, ring_bits, n, key, share, riders)
        n += len(riders)
        blind_key, masked = contribute(channel, step, ring_bits, n + CHECK_WORDS, key, extended)
        revealed = check.verify(channel, step, ring_bits, n, blind_key, masked, arrays, factor)
        return _revealed(revealed, n, ring_bits, decode, arrays)
    words = ring.ring_words(n, ring_bits)
    if check is None:
        blind_key, masked = contribute(channel, step, ring_bits, n, key, share)
        if not reveal:
            return blind_key, masked
        answer = np.asarray(masked).reshape(-1).view(np.uint64)
        if decode is not None:  # unmasked and decoded in one pass (nothing checked)
            # the words after the decoded elements (riders'), read before the call returns: this thread's scratch
            revealed = _scratch(_DECODED, "after_decoded", words)
            check_pass(answer, n, n, 0, ring_bits, blind_key, bytes(ring.KEY_BYTES), revealed, copy=False,
                       decoded=arrays, factor=factor)
            return arrays, revealed.view(np.int64)
        return _plus(answer, ring.keystream_words(np.asarray(blind_key), words), ring_bits).view(np.int64)
    extended = check.extend(channel, step, ring_bits, n, key, share)
    blind_key, masked = contribute(channel, step, ring_bits, n + CHECK_WORDS, key, extended)
    revealed = check.verify(channel, step, ring_bits, n, blind_key, masked, arrays, factor)
    if reveal:
        return _revealed(revealed, n, ring_bits, decode, arrays)
    return blind_key, np.asarray(masked).reshape(-1)[:words]


def _revealed(revealed: np.ndarray, n: int, ring_bits: int, decode, arrays: List[np.ndarray]):
    """What a checked, revealed contribution returns: its n elements' ring words (int64), or with `decode`
    ``(arrays, words)`` (`checked_contribute`)."""
    words = revealed[:ring.ring_words(n, ring_bits)].view(np.int64)
    return words if decode is None else (arrays, words)


#: Per thread, the buffers of decoded sums handed to TensorFlow (`_decoded_arrays`), reused once nothing holds them.
_DECODED = threading.local()


def _decoded_arrays(dtype, sizes: Sequence[int]) -> List[np.ndarray]:
    """Arrays of `dtype` and `sizes` for a decoded sum, each aligned for TensorFlow to take it without a copy, in
    one buffer of this thread's that nothing references any more (the pool of `SumCheck._for_tensorflow`: at most
    `_REUSED` kept), else a new one."""
    dtype = np.dtype(dtype)
    starts, size = [], 0
    for count in sizes:
        starts.append(size)
        size += -(-int(count) * dtype.itemsize // _TF_ALIGN) * _TF_ALIGN
    raw = _unheld(_DECODED.__dict__.setdefault("pool", []), size + _TF_ALIGN)
    base = -raw.ctypes.data % _TF_ALIGN
    return [raw[base + start:base + start + int(count) * dtype.itemsize].view(dtype)
            for start, count in zip(starts, sizes)]


def _signed(value: int, ring_bits: int) -> int:
    """A ring element (below 2**ring_bits) read as a two's complement integer."""
    return value - (1 << ring_bits) if value >> (ring_bits - 1) else value


def _with_riders(key, share: np.ndarray, n: int, ring_bits: int, riders: Sequence[int]) -> np.ndarray:
    """`share` (n elements) with `riders` appended, masked with the keystream of `key` at elements n, n + 1, ...
    (an unchecked contribution's riders: a new array)."""
    total = n + len(riders)
    out = np.zeros(ring.ring_words(total, ring_bits), np.uint64)
    source = np.asarray(share).reshape(-1).view(np.uint64)
    lanes = n * ring_bits // 32
    out.view("<u4")[:lanes] = source.view("<u4")[:lanes]
    modulus = 1 << ring_bits
    ring.set_elements(out, n, [(int(rider) - pad) % modulus
                               for rider, pad in zip(riders, ring.keystream_elements(key, n, len(riders), ring_bits))],
                      ring_bits)
    return out.view(np.int64)
