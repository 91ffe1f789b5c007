"""A readable terminal: TensorFlow's INFO lines and deprecation warnings hidden unless asked.

A cluster task prints, beside its own lines, TensorFlow's C++ INFO lines (e.g.
one ``replicate_on_split`` line per dataset, ``Local rendezvous recv item
cancelled``) and, per deprecated Estimator call site, a Python deprecation
block. `tfe-estimator launch` hides both from every task it starts
(`task_env`: ``TF_CPP_MIN_LOG_LEVEL=1``, TensorFlow's warnings and errors
stay), ``tfe-estimator server`` does likewise for itself, and `TfeRunConfig`
on a cluster turns the deprecation blocks and tf.data's serialization
``UserWarning`` off (`hide_deprecation_warnings`), so an owner run by hand is
as quiet, but for what TensorFlow prints at import, before any of our code
runs: its C++ INFO lines (``TF_CPP_MIN_LOG_LEVEL=1`` in the owner's
environment drops them) and, on TensorFlow 2.15 without a GPU, three
``E ... Unable to register cuDNN/cuFFT/cuBLAS factory`` lines (harmless; the
launcher drops them). ``--tf-warnings`` (the launcher and the server) or
``TFE_ESTIMATOR_TF_WARNINGS=1`` keeps everything; a ``TF_CPP_MIN_LOG_LEVEL``
the user set is never changed.

Example::

    env = task_env(dict(os.environ), tf_warnings=False)  # TF_CPP_MIN_LOG_LEVEL=1 unless set
    subprocess.Popen(argv, env=env)
"""
import os
import warnings
from typing import Dict, Mapping, Optional

__all__ = ["TF_WARNINGS_ENV", "QUIET_LOG_LEVEL", "TF_DATA_OPTIONS_WARNING", "wants_tf_warnings", "task_env",
           "quiet_this_process", "hide_deprecation_warnings"]

#: Set to 1 to keep TensorFlow's INFO lines and deprecation warnings (what ``--tf-warnings`` exports).
TF_WARNINGS_ENV = "TFE_ESTIMATOR_TF_WARNINGS"
#: TensorFlow's C++ log level for a quiet task: 1 drops INFO, keeps warnings and errors.
QUIET_LOG_LEVEL = "1"
#: tf.data's warning at every `Dataset` an Estimator input_fn builds in graph mode (TF 2.15): says nothing to a user.
TF_DATA_OPTIONS_WARNING = "To make it possible to preserve tf.data options"


def wants_tf_warnings(environ: Optional[Mapping[str, str]] = None) -> bool:
    """Whether the user asked for TensorFlow's own noise (``TFE_ESTIMATOR_TF_WARNINGS=1``)."""
    environ = os.environ if environ is None else environ
    return environ.get(TF_WARNINGS_ENV, "").strip().lower() in ("1", "true", "yes")


def task_env(env: Dict[str, str], tf_warnings: bool) -> Dict[str, str]:
    """`env` for a task process: quiet unless `tf_warnings` (then it says so to the task); returns `env`."""
    if tf_warnings:
        env[TF_WARNINGS_ENV] = "1"
    elif not wants_tf_warnings(env):
        env.setdefault("TF_CPP_MIN_LOG_LEVEL", QUIET_LOG_LEVEL)
    return env


def quiet_this_process(tf_warnings: bool = False) -> None:
    """Before TensorFlow is imported in this process: its C++ INFO lines off unless asked or set."""
    if tf_warnings:
        os.environ[TF_WARNINGS_ENV] = "1"
    task_env(os.environ, tf_warnings)  # type: ignore[arg-type]


def hide_deprecation_warnings() -> None:
    """TensorFlow's Python deprecation blocks and tf.data's options warning off in this process, unless
    ``TFE_ESTIMATOR_TF_WARNINGS=1``."""
    if wants_tf_warnings():
        return
    warnings.filterwarnings("ignore", message=TF_DATA_OPTIONS_WARNING, category=UserWarning)
    from tensorflow.python.util import deprecation  # pylint: disable=import-outside-toplevel

    deprecation._PRINT_DEPRECATION_WARNINGS = False  # pylint: disable=protected-access
