"""The data owner's side of service mode: one core, and an adapter per framework on top of it.

An owner trains alone, in its own process, and sums across owners through the aggregation service. What makes
that secure and correct is framework-neutral, and lives once, in the core:

- `service_strategy`: `ServiceStrategy` (this owner's replicas, its sums through the service), `ServiceBinding`
  (the servers and this owner), `ServiceAggregation` (the `CrossDeviceOps`);
- `contribution`, `in_flight`, `riders`: one owner's part of a per-step secure sum, the calls in flight, and the
  small sums (the reported loss) that ride in the gradients' contribution (one call per owner and step);
- `sum_check`, `check_seed`: the integrity checks on every revealed sum, under a seed only the owners hold;
- `handshake`, `model_record`: the owners agree on one model (record and weights) before the first step;
- `training_run`, `step_key`, `step_wait`: which training a session belongs to (and DP's release ledger),
  the step that keys each sum, a bounded wait for the other owners;
- `weight_check`: the owners compare their weights' fingerprints during training.

The adapters wire the core into each framework's own mechanisms, and nothing else:

- `estimator`: `EstimatorServiceStrategy` (what `TfeRunConfig` builds), the core's agreements as session-run
  hooks in every `EstimatorSpec`; `saver`: checkpoints after the handshake;
- `keras_fit`, `keras_evaluation`, `custom_loop`, `keras_build`: `OwnerStrategy` (what ``TfeStrategy()`` returns to an
  owner), the core's agreements at the steps of Keras' ``fit`` / ``evaluate`` / ``predict`` and of custom
  training loops (``strategy.run`` in the user's ``tf.function``); `keras_progress`: ``fit``'s progress lines;
  `keras_frames`: the one walk over the stack that tells which Keras call is running.

The core never imports an adapter (tests/test_owner_layers.py checks it).

Example::

    from tfe_estimator.owner.estimator import EstimatorServiceStrategy
    strategy = EstimatorServiceStrategy(binding, num_replicas=1)
"""
from tfe_estimator.compat import check_tensorflow_version

check_tensorflow_version()  # before any module here touches TensorFlow's private APIs

__all__ = []
