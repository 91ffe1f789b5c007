"""One data owner's part of a per-step secure sum through the aggregation service.

Across organisations every owner trains in its own process and graph and
talks to nobody but the two aggregation servers (`tfe_estimator.service`),
to which it only connects out. Per sum and step, in the owner's graph::

    owner (its devices):   x = x_0 + ... + x_{L-1}          its L local replicas, in plaintext (one organisation)
                           share, key = mask_share(x)       enc(x) - AES-128-CTR(key), a fresh key (our kernel)
    owner -> service:      blind_key, w = contribute(step, key, share)
                           key to server0, share to server1 (started by one `tf.numpy_function`, the only
                           op that sends anything outside the process); server0 expands every owner's key,
                           subtracts the keystream of a fresh blind key and forwards that part to server1;
                           server1 adds it to the owners' shares: w = enc(sum) - AES(blind_key)
    owner (its device):    y = dec(w + AES(blind_key))      unmasked and decoded in the call (floats; other
                                                            dtypes by `decode_sum`), then copied to the local
                                                            replicas

With `checks` (service mode's training sums: the owners' check seed from the
handshake, `check_seed`), the owner appends `sum_check.CHECK_WORDS` check
words to its masked share inside the call and verifies them on the
revealed sum in the pass that decodes it: a sum a server altered stops
the session run (`sum_check.SumIntegrityError`), nothing of it applied.

The key of a chain's first contribution (the training step's gradients) is
drawn when the step starts (``TfeAesSeed``, no input) and put on server0 at
once by a key op (``service_key``, a control input of the contribution;
`OwnerClient.put_key`); the mask op masks with it. Server0's blinded part
then travels to server1 while the owner still computes, so the owner waits
for its own round trip only once its compute takes longer than one
server-to-server leg. Later contributions of the chain put their keys with
their shares: a key put early is one of the owner's calls waiting on
server0, and only the first stays within `in_flight`'s budget whatever the
number of sums (an evaluation has dozens). (A small sum that rides, below,
keeps a key of its own that never leaves.)

Nothing but a fresh key and a masked share leaves the graph; what comes back
is the sum of all owners, masked, and the key that unmasks it. The service
binds every contribution to the caller's certificate, releases a step only
when every owner put it, and answers each owner's own call.

Each sum is two ops: the contribution op (``service_contribute``) starts the
call and returns a ticket, the answer op (``service_answer``) waits for it
(`in_flight`). The contributions of one graph are chained in the order they
were built (each waits for the previous one's ticket, not its answer): every
owner builds the same graph, so the owners put their sums in the same order,
all of a step's sums travel together (one round trip per step), and a
session's few inter-op threads can never all wait on sums that the other
owners have not reached.

A small sum built after a contribution of the same chain (the reported loss
after the gradients) rides in that contribution instead of making a call of
its own (`riders`): one call per owner and server per step; its ops keep the
audit's shape (its contribution op takes its own mask op's key and share, its
answer op only its ticket).

A chain holds the sums of one kind of session run. The training step's sums
are the ``"step"`` chain. Cross-replica reads of on-read variables (a batch
normalization's moving statistics, whose checkpointed value is the mean over
every replica of every owner) are sums too, built when the checkpoint saver is
and run by the saver's own session run: they are the ``"reads"`` chain
(`chain`), never chained to the step's sums. Chained to them, a save ran the
step's contributions again and read the input pipeline (before the iterator's
initializer: ``GetNext() failed because the iterator has not been
initialized``).

Example::

    totals = service_sum([[grad_w, grad_b]], sources=["/cpu:0"], targets=["/cpu:0"],
                         encoding=Encoding(64, 32, 2.0**24), dtype=tf.float32, owner="chief:0",
                         hint="clip gradients", scale=0.5, channel="sum_0", step=step,
                         contribute=client_call)
"""
import contextlib
import functools
import weakref
from typing import Callable, Dict, List, Optional, Sequence

import numpy as np
import tensorflow as tf
from tensorflow.python.framework import errors_impl
from tensorflow.python.framework import func_graph

from tfe_estimator.owner import in_flight, riders, sum_check
from tfe_estimator.secure.fused_sum import Encoding
from tfe_estimator.secure.kernels import check_pass, ops
from tfe_estimator.service import ring

__all__ = ["service_sum", "chain", "tf_errors", "CONTRIBUTE_OP_NAME", "ANSWER_OP_NAME", "KEY_OP_NAME", "STEP_CHAIN",
           "READS_CHAIN", "ancestors"]

