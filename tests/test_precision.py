"""Fixed-point precisions and the headroom rule."""
import pytest

from tfe_estimator.secure.precision import PRECISIONS, get_precision


@pytest.mark.parametrize("name", ["low", "high"])
def test_bits_add_up_to_the_ring(name):
    p = PRECISIONS[name]
    assert 1 + p.integer_bits + p.fraction_bits + p.headroom_bits == p.ring_bits
    assert p.max_magnitude == 2.0**p.integer_bits and p.resolution == 2.0**-p.fraction_bits
    # The encoded value passes through int64 on its way into the ring.
    assert p.integer_bits + p.fraction_bits <= 62


def test_low_precision_is_the_documented_split():
    p = get_precision("low")
    assert (p.ring_bits, p.integer_bits, p.fraction_bits, p.max_replicas) == (64, 24, 32, 128)


def test_headroom_accepts_up_to_the_limit_and_refuses_beyond():
    p = get_precision("low")
    p.check_headroom(1)
    p.check_headroom(128)
    with pytest.raises(ValueError, match="cannot sum 129 replicas.*at most 128 replicas.*precision='high'"):
        p.check_headroom(129)


def test_unknown_precision_is_refused():
    with pytest.raises(ValueError, match="Unknown precision 'medium'"):
        get_precision("medium")
