"""What each TFE party receives: the edges into its devices in the graphs a session runs.

A party "sees" exactly the tensors other devices send it. In the graphs a
TensorFlow session really executes (after placement and Grappler, one
partition per device, returned in ``RunMetadata.partition_graphs`` when a run
asks for ``RunOptions(output_partition_graphs=True)``), every such tensor
arrives through a ``_Recv`` (or ``_HostRecv``) node on the party's device,
paired with a ``_Send`` on the producer's device whose input names the
producer's output. `party_edges` lists those edges; `capture_party_views`
also fetches their values in the same run: fetching a tensor in a run returns
the very buffer the run computed once and sent to every consumer, so the
value is exactly what the party received in that step.

The unit of a party is its device on one machine, and its whole task (one
process) on a cluster: an op placed on another device of a ``tfe`` task still
runs in that party's process. Edges between devices of one party are not
crossings.

Example::

    run_metadata = tf.compat.v1.RunMetadata()
    session.run(train_op, options=tf.compat.v1.RunOptions(output_partition_graphs=True),
                run_metadata=run_metadata)
    for edge in party_edges(run_metadata.partition_graphs, strategy.secure_aggregation.server_devices):
        print(edge.party, "<-", edge.source_device, edge.tensor, edge.dtype.name)
"""
import dataclasses
import re
from typing import Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

import numpy as np
import tensorflow as tf

__all__ = ["PartyEdge", "CaptureError", "party_of", "party_edges", "party_nodes", "capture_party_views",
           "group_by_party", "partition_graphs_of", "is_control_carrier"]

#: The ops that carry a tensor between the partitions of one run.
RECV_OPS = ("_Recv", "_HostRecv")
SEND_OPS = ("_Send", "_HostSend")


class CaptureError(RuntimeError):
    """A value a party received could not be fetched (e.g. Grappler made its producer)."""


@dataclasses.dataclass(frozen=True)
class PartyEdge:
    """One tensor a party receives from a device outside it, in one run.

    Attributes:
      party: the party's unit: its device (one machine) or its task (cluster).
      device: the receiving device.
      source_device: the producer's device.
      tensor: the producer's output as named in the partition graph ("op:index").
      producer_type: the producer op's type (e.g. "TfeMaskShare").
      dtype: the received tensor's dtype.
      carries_value: False for TensorFlow's control-edge carriers (an empty
        constant sent only to order ops across devices).
      producer: the producer's `NodeDef`.
    """

    party: str
    device: str
    source_device: str
    tensor: str
    producer_type: str
    dtype: tf.DType
    carries_value: bool
    producer: object = dataclasses.field(compare=False, hash=False, repr=False)

    @property
    def output_index(self) -> int:
        """Which output of the producer this edge carries."""
        return int(self.tensor.rsplit(":", 1)[1])


def _canonical(device: str) -> str:
    from tensorflow.python.distribute import device_util  # pylint: disable=import-outside-toplevel

    return device_util.canonicalize(device)


def _unit(device: str) -> str:
    """A party's unit for `device`: the device on one machine, the task on a cluster."""
    spec = tf.DeviceSpec.from_string(device)
    if spec.job in (None, "localhost"):
        return _canonical(device)
    return f"/job:{spec.job}/replica:{spec.replica or 0}/task:{spec.task or 0}"


def party_of(device: str, party_devices: Sequence[str]) -> Optional[str]:
    """The unit of the party that `device` belongs to, or None."""
    if not device:
        return None
    units = {_unit(d) for d in party_devices}
    unit = _unit(device)
    return unit if unit in units else None


def partition_graphs_of(source) -> List:
    """The partition `GraphDef`s of a `RunMetadata` or of a sequence of `GraphDef`s."""
    graphs = getattr(source, "partition_graphs", source)
    try:
        if isinstance(graphs, (tf.Graph, str, bytes)):
            raise TypeError
        graphs = list(graphs)
    except TypeError:
        raise TypeError(
            "Expected the partitioned graphs a session ran (RunMetadata.partition_graphs from a run "
            "with tf.compat.v1.RunOptions(output_partition_graphs=True)), got "
            f"{type(source).__name__}. A tf.Graph only says where ops were requested, not where "
            "they ran: use tfe_estimator.audit.party_audit.PartyAuditHook in training, or run a step with "
            "those options."
        ) from None
    return list(graphs)


def _node_device(node, graph_def) -> str:
    return node.device or next((n.device for n in graph_def.node if n.device), "")


def _tensor_name(name: str) -> str:
    return name if ":" in name else f"{name}:0"


def is_control_carrier(node) -> bool:
    """An empty constant: what TensorFlow sends between devices only to order ops (no value)."""
    if node.op != "Const":
        return False
    shape = node.attr["value"].tensor.tensor_shape
    return any(dim.size == 0 for dim in shape.dim)


def _index(partition_graphs) -> Tuple[Dict[Tuple[str, str], object], Dict[Tuple[bytes, str], object]]:
    """(device, node name) -> NodeDef, and (rendezvous tensor name, send device) -> _Send NodeDef."""
    nodes, sends = {}, {}
    for graph_def in partition_graphs:
        for node in graph_def.node:
            device = _canonical(_node_device(node, graph_def))
            nodes[(device, node.name)] = node
            if node.op in SEND_OPS:
                sends[(node.attr["tensor_name"].s, _canonical(node.attr["send_device"].s.decode()))] = node
    return nodes, sends