#: The name (scope) of the op through which a contribution leaves the graph: what the audit looks for.
CONTRIBUTE_OP_NAME = "service_contribute"
#: The name of the op that waits for a contribution's answer (its only input: the contribution's ticket).
ANSWER_OP_NAME = "service_answer"
#: The name of the op that puts a contribution's key on server0 when the step starts (its inputs: the step and
#: the key, drawn by ``TfeAesSeed`` before the values are computed; the mask op masks with that key).
KEY_OP_NAME = "service_key"

#: The chain of the training step's sums, and of the cross-replica reads of on-read variables (the saver's).
STEP_CHAIN, READS_CHAIN = "step", "reads"
#: Per graph and chain, the ticket of the last contribution built (the chain's next contribution waits for it).
_LAST: "weakref.WeakKeyDictionary[tf.Graph, Dict[str, tf.Tensor]]" = weakref.WeakKeyDictionary()
#: Per graph and chain, the answer ops built (each later contribution of the chain runs before them:
#: `_before_earlier_answers`).
_ANSWERS: "weakref.WeakKeyDictionary[tf.Graph, Dict[str, List[tf.Operation]]]" = weakref.WeakKeyDictionary()
#: Per graph and chain, the last contribution built that carries riders: (its op, its `riders.Host`, whether it is
#: checked); a small sum built after it in the same chain rides in it (`riders`).
_HOSTS: "weakref.WeakKeyDictionary[tf.Graph, Dict[str, tuple]]" = weakref.WeakKeyDictionary()
#: The chain the sums built now belong to (`chain`): set around a cross-replica read, in cross-replica context
#: (no replica thread builds a sum meanwhile).
_CHAIN = [STEP_CHAIN]


@contextlib.contextmanager
def chain(name: str):
    """Sums built inside belong to chain `name` (module docstring), not to the training step's.

    Example::

        with chain(READS_CHAIN):
            total = strategy.reduce(tf.distribute.ReduceOp.MEAN, on_read_variable, axis=None)
    """
    previous, _CHAIN[0] = _CHAIN[0], name
    try:
        yield
    finally:
        _CHAIN[0] = previous


