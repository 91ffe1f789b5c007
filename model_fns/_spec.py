"""The part every model_fn shares: head choice and the `EstimatorSpec`.

The losses, metrics, predictions and export outputs are those of Estimator's
own heads; the train op is the head's, from a Keras optimizer created here,
inside the model_fn. Under a distribution strategy (e.g. `TfeStrategy`) the
optimizer's `apply_gradients` sums the replicas' gradients through the
strategy's cross-device ops.
"""
from typing import Any, Mapping, Sequence

import tensorflow as tf

from model_fns._dp import dp_estimator_spec, dp_settings
from model_fns._params import make_optimizer

__all__ = ["classification_head", "check_labels", "estimator_spec", "dense_inputs"]


def classification_head(n_classes: int, weight_column=None, label_vocabulary=None):
    """`BinaryClassHead` for 2 classes, `MultiClassHead` for more.

    Labels are class ids in ``[0, n_classes)``, or with `label_vocabulary` the
    class names (strings) in class-id order. `weight_column` (a feature name or
    a numeric column) weights each example's loss, as in Estimator's heads.
    """
    if label_vocabulary is not None and len(label_vocabulary) != n_classes:
        raise ValueError(
            f"label_vocabulary has {len(label_vocabulary)} class names but n_classes is {n_classes}. Fix: set "
            f"params['n_classes']={len(label_vocabulary)} (or list every class name)."
        )
    if n_classes == 2:
        return tf.estimator.BinaryClassHead(weight_column=weight_column, label_vocabulary=label_vocabulary)
    return tf.estimator.MultiClassHead(n_classes=n_classes, weight_column=weight_column,
                                       label_vocabulary=label_vocabulary)


def check_labels(head, labels, params: Mapping[str, Any]) -> None:
    """Refuses string labels the head cannot read, naming the labels' dtype and the fix (not a Cast error later)."""
    if labels is None or isinstance(labels, Mapping) or not hasattr(labels, "dtype"):
        return
    if labels.dtype != tf.string or params.get("label_vocabulary") is not None:
        return
    name = getattr(labels, "name", "labels")
    if isinstance(head, tf.estimator.RegressionHead):
        raise ValueError(
            f"The labels ({name}) are strings (dtype {labels.dtype.name}), but a regression needs numbers. Fix: "
            "read the label column as a number (e.g. csv_input_fn(..., column_defaults={'<label>': 0.0}))."
        )
    raise ValueError(
        f"The labels ({name}) are strings (dtype {labels.dtype.name}), but without a vocabulary a classifier "
        "needs class ids. Fix: pass the class names as params['label_vocabulary']=[...] (in class-id order), "
        "or read the label column as integer class ids (e.g. column_defaults={'<label>': 0})."
    )


def dense_inputs(features, feature_columns, layers: list) -> tf.Tensor:
    """Turns `features` into one dense float tensor with `DenseFeatures`.

    Appends the layer to `layers` so its variables (e.g. embeddings) train.
    Categorical columns must be wrapped in `indicator_column` or
    `embedding_column`.
    """
    layer = tf.keras.layers.DenseFeatures(list(feature_columns), name="input_layer")
    layers.append(layer)
    return layer(features)


def estimator_spec(
    head,
    features,
    labels,
    mode: str,
    logits: tf.Tensor,
    params: Mapping[str, Any],
    layers: Sequence[tf.keras.layers.Layer],
    config=None,
) -> tf.estimator.EstimatorSpec:
    """The head's `EstimatorSpec`, training the variables of `layers`.

    With a `DistributedDP` in `config` (``TfeRunConfig(dp=...)``): DP-SGD, see `model_fns._dp`.
    """
    check_labels(head, labels, params)
    dp = dp_settings(config)
    if dp is not None:
        return dp_estimator_spec(dp, head, features, labels, mode, logits, params, layers,
                                 model_dir=getattr(config, "model_dir", None))
    optimizer = make_optimizer(params) if mode == tf.estimator.ModeKeys.TRAIN else None
    trainable = [v for layer in layers for v in layer.trainable_variables]
    return head.create_estimator_spec(
        features=features,
        mode=mode,
        logits=logits,
        labels=labels,
        optimizer=optimizer,
        trainable_variables=trainable,
    )
