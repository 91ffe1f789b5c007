"""The owners' check seed: a secret every owner of a model holds and no server, agreed through server0.

The sums' integrity checks (`sum_check`) are only as good as the servers'
ignorance of their coefficients, so the owners agree on a seed in the
handshake (`handshake`) that server0 relays but cannot read or replace:

- every owner's handshake part carries its certificate (PEM); an owner uses
  another owner's certificate only if it proves that owner in the federation
  (issued by the CA of that owner's own organisation, valid, its CN naming
  it: `Federation.check_peer`, what the servers check of a caller), so
  server0 (or an impostor) cannot slip in a key of its own;
- the first owner (``owners[0]``) derives the seed from its private key and
  the model id (HKDF-SHA256), and, per other owner j, puts in its part the
  seed encrypted with AES-256-GCM under ``HKDF(ECDH(its key, j's
  certificate key))`` (static-static P-256 ECDH of the certificates' keys,
  bound to the model and both names); owner j derives the same key from its
  own private key and owners[0]'s verified certificate and decrypts. A
  ciphertext that does not decrypt (server0 altered it) stops the owner.

Everything is recomputed from the certificates' keys, so it survives
restarts: an owner restarted alone (or owners[0] itself, or all of them)
obtains the SAME seed while the others keep training. The GCM nonce is fixed
(zero): each wrap key (one pair of keys and one model) only ever encrypts one
plaintext (the seed of that model under owners[0]'s key), so the ciphertext
is deterministic and a nonce never meets a second message. What server0
stores are certificates and ciphertexts (tests/test_sum_check.py checks that
the seed is not among them). Renewing owners[0]'s key changes the seed: do
it with every owner restarted (a new training session of all).

Example::

    agreement = SeedAgreement(tls, owners=["chief:0", "worker:0"], me="worker:0", model=model_id)
    part = agreement.part
    rows, parts = client.handshake_parts(step, row, model_id, part)
    why = agreement.update([which for which, _, _ in rows], parts, sent=part)   # None: agreed
    check = agreement.check()   # the `sum_check.SumCheck` of the seed
"""
import base64
import hashlib
import json
import logging
import threading
from typing import Dict, Optional, Sequence, Tuple

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from tfe_estimator.owner.sum_check import SumCheck
from tfe_estimator.identity import certs

__all__ = ["SeedAgreement", "CheckSeedError", "owner_seed", "remember", "lookup", "SEED_BYTES"]

log = logging.getLogger("tfe_estimator")

SEED_BYTES = 32
_VERSION = 1
_NONCE = bytes(12)  # each wrap key encrypts one plaintext only (module docstring)


class CheckSeedError(ValueError):
    """The owners cannot agree on a check seed: a part that proves no owner, or does not decrypt."""


def _model_bytes(model: int) -> bytes:
    return (int(model) & ((1 << 64) - 1)).to_bytes(8, "big")


def _ec_key(key, what: str):
    if not isinstance(key, (ec.EllipticCurvePrivateKey, ec.EllipticCurvePublicKey)):
        raise CheckSeedError(f"{what} is a {type(key).__name__}, not an elliptic-curve key: the owners' check seed "
                             "is agreed with ECDH of the owners' certificate keys; make the certificates with "
                             "`tfe-estimator certs` (EC P-256).")
    return key


def owner_seed(private_key, model: int) -> bytes:
    """owners[0]'s check seed for `model`: HKDF-SHA256 of its private key (the same after any restart)."""
    scalar = _ec_key(private_key, "owners[0]'s private key").private_numbers().private_value
    return HKDF(algorithm=hashes.SHA256(), length=SEED_BYTES, salt=b"tfe-estimator check seed v1",
                info=_model_bytes(model)).derive(scalar.to_bytes(66, "big"))


def _cert_id(pem: str) -> str:
    """Names a certificate in a part (which certificate a seed was wrapped for): 16 hex digits of SHA-256."""
    return hashlib.sha256(pem.encode("ascii")).hexdigest()[:16]


def _wrap_key(private_key, peer_public_key, model: int, first: str, other: str) -> Tuple[AESGCM, bytes]:
    peer = _ec_key(peer_public_key, "a certificate's key")
    shared = _ec_key(private_key, "the private key").exchange(ec.ECDH(), peer)
    info = b"tfe-estimator check seed wrap v1\0" + _model_bytes(model) + first.encode() + b"\0" + other.encode()
    return AESGCM(HKDF(algorithm=hashes.SHA256(), length=32, salt=None, info=info).derive(shared)), info