def service_sum(
    vectors: Sequence[Sequence[tf.Tensor]],
    sources: Sequence[str],
    targets: Sequence[str],
    encoding: Encoding,
    dtype: tf.DType,
    owner: str,
    hint: str,
    scale: float,
    channel: str,
    step: tf.Tensor,
    contribute: Callable[[str, int, int, int, np.ndarray, np.ndarray], tuple],
    noise_variance: Optional[float] = None,
    checks: Optional[Callable[[], Optional[sum_check.SumCheck]]] = None,
    put_key: Optional[Callable[[str, int, int, int, np.ndarray], None]] = None,
) -> List[List[tf.Tensor]]:
    """This owner's contribution to the sum over all owners of `vectors`, revealed on each target.

    Args:
      vectors: per local replica (on ``sources[r]``), the tensors to sum, read as one flat vector.
      sources: this owner's replica devices; targets: the devices that receive the sum.
      encoding: ring, fraction bits and per-replica bound (the owner's local sum is checked
        against ``bound * len(sources)``).
      dtype: the dtype to decode to; owner: this owner's name (error messages); hint: how to fix
        an out-of-range value; scale: multiplies the decoded floats (``1/N`` for a MEAN).
      channel: the sum's name, equal on every owner (the n-th sum of the graph).
      step: scalar int64 tensor, equal on every owner for one step (the global step).
      contribute: ``contribute(channel, step, ring_bits, num_elements, key, share) -> (blind_key, w)``,
        the service call (`tfe_estimator.service.OwnerClient.contribute` behind a process-wide client).
      noise_variance: DP (`tfe_estimator.DistributedDP`): this owner's discrete Gaussian part, in ring
        units^2, added to its encoded local sum inside the mask op (before masking), or None.
      checks: called at run time, before each contribution: the `sum_check.SumCheck` of the model's
        check seed (the sum is checked), or None (not checked: equal on every owner, e.g. evaluation).
      put_key: ``put_key(channel, step, ring_bits, num_elements, key)`` (`OwnerClient.put_key`), or None: a
        contribution's key is then drawn when the step starts and put on server0 at once (`KEY_OP_NAME`), so
        that server0's part travels while the owner computes; the mask op masks with it.

    Returns:
      Per target, the decoded sums shaped like ``vectors[0]``.
    """
    shapes = [t.shape for t in vectors[0]]
    num_elements = sum(s.num_elements() for s in shapes)
    with tf.device(sources[0]), tf.name_scope("service_local_sum"):
        local = list(vectors[0]) if len(vectors) == 1 else [tf.add_n(list(parts)) for parts in zip(*vectors)]
    graph = tf.compat.v1.get_default_graph()
    eager = tf.executing_eagerly()  # Keras reading a metric across owners: each op runs as it is called
    stateful = not isinstance(graph, func_graph.FuncGraph)
    may_ride = not eager and stateful and noise_variance is None and _may_ride(graph, local, num_elements,
                                                                               checks is not None)
    # Only the chain's first contribution of a session run puts its key early: the others start behind it
    # (`in_flight`), and a key put waits on server0 as one of the owner's calls there (``--max-waiting-puts``):
    # an evaluation's dozens of metric sums putting every key at once were refused there.
    early = put_key is not None and not eager and not may_ride and \
        _CHAIN[0] not in _LAST.get(graph, {})
    with tf.device(sources[0]), tf.name_scope("service_mask_share"):
        noise = None if noise_variance is None else ops.discrete_gaussian(num_elements, noise_variance)
        drawn = ops.aes_seed() if early else None  # drawn when the step starts: no input
        share, key = ops.mask_share(local, encoding.bound * len(vectors), encoding.ring_bits,
                                    encoding.fraction_bits, owner, hint, noise=noise, key=drawn)
    if checks is not None:
        check_pass.load()
    if may_ride:
        rider = _ride_on_host(graph, key, share, step, encoding, num_elements)
        if rider is not None:
            with tf.device(sources[0]), tf.name_scope("service_reveal"):
                total = ops.decode_sum(rider, dtype, encoding.ring_bits, encoding.fraction_bits, scale, shapes)
            return _on_targets(total, targets)
    last, answers = _LAST.setdefault(graph, {}), _ANSWERS.setdefault(graph, {}).setdefault(_CHAIN[0], [])
    after = [last[_CHAIN[0]]] if _CHAIN[0] in last and not eager else []
    host = riders.Host(encoding.ring_bits) if not eager and stateful else None
    if early:
        put = functools.partial(_put_key, put_key, channel, encoding.ring_bits, num_elements, checks, host)
        with tf.device(sources[0]):
            after = after + [tf.numpy_function(put, [step, drawn], tf.int64, stateful=stateful,
                                               name=KEY_OP_NAME).op]
    # floats are decoded in the pass that unmasks and checks the answer (`sum_check.checked_contribute`)
    decode = (dtype.as_numpy_dtype, ops.decode_factor(encoding.fraction_bits, scale),
              [s.num_elements() for s in shapes]) if dtype in (tf.float32, tf.float64) else None
    begin = functools.partial(_begin, contribute, channel, encoding.ring_bits, num_elements, checks, host, decode)
    # In a tf.function (Keras) automatic control dependencies chain every stateful op without a resource input
    # in program order (mask, contribution, answer, next mask, ...): one round trip per sum, and a cycle with
    # the edges below. There both call ops are stateless (PyFuncStateless): each has inputs of its own (no
    # two merge) and feeds the update, so it runs once, in the order these explicit edges give.
    with tf.device(sources[0]), tf.control_dependencies(after):
        ticket = tf.numpy_function(begin, [step, key, share], tf.int64, stateful=stateful, name=CONTRIBUTE_OP_NAME)
    ticket.set_shape([])
    if not eager:
        last[_CHAIN[0]] = ticket
        _before_earlier_answers(answers, ticket.op)
    if host is not None:
        _HOSTS.setdefault(graph, {})[_CHAIN[0]] = (ticket.op, host, checks is not None)
    with tf.device(sources[0]):
        if decode is not None:  # the decoded sum, one array per shape
            parts = tf.numpy_function(_finish_decoded, [ticket], [dtype] * len(shapes), stateful=stateful,
                                      name=ANSWER_OP_NAME)
            # Eagerly (Keras reading a metric across owners) TensorFlow runs the function at once and returns a
            # list of one result unwrapped (script_ops.py_func_common: "Mimic the automatic unwrapping"), unlike
            # the op in a graph: a scalar's one tensor, not a list of it.
            parts = [parts] if tf.is_tensor(parts) else parts
        else:
            parts = [tf.numpy_function(functools.partial(_finish, tuple(share.shape.as_list())), [ticket],
                                       tf.int64, stateful=stateful, name=ANSWER_OP_NAME)]
    if not eager:
        answers.append(parts[0].op)
    if decode is None:
        parts[0].set_shape(share.shape)
        with tf.device(sources[0]), tf.name_scope("service_reveal"):
            # The sum's ring words are unmasked in the call (its checks need them): decode them.
            total = ops.decode_sum(parts[0], dtype, encoding.ring_bits, encoding.fraction_bits, scale, shapes)
        return _on_targets(total, targets)
    with tf.device(sources[0]), tf.name_scope("service_reveal"):
        total = []
        for part, shape in zip(parts, shapes):
            part.set_shape([shape.num_elements()])
            total.append(tf.reshape(part, shape))
    return _on_targets(total, targets)


