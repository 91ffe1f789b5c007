"""The masks on every value a TFE party touches: linear forms over the partition graphs.

The secure sum is linear in the ring: every value a party receives or
computes is a sum of owners' data and of AES-CTR masks, each mask the
keystream of one 128-bit seed, with coefficients +1 or -1 (and masks cancel:
``share_r = x_r - AES(s_r)`` plus ``AES(s_r)`` is ``x_r``). `Forms` evaluates,
for any tensor of a run's partition graphs, that linear form::

    Form(data={owner values it depends on}, masks={seed id: coefficient != 0})

and tells which seeds a party holds (drawn on it, or received from anyone).
A party can read owner data from a value exactly when the value has data and
the party holds the seed of every mask left on it.

What counts as a mask (anything else from an owner's device is data):

=====================================  =========================================
producer                               form
=====================================  =========================================
``TfeMaskShare:0`` (replica)           its values minus the mask of its seed ``:1``
``TfeAesSeededRandomUniform``,         + the mask of its seed, only with the
``I128SecureSeededRandomUniform``      full ring as [minval, maxval] (a "mask"
                                       of range [0, 1) is zero)
``TfeServerSum:0``                     + the masks of its seeds + its shares
                                       (- the mask of its own blind key ``:1``)
``Add``, ``AddV2``, ``AddN``,          sums and differences of forms
``Sub``, ``Neg``, ``I128Add``,
``I128Sub``
integer ``Const`` on a party           public (no data, no mask)
=====================================  =========================================

A seed is the output of ``TfeAesSeed``, ``TfeMaskShare:1`` or
``TfeServerSum:1``: a key drawn fresh by the op (``RAND_bytes``) on the
device it runs on. Anything else in a seed's place (a constant, a value
computed on a party) is refused: a mask whose key is known is no mask.

Example::

    forms = Forms(graphs, parties)
    form = forms.of(device, node, 0)
    if form.data and set(form.masks) <= forms.held(party):
        ...  # the party can unmask it
"""
import collections
import dataclasses
from typing import Callable, Dict, FrozenSet, Optional, Sequence, Set, Tuple

import numpy as np
import tensorflow as tf

__all__ = ["Form", "Forms", "MaskError", "MASK_STREAMS", "LINEAR_OPS", "SEED_OUTPUTS"]

MASK_STREAMS = frozenset({"TfeAesSeededRandomUniform", "I128SecureSeededRandomUniform"})
#: op type -> how its output combines its inputs' forms (coefficients per input; None: all +1).
LINEAR_OPS: Dict[str, Optional[Tuple[int, ...]]] = {
    "Add": (1, 1), "AddV2": (1, 1), "I128Add": (1, 1), "AddN": None,
    "Sub": (1, -1), "I128Sub": (1, -1), "Neg": (-1,),
}
#: (op type, output index) of ops whose output is a fresh 128-bit key.
SEED_OUTPUTS = frozenset({("TfeAesSeed", 0), ("TfeMaskShare", 1), ("TfeServerSum", 1)})
_INT128_MIN = (0, -2**63)  # (low word, high word) of I128SecureSeededRandomUniform's bounds
_INT128_MAX = (-1, 2**63 - 1)


class MaskError(ValueError):
    """A value that poses as a mask is not one (names the op and why)."""


@dataclasses.dataclass(frozen=True)
class Form:
    """A tensor as owners' data plus signed masks (seed id -> nonzero coefficient)."""

    data: FrozenSet[Tuple] = frozenset()
    masks: Tuple[Tuple[Tuple, int], ...] = ()

    @staticmethod
    def combine(terms) -> "Form":
        """The sum of ``coefficient * form`` over `terms`; cancelled masks drop out."""
        data: Set[Tuple] = set()
        masks: Dict[Tuple, int] = collections.defaultdict(int)
        for coefficient, form in terms:
            data |= form.data
            for seed, c in form.masks:
                masks[seed] += coefficient * c
        return Form(frozenset(data), tuple(sorted((s, c) for s, c in masks.items() if c)))

    @property
    def mask_seeds(self) -> FrozenSet[Tuple]:
        return frozenset(seed for seed, _ in self.masks)


def _const_value(node):
    return tf.make_ndarray(node.attr["value"].tensor)


