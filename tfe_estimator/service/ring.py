"""Ring arithmetic and AES-128-CTR keystreams in NumPy, bit-identical to the kernels.

The layout is the one of ``secure/kernels/src/secure_sum_ops.cc``: a ring
vector of n elements is ``ring_words(n, R)`` 64-bit words; R = 64 is one uint64
per element, R = 128 two words per element (a little-endian u128: low word,
high word; addition carries), R = 32 two little-endian uint32 lanes per word
(lane arithmetic modulo 2**32; an odd n's last lane is 0). Element i's mask is
keystream bytes ``[i*R/8, (i+1)*R/8)`` read little-endian, so a keystream is
simply its bytes read as uint64 words.

The keystream is ``aes_ctr.h``'s: AES-128-CTR from the counter block 0 (the
big-endian 128-bit integer 0), i.e. `cryptography`'s
``Cipher(AES(key), CTR(b"\\0" * 16))`` encrypting zeros. No cipher is written here.

Example::

    acc = np.zeros(ring_words(1000, 128), np.uint64)
    add_into(acc, keystream_words(key, acc.size), 128)   # acc += AES(key)
    sub_into(acc, share.view(np.uint64), 128)            # acc -= share
"""
import hashlib
import sys
from typing import List, Sequence

import numpy as np
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

__all__ = ["RING_BITS", "KEY_BYTES", "ring_words", "keystream_words", "keystream_into", "add_into", "copy_into",
           "negate", "sub_into", "keystream_apply", "keystream_bytes_at", "keystream_elements", "key_digest",
           "elements", "set_elements", "KEY_METADATA", "DIGESTS_METADATA", "REPLAYED_METADATA"]

RING_BITS = (32, 64, 128)
KEY_BYTES = 16
_ZERO_COUNTER = bytes(16)
#: gRPC metadata of an owner's put to server1: the digest of the key its share is masked with (hex); and of
#: server0's forward: the digests of every owner's key it summed (hex, comma-separated, owner order). Server1
#: refuses a share whose key is not the one server0 summed for the step (`steps.StepChannel.put`).
KEY_METADATA, DIGESTS_METADATA = "tfe-key-digest", "tfe-key-digests"
#: Trailing gRPC metadata of a Contribute answered from the replay window (a step released before): nothing was
#: summed or released for the call. The owner counts fresh and replayed answers (`OwnerClient.answers`).
REPLAYED_METADATA = "tfe-replayed"
#: Zeros the keystream is encrypted from, a chunk at a time (no zero buffer of the vector's size per call).
_ZEROS = memoryview(bytes(1 << 20))


def _check_ring_bits(ring_bits: int) -> int:
    if isinstance(ring_bits, bool) or ring_bits not in RING_BITS:
        raise ValueError(f"ring_bits={ring_bits!r} is not a ring of the kernels: use 32, 64 or 128.")
    return ring_bits


def ring_words(n: int, ring_bits: int) -> int:
    """64-bit words of a ring vector of `n` elements (the kernels' ``RingWords``)."""
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 0:
        raise ValueError(f"num_elements={n!r} must be an integer >= 0.")
    return (int(n) + 1) // 2 if _check_ring_bits(ring_bits) == 32 else int(n) * (ring_bits // 64)


def keystream_words(key16: bytes, words: int) -> np.ndarray:
    """`words` uint64 words of AES-128-CTR keystream under `key16` from counter 0 (read-only array).

    Args:
      key16: the 16-byte key (bytes, or an int32[4] / uint8[16] array as the kernels hold it).
      words: how many 64-bit words.
    """
    key = np.ascontiguousarray(key16).tobytes() if isinstance(key16, np.ndarray) else bytes(key16)
    if len(key) != KEY_BYTES:
        raise ValueError(f"an AES-128 key has {KEY_BYTES} bytes, got {len(key)}: pass the kernels' int32[4] "
                         "seed or 16 bytes.")
    encryptor = Cipher(algorithms.AES(key), modes.CTR(_ZERO_COUNTER)).encryptor()
    size = 8 * int(words)
    out = np.empty(size + 15, np.uint8)  # update_into wants room for a block beyond what it writes
    view = memoryview(out)
    for start in range(0, size, len(_ZEROS)):
        chunk = min(len(_ZEROS), size - start)
        encryptor.update_into(_ZEROS[:chunk], view[start:start + chunk + 15])
    stream = out[:size].view("<u8")
    stream.flags.writeable = False
    return stream


