"""Validation of a model_fn's `params` and the optimizer they name.

Every model_fn in this package calls `validate_params` first, so a misspelt
or missing key fails at graph-build time with a message naming the key, the
allowed keys and the fix, and `make_optimizer` inside the model_fn, so each
graph (and, under a distribution strategy, each replica's call) gets its own
Keras optimizer.

Example::

    params = validate_params("logistic_regression", {"feature_columns": cols},
                             defaults={"learning_rate": 0.05, "optimizer": "adam"})
    optimizer = make_optimizer(params)
"""
import collections.abc
from typing import Any, Callable, Dict, Mapping, Optional, Sequence, Union

import tensorflow as tf

from tfe_estimator.validation import check_int, is_int, is_number
__all__ = ["OPTIMIZERS", "OptimizerSpec", "keras_optimizers", "validate_params", "make_optimizer"]


def keras_optimizers():
    """The namespace of the Keras optimizers Estimator trains with on this TensorFlow.

    TensorFlow >= 2.11: `tf.keras.optimizers.legacy`; Estimator's canned models
    and heads refuse the new optimizers ("Please set your optimizer as an
    instance of `tf.keras.optimizers.legacy.Optimizer`"). TensorFlow 2.9 and
    2.10: `tf.keras.optimizers`, whose optimizers are those same (V2) ones.

    Example::

        est = tf.estimator.LinearRegressor(
            feature_columns=cols, optimizer=lambda: model_fns.keras_optimizers().SGD(0.05))
    """
    major, minor = (int(p) for p in tf.__version__.split(".")[:2])
    return tf.keras.optimizers.legacy if (major, minor) >= (2, 11) else tf.keras.optimizers


_KERAS = keras_optimizers()

OPTIMIZERS = {
    "adagrad": _KERAS.Adagrad,
    "adam": _KERAS.Adam,
    "ftrl": _KERAS.Ftrl,
    "rmsprop": _KERAS.RMSprop,
    "sgd": _KERAS.SGD,
}

OptimizerSpec = Union[str, _KERAS.Optimizer, Callable[[], _KERAS.Optimizer]]


def _is_new_keras_optimizer(value) -> bool:
    """A TF >= 2.11 Keras optimizer that Estimator refuses (not a legacy one)."""
    return _KERAS is not tf.keras.optimizers and isinstance(value, tf.keras.optimizers.Optimizer)


def _legacy_hint(value) -> str:
    return (f"Estimator on TensorFlow {tf.__version__} needs a tf.keras.optimizers.legacy optimizer; "
            f"use tf.keras.optimizers.legacy.{type(value).__name__} (or model_fns.keras_optimizers()."
            f"{type(value).__name__}) instead of tf.keras.optimizers.{type(value).__name__}.")


def validate_params(
    model: str,
    params: Optional[Mapping[str, Any]],
    defaults: Mapping[str, Any],
    required: Sequence[str] = ("feature_columns",),
) -> Dict[str, Any]:
    """Returns `params` merged over `defaults`, after checking keys and values.

    Args:
      model: the model_fn's module name, used in messages.
      params: the `params` the Estimator passes to the model_fn.
      defaults: the optional keys and their default values.
      required: the keys without a default.

    Raises:
      ValueError: for an unknown or missing key or a bad value.
      TypeError: for a value of the wrong type.
    """
    params = dict(params or {})
    allowed = sorted(set(required) | set(defaults))
    where = f"model_fns.{model}.model_fn"
    for key in params:
        if key not in allowed:
            raise ValueError(
                f"{where}: unknown params key {key!r}. Allowed keys: {allowed}. "
                f"Fix: remove or rename it in tf.estimator.Estimator(params=...)."
            )
    for key in required:
        if params.get(key) is None:
            raise ValueError(
                f"{where}: params key {key!r} is required but missing. Allowed keys: {allowed}. "
                f"Fix: pass tf.estimator.Estimator(model_fn, params={{{key!r}: ..., ...}})."
            )
    if "optimizer" in defaults and "learning_rate" in params and not isinstance(
        params.get("optimizer", defaults["optimizer"]), str
    ):
        raise ValueError(
            f"{where}: params key 'learning_rate' applies only when 'optimizer' is a name "
            f"({sorted(OPTIMIZERS)}); got optimizer={params['optimizer']!r}. "
            "Fix: set the learning rate on the optimizer you pass, and drop 'learning_rate'."
        )
    merged = {**defaults, **params}
    for key, value in merged.items():
        _CHECKS.get(key, lambda *_: None)(where, key, value)
    return merged


