"""`audit_party_inputs`: what every TFE party received in the graphs a session really ran.

The audit reads the partitioned graphs of one run (``RunMetadata.partition_graphs``
of a run with ``tf.compat.v1.RunOptions(output_partition_graphs=True)``: actual
placement, after soft placement, colocation and Grappler) and checks every
tensor that enters a party from outside it (`tfe_estimator.audit.server_view`; a
party is its device on one machine, its whole task on a cluster). It raises
`PartyAuditError`, naming the party, the op and the producer, unless:

- the run placed at least one op on a party (no party ops: no secure sum);
- no party runs a collective op (data would move without a send/receive the
  audit can see) or takes a value fed by the client;
- every edge that carries a value is an integer tensor (no float, bool,
  string, resource or variant: an empty tensor, which is how TensorFlow
  orders ops across devices, carries no value and is skipped);
- its producer is on the allow-list:

  =====================================  ====================================
  producer (op type:output)              what it is
  =====================================  ====================================
  ``TfeMaskShare:0``                     a masked share (fused Pond)
  ``TfeMaskShare:1``                     the seed of that share's mask
  ``TfeAesSeed:0``                       a 128-bit seed (tf-encrypted's Pond
                                         and ABY3 on our generator)
  ``TfeAesSeededRandomUniform:0``,       a mask: the AES-CTR (or, for
  ``I128SecureSeededRandomUniform:0``    tf-encrypted's 128-bit ring, ChaCha)
                                         stream of a seed
  ``Sub:0``, ``I128Sub:0``               a masked share ``x - mask`` of
                                         tf-encrypted's sharing, only if its
                                         subtrahend is such a mask (ABY3:
                                         ``(x - mask0) - mask1``)
  any integer op on another party       a message between parties
  =====================================  ====================================

- no party receives a masked share together with the seeds (or streams) of
  all of its masks: it could unmask it.

What it cannot prove: that a mask is really random or that a producer
computes what its name says (the server-view tests in ``tests/test_security.py``
check the values statistically); what a party does with what it legitimately
holds; messages between parties beyond their dtype; runs it did not see
(audit the runs you care about, e.g. with `PartyAuditHook`); anyone who
reaches a task's gRPC port and runs ops there (see the README's threat model).

Example::

    hook = tfe_estimator.PartyAuditHook(config.train_distribute.secure_aggregation.server_devices)
    estimator.train(input_fn, steps=10, hooks=[hook])
    print(hook.report)
"""
import dataclasses
import logging
from typing import Dict, FrozenSet, Iterable, List, Optional, Sequence, Set, Tuple

import tensorflow as tf
from tensorflow.python.distribute import device_util

from tfe_estimator.cluster.spec import TFE_JOB
from tfe_estimator.errors import PlaintextOnServerError
from tfe_estimator.audit.server_view import RECV_OPS, SEND_OPS, PartyEdge, partition_graphs_of, party_edges, party_of

__all__ = ["audit_party_inputs", "assert_no_plaintext_on_servers", "AuditReport", "PartyAuditError",
           "PartyAuditHook", "server_ops"]

_LOG = logging.getLogger("tfe_estimator")

_MASK_SHARE = "TfeMaskShare"
_SEEDS = frozenset({"TfeAesSeed"})
_STREAMS = frozenset({"TfeAesSeededRandomUniform", "I128SecureSeededRandomUniform"})
_SUBS = frozenset({"Sub", "I128Sub"})
_TRANSPARENT = frozenset({"Identity", "Snapshot"})


class PartyAuditError(PlaintextOnServerError):
    """A party receives something the protocol does not allow (names the op)."""


