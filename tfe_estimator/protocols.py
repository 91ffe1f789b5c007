"""The tf-encrypted protocols secure aggregation can run, and their party counts.

============  =======  ================================  =====================
protocol      servers  sharing                           collusion tolerated
============  =======  ================================  =====================
``"pond"``    2 (+1)   additive 2-out-of-2 (a seed + a   none: server0 and
                       masked share per replica)         server1 must not collude
``"aby3"``    3        replicated 2-out-of-3             any 1 of the 3 servers
============  =======  ================================  =====================

Pond's third party is its crypto producer; a sum never asks it for anything,
but it is still a `tfe` task so that one cluster layout serves both protocols.

Example::

    >>> validate_protocol("pond")
    'pond'
    >>> PROTOCOLS["aby3"]
    3
"""

__all__ = ["PROTOCOLS", "validate_protocol"]

#: Protocol name -> number of `tfe` tasks (parties) it needs.
PROTOCOLS = {"pond": 3, "aby3": 3}


def validate_protocol(protocol: str) -> str:
    """Returns `protocol` if it is a known protocol name.

    Raises:
      ValueError: naming the value and the known protocols.
    """
    if protocol not in PROTOCOLS:
        raise ValueError(
            f"Unknown protocol {protocol!r}: use one of {sorted(PROTOCOLS)} "
            "('pond': 2 servers and a crypto producer; 'aby3': 3 servers, honest majority)."
        )
    return protocol
