"""The audit's rule for between-graph sums: server accumulators and queues that carry a step's contributions.

In between-graph mode (`tfe_estimator.distribute.step_sum`) an owner's graph
does not show the other owners' contributions: they arrive through shared-name
resources on the servers. The audit treats those resources as channels with a
fixed meaning, checked in every graph that touches them:

- every ``TfeStepAccumulator``/``FIFOQueueV2`` on a party is named by
  step_sum's scheme, ``<SHARED_NAME_PREFIX>/<channel>/server<k>`` (an
  accumulator) or ``.../server<k>/owner<o>`` (an owner's queue), with ``k`` the
  index of the party it lives on; any other accumulator or queue on a party is
  refused;
- ``TfeStepPut`` runs on the accumulator's party; into server0's accumulator
  it puts a fresh key (`SEED_OUTPUTS`, drawn on an owner's device), into
  server1's a masked share (a value with owner data and masks); a key put into
  server1's accumulator is refused, and the share is checked like any value a
  party receives (server1 must lack its key);
- ``TfeStepTake`` runs only on the accumulator's party and each of its outputs
  reaches nothing but that party's ``TfeServerSum``; output ``r`` of server0's
  take is owner r's key, of server1's take owner r's share masked by that key,
  so the server sums get the same forms as in-graph;
- ``QueueEnqueueV2`` enqueues ``(step, TfeServerSum:0 or :1 of its own
  party)`` into a queue of the scheme: a partial sum or server0's fresh blind
  key, which only owners receive; ``QueueDequeueV2`` therefore yields one;
- the step itself (an integer scalar) may reach a party only as the step input
  of a put or a take, or as a queue's step component.

Limits: the takes and enqueues are in the chief's graph only, so a non-chief
owner's audit relies on the chief's; the step value a party sees is public but
not proven to be the step (an owner could put 64 bits of anything there).

Example::

    checks = StepChannels(graphs, unit, party_devices)
    checks.check()   # raises PartyAuditError naming the op
"""
import re
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from tfe_estimator.distribute.step_sum import SHARED_NAME_PREFIX

__all__ = ["StepChannels", "CHANNEL_OPS"]

#: Resource ops of a between-graph channel (checked by `StepChannels`).
CHANNEL_OPS = frozenset({"TfeStepAccumulator", "TfeStepPut", "TfeStepTake", "FIFOQueueV2", "QueueEnqueueV2",
                         "QueueDequeueV2"})
#: Where the public step may go on a party: (op type, input position).
_STEP_INPUTS = frozenset({("TfeStepPut", 1), ("TfeStepTake", 1), ("QueueEnqueueV2", 1)})
_ACCUMULATOR = re.compile(re.escape(SHARED_NAME_PREFIX) + r"/(.+)/server(\d+)$")
_QUEUE = re.compile(re.escape(SHARED_NAME_PREFIX) + r"/(.+)/server(\d+)/owner(\d+)$")