@dataclasses.dataclass(frozen=True)
class AuditReport:
    """What an audit saw.

    Attributes:
      parties: the parties' units (devices or tasks) that ran ops.
      party_ops: how many ops ran on the parties.
      edges: the value-carrying tensors the parties received.
    """

    parties: Tuple[str, ...]
    party_ops: int
    edges: Tuple[PartyEdge, ...]

    def __str__(self) -> str:
        kinds: Dict[str, int] = {}
        for edge in self.edges:
            key = f"{edge.producer_type}:{edge.output_index}"
            kinds[key] = kinds.get(key, 0) + 1
        received = ", ".join(f"{n} x {k}" for k, n in sorted(kinds.items()))
        return (f"{self.party_ops} ops on {len(self.parties)} parties; every one of the {len(self.edges)} "
                f"tensors they receive is a seed, a mask or a masked share ({received})")


class _Graphs:
    """Partition graphs indexed for tracing producers across devices."""

    def __init__(self, partition_graphs):
        self.nodes, self.sends = {}, {}
        for graph_def in partition_graphs:
            default = next((n.device for n in graph_def.node if n.device), "")
            for node in graph_def.node:
                device = device_util.canonicalize(node.device or default) if (node.device or default) else ""
                self.nodes[(device, node.name)] = (device, node)
                if node.op in SEND_OPS:
                    key = (node.attr["tensor_name"].s, device_util.canonicalize(node.attr["send_device"].s.decode()))
                    self.sends[key] = node

    def resolve(self, device: str, name: str):
        """``(device, NodeDef, output)`` producing input `name` of a node on `device`,
        through receives and identities."""
        for _ in range(64):
            op_name, _, index = name.lstrip("^").partition(":")
            device, node = self.nodes[(device, op_name)]
            if node.op in RECV_OPS:
                source = device_util.canonicalize(node.attr["send_device"].s.decode())
                send = self.sends[(node.attr["tensor_name"].s, source)]
                device, name = source, send.input[0]
                continue
            if node.op in _TRANSPARENT:
                name = node.input[0]
                continue
            return device, node, int(index or 0)
        raise ValueError(f"Producer chain of {name!r} too long")


def _seed_of_stream(graphs: _Graphs, device: str, node) -> Tuple:
    """The mask id of a stream op: the seed it expands (through a key derived from it)."""
    seed_device, seed, index = graphs.resolve(device, node.input[1])
    if seed.op in _STREAMS:  # tf-encrypted's 128-bit ring: a key derived from our seed
        return _seed_of_stream(graphs, seed_device, seed)
    if seed.op not in _SEEDS:
        return ("unseeded", device, node.name)
    return ("seed", seed_device, seed.name, index)


def _masks_of(graphs: _Graphs, device: str, node) -> Optional[FrozenSet[Tuple]]:
    """The masks subtracted in a masked share, or None if it is not masked by a stream."""
    if node.op == _MASK_SHARE:
        return frozenset({("mask_share", device, node.name)})
    if node.op not in _SUBS:
        return None
    mask_device, mask, _ = graphs.resolve(device, node.input[1])
    if mask.op not in _STREAMS:
        return None
    masks = {_seed_of_stream(graphs, mask_device, mask)}
    inner_device, inner, _ = graphs.resolve(device, node.input[0])
    if inner.op in _SUBS:  # ABY3: (x - mask0) - mask1
        inner_masks = _masks_of(graphs, inner_device, inner)
        if inner_masks:
            masks |= inner_masks
    return frozenset(masks)


def _held(graphs: _Graphs, edge: PartyEdge) -> Set[Tuple]:
    """The mask ids a party learns from receiving `edge`."""
    node = edge.producer
    if node.op == _MASK_SHARE and edge.output_index == 1:
        return {("mask_share", edge.source_device, node.name)}
    if node.op in _SEEDS:
        return {("seed", edge.source_device, node.name, edge.output_index)}
    if node.op in _STREAMS:
        return {_seed_of_stream(graphs, edge.source_device, node)}
    return set()


def _tfe_devices(partition_graphs) -> List[str]:
    devices = set()
    for graph_def in partition_graphs:
        for node in graph_def.node:
            if node.device and tf.DeviceSpec.from_string(node.device).job == TFE_JOB:
                devices.add(device_util.canonicalize(node.device))
    return sorted(devices)


