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

Not every protocol and precision runs on every TensorFlow: the 128-bit ring
(``precision="high"``) is tf-encrypted's ``int128`` tensor, backed by its
compiled ``tf_i128`` op library, which tf-encrypted 0.9.1 ships for
TensorFlow 2.9.1 only. Pond's 128-bit sum runs on tfe_estimator's own kernels;
ABY3's would need tf-encrypted's, which tfe_estimator does not provide.
`check_supported` refuses such a combination when a `SecureAggregation`,
`TfeStrategy` or `TfeRunConfig` is built, naming what works instead.

=========  ===========  ===================  ==========================
protocol   precision    TensorFlow 2.9.1     TensorFlow 2.10 - 2.15
=========  ===========  ===================  ==========================
pond       low          yes                  yes
aby3       low          yes                  yes
pond       high         yes                  yes (tfe_estimator's kernels)
aby3       high         yes                  no: needs tf-encrypted int128
=========  ===========  ===================  ==========================

Example::

    >>> validate_protocol("pond")
    'pond'
    >>> PROTOCOLS["aby3"]
    3
"""

import importlib.util
import os
from typing import Optional

__all__ = ["PROTOCOLS", "NEEDS_TFE_INT128", "validate_protocol", "check_supported",
           "supported_combinations", "load_backend"]

#: Protocol name -> number of `tfe` tasks (parties) it needs.
PROTOCOLS = {"pond": 3, "aby3": 3}

#: (protocol, precision) pairs whose secure sum runs on tf-encrypted's int128
#: ring, i.e. needs its compiled `tf_i128` op library. Pond's 128-bit sum runs
#: on tfe_estimator's own fused kernels (`tfe_estimator.secure.kernels`) instead.
NEEDS_TFE_INT128 = frozenset({("aby3", "high")})

# tf-encrypted 0.9.1 loads each op library from this path inside its package
# (operations/tf_i128/tf_i128.py); it exists for the TensorFlow it was built for.
_TFE_I128_LIBRARY = os.path.join("operations", "tf_i128", "tf_i128_module_tf_{version}.so")


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


def _tfe_int128_available(tf_version: Optional[str] = None) -> bool:
    """Whether tf-encrypted's int128 op library exists for this TensorFlow (no import)."""
    if tf_version is None:
        import tensorflow as tf  # pylint: disable=import-outside-toplevel

        tf_version = tf.__version__
    spec = importlib.util.find_spec("tf_encrypted")
    if spec is None or not spec.submodule_search_locations:
        return False
    package_dir = list(spec.submodule_search_locations)[0]
    return os.path.exists(os.path.join(package_dir, _TFE_I128_LIBRARY.format(version=tf_version)))


def supported_combinations(tf_version: Optional[str] = None):
    """The (protocol, precision) pairs this installation can run, sorted."""
    from tfe_estimator.secure.precision import PRECISIONS  # pylint: disable=import-outside-toplevel

    int128 = _tfe_int128_available(tf_version)
    return sorted((p, q) for p in PROTOCOLS for q in PRECISIONS
                  if int128 or (p, q) not in NEEDS_TFE_INT128)


def check_supported(protocol: str, precision: str, tf_version: Optional[str] = None) -> None:
    """Refuses a protocol/precision pair that needs ops this installation lacks.

    Cheap (no tf-encrypted import): call it in constructors.

    Args:
      protocol: a name from `PROTOCOLS`.
      precision: a precision name ("low", "high") or a `Precision`.
      tf_version: the TensorFlow version to judge; default the installed one.

    Raises:
      NotImplementedError: naming the combination, the TensorFlow version, why,
        and the combinations that work instead.

    Example::

        check_supported("aby3", "low")   # fine everywhere
        check_supported("aby3", "high")  # NotImplementedError on TensorFlow 2.15
    """
    precision = getattr(precision, "name", precision)
    if (protocol, precision) not in NEEDS_TFE_INT128 or _tfe_int128_available(tf_version):
        return
    if tf_version is None:
        import tensorflow as tf  # pylint: disable=import-outside-toplevel

        tf_version = tf.__version__
    works = ", ".join(f"protocol={p!r} with precision={q!r}" for p, q in supported_combinations(tf_version))
    raise NotImplementedError(
        f"protocol={protocol!r} with precision={precision!r} is not available on TensorFlow "
        f"{tf_version}: its 128-bit ring is tf-encrypted's int128 tensor, whose compiled op "
        f"library (tf_i128_module_tf_<version>.so) tf-encrypted 0.9.1 ships for TensorFlow 2.9.1 "
        f"only, and tfe_estimator does not provide it. What works here: {works}. Or run the "
        "TensorFlow 2.9 stack (Python 3.10, `make test STACK=tf29`; README, 'Versions')."
    )


def load_backend(require_secure_randomness: bool = True):
    """Imports `tfe_estimator.secure.tfe_backend` (and so tf-encrypted) safely; returns it.

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

    if "tfe_estimator.secure.tfe_backend" not in sys.modules:
        with tf.Graph().as_default():
            import tfe_estimator.secure.tfe_backend  # noqa: F401 (imported for its effect: it loads tf-encrypted)
    backend = sys.modules["tfe_estimator.secure.tfe_backend"]
    backend.install_secure_random()
    if require_secure_randomness:
        backend.require_secure_randomness()
    return backend