def _on_targets(total: List[tf.Tensor], targets: Sequence[str]) -> List[List[tf.Tensor]]:
    """Per target device, its copy of the decoded sums `total`."""
    results = []
    for device in targets:
        with tf.device(device):
            results.append([tf.identity(t) for t in total])
    return results


def _may_ride(graph, values, num_elements, checked) -> bool:
    """Whether a sum of `values` can ride in the chain's last contribution (`_ride_on_host`), decided before its
    mask op exists (a contribution of its own draws its key first)."""
    found = _HOSTS.get(graph, {}).get(_CHAIN[0])
    if found is None or num_elements > riders.MAX_ELEMENTS:
        return False
    host_op, _, host_checked = found
    above = set().union(*(ancestors(v.op) | {v.op} for v in values))
    return host_checked == checked and host_op not in above  # `_ride_on_host` checks the rest (a TF1 frame)


def _put_key(put_key, channel, ring_bits, num_elements, checks, host, step, key) -> np.ndarray:
    """The numpy side of the key op: puts this step's key on server0 now, for the contribution of the channel's
    full size (its riders' limbs and check words after its own elements, as `sum_check` appends them)."""
    total = num_elements + (host.limbs if host is not None else 0) + (
        sum_check.CHECK_WORDS if checks is not None and checks() is not None else 0)
    put_key(channel, int(step), ring_bits, total, key)
    return np.int64(0)


def _ride_on_host(graph, key, share, step, encoding, num_elements) -> Optional[tf.Tensor]:
    """Makes this sum ride in the chain's last contribution (`riders`) if it can; returns its revealed ring
    words, or None (it is a contribution of its own).

    Called once `_may_ride` found it small (`riders.MAX_ELEMENTS`), the chain's host checked alike and not
    depending on this sum (the rider's op runs before it: no cycle); it rides unless the host is in another
    TF1 control-flow frame.
    """
    host_op, host, _ = _HOSTS[graph][_CHAIN[0]]
    if getattr(host_op, "_control_flow_context", None) is not getattr(share.op, "_control_flow_context", None):
        return None  # TF1 cond/while: the edges below stay in one frame
    index = host.add(num_elements * riders.limbs_per_element(encoding.ring_bits, host.ring_bits))
    ride = functools.partial(_ride, host, index, encoding.ring_bits, num_elements)
    with tf.device(share.device):
        ticket = tf.numpy_function(ride, [step, key, share], tf.int64, stateful=True, name=CONTRIBUTE_OP_NAME)
    ticket.set_shape([])
    host_op._add_control_input(ticket.op)  # pylint: disable=protected-access  # the rider's limbs first
    with tf.device(share.device), tf.control_dependencies([host_op]):  # the host's call answers the rider
        revealed = tf.numpy_function(functools.partial(_ride_finish, tuple(share.shape.as_list())), [ticket],
                                     tf.int64, stateful=True, name=ANSWER_OP_NAME)
    revealed.set_shape(share.shape)
    _ANSWERS.setdefault(graph, {}).setdefault(_CHAIN[0], []).append(revealed.op)  # after later contributions
    return revealed


def _ride(host, index, ring_bits, num_elements, step, key, share) -> np.ndarray:
    """The numpy side of a rider's contribution op (`riders.ride`): leaves its elements for the host's call."""
    del step  # keyed by the host's call (the same step)
    return np.int64(riders.ride(host, index, ring_bits, num_elements, key, share))


def _ride_finish(shape, ticket) -> np.ndarray:
    """The numpy side of a rider's answer op: its revealed ring words from the host's answer."""
    return riders.finish(int(ticket)).reshape(shape)


def _before_earlier_answers(answers: List[tf.Operation], contribution: tf.Operation) -> None:
    """Makes every earlier answer op of the chain (`answers`) that `contribution` does not need run after it.

    TensorFlow's executor may run a ready answer op (which blocks until the call's answer) before a
    contribution that became ready at the same time, on the same thread: the step's next sum would start
    only after the previous one's round trip. With these edges every sum of a step is on the wire before
    any answer is awaited. An answer the contribution depends on (a sum computed from another's result)
    keeps its order: no cycle.
    """
    if not answers:
        return
    needed = ancestors(contribution)
    context = getattr(contribution, "_control_flow_context", None)  # TF1 cond/while: edges stay in one frame
    for answer in answers:
        if answer not in needed and getattr(answer, "_control_flow_context", None) is context:
            answer._add_control_input(contribution)  # pylint: disable=protected-access


