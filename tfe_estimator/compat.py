"""The TensorFlow versions tfe_estimator supports, and the check that refuses others.

tfe_estimator runs on the last Estimator stack and on the one before it:

=====================  ==========  ===================  =======================
stack                  Python      TensorFlow           tensorflow-estimator
=====================  ==========  ===================  =======================
default (``tf215``)    3.11        2.15.1               2.15.0
old (``tf29``)         3.10        2.9.1                2.9.0
=====================  ==========  ===================  =======================

Anything in ``>=2.9,<2.16`` is accepted; those two are the ones CI runs.
TensorFlow 2.16 has no Estimator (tensorflow-estimator's last release is
2.15), and tfe_estimator subclasses private classes of
`tf.distribute` (`MirroredExtended`, `ReductionToOneDevice`) whose behaviour
it has read on exactly this range (see `tfe_estimator.distribute.strategy`). The
`setup.py` metadata states the same range.

Example::

    >>> from tfe_estimator import compat
    >>> compat.check_tensorflow_version("2.15.1")
    >>> compat.check_tensorflow_version("2.16.1")
    Traceback (most recent call last):
    ...
    ImportError: tfe_estimator supports TensorFlow >=2.9,<2.16; TensorFlow 2.16.1 is installed...
"""
import re
from typing import Optional, Tuple

__all__ = ["SUPPORTED_TENSORFLOW", "tensorflow_version", "check_tensorflow_version"]

#: Supported TensorFlow versions: ``(lowest, first unsupported)`` as (major, minor).
SUPPORTED_TENSORFLOW = ((2, 9), (2, 16))


def _range_text() -> str:
    (lo_major, lo_minor), (hi_major, hi_minor) = SUPPORTED_TENSORFLOW
    return f">={lo_major}.{lo_minor},<{hi_major}.{hi_minor}"


def tensorflow_version(version: Optional[str] = None) -> Tuple[int, int]:
    """``(major, minor)`` of `version`, default the installed `tf.__version__`.

    Raises:
      ValueError: if `version` does not start with ``<major>.<minor>``.
    """
    if version is None:
        import tensorflow as tf  # pylint: disable=import-outside-toplevel

        version = tf.__version__
    match = re.match(r"(\d+)\.(\d+)", version)
    if not match:
        raise ValueError(f"Cannot read a TensorFlow version from {version!r}.")
    return int(match.group(1)), int(match.group(2))


def check_tensorflow_version(version: Optional[str] = None) -> None:
    """Refuses a TensorFlow outside `SUPPORTED_TENSORFLOW`.

    Args:
      version: a version string; default the installed `tf.__version__`.

    Raises:
      ImportError: naming the installed version, the supported range and the fix.
    """
    if version is None:
        import tensorflow as tf  # pylint: disable=import-outside-toplevel

        version = tf.__version__
    lowest, first_unsupported = SUPPORTED_TENSORFLOW
    if not lowest <= tensorflow_version(version) < first_unsupported:
        raise ImportError(
            f"tfe_estimator supports TensorFlow {_range_text()}; TensorFlow {version} is "
            "installed. Install a supported stack: `pip install 'tensorflow==2.15.1' "
            "'tensorflow-estimator==2.15.0'` (Python 3.11) or `pip install 'tensorflow==2.9.1' "
            "'tensorflow-estimator==2.9.0'` (Python 3.10); see README, 'Versions' "
            "(`make test STACK=tf29` builds the second)."
        )