def make_optimizer(params: Mapping[str, Any]) -> "_KERAS.Optimizer":
    """Returns a new Keras optimizer for `params["optimizer"]`.

    A name builds that optimizer with `params["learning_rate"]`; an instance is
    copied through its config (a Keras optimizer must not be shared between
    graphs, and Estimator builds a new graph for every `train` call); a
    callable is called. The optimizer's `iterations` is the global step, so
    Estimator's step counting and hooks work.
    """
    spec = params["optimizer"]
    if isinstance(spec, str):
        optimizer = OPTIMIZERS[spec.lower()](learning_rate=params["learning_rate"])
    elif isinstance(spec, _KERAS.Optimizer):
        optimizer = spec.__class__.from_config(spec.get_config())
    else:
        optimizer = spec()
        if _is_new_keras_optimizer(optimizer):
            raise TypeError(f"params['optimizer'] is a callable that returned {type(optimizer).__name__}: "
                            + _legacy_hint(optimizer))
        if not isinstance(optimizer, _KERAS.Optimizer):
            raise TypeError(
                "params['optimizer'] is a callable that returned "
                f"{type(optimizer).__name__}; it must return a Keras optimizer "
                "(e.g. lambda: model_fns.keras_optimizers().Adam(0.01))."
            )
    optimizer.iterations = tf.compat.v1.train.get_or_create_global_step()
    return optimizer


def _check_feature_columns(where, key, value):
    if isinstance(value, (str, bytes)) or not isinstance(value, collections.abc.Iterable) or not list(value):
        raise ValueError(
            f"{where}: params[{key!r}] must be a non-empty list of feature columns "
            f"(e.g. [tf.feature_column.numeric_column('x', shape=(4,))]); got {value!r}."
        )


def _check_learning_rate(where, key, value):
    if not is_number(value) or not value > 0:
        raise ValueError(f"{where}: params[{key!r}] must be a number > 0; got {value!r}.")


def _check_optimizer(where, key, value):
    if isinstance(value, str):
        if value.lower() not in OPTIMIZERS:
            raise ValueError(
                f"{where}: params[{key!r}]={value!r} is not a known optimizer name. "
                f"Known names: {sorted(OPTIMIZERS)}; or pass a Keras optimizer instance "
                "(model_fns.keras_optimizers().Adam(0.01)) or a callable returning one."
            )
    elif _is_new_keras_optimizer(value):
        raise TypeError(f"{where}: params[{key!r}] is a {type(value).__name__}: " + _legacy_hint(value))
    elif not isinstance(value, _KERAS.Optimizer) and not callable(value):
        raise TypeError(
            f"{where}: params[{key!r}] must be an optimizer name ({sorted(OPTIMIZERS)}), a "
            f"Keras optimizer (model_fns.keras_optimizers(), i.e. tf.keras.optimizers.legacy on "
            f"TensorFlow >= 2.11) or a callable returning one; got {type(value).__name__}. "
            "(TF1 tf.compat.v1.train optimizers are not supported.)"
        )


def _check_n_classes(where, key, value):
    check_int(value, f"{where}: params[{key!r}] must be an int >= 2; got {value!r}.", minimum=2)


def _check_label_dimension(where, key, value):
    check_int(value, f"{where}: params[{key!r}] must be an int >= 1; got {value!r}.", minimum=1)


def _check_hidden_units(where, key, value):
    units = list(value) if isinstance(value, collections.abc.Iterable) and not isinstance(value, str) else None
    if not units or not all(is_int(u, minimum=1) for u in units):
        raise ValueError(
            f"{where}: params[{key!r}] must be a non-empty list of positive ints, one per "
            f"hidden layer (e.g. [64, 32]); got {value!r}."
        )


def _check_dropout(where, key, value):
    if value is not None and (not is_number(value) or not 0 <= value < 1):
        raise ValueError(
            f"{where}: params[{key!r}] must be None or a drop probability in [0, 1); got {value!r}."
        )


def _check_label_vocabulary(where, key, value):
    if value is None:
        return
    words = list(value) if isinstance(value, (list, tuple)) else None
    if not words or not all(isinstance(w, str) for w in words) or len(set(words)) != len(words):
        raise ValueError(
            f"{where}: params[{key!r}] must be None or a list of distinct strings, the class names in class-id "
            f"order (e.g. ['no', 'yes']); got {value!r}."
        )


def _check_weight_column(where, key, value):
    if value is not None and not (isinstance(value, str) and value) and not hasattr(value, "key"):
        raise ValueError(
            f"{where}: params[{key!r}] must be None, a feature name or a numeric_column whose values weight "
            f"each example's loss; got {value!r}."
        )


_CHECKS = {
    "feature_columns": _check_feature_columns,
    "learning_rate": _check_learning_rate,
    "optimizer": _check_optimizer,
    "n_classes": _check_n_classes,
    "label_dimension": _check_label_dimension,
    "hidden_units": _check_hidden_units,
    "dropout": _check_dropout,
    "label_vocabulary": _check_label_vocabulary,
    "weight_column": _check_weight_column,
}