class SeedAgreement:
    """One owner's side of the check-seed agreement for one model (module docstring).

    Args:
      tls: this owner's `tfe_estimator.service.TlsFiles` (its certificate and key; the federation).
      owners: every owner's name, in the configured order (owners[0] makes the seed); me: this owner.
      model: the model id of the handshake.
    """

    def __init__(self, tls, owners: Sequence[str], me: str, model: int):
        self._tls, self._owners, self._me, self._model = tls, list(owners), me, int(model)
        with open(tls.cert, "rb") as f:
            self._cert_pem = f.read()
        with open(tls.key, "rb") as f:
            self._key = serialization.load_pem_private_key(f.read(), password=None)
        _ec_key(self._key, f"the private key of {me} ({tls.key})")
        self._first = self._owners[0]
        self._seed = owner_seed(self._key, model) if me == self._first else None
        self._wrapped: Dict[str, Dict[str, str]] = {}  # owner -> its certificate's id and the wrapped seed
        self._part = self._encode()

    @property
    def part(self) -> bytes:
        """This owner's handshake part now: its certificate, and for owners[0] the seed wrapped per owner."""
        return self._part

    @property
    def seed(self) -> Optional[bytes]:
        """The seed once known (owners[0]: at once)."""
        return self._seed

    def _encode(self) -> bytes:
        body = {"v": _VERSION, "cert": self._cert_pem.decode("ascii"), "seeds": dict(sorted(self._wrapped.items()))}
        return json.dumps(body, sort_keys=True).encode()

    def _decode(self, owner: str, part: bytes) -> Optional[dict]:
        if not part:
            return None
        try:
            body = json.loads(bytes(part).decode())
            if not isinstance(body, dict) or body.get("v") != _VERSION or not isinstance(body.get("cert"), str) \
                    or not isinstance(body.get("seeds", {}), dict):
                raise ValueError("not a check-seed part")
        except ValueError as e:
            raise CheckSeedError(f"the handshake part of {owner} for model {self._model:016x} is not a check-seed "
                                 f"part of this version ({e}): run the same tfe_estimator version on every owner, "
                                 "or server0 altered it.") from None
        return body

    def _verified_key(self, owner: str, body: dict):
        """The public key of `owner`'s certificate in its part, if it proves `owner` in the federation."""
        trust = self._tls.trust()
        try:
            pem = body["cert"].encode("ascii")
            problem = trust.check_peer(owner, pem)
            cert = certs.load_certificate(pem, f"the handshake part of {owner}")
        except ValueError as e:
            problem, cert = f"{e}", None
        if problem is None and certs.certificate_identity(cert) != owner:
            problem = f"its certificate names {certs.certificate_identity(cert)!r}, not {owner}."
        if problem is not None:
            raise CheckSeedError(
                f"the handshake part of {owner} for the owners' check seed carries a certificate that does not "
                f"prove {owner}: {problem} Server0 ({trust.describe('tfe:0')}) relayed it: it altered the "
                "handshake, or the owner uses a certificate its organisation's CA did not issue. Refused: the sums' "
                "integrity checks need a seed no server knows.")
        return cert.public_key()

    def update(self, models: Sequence[int], parts: Sequence[bytes], sent: bytes) -> Optional[str]:
        """Reads the owners' parts (`parts[o]` with `models[o]`, from server0's reply to a call that sent
        `sent`); returns None once this owner is done, else why it waits.

        owners[0] is done when the part it sent wrapped the seed for every other owner (whose parts it
        read and verified); any other owner when it decrypted the seed from owners[0]'s part.

        Raises:
          CheckSeedError: a certificate that does not prove its owner, or a seed that does not decrypt.
        """
        bodies = {owner: self._decode(owner, part) if which == self._model else None
                  for owner, which, part in zip(self._owners, models, parts)}
        if self._me == self._first:
            missing = []
            for owner in self._owners[1:]:
                body = bodies.get(owner)
                if body is None:
                    missing.append(owner)
                    continue
                made_for = _cert_id(body["cert"])
                if self._wrapped.get(owner, {}).get("for") != made_for:  # new, or its certificate was renewed
                    aead, info = _wrap_key(self._key, self._verified_key(owner, body), self._model, self._first,
                                           owner)
                    self._wrapped[owner] = {"for": made_for,
                                            "seed": base64.b64encode(aead.encrypt(_NONCE, self._seed, info)).decode()}
            self._part = self._encode()
            if missing:
                return f"the check seed: no handshake part of {', '.join(missing)} yet"
            return None if self._part == bytes(sent) else "the check seed: wrapping it for every owner"
        if self._seed is not None:
            return None
        body = bodies.get(self._first)
        entry = None if body is None else body.get("seeds", {}).get(self._me)
        if not isinstance(entry, dict) or entry.get("for") != _cert_id(self._cert_pem.decode("ascii")):
            return f"the check seed: {self._first} has not wrapped it for {self._me}'s certificate yet"
        wrapped = entry.get("seed", "")
        aead, info = _wrap_key(self._key, self._verified_key(self._first, body), self._model, self._first, self._me)
        try:
            seed = aead.decrypt(_NONCE, base64.b64decode(wrapped), info)
        except (InvalidTag, ValueError):
            raise CheckSeedError(
                f"the check seed {self._first} wrapped for {self._me} (model {self._model:016x}) does not decrypt "
                f"under the key of {self._first}'s certificate and {self._me}'s: server0 "
                f"({self._tls.trust().describe('tfe:0')}) altered the handshake. Refused: the sums' integrity "
                "checks need a seed no server knows.") from None
        if len(seed) != SEED_BYTES:
            raise CheckSeedError(f"the check seed from {self._first} has {len(seed)} bytes, not {SEED_BYTES}.")
        self._seed = seed
        return None

    def check(self) -> SumCheck:
        """The `sum_check.SumCheck` of the agreed seed, naming the servers' operators."""
        if self._seed is None:
            raise CheckSeedError(f"{self._me} has no check seed for model {self._model:016x} yet: finish the "
                                 "handshake first.")
        trust = self._tls.trust()
        return SumCheck(self._seed, operators=f"{trust.describe('tfe:0')}, {trust.describe('tfe:1')}",
                        num_owners=len(self._owners))


_CHECKS: Dict[Tuple[str, int], SumCheck] = {}
_LOCK = threading.Lock()


def remember(owner: str, model: int, check: SumCheck) -> None:
    """Keeps `owner`'s `SumCheck` for `model` in this process (the handshake, before the first step)."""
    with _LOCK:
        _CHECKS[(owner, int(model))] = check


def lookup(owner: str, model: Optional[int]) -> Optional[SumCheck]:
    """`owner`'s `SumCheck` for `model`, or None (a model without a handshake: evaluation)."""
    with _LOCK:
        return None if model is None else _CHECKS.get((owner, int(model)))