def _fail(message: str) -> None:
    raise PartyAuditError(message + " Secure aggregation's promise does not hold for this graph.")


def audit_party_inputs(run_metadata_or_partition_graphs, party_devices: Optional[Sequence[str]] = None) -> AuditReport:
    """Checks every tensor entering a TFE party in one run; raises naming the first violation.

    Args:
      run_metadata_or_partition_graphs: a `RunMetadata` (or its
        ``partition_graphs``) from a run with
        ``tf.compat.v1.RunOptions(output_partition_graphs=True)``.
      party_devices: the parties' devices (``SecureAggregation.server_devices``);
        None means every device of the ``tfe`` job (the cluster layout).

    Returns:
      An `AuditReport`.

    Raises:
      PartyAuditError: naming the party, the op and what is wrong (see the module docstring).
      TypeError: for a `tf.Graph` (requested placement is not actual placement).
    """
    partition_graphs = partition_graphs_of(run_metadata_or_partition_graphs)
    if party_devices is None:
        party_devices = _tfe_devices(partition_graphs)
    graphs = _Graphs(partition_graphs)
    parties, count = set(), 0
    for graph_def in partition_graphs:
        for node in graph_def.node:
            device = node.device or next((n.device for n in graph_def.node if n.device), "")
            party = party_of(device, party_devices) if party_devices else None
            if party is None:
                continue
            if node.op in RECV_OPS and node.attr["client_terminated"].b or node.op in ("_Arg", "Placeholder"):
                _fail(f"{party} takes a value fed by the client: {node.op} {node.name!r}.")
            if node.op.startswith(("Collective", "Nccl")):
                _fail(f"{party} runs the collective op {node.name!r} ({node.op}), which exchanges data "
                      "without a send/receive the audit can check.")
            if node.op not in RECV_OPS + SEND_OPS:
                parties.add(party)
                count += 1
    if count == 0:
        _fail(f"No op of this run is placed on the parties {list(party_devices)}: the run has no secure "
              "sum, or the parties are not the devices it uses.")
    edges = [e for e in party_edges(partition_graphs, party_devices) if e.carries_value]
    held: Dict[str, Set[Tuple]] = {}
    for edge in edges:
        held.setdefault(edge.party, set()).update(_held(graphs, edge))
    masked: List[Tuple[PartyEdge, FrozenSet[Tuple]]] = []
    for edge in edges:
        where = (f"{edge.party} receives {edge.tensor} ({edge.producer_type}, {edge.dtype.name}) from "
                 f"{edge.source_device}")
        if not edge.dtype.is_integer:
            _fail(f"{where}: a {edge.dtype.name} value; parties must only receive ring elements and seeds.")
        if party_of(edge.source_device, party_devices) is not None:
            continue  # a message between parties
        node = edge.producer
        if node.op == _MASK_SHARE and edge.output_index in (0, 1) or node.op in _SEEDS | _STREAMS:
            if node.op == _MASK_SHARE and edge.output_index == 0:
                masked.append((edge, _masks_of(graphs, edge.source_device, node)))
            continue
        if node.op in _SUBS:
            masks = _masks_of(graphs, edge.source_device, node)
            if masks:
                masked.append((edge, masks))
                continue
            _fail(f"{where}: a difference whose subtrahend is not a seeded mask, i.e. not a masked share.")
        _fail(f"{where}: {node.op} is not an allowed producer (a masked share, a seed, a mask, or "
              "another party); an unmasked value may reach this party.")
    for edge, masks in masked:
        if masks <= held.get(edge.party, set()):
            _fail(f"{edge.party} receives the masked share {edge.tensor} from {edge.source_device} and "
                  f"also the seed of every one of its masks: it can unmask the value.")
    return AuditReport(parties=tuple(sorted(parties)), party_ops=count, edges=tuple(edges))


