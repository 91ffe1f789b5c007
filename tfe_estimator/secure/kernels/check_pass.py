"""The owner's integrity-check pass over a ring vector, in the kernel library (``src/sum_check_pass.cc``).

`tfe_estimator.owner.sum_check` needs, per contribution, its own vector
read back from its masked share (``share + AES(key)``) and, after the
reveal, the sum (``answer + AES(blind_key)``), each with the exact check
values ``sum_i r_mi x_i`` under the coefficients of the step. `check_pass`
does both in one cache-resident pass in C++ (BoringSSL's AES-128-CTR, exact
128-bit sums), called through `ctypes` on the library `kernels.load` built and
self-tested: no TensorFlow op, so no graph or eager dispatch inside the
contribution's `tf.numpy_function`. A revealed sum's elements can be decoded
in the same pass (`decoded`), into the arrays the answer op hands TensorFlow.

Example::

    out = np.empty(ring.ring_words(n + 4, 64), np.uint64)
    values = check_pass(share, n, n + 4, n, 64, key, coefficient_key, out, copy=True)
    # out[:n] == share, out[n:] == AES(key) at elements n..n+3,
    # values[m] == sum_i r_mi * signed(share_i + AES(key)_i)
"""
import ctypes
import threading
from typing import List, Sequence

import numpy as np

__all__ = ["check_pass", "load", "ROWS", "CheckPassError"]

#: Check rows the pass computes (`sum_check.ROWS`).
ROWS = 2
_LOCK = threading.Lock()
_FUNCTION = None


class CheckPassError(RuntimeError):
    """The cipher library reported an error, or the pass was called outside its contract."""


def load() -> None:
    """Loads the pass (the kernel library, built and self-tested) now: a graph that will call it does so while it
    is built, so that no step's first call loads a library in a thread of its own."""
    _function()


def _function():
    global _FUNCTION  # pylint: disable=global-statement
    with _LOCK:
        if _FUNCTION is None:
            from tfe_estimator.secure import kernels  # pylint: disable=import-outside-toplevel

            kernels.load()  # built, loaded by TensorFlow and self-tested (the known-answer test) first
            function = ctypes.CDLL(str(kernels.library_path())).tfe_sum_check_pass
            function.restype = ctypes.c_int
            function.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_int,
                                 ctypes.c_char_p, ctypes.c_char_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p,
                                 ctypes.c_int, ctypes.c_int64, ctypes.c_double, ctypes.c_void_p, ctypes.c_void_p,
                                 ctypes.c_int64]
            _FUNCTION = function
    return _FUNCTION


def _key(key, name: str) -> bytes:
    data = np.ascontiguousarray(key).tobytes() if isinstance(key, np.ndarray) else bytes(key)
    if len(data) != 16:
        raise ValueError(f"{name} is an AES-128 key of 16 bytes, got {len(data)}: pass the kernels' int32[4] seed "
                         "or 16 bytes.")
    return data


def _ring_words(elements: int, ring_bits: int) -> int:
    return (elements + 1) // 2 if ring_bits == 32 else elements * (ring_bits // 64)


#: The decoded arrays' dtypes, as the pass names them.
_DECODED_TYPES = {np.dtype(np.float32): 1, np.dtype(np.float64): 2}


def _decoded(decoded: Sequence[np.ndarray], total: int, copy: bool, source: np.ndarray, out: np.ndarray):
    """The pass's arguments for `decoded` (`check_pass`): its type, the arrays' addresses and sizes."""
    pointers = np.array([a.ctypes.data for a in decoded], np.uint64) if decoded else np.zeros(1, np.uint64)
    sizes = np.array([a.size for a in decoded], np.int64) if decoded else np.zeros(1, np.int64)
    if not decoded:
        return 0, pointers, sizes
    dtypes = {a.dtype for a in decoded if isinstance(a, np.ndarray)}
    if copy or len(dtypes) != 1 or next(iter(dtypes)) not in _DECODED_TYPES or \
            not all(a.flags.c_contiguous and a.flags.writeable for a in decoded) or sizes.sum() > total:
        raise ValueError(f"decoded must be writable contiguous float32 or float64 arrays of one dtype, at most "
                         f"{total} elements in all, and only without copy; got {len(decoded)} arrays of "
                         f"{sorted(str(d) for d in dtypes)}, {int(sizes.sum())} elements, copy={copy}.")
    if any(np.may_share_memory(a, b) for a in decoded for b in (source, out)):
        raise ValueError("decoded must not overlap the input or out.")
    return _DECODED_TYPES[next(iter(dtypes))], pointers, sizes


