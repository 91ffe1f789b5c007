"""How many replicas wrote a checkpoint, and a clear error when more now want to restore it.

Under `MirroredStrategy` in graph mode, Keras' (legacy) optimizers keep some
slot variables once per replica: Ftrl's and Adagrad's accumulators are saved as
``.../accumulator``, ``.../accumulator/replica_1``, ... (canned `LinearRegressor`
and `DNNRegressor` use them by default). Training again in the same
``model_dir`` with more replicas then fails deep in the restore with
``NotFoundError: Key training/Ftrl/.../accumulator/replica_2 not found in
checkpoint``, which never says "replicas". `check_checkpoint_replicas` reads the
checkpoint's variable names (no graph, no session) and refuses up front.

`TfeRunConfig` runs it when it is given a ``model_dir`` (in its constructor or
`replace`). Estimator's own ``model_dir`` argument bypasses it (Estimator
calls the base class's `RunConfig.replace`), so pass ``model_dir`` to the
`TfeRunConfig`.

Example::

    check_checkpoint_replicas("/tmp/model", num_replicas=3)
    # ValueError: model_dir='/tmp/model' holds a checkpoint written by 2 replicas ...
"""
import re
from typing import Optional

__all__ = ["checkpoint_replicas", "check_checkpoint_replicas"]

_REPLICA_SUFFIX = re.compile(r"/replica_(\d+)$")


def checkpoint_replicas(model_dir: Optional[str]) -> Optional[int]:
    """The number of replicas that wrote the newest checkpoint in `model_dir`.

    Returns:
      None when there is no checkpoint or it keeps nothing per replica (then
      any number of replicas can restore it).
    """
    if not model_dir:
        return None
    import tensorflow as tf  # pylint: disable=import-outside-toplevel

    try:
        path = tf.train.latest_checkpoint(model_dir)
        if not path:
            return None
        names = [name for name, _ in tf.train.list_variables(path)]
    except (tf.errors.OpError, ValueError):  # unreadable: leave it to Estimator's own error
        return None
    indices = [int(m.group(1)) for m in map(_REPLICA_SUFFIX.search, names) if m]
    return max(indices) + 1 if indices else None


def check_checkpoint_replicas(model_dir: Optional[str], num_replicas: int, source: str = "num_replicas") -> None:
    """Refuses to train `num_replicas` replicas from a checkpoint that fewer replicas wrote.

    Raises:
      ValueError: naming the model_dir, both replica counts, a per-replica variable and the fixes.
    """
    saved = checkpoint_replicas(model_dir)
    if saved is None or num_replicas <= saved:
        return
    raise ValueError(
        f"model_dir={model_dir!r} holds a checkpoint written by {saved} replicas, but this TfeRunConfig "
        f"trains {num_replicas} replicas ({source}). The optimizer keeps some slot variables once per "
        f"replica (e.g. '.../accumulator/replica_{saved - 1}'), so the checkpoint has none for replica "
        f"{saved} and restoring it would fail with 'Key ... /replica_{saved} not found in checkpoint'. "
        f"Train with {saved} replicas in this model_dir, or start a new model_dir (to continue from these "
        "weights with more replicas, warm-start: tf.estimator.WarmStartSettings(ckpt_to_initialize_from="
        "the old model_dir, vars_to_warm_start='.*weights|.*bias.*'))."
    )
