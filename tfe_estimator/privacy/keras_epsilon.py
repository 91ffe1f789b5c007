"""`EpsilonCallback`: the epsilon a Keras ``model.fit`` under ``TfeStrategy(dp=DistributedDP(...))`` has spent.

Keras' counterpart of Estimator's `tfe_estimator.privacy.dp.EpsilonLoggingHook`, with the same line on
standard error every `every_n_steps` steps and at the end of ``fit``, and the same INFO line through the
"tfe_estimator" logger at the end (`dp.show_epsilon`, `dp.log_epsilon`): dp-accounting's RDP accountant
(`dp.dp_epsilon`) for the steps the optimizer took (its ``iterations``), plus, in service mode, the steps the
servers released again (``DistributedDP(count_repeated_releases=True)``). N (the noise parties) is the owners
in service mode, the replicas on one machine (`dp.noise_parties`).

Example::

    dp = tfe_estimator.DistributedDP(l2_norm_clip=1.0, noise_multiplier=1.1, num_examples=60000,
                                     expected_batch_size=256)
    strategy = tfe_estimator.TfeStrategy(dp=dp)
    with strategy.scope():
        model = tf.keras.Sequential([tf.keras.layers.Dense(1, input_shape=(3,))])
        model.compile(make_dp_optimizer(tf.keras.optimizers.legacy.SGD(0.1), dp.l2_norm_clip),
                      tf.keras.losses.MeanSquaredError(reduction="none"))
    model.fit(rows.repeat().batch(256), steps_per_epoch=100, callbacks=[tfe_estimator.EpsilonCallback(dp)])
"""
import logging
from typing import Optional

import tensorflow as tf

from tfe_estimator.privacy import dp as dp_lib
from tfe_estimator.validation import check_int

__all__ = ["EpsilonCallback"]


class EpsilonCallback(tf.keras.callbacks.Callback):
    """Shows the DP epsilon ``model.fit`` spent so far (module docstring).

    Args:
      dp: the strategy's `DistributedDP`, with ``num_examples`` (without it there is no epsilon to show:
        refused).
      every_n_steps: how often to show the line (optimizer steps); stream: where (default: standard error).

    Raises:
      ValueError: `dp` has no ``num_examples``; `every_n_steps` is not a positive int; at the first step, a
        global batch size neither set (``expected_batch_size``) nor static (the per-example loss's batch
        dimension).
    """

    def __init__(self, dp: "dp_lib.DistributedDP", every_n_steps: int = 100, stream=None):
        super().__init__()
        if not isinstance(dp, dp_lib.DistributedDP) or dp.num_examples is None:
            raise ValueError(f"EpsilonCallback needs a DistributedDP with num_examples (the size of the training "
                             f"set epsilon is accounted over), got {dp!r}. Fix: DistributedDP(..., num_examples=N).")
        self._dp = dp
        self._every = check_int(every_n_steps, f"EpsilonCallback(every_n_steps={every_n_steps!r}): give a positive "
                                               "int, how many optimizer steps apart the epsilon line shows.",
                                minimum=1)
        self._stream = stream
        self._shown: Optional[int] = None

    def _batch(self) -> int:
        batch = self._dp.expected_batch_size or getattr(self.model.optimizer, "_tfe_global_batch", None)
        if not batch:
            raise ValueError(
                "EpsilonCallback: the global batch size is not known (no DistributedDP(expected_batch_size=...) "
                "and a batch dimension that is not static), so no epsilon can be accounted. Fix: "
                "DistributedDP(expected_batch_size=<global batch>) or dataset.batch(n, drop_remainder=True).")
        return batch

    def _parties(self) -> int:
        return dp_lib.noise_parties(self.model.distribute_strategy)

    def _repeated(self) -> int:
        from tfe_estimator.owner import keras_fit  # pylint: disable=import-outside-toplevel

        return keras_fit.repeated_releases(self.model)

    def _show(self) -> int:
        steps = int(self.model.optimizer.iterations.numpy())
        if steps != self._shown:
            dp_lib.show_epsilon(self._dp, self._batch(), steps, self._parties(), self._repeated(), self._stream)
            self._shown = steps
        return steps

    def on_train_batch_end(self, batch, logs=None):
        del batch, logs
        if (int(self.model.optimizer.iterations.numpy()) - 1) % self._every == 0:
            self._show()

    def on_train_end(self, logs=None):
        del logs
        steps = int(self.model.optimizer.iterations.numpy())
        if steps:
            self._show()
            dp_lib.log_epsilon(self._dp, self._batch(), steps, self._parties(), self._repeated(),
                               logging.getLogger("tfe_estimator").info)