def check_pass(words: np.ndarray, in_elements: int, total: int, n: int, ring_bits: int, mask_key, coefficient_key,
               out: np.ndarray, copy: bool, decoded: Sequence[np.ndarray] = (), factor: float = 1.0) -> List[int]:
    """One pass over a ring vector; returns per row the exact check value of its first `n` plain elements.

    Args:
      words: the input's ring words (at least ``ring_words(in_elements)`` of them, any 64-bit integer dtype).
      in_elements: elements of `words` read; the elements from `in_elements` to `total` read as 0 (their plain
        value is the keystream: a check over them counts ``signed(AES(mask_key)_i)``, which a caller that puts
        other words there corrects, `sum_check.SumCheck.extend`).
      total: elements written to `out`; n: elements checked (``n <= total``).
      ring_bits: 32, 64 or 128. mask_key: the key whose keystream is added (16 bytes or int32[4]).
      coefficient_key: the key of the step's coefficients (`sum_check`'s HKDF output).
      out: a writable contiguous uint64 array of ``ring_words(total)`` words: the input (`copy`) or the plain
        vector ``words + AES(mask_key)`` below `in_elements`, and the keystream (plain) after.
      copy: write the input, not the plain vector, below `in_elements`.
      decoded: without `copy`, float32 or float64 arrays (one dtype, contiguous, writable) whose sizes sum to at
        most `total`: the vector's first elements, in order, decoded into them as ``TfeRevealSum`` decodes one
        revealed part (``float(double(signed(x)) * factor)``) instead of written to `out` (a revealed sum
        unmasked, checked and decoded in one pass); factor: ``2**-fraction_bits / divisor``.

    Returns:
      ``[sum_i r_0i x_i, sum_i r_1i x_i]`` over the plain elements ``x_i`` read as signed integers.
    """
    if ring_bits not in (32, 64, 128):
        raise ValueError(f"ring_bits={ring_bits!r} is not a ring of the kernels: use 32, 64 or 128.")
    if not 0 <= in_elements <= total or not 0 <= n <= total:
        raise ValueError(f"a check pass reads {in_elements} of {total} elements and checks {n}: need "
                         "0 <= in_elements <= total and 0 <= n <= total.")
    source = np.ascontiguousarray(words).reshape(-1)
    if source.dtype.itemsize != 8 or source.dtype.kind not in "iu" or source.size < _ring_words(in_elements,
                                                                                                 ring_bits):
        raise ValueError(f"the input has {source.size} words of {source.dtype}, not the "
                         f"{_ring_words(in_elements, ring_bits)} 64-bit ring words of {in_elements} elements.")
    if not isinstance(out, np.ndarray) or out.dtype != np.uint64 or not out.flags.c_contiguous or \
            not out.flags.writeable or out.size != _ring_words(total, ring_bits):
        raise ValueError(f"out must be a writable contiguous uint64 array of {_ring_words(total, ring_bits)} words, "
                         f"got {getattr(out, 'dtype', type(out))} of {getattr(out, 'size', '?')}.")
    if source.size and np.shares_memory(source, out):
        raise ValueError("out must not overlap the input.")
    decoded_type, pointers, sizes = _decoded(decoded, total, copy, source, out)
    sums = np.zeros(4 * ROWS, np.int64)
    status = _function()(source.ctypes.data, in_elements, total, n, ring_bits, _key(mask_key, "mask_key"),
                         _key(coefficient_key, "coefficient_key"), int(bool(copy)), out.ctypes.data,
                         sums.ctypes.data, decoded_type, int(sizes.sum()), float(factor),
                         pointers.ctypes.data, sizes.ctypes.data, len(decoded))
    if status != 0:
        raise CheckPassError(f"the integrity-check pass failed with status {status} (-1: the cipher library "
                             "reported an error; -2: arguments outside the contract).")
    words64 = [int(v) for v in sums.view(np.uint64)]
    values = []
    for row in range(ROWS):
        a = words64[4 * row] | (words64[4 * row + 1] << 64)
        a -= (a >> 127) << 128  # signed
        b = words64[4 * row + 2] | (words64[4 * row + 3] << 64)
        values.append((a << 64) + b if ring_bits == 128 else a)
    return values