def ancestors(op: tf.Operation) -> set:
    """Every op `op` depends on, through data and control edges."""
    seen, todo = set(), [op]
    while todo:
        current = todo.pop()
        for parent in [t.op for t in current.inputs] + list(current.control_inputs):
            if parent not in seen:
                seen.add(parent)
                todo.append(parent)
    return seen


def _begin(contribute, channel, ring_bits, num_elements, checks, host, decode, step, key, share) -> np.ndarray:
    """The numpy side of the contribution op: starts one call to the service (`in_flight.TICKETS`) with this
    owner's key and masked share (check words appended first); returns its ticket (int64 scalar).

    The call, in its channel's worker thread (`in_flight`), waits out what can be waited out
    (`OwnerClient.contribute`): a step aborted because another owner was missing, or a server unreachable
    mid-call, is put again with the SAME key and masked share (a fresh mask is drawn only by a new session
    run): server0 may already have released the step with this key, and server1 refuses a share of another
    key for it; nothing was released for the aborted step, so the servers learn nothing new. A released step
    is answered from the servers' replay window, so a restored owner replays bit-identically. With `decode`
    (`sum_check.checked_contribute`'s), the call's answer is the decoded sum.
    """
    check = checks() if checks is not None else None
    # `key` and `share` alias the op's input tensors, whose buffers they keep alive after the op returns
    call = functools.partial(sum_check.checked_contribute, contribute, check, channel, int(step), ring_bits,
                             num_elements, key, share, reveal=True, decode=decode)
    if host is not None and host.riders:
        call = functools.partial(_carrying, call, host.take(), ring_bits, num_elements)
    return np.int64(in_flight.TICKETS.begin(channel, call))


def _carrying(call, taken, ring_bits, num_elements) -> np.ndarray:
    """Runs a host's `call` with its riders' limbs (`riders.Host.take`); hands each rider its part of the
    revealed sum (or the call's error); returns the host's own ring words."""
    limbs, settle = taken
    try:
        revealed = call(riders=limbs)
    except BaseException as e:
        settle(None, num_elements, e)
        raise
    if isinstance(revealed, tuple):  # decoded: (the host's arrays, the revealed words after them)
        settle(revealed[1], num_elements, None)
        return revealed
    settle(revealed, num_elements, None)
    own = revealed[:ring.ring_words(num_elements, ring_bits)]
    if ring_bits == 32 and num_elements % 2:  # the last word's upper lane held the first rider element
        own = own.copy()
        own.view("<u4")[num_elements] = 0
    return own


def _finish(shape, ticket) -> np.ndarray:
    """The numpy side of the answer op: waits for the call of `ticket`; returns the revealed sum's ring words
    (its answers unmasked, ``w + AES(blind_key)``, checked with `checks`), which the graph decodes.

    A call that still fails fails the session run with the server's message (TensorFlow reports an
    exception raised inside a `tf.numpy_function` as ``UnknownError`` whatever its type, so Estimator does
    not retry it in the same process): the owner's process exits, and its supervisor (the launcher's
    ``--max-restarts``, Kubernetes' restart policy) restarts it from its latest checkpoint; its handshake
    drops its own unreleased contributions, and it catches up from the replay window. `SumIntegrityError`
    (a sum a server altered) fails it the same way.
    """
    return in_flight.TICKETS.finish(int(ticket)).reshape(shape)  # the share's shape (128-bit ring: (n, 2))


def _finish_decoded(ticket) -> List[np.ndarray]:
    """`_finish` for a sum decoded in the call: its decoded arrays, one per shape of the sum."""
    return in_flight.TICKETS.finish(int(ticket))[0]


@contextlib.contextmanager
def tf_errors():
    """Turns a failed service call (an exception with a gRPC ``code``) into TensorFlow's error of that code.

    For calls made from Python (the handshake hook): Estimator recreates a session whose creation
    failed with ``UnavailableError`` (a server not up yet), and names the others.
    """
    try:
        yield
    except Exception as e:  # pylint: disable=broad-except
        code = getattr(getattr(e, "code", None), "value", None)
        if not code:
            raise
        raise errors_impl.exception_type_from_error_code(code[0])(None, None, str(e)) from e
