"""A feed-forward neural network classifier as a `model_fn` for `tf.estimator.Estimator`.

`DenseFeatures`, then one ReLU `Dense` layer per entry of `hidden_units`
(each followed by `Dropout` when `dropout` is set), then a logits layer, with
Estimator's `BinaryClassHead` (2 classes) or `MultiClassHead` (more).

Example::

    import tensorflow as tf
    import tfe_estimator
    from model_fns import dnn_classifier

    est = tf.estimator.Estimator(
        model_fn=dnn_classifier.model_fn,
        params={"feature_columns": [tf.feature_column.numeric_column("pixels", shape=(64,))],
                "hidden_units": [64, 32], "n_classes": 10, "optimizer": "adam",
                "learning_rate": 0.01},
        config=tfe_estimator.TfeRunConfig(model_dir="/tmp/dnn", num_replicas=2))
    est.train(input_fn, steps=500)

Params:
  feature_columns: required; dense columns (wrap categorical ones in
    `indicator_column` or `embedding_column`).
  hidden_units: required; units per hidden layer, e.g. ``[64, 32]``.
  n_classes: default 2; labels are class ids in ``[0, n_classes)``.
  label_vocabulary: default None; the class names (strings) in class-id order,
    for string labels (as Estimator's canned heads).
  weight_column: default None; a feature name or numeric column weighting
    each example's loss.
  dropout: default None; the probability of dropping a hidden unit in training.
  learning_rate: default 0.05; used when `optimizer` is a name.
  optimizer: default "adagrad"; a name (see `model_fns.OPTIMIZERS`), a Keras
    optimizer instance (copied per graph) or a callable returning one.
"""
import tensorflow as tf

from model_fns import _params, _spec

__all__ = ["DEFAULTS", "model_fn"]

DEFAULTS = {"learning_rate": 0.05, "optimizer": "adagrad", "n_classes": 2, "dropout": None,
            "label_vocabulary": None, "weight_column": None}


def model_fn(features, labels, mode, params, config=None) -> tf.estimator.EstimatorSpec:
    """Builds a DNN classifier; see the module docstring for `params`."""
    seed = config.tf_random_seed if config is not None else None
    params = _params.validate_params(
        "dnn_classifier", params, DEFAULTS, required=("feature_columns", "hidden_units"))
    head = _spec.classification_head(params["n_classes"], weight_column=params["weight_column"],
                                     label_vocabulary=params["label_vocabulary"])
    training = mode == tf.estimator.ModeKeys.TRAIN
    layers = []
    net = _spec.dense_inputs(features, params["feature_columns"], layers)
    for i, units in enumerate(params["hidden_units"]):
        hidden = tf.keras.layers.Dense(
            units, activation="relu", kernel_initializer=_glorot(seed, i), name=f"hiddenlayer_{i}")
        layers.append(hidden)
        net = hidden(net)
        if params["dropout"]:
            net = tf.keras.layers.Dropout(params["dropout"], name=f"dropout_{i}")(net, training=training)
    logits = tf.keras.layers.Dense(
        head.logits_dimension, kernel_initializer=_glorot(seed, len(params["hidden_units"])),
        name="logits")
    layers.append(logits)
    return _spec.estimator_spec(head, features, labels, mode, logits(net), params, layers,
                                config)  # config: DP-SGD when it carries dp


def _glorot(seed, layer):
    return tf.keras.initializers.GlorotUniform(seed=None if seed is None else seed + layer)
