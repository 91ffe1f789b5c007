"""Owners of the aggregation service agree on step, settings, number of owners and model before training.

Once per training session (so also after every restore), after the session
is created and before its first step, each owner sends its descriptor
(`weight_check_handshake.FIELDS`: step, a hash of the settings, the number
of owners, a hash of the model's variables) to server0's ``Handshake``
method, polls it (bounded: `step_wait.poll`) until every owner's descriptor
of the same step is there, and stops with `OwnersDisagreeError` naming the
first field that differs and the owners it differs for (the same messages
as the TensorFlow-runtime between-graph mode). The server learns these
hashes and the step, nothing else.

Before that, when the training graph is complete, `audit.owner_graph`
checks that it lets out nothing but fresh keys and masked shares.

Once the owners agree, the owner rewinds its own state on both servers
(``Rewind``): a contribution left by a failed session is dropped, and it may
contribute from the restored step again, so owners that all recovered from
one checkpoint (after an owner or a server restart) continue together.

Example::

    hook = ServiceHandshakeHook(binding, settings="pond/low/clip=None/ring=64/replicas=1", client=service_client)
    estimator_spec = estimator_spec._replace(training_hooks=(*estimator_spec.training_hooks, hook))
"""
from typing import Callable

import numpy as np
import tensorflow as tf

from tfe_estimator.audit.owner_graph import audit_owner_graph
from tfe_estimator.distribute import step_wait
from tfe_estimator.distribute.service_sum import tf_errors
from tfe_estimator.distribute.weight_check_handshake import OwnersDisagreeError, descriptor, mismatch

__all__ = ["ServiceHandshakeHook"]


class ServiceHandshakeHook(tf.compat.v1.train.SessionRunHook):
    """Checks, before a session's first step, that every owner agrees with this one (module docstring).

    Args:
      binding: this owner's `ServiceBinding`.
      settings: a string equal on owners with the same secure-sum settings.
      client: ``client(binding)`` returns the owner's `tfe_estimator.service.OwnerClient`.

    Raises (from `after_create_session`):
      OwnersDisagreeError: naming the field, the owners and the step.
    """

    def __init__(self, binding, settings: str, client: Callable):
        self._binding, self._settings, self._client = binding, settings, client
        self._mine = None

    def begin(self):
        # The training graph is complete: check what it lets out before it runs (`audit.owner_graph`).
        audit_owner_graph(tf.compat.v1.get_default_graph())
        with tf.name_scope("service_handshake"):
            _, self._mine = descriptor(self._settings, len(self._binding.owners))

    def after_create_session(self, session, coord):
        del coord
        mine = session.run(self._mine)
        client = self._client(self._binding)
        owners = list(self._binding.owners)
        rows = [None]

        def everyone_at_my_step():
            with tf_errors():
                rows[0] = np.asarray(client.handshake(int(mine[0]), [int(v) for v in mine]))
            return bool(np.all(rows[0][:, 0] == mine[0]))

        timeout = 0.9 * self._binding.timeout_secs
        arrived = step_wait.poll(everyone_at_my_step, timeout)
        message = mismatch(rows[0], owners.index(self._binding.owner), owners, timeout, arrived)
        if message:
            raise OwnersDisagreeError(message)
        with tf_errors():
            client.rewind(int(mine[0]))