def party_nodes(partition_graphs, party_devices: Sequence[str]) -> List[Tuple[str, object]]:
    """``(party, NodeDef)`` for every op that ran on a party's devices, sends and receives excluded."""
    out = []
    for graph_def in partition_graphs_of(partition_graphs):
        for node in graph_def.node:
            party = party_of(_node_device(node, graph_def), party_devices)
            if party is not None and node.op not in SEND_OPS + RECV_OPS:
                out.append((party, node))
    return out


def party_edges(partition_graphs, party_devices: Sequence[str]) -> List[PartyEdge]:
    """Every tensor a party received from outside it in the run these partitions come from.

    Args:
      partition_graphs: ``RunMetadata.partition_graphs`` (or the `RunMetadata`).
      party_devices: the TFE parties' devices (e.g. ``SecureAggregation.server_devices``).

    Returns:
      One `PartyEdge` per (receiving device, producer output), in partition order.

    Raises:
      ValueError: if a receive has no matching send in the partitions (they
        are not all from one run).
    """
    partition_graphs = partition_graphs_of(partition_graphs)
    nodes, sends = _index(partition_graphs)
    edges = []
    for graph_def in partition_graphs:
        for node in graph_def.node:
            if node.op not in RECV_OPS or node.attr["client_terminated"].b:
                continue  # a client feed has no send: `audit` refuses those on parties
            device = _canonical(_node_device(node, graph_def))
            party = party_of(device, party_devices)
            source_device = _canonical(node.attr["send_device"].s.decode())
            if party is None or party_of(source_device, party_devices) == party:
                continue
            send = sends.get((node.attr["tensor_name"].s, source_device))
            if send is None:
                raise ValueError(
                    f"The receive {node.name!r} on {device} has no matching send in the partition "
                    "graphs: pass all the partition graphs of one run."
                )
            tensor = _tensor_name(send.input[0])
            producer = nodes[(source_device, tensor.rsplit(":", 1)[0])]
            edges.append(PartyEdge(
                party=party, device=device, source_device=source_device, tensor=tensor,
                producer_type=producer.op, dtype=tf.as_dtype(node.attr["tensor_type"].type),
                carries_value=not is_control_carrier(producer), producer=producer))
    return edges


def capture_party_views(
    session: tf.compat.v1.Session,
    fetches,
    party_devices: Sequence[str],
    feed_dict: Optional[Mapping] = None,
    max_attempts: int = 3,
):
    """Runs one step of `fetches` and returns what each party received in that very step.

    The run asks for its partition graphs and also fetches the producer of
    every edge into a party. A fetch can change what a run prunes, so the
    edges are read from the same run that fetched the values; if that run
    has an edge whose producer was not fetched, the step is run again with
    it (at most `max_attempts` runs). Every returned value is the value of
    that edge in the returned run.

    Returns:
      ``(results, views, partition_graphs)``: the fetched `fetches`, a list
      of ``(PartyEdge, numpy value)`` for every value-carrying edge into a
      party, and the run's partition graphs.

    Raises:
      CaptureError: if an edge's producer is not a tensor of the session's
        graph (Grappler created it), or the edges did not settle.
    """
    graph = session.graph
    extra: Dict[str, tf.Tensor] = {}
    for _ in range(max_attempts):
        run_metadata = tf.compat.v1.RunMetadata()
        results, values = session.run(
            (fetches, dict(extra)), feed_dict=feed_dict, run_metadata=run_metadata,
            options=tf.compat.v1.RunOptions(output_partition_graphs=True))
        edges = [e for e in party_edges(run_metadata.partition_graphs, party_devices) if e.carries_value]
        missing = [e for e in edges if e.tensor not in extra]
        if not missing:
            return results, [(e, np.asarray(values[e.tensor])) for e in edges], list(run_metadata.partition_graphs)
        for edge in missing:
            try:
                extra[edge.tensor] = graph.get_tensor_by_name(_graph_tensor_name(edge))
            except (KeyError, ValueError) as exc:
                raise CaptureError(
                    f"{edge.party} receives {edge.tensor} ({edge.producer_type}) from {edge.source_device}, "
                    "which is not a tensor of the session's graph (a node Grappler made); its value "
                    "cannot be fetched."
                ) from exc
    raise CaptureError(f"The edges into the parties did not settle after {max_attempts} runs.")


def _graph_tensor_name(edge: PartyEdge) -> str:
    """The session graph's name of an edge's tensor.

    A fed placeholder runs as an ``_Arg`` node named
    ``_arg_<placeholder>_<output>_<argument index>``: fetching the placeholder
    gives the fed value, which is what the party received.
    """
    match = re.fullmatch(r"_arg_(.+)_(\d+)_\d+:0", edge.tensor) if edge.producer_type == "_Arg" else None
    return f"{match.group(1)}:{match.group(2)}" if match else edge.tensor


def group_by_party(views: Iterable[Tuple[PartyEdge, np.ndarray]]) -> Dict[str, List[Tuple[PartyEdge, np.ndarray]]]:
    """``party -> [(edge, value), ...]``."""
    grouped: Dict[str, List[Tuple[PartyEdge, np.ndarray]]] = {}
    for edge, value in views:
        grouped.setdefault(edge.party, []).append((edge, value))
    return grouped
