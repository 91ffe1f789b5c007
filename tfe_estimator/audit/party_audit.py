"""`audit_party_inputs`: what every TFE party received and computed in the graphs a session really ran.

The audit reads the partitioned graphs of one run (``RunMetadata.partition_graphs``
of a run with ``tf.compat.v1.RunOptions(output_partition_graphs=True)``: actual
placement, after soft placement, colocation and Grappler; a party is its
device on one machine, its whole task on a cluster). It raises
`PartyAuditError`, naming the party, the op and what is wrong, unless:

- the run placed at least one op on a party (no party ops: no secure sum);
- every op on a party is of a type in `PARTY_OPS` (below), none takes a value
  fed by the client, none runs a collective, and no op on a party has a
  floating-point input, output or constant;
- every tensor a party receives from outside it carries integers (an empty
  tensor, how TensorFlow orders ops across devices, carries no value);
- every mask is a real one: a keystream op with the full ring as its bounds,
  keyed by a fresh key (`tfe_estimator.audit.masks`); a constant or computed
  key, or a stream of range [0, 1), is refused;
- no party can read owners' data from anything it receives or computes:
  following each value through owners' and parties' ops as a linear form
  (data plus signed masks, masks cancelling), a value that depends on owner
  data must keep at least one mask whose key the party does not hold. A party
  holds the keys it draws itself and every key (or mask stream) that reaches
  it, from an owner or from another party. This covers messages between
  parties (server0's blinded part to server1) and a party's own sums.

`PARTY_OPS`, the op types that may run on a party:

================================================  ==============================
op types                                          role
================================================  ==============================
``TfeServerSum``                                  a server's part of a fused sum
``TfeAesSeededRandomUniform``,                    expanding a key into its mask
``I128SecureSeededRandomUniform``                 (tf-encrypted's parties)
``TfeAesSeed``                                    a key the party draws
``Add``, ``AddV2``, ``AddN``, ``Sub``, ``Neg``,   ring arithmetic on shares
``I128Add``, ``I128Sub``
``Const`` (integers only)                         bounds and shapes
``Identity``, ``Snapshot``, ``NoOp``              plumbing
``_Send``, ``_Recv``, ``_HostSend``, ``_HostRecv``  TensorFlow's transfers
================================================  ==============================

What it cannot prove: that a key is really random or that an op computes what
its name says (the server-view tests in ``tests/test_security.py`` check the
values statistically); collusion between parties; runs it did not see (audit
the runs you care about, e.g. with `PartyAuditHook`); anyone who reaches a
task's gRPC port and runs ops there (see the README's threat model).

Example::

    hook = tfe_estimator.PartyAuditHook(config.train_distribute.secure_aggregation.server_devices)
    estimator.train(input_fn, steps=10, hooks=[hook])
    print(hook.report)
"""
import collections
import dataclasses
import logging
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

import tensorflow as tf
from tensorflow.python.distribute import device_util

from tfe_estimator.audit.masks import LINEAR_OPS, MASK_STREAMS, SEED_OUTPUTS, Form, Forms, MaskError
from tfe_estimator.audit.server_view import (RECV_OPS, SEND_OPS, PartyEdge, is_control_carrier, partition_graphs_of,
                                             party_edges, party_of)
from tfe_estimator.cluster.spec import TFE_JOB
from tfe_estimator.errors import PlaintextOnServerError

__all__ = ["audit_party_inputs", "assert_no_plaintext_on_servers", "AuditReport", "PartyAuditError",
           "PartyAuditHook", "server_ops", "PARTY_OPS"]

_LOG = logging.getLogger("tfe_estimator")

#: The op types that may run on a party (the allow-list; see the module docstring).
PARTY_OPS = frozenset({"TfeServerSum", "TfeAesSeed", "Const", "Identity", "Snapshot", "NoOp"}
                      | MASK_STREAMS | set(LINEAR_OPS) | set(RECV_OPS) | set(SEND_OPS))
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
                f"tensors they receive is a key, a mask or a value masked by a key they lack ({received})")


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


def _float_dtypes(node) -> List[str]:
    """The floating-point dtypes among a node's type attributes (T, dtype, DstT, a Const's value...)."""
    found = []
    for value in node.attr.values():
        types = list(value.list.type) + ([value.type] if value.type else [])
        found += [tf.as_dtype(t).name for t in types if tf.as_dtype(t).is_floating or tf.as_dtype(t).is_complex]
    return found


def _orders_only(graphs: "_Graphs", device: str, node) -> bool:
    """A transfer or identity of TensorFlow's empty control carrier (no value), or the carrier itself."""
    if is_control_carrier(node):
        return True
    if node.op in RECV_OPS:
        source = device_util.canonicalize(node.attr["send_device"].s.decode())
        send = graphs.sends.get((node.attr["tensor_name"].s, source))
        return send is not None and is_control_carrier(graphs.resolve(source, send.input[0])[1])
    if node.op in SEND_OPS or node.op in _TRANSPARENT:
        return is_control_carrier(graphs.resolve(device, node.input[0])[1])
    return False


