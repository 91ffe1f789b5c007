"""input_fns: Estimator input functions that shard by input pipeline.

Each function returns `input_fn(input_context=None)`. Without a distribution
strategy Estimator calls it without a context and it yields whole batches;
under one (e.g. `tfe_estimator.TfeRunConfig`) Estimator passes a
`tf.distribute.InputContext`, and it yields per-replica batches of
``batch_size / num_replicas_in_sync`` records from this pipeline's own shard
(see `input_fns.sharding`). File patterns may contain ``{worker}``::

    import input_fns

    train = input_fns.csv_input_fn("/data/worker{worker}/*.csv", label_key="label",
                                   batch_size=64, column_names=names)
    est.train(train, steps=1000)

Evaluation caveat (Estimator's, not these functions'): with several replicas
per input pipeline, evaluation ends at the first step in which some replica
gets no batch, so when the last round of per-replica batches is incomplete
its records are not evaluated. For exact metrics on a finite set, pick a
global `batch_size` that covers it in one step (``len(data)`` rounded up to a
multiple of the replicas), as the examples do.

Importing this package imports TensorFlow and nothing else.
"""
from input_fns import sharding
from input_fns.csv_input import csv_input_fn
from input_fns.numpy_input import numpy_input_fn
from input_fns.tfrecord_input import tfrecord_input_fn

__all__ = ["numpy_input_fn", "csv_input_fn", "tfrecord_input_fn", "sharding"]
