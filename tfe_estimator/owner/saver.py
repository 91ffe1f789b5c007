"""Checkpoints in service mode: saved after the owners' handshake, on-read variables summed across owners.

An on-read variable (``synchronization=ON_READ``: a batch normalization's
moving mean and variance, from `tf.compat.v1.layers` or Keras) holds one value
per replica; its checkpointed value is their MEAN (or SUM) over every replica,
as TensorFlow's MirroredStrategy saves it. In service mode those replicas are
every owner's, so the checkpoint saver's read of such a variable is a sum
through the aggregation service, like a gradient's (its own chain of sums,
`contribution.READS_CHAIN`): every owner's checkpoint holds the same moving
statistics, those of a plaintext training on the union of the owners' rows.

A sum across owners needs the model's channels, which the owners' handshake
names (`handshake`), and every owner's contribution at the same step.
Hence:

- `saver_hook` gives the training the checkpoint saver Estimator would make,
  as one of its training hooks, placed after the handshake: Estimator's own
  runs its first save (step 0, or the restored step) as the first hook of a
  new session, before the handshake and the input's initializer;
- `check_saving` refuses, before the first step, time-based checkpoints
  (``save_checkpoints_secs``) for a model with on-read variables: each owner
  would save at another step, and the reads would wait for each other until
  the step timeout. Under `tfe_estimator.DistributedDP` reads stay local (an
  un-noised sum of the owners' statistics would leave the DP guarantee), so
  nothing is summed and nothing refused.

Example::

    check_saving(config, dp=None)
    hook = saver_hook(config, estimator_spec)
    if hook is not None:
        estimator_spec = estimator_spec._replace(training_hooks=(*estimator_spec.training_hooks, hook))
"""
from typing import List, Optional

import tensorflow as tf
from tensorflow.python.distribute import values as value_lib

__all__ = ["on_read_variables", "check_saving", "saver_hook"]


def on_read_variables(graph: Optional[tf.Graph] = None) -> List[str]:
    """The names of `graph`'s on-read variables (whose checkpointed value is a reduction over replicas)."""
    graph = graph or tf.compat.v1.get_default_graph()
    variables = graph.get_collection(tf.compat.v1.GraphKeys.GLOBAL_VARIABLES)
    return sorted(v.name for v in variables if isinstance(v, value_lib.SyncOnReadVariable))


def check_saving(config: Optional["tf.estimator.RunConfig"], dp=None) -> None:
    """Refuses time-based checkpoints when the saver sums on-read variables across owners (module docstring).

    Raises:
      ValueError: naming the variables, the setting and the fix.
    """
    if dp is not None or config is None or config.save_checkpoints_steps or not config.save_checkpoints_secs:
        return
    names = on_read_variables()
    if names:
        raise ValueError(
            f"Service mode: the model has on-read variables ({', '.join(names[:4])}"
            f"{', ...' if len(names) > 4 else ''}; e.g. a batch normalization's moving statistics), whose "
            "checkpointed value is summed across the owners when a checkpoint is saved, but the RunConfig saves "
            f"checkpoints every save_checkpoints_secs={config.save_checkpoints_secs} seconds: each owner would "
            "save at another step and wait for the others' sums until the step timeout. Save by steps, equal "
            "on every owner: TfeRunConfig(save_checkpoints_steps=N, save_checkpoints_secs=None).")


def saver_hook(config: Optional["tf.estimator.RunConfig"],
               spec: "tf.estimator.EstimatorSpec") -> Optional[tf.compat.v1.train.CheckpointSaverHook]:
    """Estimator's checkpoint saver, to run after the handshake (module docstring); None when Estimator makes
    none (no checkpoints) or the model_fn brings its own."""
    if config is None or not (config.save_checkpoints_steps or config.save_checkpoints_secs):
        return None
    hooks = (*spec.training_hooks, *spec.training_chief_hooks)
    if any(isinstance(h, tf.compat.v1.train.CheckpointSaverHook) for h in hooks):
        return None
    # Estimator finds this hook among the training hooks, makes no saver of its own and gives this one its
    # saving listeners (train_and_evaluate's evaluations). Without a saver of the model_fn's scaffold, the
    # hook uses the SAVERS collection's, which Estimator fills.
    scaffold = spec.scaffold if spec.scaffold is not None and spec.scaffold.saver is not None else None
    return tf.compat.v1.train.CheckpointSaverHook(
        config.model_dir, save_secs=config.save_checkpoints_secs, save_steps=config.save_checkpoints_steps,
        scaffold=scaffold, save_graph_def=getattr(config, "checkpoint_save_graph_def", True))