def _tfe_devices(partition_graphs) -> List[str]:
    devices = set()
    for graph_def in partition_graphs:
        for node in graph_def.node:
            if node.device and tf.DeviceSpec.from_string(node.device).job == TFE_JOB:
                devices.add(device_util.canonicalize(node.device))
    return sorted(devices)


def _fail(message: str) -> None:
    raise PartyAuditError(message + " Secure aggregation's promise does not hold for this graph.")


def _party_nodes(graphs: _Graphs, unit) -> Tuple[List[Tuple[str, object]], set, int]:
    """The nodes on parties, checked against `PARTY_OPS`, feeds, collectives and floats."""
    nodes, parties, count = [], set(), 0
    for device, node in graphs.nodes.values():
        party = unit(device)
        if party is None:
            continue
        if node.op in RECV_OPS and node.attr["client_terminated"].b or node.op in ("_Arg", "Placeholder"):
            _fail(f"{party} takes a value fed by the client: {node.op} {node.name!r}.")
        if node.op.startswith(("Collective", "Nccl")):
            _fail(f"{party} runs the collective op {node.name!r} ({node.op}), which exchanges data "
                  "without a send/receive the audit can check.")
        floats = [] if _orders_only(graphs, device, node) else _float_dtypes(node)
        if floats:
            _fail(f"{party} runs {node.op} {node.name!r} on a {floats[0]} value: parties must hold ring "
                  "elements and keys only.")
        if node.op not in PARTY_OPS:
            _fail(f"{party} runs {node.op} {node.name!r}, which is not an op a party may run "
                  f"(tfe_estimator.audit.party_audit.PARTY_OPS).")
        nodes.append((device, node))
        if node.op not in RECV_OPS + SEND_OPS:
            parties.add(party)
            count += 1
    return nodes, parties, count


def audit_party_inputs(run_metadata_or_partition_graphs, party_devices: Optional[Sequence[str]] = None) -> AuditReport:
    """Checks every tensor a TFE party receives or computes in one run; raises naming the first violation.

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

    def unit(device):
        return party_of(device, party_devices) if party_devices and device else None

    nodes, parties, count = _party_nodes(graphs, unit)
    if count == 0:
        _fail(f"No op of this run is placed on the parties {list(party_devices)}: the run has no secure "
              "sum, or the parties are not the devices it uses.")
    forms = Forms(graphs.resolve, unit)
    edges = [e for e in party_edges(partition_graphs, party_devices) if e.carries_value]
    received: Dict[str, List[Tuple]] = collections.defaultdict(list)
    values: List[Tuple[str, str, Tuple]] = []  # (party, where, producer) of every value to check
    for edge in edges:
        where = (f"{edge.party} receives {edge.tensor} ({edge.producer_type}, {edge.dtype.name}) from "
                 f"{edge.source_device}")
        if not edge.dtype.is_integer:
            _fail(f"{where}: a {edge.dtype.name} value; parties must only receive ring elements and keys.")
        device, node, index = graphs.resolve(edge.source_device, edge.tensor)
        try:
            if (node.op, index) in SEED_OUTPUTS:
                received[edge.party].append(forms.seed_id(device, node, index))
            elif node.op in MASK_STREAMS:  # a mask itself: the party then knows it
                received[edge.party].extend(forms.of(device, node, index).mask_seeds)
            else:
                values.append((edge.party, where, (device, node, index)))
        except MaskError as e:
            _fail(f"{where}: {e}.")
    for device, node in nodes:  # what each party computes from what it holds
        if node.op == "TfeServerSum" or node.op in LINEAR_OPS:
            values.append((unit(device), f"{unit(device)} computes {node.name}:0 ({node.op})", (device, node, 0)))
    held = {party: forms.held(party, received[party], nodes) for party in set(received) | parties}
    for party, where, producer in values:
        try:
            form = forms.of(*producer)
        except MaskError as e:
            _fail(f"{where}: {e}.")
        _check_hidden(party, where, form, held.get(party, frozenset()))
    return AuditReport(parties=tuple(sorted(parties)), party_ops=count, edges=tuple(edges))


def _check_hidden(party: str, where: str, form: Form, held) -> None:
    if not form.data:
        return
    owners = ", ".join(sorted({f"{name} on {device}" for device, name, _ in form.data})[:3])
    if not form.masks:
        _fail(f"{where}: not a masked share: it carries owner data ({owners}) with no mask left on it; an "
              "unmasked value reaches this party.")
    if form.mask_seeds <= held:
        _fail(f"{where}: {party} also holds the key of every mask on it ({len(form.masks)}): it can unmask "
              f"the owner data ({owners}).")


class PartyAuditHook(tf.compat.v1.train.SessionRunHook):
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
        return tf.compat.v1.train.SessionRunArgs(
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