class StepChannels:
    """Checks the between-graph channel ops of one run's partition graphs.

    Args:
      graphs: `party_audit`'s graph index (``nodes``, ``resolve``).
      unit: device -> the party's unit, or None for an owner's device.
      party_devices: the parties in protocol order (server0, server1, ...).
      fail: raises `PartyAuditError` with a message.
      seed_outputs: (op type, output index) of fresh keys.
    """

    def __init__(self, graphs, unit: Callable[[str], Optional[str]], party_devices: Sequence[str],
                 fail: Callable[[str], None], seed_outputs):
        self._graphs, self._unit, self._fail, self._seeds = graphs, unit, fail, seed_outputs
        self._index = {}
        for device in party_devices:
            party = unit(device)
            if party is not None and party not in self._index:
                self._index[party] = len(self._index)
        self.consumers: Dict[Tuple[str, str], List[Tuple[object, int]]] = {}
        for device, node in graphs.nodes.values():
            for i, name in enumerate(node.input):
                if not name.startswith("^"):
                    self.consumers.setdefault((device, name.partition(":")[0]), []).append((node, i))

    def _scheme(self, device: str, handle: str, pattern, what: str, user) -> Tuple:
        res_device, res, _ = self._graphs.resolve(device, handle)
        party = self._unit(res_device)
        name = res.attr["shared_name"].s.decode() if "shared_name" in res.attr else ""
        match = pattern.match(name)
        if party is None or match is None or int(match.group(2)) != self._index.get(party):
            self._fail(f"{user.op} {user.name!r} on {device} uses the {what} {res.op} {res.name!r} on {res_device} "
                       f"named {name!r}: between-graph sums use only {what}s named "
                       f"'{SHARED_NAME_PREFIX}/<channel>/server<k>...' on server k.")
        if res_device != device:
            self._fail(f"{user.op} {user.name!r} runs on {device}, not on its {what}'s party {res_device}: an "
                       "owner's device must not touch the servers' contributions.")
        return int(match.group(2)), match.group(1)

    def channel_of(self, device: str, node) -> Tuple[int, str]:
        """(server index, channel) of the accumulator a ``TfeStepTake`` takes from."""
        return self._scheme(device, node.input[0], _ACCUMULATOR, "accumulator", node)

    def check(self) -> None:
        """Raises through `fail` naming the first channel op that breaks the rule (module docstring)."""
        for device, node in list(self._graphs.nodes.values()):
            if node.op in ("TfeStepAccumulator", "FIFOQueueV2") and self._unit(device) is not None:
                pattern, what = (_ACCUMULATOR, "accumulator") if node.op == "TfeStepAccumulator" else (_QUEUE, "queue")
                self._scheme(device, node.name, pattern, what, node)
            elif node.op == "TfeStepPut":
                k, _ = self._scheme(device, node.input[0], _ACCUMULATOR, "accumulator", node)
                self._check_put(device, node, k)
            elif node.op == "TfeStepTake":
                self._scheme(device, node.input[0], _ACCUMULATOR, "accumulator", node)
                self._check_take(device, node)
            elif node.op == "QueueEnqueueV2":
                self._scheme(device, node.input[0], _QUEUE, "queue", node)
                value_device, value, index = self._graphs.resolve(device, node.input[2])
                if value.op != "TfeServerSum" or index not in (0, 1) or value_device != device:
                    self._fail(f"{node.name!r} on {device} enqueues {value.op} {value.name!r}:{index} from "
                               f"{value_device}: an owner's queue may only receive its server's partial sum "
                               "or blind key (TfeServerSum:0 or :1 on the queue's party).")
            elif node.op == "QueueDequeueV2":
                self._scheme(device, node.input[0], _QUEUE, "queue", node)

    def _check_put(self, device: str, node, k: int) -> None:
        value_device, value, index = self._graphs.resolve(device, node.input[2])
        is_seed = (value.op, index) in self._seeds
        if k == 0 and not (is_seed and self._unit(value_device) is None):
            self._fail(f"{node.name!r} puts {value.op} {value.name!r}:{index} from {value_device} into "
                       "server0's accumulator, which takes only a fresh key drawn on an owner's device.")
        if k != 0 and is_seed:
            self._fail(f"{node.name!r} puts the key {value.name!r}:{index} into server{k}'s accumulator, which "
                       "holds the masked shares: one server would hold both key and share.")

    def _check_take(self, device: str, node) -> None:
        pending = [(node.name, i) for i in range(node.attr["num_owners"].i)]
        while pending:
            name, index = pending.pop()
            for user, position in self.consumers.get((device, name), []):
                if user.input[position] not in (name if index == 0 else f"{name}:{index}", f"{name}:{index}"):
                    continue
                if user.op == "Identity":
                    pending.append((user.name, 0))
                elif user.op != "TfeServerSum":
                    self._fail(f"{node.name!r} on {device} takes the owners' contributions and {user.op} "
                               f"{user.name!r} uses them: they may only reach this server's TfeServerSum "
                               "(no single owner's contribution leaves a server).")

    def is_step_value(self, device: str, tensor: str, source_device: str) -> bool:
        """Whether the tensor `tensor` of `source_device` received on a party only serves as the public step."""
        names = [node.name for d, node in self._graphs.nodes.values()
                 if d == device and node.op in ("_Recv", "_HostRecv")
                 and node.attr["send_device"].s.decode().lower() == source_device.lower()
                 and _input_tensor(self._graphs.sends.get((node.attr["tensor_name"].s, source_device))) == tensor]
        return bool(names) and all(self._step_only(device, name) for name in names)

    def _step_only(self, device: str, recv_name: str) -> bool:
        uses = self.consumers.get((device, recv_name), [])
        if not uses:
            return False
        return all((user.op, position) in _STEP_INPUTS for user, position in uses)


def _input_tensor(send) -> Optional[str]:
    if send is None:
        return None
    name = send.input[0]
    return name if ":" in name else name + ":0"