def keystream_into(key16, out: np.ndarray) -> np.ndarray:
    """Writes ``keystream_words(key16, out.size)`` into `out` (a writable contiguous uint64 array): no allocation.

    Example::

        buffer = np.empty(words, np.uint64)
        keystream_into(key, buffer)      # buffer == keystream_words(key, words)
    """
    key = np.ascontiguousarray(key16).tobytes() if isinstance(key16, np.ndarray) else bytes(key16)
    if len(key) != KEY_BYTES:
        raise ValueError(f"an AES-128 key has {KEY_BYTES} bytes, got {len(key)}: pass the kernels' int32[4] "
                         "seed or 16 bytes.")
    if not isinstance(out, np.ndarray) or out.dtype != np.uint64 or not out.flags.writeable or \
            not out.flags.c_contiguous:
        raise TypeError(f"out must be a writable contiguous uint64 array, got {getattr(out, 'dtype', type(out))}.")
    encryptor = Cipher(algorithms.AES(key), modes.CTR(_ZERO_COUNTER)).encryptor()
    view = memoryview(out.reshape(-1)).cast("B")
    size = view.nbytes
    # update_into wants 15 bytes of room beyond what it writes: the last bytes go through a small scratch.
    tail = min(size, 4096)
    body = size - tail
    for start in range(0, body, len(_ZEROS)):
        chunk = min(len(_ZEROS), body - start)
        encryptor.update_into(_ZEROS[:chunk], view[start:start + chunk + 15])
    if tail:
        scratch = bytearray(tail + 15)
        encryptor.update_into(_ZEROS[:tail], scratch)
        view[body:] = scratch[:tail]
    return out


def keystream_bytes_at(key16, offset: int, size: int) -> bytes:
    """`size` bytes of the keystream of `key16` (`keystream_words`) from byte `offset` on, without expanding the
    bytes before it: what masks a few elements at the end of a long vector.

    Example::

        tail = keystream_bytes_at(key, 8 * n, 8 * m)   # == keystream_words(key, n + m)[n:].tobytes()
    """
    key = np.ascontiguousarray(key16).tobytes() if isinstance(key16, np.ndarray) else bytes(key16)
    if len(key) != KEY_BYTES:
        raise ValueError(f"an AES-128 key has {KEY_BYTES} bytes, got {len(key)}: pass the kernels' int32[4] "
                         "seed or 16 bytes.")
    if offset < 0 or size < 0:
        raise ValueError(f"keystream_bytes_at: offset={offset!r} and size={size!r} must be >= 0.")
    block, skip = divmod(int(offset), 16)
    encryptor = Cipher(algorithms.AES(key), modes.CTR(block.to_bytes(16, "big"))).encryptor()
    return encryptor.update(bytes(skip + int(size)))[skip:]


def keystream_elements(key16, start: int, count: int, ring_bits: int) -> List[int]:
    """Elements ``start .. start + count - 1`` of the keystream of `key16` on ring `ring_bits`, as unsigned
    integers below 2**ring_bits (`elements` of `keystream_words`), expanding only their bytes: the masks of a few
    elements, e.g. riders after a long vector.

    Example::

        pads = keystream_elements(key, n, 3, 128)
        # == elements(keystream_words(key, ring_words(n + 3, 128)), n, 3, 128)
    """
    per = _check_ring_bits(ring_bits) // 8
    return elements(np.frombuffer(keystream_bytes_at(key16, per * int(start), per * int(count)), np.uint8), 0,
                    count, ring_bits)


