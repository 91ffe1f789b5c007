"""model_fns: `model_fn`s for `tf.estimator.Estimator` built on Estimator's heads.

Each module exports `model_fn(features, labels, mode, params, config)`; the
losses, metrics, predictions and export signatures are those of
`tf.estimator.RegressionHead`, `BinaryClassHead` and `MultiClassHead`, and
the train op comes from a Keras optimizer made inside the model_fn, so they
train under any distribution strategy, `tfe_estimator.TfeStrategy` included.
`keras_optimizers()` is the Keras optimizer namespace Estimator accepts on the
installed TensorFlow (`tf.keras.optimizers.legacy` from 2.11 on)::

    import tensorflow as tf
    import tfe_estimator
    from model_fns import logistic_regression

    est = tf.estimator.Estimator(
        logistic_regression.model_fn,
        params={"feature_columns": cols, "optimizer": "adam", "learning_rate": 0.05},
        config=tfe_estimator.TfeRunConfig(model_dir="/tmp/m", num_replicas=2))

Importing this package imports TensorFlow and nothing else.
"""
from model_fns import dnn_classifier, linear_regression, logistic_regression
from model_fns._params import OPTIMIZERS, keras_optimizers

__all__ = ["linear_regression", "logistic_regression", "dnn_classifier", "OPTIMIZERS", "keras_optimizers"]
