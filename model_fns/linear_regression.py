"""Linear regression as a `model_fn` for `tf.estimator.Estimator`.

One dense layer (weights initialised to zero) over `DenseFeatures`, with
Estimator's `RegressionHead`: mean squared error loss, `average_loss` and
`label/mean`/`prediction/mean` metrics, `predictions` output, regression
export signatures.

Example::

    import tensorflow as tf
    import tfe_estimator
    from model_fns import linear_regression

    est = tf.estimator.Estimator(
        model_fn=linear_regression.model_fn,
        params={"feature_columns": [tf.feature_column.numeric_column("x", shape=(3,))],
                "optimizer": "sgd", "learning_rate": 0.1},
        config=tfe_estimator.TfeRunConfig(model_dir="/tmp/linreg", num_replicas=2))
    est.train(input_fn, steps=200)

Params:
  feature_columns: required; dense columns (wrap categorical ones in
    `indicator_column` or `embedding_column`).
  learning_rate: default 0.05; used when `optimizer` is a name.
  optimizer: default "sgd"; a name (see `model_fns.OPTIMIZERS`), a Keras
    optimizer instance (copied per graph) or a callable returning one.
  label_dimension: default 1; the number of regression targets.
"""
import tensorflow as tf

from model_fns import _params, _spec

__all__ = ["DEFAULTS", "model_fn"]

DEFAULTS = {"learning_rate": 0.05, "optimizer": "sgd", "label_dimension": 1}


def model_fn(features, labels, mode, params, config=None) -> tf.estimator.EstimatorSpec:
    """Builds a linear regression; see the module docstring for `params`."""
    params = _params.validate_params("linear_regression", params, DEFAULTS)
    layers = []
    inputs = _spec.dense_inputs(features, params["feature_columns"], layers)
    dense = tf.keras.layers.Dense(params["label_dimension"], kernel_initializer="zeros", name="linear")
    layers.append(dense)
    head = tf.estimator.RegressionHead(label_dimension=params["label_dimension"])
    return _spec.estimator_spec(head, features, labels, mode, dense(inputs), params, layers,
                                config)  # config: DP-SGD when it carries dp