class Forms:
    """Linear forms of the tensors of one run's partition graphs.

    Args:
      resolve: ``resolve(device, input name) -> (device, NodeDef, output index)``
        through receives and identities (`party_audit`'s graph index).
      party_of: device -> the party's unit, or None for an owner's device.
    """

    def __init__(self, resolve: Callable, party_of: Callable[[str], Optional[str]]):
        self._resolve = resolve
        self._party_of = party_of
        self._memo: Dict[Tuple, Form] = {}

    def seed_id(self, device: str, node, index: int) -> Tuple:
        """The id of the key `node:index` on `device`; raises `MaskError` if it is not a fresh key."""
        if (node.op, index) not in SEED_OUTPUTS:
            raise MaskError(f"{node.op} {node.name!r} on {device} stands where a fresh key must be: its mask is "
                            "not secret (only TfeAesSeed, TfeMaskShare:1 and TfeServerSum:1 draw keys)")
        return (device, node.name, index)

    def seed_of_input(self, device: str, name: str) -> Tuple:
        seed_device, seed, index = self._resolve(device, name)
        if seed.op in MASK_STREAMS:  # tf-encrypted's 128-bit ring: a key derived from our seed's stream
            self._check_full_ring(seed_device, seed)
            return self.seed_of_input(seed_device, seed.input[1])
        return self.seed_id(seed_device, seed, index)

    def _check_full_ring(self, device: str, node) -> None:
        bounds = []
        for name in node.input[2:4]:
            _, const, _ = self._resolve(device, name)
            if const.op != "Const":
                raise MaskError(f"{node.op} {node.name!r} on {device} draws a mask between bounds that are not "
                                f"constants ({const.op} {const.name!r}): its range cannot be checked")
            bounds.append(_const_value(const))
        low, high = bounds
        dtype = tf.as_dtype(node.attr["dtype"].type) if "dtype" in node.attr else None
        if node.op == "I128SecureSeededRandomUniform":
            full = tuple(np.ravel(low).tolist()) == _INT128_MIN and tuple(np.ravel(high).tolist()) == _INT128_MAX
        else:
            full = dtype is not None and int(low) == dtype.min and int(high) == dtype.max
        if not full:
            raise MaskError(f"{node.op} {node.name!r} on {device} draws a mask in [{np.ravel(low).tolist()}, "
                            f"{np.ravel(high).tolist()}), not the full ring: it does not hide the value it masks")

    def of(self, device: str, node, index: int) -> Form:
        """The form of output `index` of `node` on `device` (memoised)."""
        key = (device, node.name, index)
        if key not in self._memo:
            self._memo[key] = self._evaluate(device, node, index)
        return self._memo[key]

    def of_input(self, device: str, name: str) -> Form:
        return self.of(*self._resolve(device, name))

    def _evaluate(self, device: str, node, index: int) -> Form:
        on_party = self._party_of(device) is not None
        if node.op == "TfeMaskShare" and index == 0:
            return Form(frozenset({(device, node.name, 0)}), ((self.seed_id(device, node, 1), -1),))
        if node.op in MASK_STREAMS:
            self._check_full_ring(device, node)
            return Form(masks=((self.seed_of_input(device, node.input[1]), 1),))
        if node.op == "TfeServerSum" and index == 0:
            seeds = node.attr["num_seeds"].i
            shares = node.attr["num_shares"].i
            terms = [(1, Form(masks=((self.seed_of_input(device, name), 1),))) for name in node.input[:seeds]]
            terms += [(1, self.of_input(device, name)) for name in node.input[seeds:seeds + shares]]
            if node.attr["num_blind"].i:
                terms.append((-1, Form(masks=((self.seed_id(device, node, 1), 1),))))
            return Form.combine(terms)
        if node.op in LINEAR_OPS:
            inputs = [name for name in node.input if not name.startswith("^")]
            coefficients = LINEAR_OPS[node.op] or (1,) * len(inputs)
            return Form.combine((c, self.of_input(device, name)) for c, name in zip(coefficients, inputs))
        if on_party and node.op == "Const" and tf.as_dtype(node.attr["dtype"].type).is_integer:
            return Form()
        # Anything else from an owner is the owner's data (an encoding, a cast, a feed...).
        return Form(data=frozenset({(device, node.name, index)}))

    def held(self, party: str, seeds_received: Sequence[Tuple], nodes) -> FrozenSet[Tuple]:
        """The seeds `party` holds: `seeds_received` plus the keys its own ops draw (`nodes`: (device, NodeDef))."""
        own = {self.seed_id(device, node, index) for device, node in nodes
               for op, index in SEED_OUTPUTS if node.op == op and self._party_of(device) == party}
        return frozenset(own | set(seeds_received))