def elements(words: np.ndarray, start: int, count: int, ring_bits: int) -> List[int]:
    """Elements ``start .. start + count - 1`` of ring vector `words` as unsigned integers below 2**ring_bits (a
    few elements, e.g. check words: one slice, no per-element indexing).

    Example::

        elements(words, n, 4, 128)    # the four elements after the first n, as Python integers
    """
    flat = np.asarray(words).reshape(-1)
    if _check_ring_bits(ring_bits) == 32:
        return flat.view("<u4")[start:start + count].tolist()
    per = ring_bits // 64
    parts = flat.view("<u8")[per * start:per * (start + count)].tolist()
    return parts if per == 1 else [low | (high << 64) for low, high in zip(parts[0::2], parts[1::2])]


def set_elements(words: np.ndarray, start: int, values: Sequence[int], ring_bits: int) -> None:
    """Writes `values` (each below 2**ring_bits) to elements ``start, start + 1, ...`` of ring vector `words` (a
    writable contiguous array of 64-bit words), in one slice assignment."""
    count = len(values)
    if _check_ring_bits(ring_bits) == 32:
        words.view("<u4")[start:start + count] = np.array(values, np.uint32)
    elif ring_bits == 64:
        words.view("<u8")[start:start + count] = np.array(values, np.uint64)
    else:
        mask = (1 << 64) - 1
        words.view("<u8")[2 * start:2 * (start + count)] = np.array(
            [part for v in values for part in (v & mask, v >> 64)], np.uint64)


def key_digest(key16) -> bytes:
    """16 bytes of SHA-256 of a mask key: names the key (to match a share with it) without revealing it."""
    key = np.ascontiguousarray(key16).tobytes() if isinstance(key16, np.ndarray) else bytes(key16)
    return hashlib.sha256(key).digest()[:16]


def _operands(acc: np.ndarray, other: np.ndarray):
    if sys.byteorder != "little":
        raise NotImplementedError("the kernels' ring layout is little-endian; this host is big-endian.")
    if not isinstance(acc, np.ndarray) or acc.dtype != np.uint64 or acc.ndim != 1 or not acc.flags.writeable \
            or not acc.flags.c_contiguous:
        raise TypeError(f"the accumulator must be a writable contiguous 1-D uint64 array, got "
                        f"{getattr(acc, 'dtype', type(acc))} of shape {getattr(acc, 'shape', None)}.")
    other = np.ascontiguousarray(other).reshape(-1)
    if other.dtype.itemsize != 8 or other.dtype.kind not in "iu":
        raise TypeError(f"ring words are 64-bit integers, got dtype {other.dtype}.")
    other = other.view(np.uint64)
    if other.size != acc.size:
        raise ValueError(f"ring vectors differ in size: {acc.size} words and {other.size} words.")
    return acc, other


#: Ring-128 arithmetic runs over blocks of this many words: its carries and borrows are temporaries of a
#: block's size, not of the vector's (1/16 of a 2**24-element sum, 16 MiB, per call otherwise).
_BLOCK_WORDS = 1 << 17


def _blocks(acc: np.ndarray, other: np.ndarray):
    """``(acc block, other block)`` pairs of `_BLOCK_WORDS` words (even: whole ring-128 elements)."""
    for start in range(0, acc.size, _BLOCK_WORDS):
        yield acc[start:start + _BLOCK_WORDS], other[start:start + _BLOCK_WORDS]


