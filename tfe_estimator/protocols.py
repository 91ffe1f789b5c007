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

__all__ = ["PROTOCOLS", "validate_protocol", "load_backend"]

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


def load_backend(require_secure_randomness: bool = True):
    """Imports `tfe_estimator.tfe_backend` (and so tf-encrypted) safely; returns it.

    Importing tf_encrypted builds a default ABY3 protocol whose ops land in
    whatever graph is the default at that moment (an Estimator's training
    graph, with devices that do not exist on a cluster), so the first import
    happens inside a throwaway graph. It also registers tf-encrypted's ops,
    which a task must do before its TensorFlow server starts.

    Raises:
      InsecureRandomnessError: if `require_secure_randomness` and
        tf-encrypted's secure random op library did not load.
    """
    import sys  # pylint: disable=import-outside-toplevel

    import tensorflow as tf  # pylint: disable=import-outside-toplevel

    if "tfe_estimator.tfe_backend" not in sys.modules:
        with tf.Graph().as_default():
            import tfe_estimator.tfe_backend  # pylint: disable=import-outside-toplevel,unused-import
    backend = sys.modules["tfe_estimator.tfe_backend"]
    if require_secure_randomness:
        backend.require_secure_randomness()
    return backend
