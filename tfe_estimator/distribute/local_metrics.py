"""An owner's own metrics beside the federated ones: `evaluate_locally` and `LocalMetricsExporter`.

In service mode `eval_distribute` is federated: every owner reads the metrics
of the union of all owners' evaluation data, summed through the aggregation
service. An owner often wants its own metrics too (how the shared model does
on its data alone). They never leave the owner: `evaluate_locally` evaluates
a checkpoint of the owner's `model_dir` with a plain `RunConfig` (no strategy,
no cluster, nothing sent anywhere) and writes the summaries to
``<model_dir>/eval_<name>`` (default ``eval_local``), beside the federated
``<model_dir>/eval``. `LocalMetricsExporter` does it after every evaluation of
`tf.estimator.train_and_evaluate`, on the checkpoint just evaluated.

Example::

    est = tf.estimator.LinearRegressor(feature_columns=cols, config=tfe_estimator.TfeRunConfig())
    eval_spec = tf.estimator.EvalSpec(test_input_fn, throttle_secs=0,
                                      exporters=[tfe_estimator.LocalMetricsExporter(test_input_fn)])
    tf.estimator.train_and_evaluate(est, train_spec, eval_spec)  # model_dir/eval and model_dir/eval_local
"""
import sys
from typing import Callable, Dict, Optional, TextIO

import tensorflow as tf

from tfe_estimator.cluster.spec import tf_config_hidden
from tfe_estimator.compat import require_estimator
from tfe_estimator.distribute.progress import metrics_line
from tfe_estimator.privacy.dp import EPSILON_METRICS

require_estimator("tfe_estimator.LocalMetricsExporter")  # it subclasses tf.estimator.Exporter

__all__ = ["LocalMetricsExporter", "evaluate_locally"]


def evaluate_locally(estimator: tf.estimator.Estimator, input_fn: Callable, steps: Optional[int] = None,
                     checkpoint_path: Optional[str] = None, name: str = "local") -> Dict:
    """Evaluates `estimator`'s checkpoint on `input_fn` in this process only, without any secure sum.

    Args:
      estimator: the owner's Estimator (any `RunConfig`; its `model_fn` and `model_dir` are used).
      input_fn: this owner's evaluation data.
      steps: as `Estimator.evaluate` (None: until `input_fn` ends).
      checkpoint_path: the checkpoint to evaluate (default: the latest in `model_dir`).
      name: the summaries go to ``<model_dir>/eval_<name>``.

    Returns:
      `Estimator.evaluate`'s dict of metrics (with ``global_step``).

    Example::

        own = tfe_estimator.evaluate_locally(est, test_input_fn)  # this owner's data only
    """
    _check_name(name)
    with tf_config_hidden():  # a plain, local RunConfig even on a TF_CONFIG cluster
        config = tf.estimator.RunConfig(model_dir=estimator.model_dir,
                                        session_config=estimator.config.session_config,
                                        tf_random_seed=estimator.config.tf_random_seed)
    local = tf.estimator.Estimator(model_fn=estimator.model_fn, model_dir=estimator.model_dir, config=config)
    return local.evaluate(input_fn, steps=steps, checkpoint_path=checkpoint_path, name=name)  # logs them at INFO


class LocalMetricsExporter(tf.estimator.Exporter):
    """After each evaluation of `train_and_evaluate`, this owner's own metrics of the same checkpoint.

    Put it in `EvalSpec(exporters=[...])` with the owner's evaluation `input_fn`;
    it calls `evaluate_locally` on the checkpoint just evaluated and exports no
    model (it returns None). It prints the owner's own metrics, and first the
    federated ones when evaluation is federated (service mode without DP)::

        tfe_estimator: evaluation at step 300, all owners' data: average_loss 5131.75, ...
        tfe_estimator: evaluation at step 300, this owner's data only: average_loss 4522.48, ...

    Under DP the own line also carries the evaluated checkpoint's epsilon
    (``dp_epsilon``, ``dp_epsilon_outsiders``: what its training spent).

    Args:
      input_fn: this owner's evaluation data (usually the EvalSpec's own input_fn).
      steps: as `Estimator.evaluate`.
      name: the exporter's name; the summaries go to ``<model_dir>/eval_<name>``.
      stream: where its metrics lines go (default: standard error at print time).

    Example::

        tf.estimator.EvalSpec(test, throttle_secs=0, exporters=[tfe_estimator.LocalMetricsExporter(test)])
    """

    def __init__(self, input_fn: Callable, steps: Optional[int] = None, name: str = "local",
                 stream: Optional[TextIO] = None) -> None:
        if not callable(input_fn):
            raise TypeError(f"input_fn={input_fn!r} is not callable: pass the owner's evaluation input_fn.")
        _check_name(name)
        self._input_fn, self._steps, self._name, self._stream = input_fn, steps, name, stream
        self.last_metrics: Optional[Dict] = None

    @property
    def name(self) -> str:
        return self._name

    def export(self, estimator, export_path, checkpoint_path, eval_result, is_the_final_export):
        del export_path, is_the_final_export  # no model is exported
        self.last_metrics = evaluate_locally(estimator, self._input_fn, steps=self._steps,
                                             checkpoint_path=checkpoint_path, name=self._name)
        stream = self._stream or sys.stderr
        if getattr(estimator.config.eval_distribute, "federated_metrics", False):
            stream.write("tfe_estimator: " + metrics_line("all owners' data", eval_result) + "\n")
        # Under DP the checkpoint's epsilon (of its training, not of any data) comes from the evaluation: the
        # local one runs without the DP settings.
        own = {**{k: v for k, v in eval_result.items() if k in EPSILON_METRICS}, **self.last_metrics}
        stream.write("tfe_estimator: " + metrics_line("this owner's data only", own) + "\n")
        stream.flush()
        return None


def _check_name(name) -> None:
    if not isinstance(name, str) or not name:
        raise ValueError(f"name={name!r}: give a non-empty string (the summaries go to model_dir/eval_<name>).")
