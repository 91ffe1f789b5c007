"""The TensorFlow versions tfe_estimator supports, and the check that refuses others.

tfe_estimator runs on the last Estimator stack, on the one before it, and (Keras
only) on current TensorFlow:

=====================  ==========  ===================  =======================
stack                  Python      TensorFlow           tensorflow-estimator
=====================  ==========  ===================  =======================
default (``tf215``)    3.11        2.15.1               2.15.0
old (``tf29``)         3.10        2.9.1                2.9.0
Keras 3 (``tf221``)    3.11        2.21.0 (Keras 3)     none: Keras only
=====================  ==========  ===================  =======================

Anything in ``>=2.9,<2.16`` or ``==2.21.*`` is accepted; those three are the
ones CI runs. TensorFlow 2.16 has no Estimator (tensorflow-estimator's last
release is 2.15), so on 2.21 only `TfeStrategy` (Keras, custom training loops)
exists; `require_estimator` refuses the Estimator parts with the fix.
tfe_estimator subclasses private classes of `tf.distribute` (`MirroredExtended`,
`ReductionToOneDevice`) whose behaviour it has read on exactly these versions
(see `tfe_estimator.distribute.strategy`); 2.16 to 2.20 are not read, so not
accepted. The `setup.py` metadata states the same versions.

Example::

    >>> from tfe_estimator import compat
    >>> compat.check_tensorflow_version("2.15.1")
    >>> compat.check_tensorflow_version("2.21.0")
    >>> compat.check_tensorflow_version("2.16.1")
    Traceback (most recent call last):
    ...
    ImportError: tfe_estimator supports TensorFlow >=2.9,<2.16 (Estimator and Keras) or 2.21 (Keras only); ...
"""
import importlib.util
import re
from typing import Optional, Tuple

__all__ = ["SUPPORTED_TENSORFLOW", "KERAS_ONLY_TENSORFLOW", "tensorflow_version", "check_tensorflow_version",
           "has_estimator", "require_estimator", "estimator_spec_mode"]

#: TensorFlow versions with Estimator: ``(lowest, first unsupported)`` as (major, minor).
SUPPORTED_TENSORFLOW = ((2, 9), (2, 16))
#: The (major, minor) of the supported TensorFlow without Estimator (Keras 3; `TfeStrategy` only).
KERAS_ONLY_TENSORFLOW = (2, 21)


def _range_text() -> str:
    (lo_major, lo_minor), (hi_major, hi_minor) = SUPPORTED_TENSORFLOW
    keras_major, keras_minor = KERAS_ONLY_TENSORFLOW
    return (f">={lo_major}.{lo_minor},<{hi_major}.{hi_minor} (Estimator and Keras) "
            f"or {keras_major}.{keras_minor} (Keras only)")


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
    installed = tensorflow_version(version)
    if not (lowest <= installed < first_unsupported or installed == KERAS_ONLY_TENSORFLOW):
        raise ImportError(
            f"tfe_estimator supports TensorFlow {_range_text()}; TensorFlow {version} is "
            "installed. Install a supported stack: `pip install 'tensorflow==2.15.1' "
            "'tensorflow-estimator==2.15.0'` (Python 3.11), `pip install 'tensorflow==2.9.1' "
            "'tensorflow-estimator==2.9.0'` (Python 3.10) or, for Keras only, "
            "`pip install 'tensorflow==2.21.0'` (Python 3.11); see README, 'Versions' "
            "(`make test STACK=tf29` and `make test STACK=tf221` build the others)."
        )


def has_estimator() -> bool:
    """Whether the installed TensorFlow has `tf.estimator` (2.9 to 2.15 with tensorflow-estimator)."""
    import tensorflow as tf  # pylint: disable=import-outside-toplevel

    if tensorflow_version(tf.__version__) >= SUPPORTED_TENSORFLOW[1]:
        return False  # 2.16+: no tf.estimator at all
    # 2.9-2.15: tf.estimator is a lazy loader of tensorflow_estimator, which may not be installed
    return importlib.util.find_spec("tensorflow_estimator") is not None


def require_estimator(what: str) -> None:
    """Refuses an Estimator-only part of tfe_estimator where TensorFlow has no Estimator.

    Args:
      what: the part, as the user named it (e.g. "tfe_estimator.TfeRunConfig").

    Raises:
      ImportError: naming `what`, the installed TensorFlow and the fix.
    """
    if has_estimator():
        return
    import tensorflow as tf  # pylint: disable=import-outside-toplevel

    raise ImportError(
        f"{what} needs TensorFlow Estimator, which TensorFlow {tf.__version__} does not have "
        "(Estimator's last release is 2.15; tensorflow-estimator must be installed). On this TensorFlow "
        "use Keras: `tfe_estimator.TfeStrategy()` with `model.fit` or a custom training loop. For "
        "Estimator install the default stack: `pip install 'tensorflow==2.15.1' "
        "'tensorflow-estimator==2.15.0'` (Python 3.11); see README, 'Versions'."
    )


def estimator_spec_mode(value) -> Optional[str]:
    """The mode of `value` if it is a `tf.estimator.EstimatorSpec` ("train", "eval", "infer"), else None.

    Safe where TensorFlow has no Estimator (then nothing is an EstimatorSpec).
    """
    if not has_estimator():
        return None
    import tensorflow as tf  # pylint: disable=import-outside-toplevel

    return value.mode if isinstance(value, tf.estimator.EstimatorSpec) else None
