"""Fixed-point precisions for secure summation, and their headroom rules.

A secure sum encodes each float as an integer ``round_toward_zero(x * 2**F)`` in
a ring of ``R`` bits (two's complement), shares it, adds shares and decodes
the sum. Summation needs no truncation, so a power-of-two fixed point with
many fraction bits fits better than tf-encrypted's default (base 3, made for
multiplication). The ring's bits are split into::

    1 sign bit + I integer bits + F fraction bits + ceil(log2 N) headroom bits

where N is the number of replicas whose values are added: each replica's
values must have magnitude below ``2**I``, so the sum of N of them stays
below ``2**(I + ceil(log2 N))`` and cannot wrap.

============  ======  =======  ========  ==================  ===============
precision     ring    integer  fraction  largest |value|     resolution
============  ======  =======  ========  ==================  ===============
``"low"``     64      24       32        2**24 = 16,777,216  2**-32 = 2.3e-10
``"high"``    128     30       32        2**30 = 1.07e9      2**-32 = 2.3e-10
============  ======  =======  ========  ==================  ===============

``"low"`` leaves 7 headroom bits (up to 128 replicas). ``"high"`` uses
tf-encrypted's 128-bit ring (its ``int128`` op library): 65 headroom bits,
and 64 times the range of ``"low"``. The encoded value still passes through
int64 on the way in (and float64 on the way out), which bounds ``I + F`` to
62. tf-encrypted's int100 (CRT) backing is not used: in 0.9.1 it decodes
through int32, which would bound ``I + F`` to 31 and make "high" the smaller
range. Example::

    >>> from tfe_estimator.secure.precision import get_precision
    >>> p = get_precision("low")
    >>> p.max_magnitude, p.max_replicas
    (16777216.0, 128)
"""
import dataclasses
import math
from typing import Union

__all__ = ["Precision", "PRECISIONS", "READ_PRECISION", "get_precision"]


@dataclasses.dataclass(frozen=True)
class Precision:
    """One fixed-point setting: ring size and the split of its bits.

    Attributes:
      name: "low" or "high".
      ring_bits: bits of the ring the shares live in (64 or 128).
      integer_bits: I, values must satisfy ``|x| < 2**I``.
      fraction_bits: F, the resolution is ``2**-F``.
    """

    name: str
    ring_bits: int
    integer_bits: int
    fraction_bits: int

    @property
    def max_magnitude(self) -> float:
        """The exclusive bound on the magnitude of one replica's value."""
        return float(2**self.integer_bits)

    @property
    def resolution(self) -> float:
        """The smallest step the encoding represents (``2**-F``)."""
        return 2.0**-self.fraction_bits

    @property
    def headroom_bits(self) -> int:
        """Ring bits left for the growth of a sum of replicas."""
        return self.ring_bits - 1 - self.integer_bits - self.fraction_bits

    @property
    def max_replicas(self) -> int:
        """How many replicas can be summed without any risk of wrapping."""
        return 2**self.headroom_bits

    def check_headroom(self, num_replicas: int) -> None:
        """Refuses a replica count whose sum could wrap around the ring.

        Args:
          num_replicas: how many values are summed.

        Raises:
          ValueError: if ``1 + I + F + ceil(log2 num_replicas) > ring_bits``.
        """
        need = 1 + self.integer_bits + self.fraction_bits + math.ceil(math.log2(max(num_replicas, 1)))
        if need > self.ring_bits:
            raise ValueError(
                f"precision={self.name!r} cannot sum {num_replicas} replicas: the "
                f"{self.ring_bits}-bit ring holds 1 sign + {self.integer_bits} integer + "
                f"{self.fraction_bits} fraction bits + {self.headroom_bits} headroom bits, "
                f"enough for at most {self.max_replicas} replicas. Use fewer replicas"
                + (" or precision='high'." if self.name == "low" else ".")
            )

    def fixedpoint_config(self):
        """The matching `tf_encrypted.tensor.fixed.FixedpointConfig`.

        Imports tf-encrypted: call only after local devices are set up.
        """
        from tf_encrypted.tensor.fixed import FixedpointConfig  # pylint: disable=import-outside-toplevel

        return FixedpointConfig(
            scaling_base=2,
            nbits=self.ring_bits,
            # tf-encrypted uses precision_integral only for Pond's decoding
            # shift `(x + 2**(I+F)).to_native() - 2**(I+F)`. On the 128-bit
            # ring to_native is float64, where adding 2**62 would erase the
            # low bits of small sums; a zero integral part keeps the shift at
            # 2**F, which is exact. Our range checks use `integer_bits`.
            precision_integral=0,
            precision_fractional=self.fraction_bits,
            matmul_threshold=1,  # secure aggregation never multiplies
            truncation_gap=0,  # nor truncates
            use_noninteractive_truncation=False,
        )


PRECISIONS = {
    "low": Precision(name="low", ring_bits=64, integer_bits=24, fraction_bits=32),
    "high": Precision(name="high", ring_bits=128, integer_bits=30, fraction_bits=32),
}

#: The encoding of values a model reports (the loss, metric values: reductions
#: to one device, never applied as updates) on the fused kernels, whatever the
#: precision: the 128-bit ring with 80 integer bits, so an unscaled regression
#: loss (1e11 and far beyond) sums exactly where float32 training can report it.
READ_PRECISION = Precision(name="read", ring_bits=128, integer_bits=80, fraction_bits=32)


def get_precision(precision: Union[str, Precision]) -> Precision:
    """Looks up a precision by name.

    Args:
      precision: "low", "high", or a `Precision`.

    Returns:
      The `Precision`.

    Raises:
      ValueError: for an unknown name.
    """
    if isinstance(precision, Precision):
        return precision
    if precision not in PRECISIONS:
        raise ValueError(
            f"Unknown precision {precision!r}: use one of {sorted(PRECISIONS)} "
            "('low': 64-bit ring, |values| < 2**24; 'high': 128-bit ring, |values| < 2**30)."
        )
    return PRECISIONS[precision]