def add_into(acc: np.ndarray, other: np.ndarray, ring_bits: int) -> np.ndarray:
    """``acc += other`` modulo 2**ring_bits per element, in place; returns `acc`."""
    acc, other = _operands(acc, other)
    if _check_ring_bits(ring_bits) == 32:
        np.add(acc.view(np.uint32), other.view(np.uint32), out=acc.view(np.uint32))
    elif ring_bits == 64:
        np.add(acc, other, out=acc)
    else:
        for acc_block, other_block in _blocks(acc, other):
            low, high = acc_block[0::2], acc_block[1::2]
            other_low = other_block[0::2]
            np.add(low, other_low, out=low)
            carry = low < other_low  # the low word wrapped
            np.add(high, other_block[1::2], out=high)
            np.add(high, carry, out=high, casting="unsafe")
    return acc


def copy_into(acc: np.ndarray, other: np.ndarray) -> np.ndarray:
    """``acc = other`` (the first addend of a reused accumulator: ``0 + other`` in every ring); returns `acc`."""
    acc, other = _operands(acc, other)
    np.copyto(acc, other)
    return acc


def negate(acc: np.ndarray, ring_bits: int) -> np.ndarray:
    """``acc = -acc`` modulo 2**ring_bits per element, in place; returns `acc`."""
    acc, _ = _operands(acc, acc)
    if _check_ring_bits(ring_bits) == 32:
        np.negative(acc.view(np.uint32), out=acc.view(np.uint32))
    elif ring_bits == 64:
        np.negative(acc, out=acc)
    else:  # -(high * 2**64 + low) = ~high * 2**64 + (-low), plus 2**64 when low is 0
        for block, _ in _blocks(acc, acc):
            low, high = block[0::2], block[1::2]
            zero = low == 0
            np.negative(low, out=low)
            np.invert(high, out=high)
            np.add(high, zero, out=high, casting="unsafe")
    return acc


def sub_into(acc: np.ndarray, other: np.ndarray, ring_bits: int) -> np.ndarray:
    """``acc -= other`` modulo 2**ring_bits per element, in place; returns `acc`."""
    acc, other = _operands(acc, other)
    if _check_ring_bits(ring_bits) == 32:
        np.subtract(acc.view(np.uint32), other.view(np.uint32), out=acc.view(np.uint32))
    elif ring_bits == 64:
        np.subtract(acc, other, out=acc)
    else:
        for acc_block, other_block in _blocks(acc, other):
            low, high = acc_block[0::2], acc_block[1::2]
            other_low = other_block[0::2]
            borrow = low < other_low  # the low word wraps
            np.subtract(low, other_low, out=low)
            np.subtract(high, other_block[1::2], out=high)
            np.subtract(high, borrow, out=high, casting="unsafe")
    return acc


def keystream_apply(key16, acc: np.ndarray, ring_bits: int, subtract: bool = False) -> np.ndarray:
    """``acc += AES(key16)`` (or ``-=`` with `subtract`) in place, the keystream drawn a block at a time: no
    vector-sized buffer (server0 blinds a released sum with it). Returns `acc`.

    Example::

        keystream_apply(blind, acc, 128, subtract=True)   # acc -= AES(blind)
    """
    key = np.ascontiguousarray(key16).tobytes() if isinstance(key16, np.ndarray) else bytes(key16)
    if len(key) != KEY_BYTES:
        raise ValueError(f"an AES-128 key has {KEY_BYTES} bytes, got {len(key)}: pass the kernels' int32[4] "
                         "seed or 16 bytes.")
    acc, _ = _operands(acc, acc)
    encryptor = Cipher(algorithms.AES(key), modes.CTR(_ZERO_COUNTER)).encryptor()
    scratch = np.empty(8 * _BLOCK_WORDS + 15, np.uint8)  # update_into wants 15 bytes of room beyond its output
    apply = sub_into if subtract else add_into
    for start in range(0, acc.size, _BLOCK_WORDS):
        block = acc[start:start + _BLOCK_WORDS]
        nbytes = 8 * block.size
        encryptor.update_into(_ZEROS[:nbytes], memoryview(scratch)[:nbytes + 15])  # CTR continues across blocks
        apply(block, scratch[:nbytes].view("<u8"), ring_bits)
    return acc
