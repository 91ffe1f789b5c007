"""Logistic regression as a `model_fn` for `tf.estimator.Estimator`.

A linear layer (weights initialised to zero) over `DenseFeatures`, with
Estimator's `BinaryClassHead` for 2 classes (sigmoid cross entropy;
`accuracy`, `auc`, `precision`, `recall`, `average_loss`, ... metrics) or
`MultiClassHead` for more (softmax: multinomial logistic regression).

Example::

    import tensorflow as tf
    import tfe_estimator
    from model_fns import logistic_regression

    est = tf.estimator.Estimator(
        model_fn=logistic_regression.model_fn,
        params={"feature_columns": [tf.feature_column.numeric_column("x", shape=(30,))],
                "optimizer": "adam", "learning_rate": 0.05},
        config=tfe_estimator.TfeRunConfig(model_dir="/tmp/logreg", num_replicas=2))
    est.train(input_fn, steps=300)
    print(est.evaluate(eval_input_fn)["accuracy"])

Params:
  feature_columns: required; dense columns (wrap categorical ones in
    `indicator_column` or `embedding_column`).
  n_classes: default 2; labels are class ids in ``[0, n_classes)``.
  label_vocabulary: default None; the class names (strings) in class-id order.
  weight_column: default None; a feature name or numeric column weighting
    each example's loss.
  learning_rate: default 0.05; used when `optimizer` is a name.
  optimizer: default "adam"; a name (see `model_fns.OPTIMIZERS`), a Keras
    optimizer instance (copied per graph) or a callable returning one.
"""
import tensorflow as tf

from model_fns import _params, _spec

__all__ = ["DEFAULTS", "model_fn"]

DEFAULTS = {"learning_rate": 0.05, "optimizer": "adam", "n_classes": 2, "label_vocabulary": None,
            "weight_column": None}


def model_fn(features, labels, mode, params, config=None) -> tf.estimator.EstimatorSpec:
    """Builds a logistic regression; see the module docstring for `params`."""
    params = _params.validate_params("logistic_regression", params, DEFAULTS)
    head = _spec.classification_head(params["n_classes"], weight_column=params["weight_column"],
                                     label_vocabulary=params["label_vocabulary"])
    layers = []
    inputs = _spec.dense_inputs(features, params["feature_columns"], layers)
    dense = tf.keras.layers.Dense(head.logits_dimension, kernel_initializer="zeros", name="logits")
    layers.append(dense)
    return _spec.estimator_spec(head, features, labels, mode, dense(inputs), params, layers,
                                config)  # config: DP-SGD when it carries dp