class PartyAuditHook(tf.estimator.SessionRunHook):
    """Audits the partitioned graphs of the first `steps` runs of a training loop.

    Each audited run asks for its partition graphs
    (``RunOptions(output_partition_graphs=True)``) and raises
    `PartyAuditError` from `after_run` if `audit_party_inputs` does.

    Args:
      party_devices: the parties' devices; None: every device of the ``tfe`` job.
      steps: how many runs to audit.
      log: log each report (``tfe_estimator`` logger, INFO), also printed if `print_report`.

    Example::

        hook = PartyAuditHook(strategy.secure_aggregation.server_devices)
        estimator.train(input_fn, steps=5, hooks=[hook])
        assert hook.report.party_ops > 0
    """

    def __init__(self, party_devices: Optional[Sequence[str]] = None, steps: int = 1, print_report: bool = False):
        self._party_devices = None if party_devices is None else list(party_devices)
        self._remaining = steps
        self._print = print_report
        self.report: Optional[AuditReport] = None
        self.audited_runs = 0

    def before_run(self, run_context):
        if self._remaining <= 0:
            return None
        return tf.estimator.SessionRunArgs(
            fetches=None, options=tf.compat.v1.RunOptions(output_partition_graphs=True))

    def after_run(self, run_context, run_values):
        if self._remaining <= 0:
            return
        self._remaining -= 1
        self.report = audit_party_inputs(run_values.run_metadata, self._party_devices)
        self.audited_runs += 1
        message = f"audit of the partitioned graphs of run {self.audited_runs}: {self.report}"
        _LOG.info(message)
        if self._print:
            print(message, flush=True)


# ---------------------------------------------------------------------------
# The former check, kept for callers that hold a tf.Graph.

def _is_plaintext(dtype: tf.DType) -> bool:
    dtype = dtype.base_dtype
    return dtype.is_floating or dtype.is_complex


def server_ops(graph: tf.Graph, server_devices: Optional[Iterable[str]] = None):
    """The ops of `graph` whose requested device is a server device (None: the ``tfe`` job)."""
    wanted = None if server_devices is None else {device_util.canonicalize(d) for d in server_devices}
    for op in graph.get_operations():
        if not op.device:
            continue
        if wanted is None:
            if tf.DeviceSpec.from_string(op.device).job == TFE_JOB:
                yield op
        elif device_util.canonicalize(op.device) in wanted:
            yield op


def assert_no_plaintext_on_servers(graph_or_partitions, server_devices: Optional[Iterable[str]] = None) -> int:
    """Alias of `audit_party_inputs` (returns the number of party ops); legacy check for a `tf.Graph`.

    Given a `RunMetadata` or partition graphs, this is `audit_party_inputs`.
    Given a `tf.Graph` it can only see *requested* placement, so it keeps the
    former, weaker check (no op requested on a server takes or produces a
    float tensor) and logs a warning: it cannot see soft placement, an
    unmasked integer or where a tensor comes from. Use `PartyAuditHook` or
    `audit_party_inputs` instead.

    Returns:
      How many server ops were audited.
    """
    if not isinstance(graph_or_partitions, tf.Graph):
        devices = None if server_devices is None else list(server_devices)
        return audit_party_inputs(graph_or_partitions, devices).party_ops
    _LOG.warning("assert_no_plaintext_on_servers(tf.Graph) checks requested placement and float dtypes only; "
                 "use tfe_estimator.PartyAuditHook to audit the partitioned graphs a session runs.")
    count = 0
    for op in server_ops(graph_or_partitions, server_devices):
        count += 1
        for kind, tensors in (("input", op.inputs), ("output", op.outputs)):
            for t in tensors:
                if _is_plaintext(t.dtype):
                    raise PlaintextOnServerError(
                        f"Op {op.name!r} ({op.type}) on TFE server device {op.device} has the "
                        f"{t.dtype.name} {kind} {t.name!r}: a server must only hold integer "
                        "shares. Something placed plaintext on a server device."
                    )
    return count
