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

__all__ = ["classification_head", "estimator_spec", "dense_inputs"]


def classification_head(n_classes: int):
    """`BinaryClassHead` for 2 classes, `MultiClassHead` for more.

    Labels are class ids in ``[0, n_classes)``.
    """
    if n_classes == 2:
        return tf.estimator.BinaryClassHead()
    return tf.estimator.MultiClassHead(n_classes=n_classes)


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
    dp = dp_settings(config)
    if dp is not None:
        return dp_estimator_spec(dp, head, features, labels, mode, logits, params, layers)
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
