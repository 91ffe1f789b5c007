"""Server0's blind key, sealed for each owner, so it reaches the owners inside server1's answer.

Server0 blinds a step's sum with a fresh key ``B`` (server1 sees ``w = sum -
AES(B)``, never the sum). The owners need ``B`` to unmask ``w``. Server0 used to
answer it itself, after server1 released the step: at a distance that is one
more server-to-server hop on every step (server1's release travels to server0
before server0 answers). Instead server0 seals ``B`` for every owner under a
key only that owner and server0 hold, and sends the sealed copies with its
forwarded part; server1 puts them in the step's answer, and each owner opens
its own. Server1 carries 44 bytes per owner it cannot open.

- The sealing key is HKDF-SHA256 of the owner's mask key for the step (fresh
  per contribution, sent only to server0), under its own label: independent of
  the mask's AES-CTR keystream and of the key's digest server1 sees
  (`ring.key_digest`, SHA-256 of the key itself).
- The seal is AES-128-GCM (`cryptography`) with a random 96-bit nonce (a step
  forwarded again is sealed again: never one nonce for two plaintexts), over
  the step's channel, settings and number as associated data: a sealed key of
  another step, channel or owner does not open (`SealError`).

Example::

    sealed = seal(owner_key, blind, "m/sum_0", 64, 1000, step=7)        # server0, per owner
    blind = open_sealed(owner_key, sealed, "m/sum_0", 64, 1000, step=7)  # that owner
"""
import os
import struct
from typing import Optional, Sequence

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from tfe_estimator.service import ring

__all__ = ["SEALED_BYTES", "SealError", "seal", "open_sealed", "open_own"]

_NONCE, _TAG = 12, 16
#: Bytes of one sealed blind key: nonce, the 16-byte key encrypted, GCM's tag.
SEALED_BYTES = _NONCE + ring.KEY_BYTES + _TAG
_LABEL = b"tfe_estimator/service sealed blind key v1"


class SealError(ValueError):
    """A sealed blind key that does not open under this owner's key for this step (another owner's, another
    step's, altered on the way, or sealed with another key)."""


def _cipher(owner_key: bytes) -> AESGCM:
    """AES-128-GCM under the sealing key of `owner_key` (HKDF-SHA256 under this module's label)."""
    key = bytes(owner_key)
    if len(key) != ring.KEY_BYTES:
        raise ValueError(f"owner_key has {len(key)} bytes; pass the 16-byte mask key of the contribution.")
    return AESGCM(HKDF(algorithm=hashes.SHA256(), length=16, salt=None, info=_LABEL).derive(key))


def _associated(channel: str, ring_bits: int, num_elements: int, step: int) -> bytes:
    return struct.pack("<iqq", int(ring_bits), int(num_elements), int(step)) + channel.encode("utf-8")


def seal(owner_key: bytes, blind: bytes, channel: str, ring_bits: int, num_elements: int, step: int) -> bytes:
    """Server0: `blind` (16 bytes) sealed for the owner whose mask key for this step is `owner_key`."""
    blind = bytes(blind)
    if len(blind) != ring.KEY_BYTES:
        raise ValueError(f"blind has {len(blind)} bytes; a blind key has {ring.KEY_BYTES}.")
    nonce = os.urandom(_NONCE)
    return nonce + _cipher(owner_key).encrypt(nonce, blind, _associated(channel, ring_bits, num_elements, step))


def open_sealed(owner_key: bytes, sealed: bytes, channel: str, ring_bits: int, num_elements: int,
                step: int) -> bytes:
    """The owner: the blind key in `sealed`; `SealError` if it was not sealed for this key and step."""
    return _open(_cipher(owner_key), sealed, _associated(channel, ring_bits, num_elements, step), channel, step)


def _open(cipher: AESGCM, sealed: bytes, associated: bytes, channel: str, step: int) -> bytes:
    sealed = bytes(sealed)
    if len(sealed) != SEALED_BYTES:
        raise SealError(f"a sealed blind key has {SEALED_BYTES} bytes, not {len(sealed)}.")
    try:
        return cipher.decrypt(sealed[:_NONCE], sealed[_NONCE:], associated)
    except InvalidTag:
        raise SealError(f"the sealed blind key of step {step} of {channel!r} does not open under this owner's "
                        "key for it.") from None


def open_own(owner_key: bytes, sealed: Sequence[bytes], channel: str, ring_bits: int, num_elements: int,
             step: int) -> Optional[bytes]:
    """The owner: the blind key of the one entry of `sealed` (server1's answer carries every owner's) that opens
    under `owner_key`; None if none does (an answer without them, from a server0 that does not seal)."""
    cipher, associated = _cipher(owner_key), _associated(channel, ring_bits, num_elements, step)
    for entry in sealed:
        try:
            return _open(cipher, entry, associated, channel, step)
        except SealError:
            continue
    return None
