"""Server0's handshake rows: per model id, each owner's latest row (contract rule 7 of the service's steps).

An owner's ``Handshake(step, descriptor, model)`` replaces its row for that
model and returns, for every configured owner in order, its row for the same
model, or else its latest row for another model (so the caller can say what
differs), or nothing; with how long ago each owner last called. Rows of one
model never block or replace another model's, an owner's rows never touch
another owner's, and nothing here compares rows: the owners do
(`tfe_estimator.owner.handshake`). Beside each row, the owner's
opaque part of the check-seed agreement (its certificate and, from the first
owner, the seed wrapped for each owner: `tfe_estimator.owner.check_seed`;
server0 can read none of it); an empty part keeps the previous one. Bounded:
`MAX_FIELDS` values and `MAX_PART_BYTES` per row and the `MAX_MODELS` most
recently written models.

Example::

    table = HandshakeTable(["chief:0", "worker:0"])
    table.put(0, model=7, row=[0, 12, 3, 4, 5])
    rows, models, ages = table.view(model=7)   # rows[1] is None: worker:0 has not called yet
    rows, models, ages, parts = table.view_parts(model=7)
"""
import threading
import time
from typing import Dict, List, Optional, Sequence, Tuple

__all__ = ["HandshakeTable", "MAX_FIELDS", "MAX_MODELS", "MAX_PART_BYTES"]

#: The longest row an owner may store (a model record has a few values per variable).
MAX_FIELDS = 1 << 16
#: How many models' rows the server keeps (the least recently written go first).
MAX_MODELS = 64
#: The largest check-seed part an owner may store (a certificate and a wrapped seed per owner).
MAX_PART_BYTES = 1 << 20


class HandshakeTable:
    """Each owner's handshake rows, per model id (module docstring). Thread-safe.

    Args:
      owners: the configured owners' names, in order.
      clock: the time source (seconds; `time.monotonic`).
    """

    def __init__(self, owners: Sequence[str], clock=time.monotonic):
        self._owners = list(owners)
        self._clock = clock
        self._lock = threading.Lock()
        self._models: Dict[int, Dict[int, List[int]]] = {}  # model -> owner -> row; insertion order = age
        self._parts: Dict[int, Dict[int, bytes]] = {}       # model -> owner -> its check-seed part
        self._latest: Dict[int, int] = {}                  # owner -> model of its latest row
        self._called: Dict[int, float] = {}                # owner -> time of its last call

    def put(self, owner: int, model: int, row: Sequence[int], part: bytes = b"") -> bool:
        """Stores `owner`'s `row` (and check-seed `part`, if not empty) for `model`; returns whether the row or
        the part differs from what it had there.

        Raises:
          ValueError: a row longer than `MAX_FIELDS`, a part longer than `MAX_PART_BYTES` (naming the owner).
        """
        if len(part) > MAX_PART_BYTES:
            raise ValueError(f"{self._owners[owner]}'s check-seed part has {len(part)} bytes, above the server's "
                             f"limit of {MAX_PART_BYTES}: run the same tfe_estimator version on every owner and "
                             "the servers.")
        if len(row) > MAX_FIELDS:
            raise ValueError(f"{self._owners[owner]}'s handshake row has {len(row)} values, above the "
                             f"server's limit of {MAX_FIELDS}: a model record has a few per variable; run "
                             "the same tfe_estimator version on every owner and the servers.")
        row = [int(v) for v in row]
        with self._lock:
            rows = self._models.pop(model, {})
            parts = self._parts.setdefault(model, {})
            changed = rows.get(owner) != row or (bool(part) and parts.get(owner) != bytes(part))
            rows[owner] = row
            if part:
                parts[owner] = bytes(part)
            self._models[model] = rows  # most recently written last
            while len(self._models) > MAX_MODELS:
                oldest = next(iter(self._models))
                del self._models[oldest]
                self._parts.pop(oldest, None)
                self._latest = {o: m for o, m in self._latest.items() if m != oldest}
            self._latest[owner] = model
            self._called[owner] = self._clock()
        return changed

    def view(self, model: int) -> Tuple[List[Optional[List[int]]], List[int], List[Optional[float]]]:
        """``(rows, models, ages)`` per configured owner: its row for `model`, else its latest row for another
        model, else None; the model id of that row (0: none); seconds since its last call (None: never)."""
        return self.view_parts(model)[:3]

    def view_parts(self, model: int):
        """``(rows, models, ages, parts)``: `view`, and each row's check-seed part (b"": none)."""
        now = self._clock()
        rows, models, ages, parts = [], [], [], []
        with self._lock:
            for owner in range(len(self._owners)):
                which = model if owner in self._models.get(model, {}) else self._latest.get(owner)
                row = self._models.get(which, {}).get(owner) if which is not None else None
                rows.append(None if row is None else list(row))
                models.append(0 if row is None else which)
                parts.append(b"" if row is None else self._parts.get(which, {}).get(owner, b""))
                called = self._called.get(owner)
                ages.append(None if called is None else max(0.0, now - called))
        return rows, models, ages, parts
