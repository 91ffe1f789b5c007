"""The Flower app that `tools.bench.flower_deployed` runs on Flower's own deployment runtime.

It is copied, with a generated ``pyproject.toml``, into a temporary Flower app directory and
submitted with ``flwr run`` to a SuperLink; it runs in Flower's own virtualenv (``.venv-flower``),
never in ours. Two components, built on first access (importing this file
does nothing, and it imports without Flower installed; Flower finds them as ``components.serverapp``
and ``components.clientapp``):

- ``clientapp``: a `NumPyClient` whose ``fit`` returns one float32 vector of ``elements`` values
  (seeded by its node id), wrapped by Flower's ``secaggplus_mod``;
- ``serverapp``: Flower's legacy `DefaultWorkflow` with ``SecAggPlusWorkflow`` as its fit workflow
  (FedAvg over all ``clients``, no evaluation, initial parameters given so no client is asked),
  ``rounds`` secure rounds. Around each round it writes one JSON line to the run config's ``out``
  file: the round's wall seconds and the CPU seconds, over that round, of every process descended
  from the ``pids`` the bench started (SuperLink, SuperNodes and what they spawn: SuperExecs,
  ServerApp and ClientApp processes), in total and per pid's tree (``cpu_s_by_root``), read from
  ``/proc``, and how far the released mean is from the
  plain mean of the clients' vectors (``max_error``; each client's vector is seeded by its node id).

Usage (what the bench writes into the app's ``pyproject.toml``)::

    [tool.flwr.app.components]
    serverapp = "flower_deployed_app:components.serverapp"
    clientapp = "flower_deployed_app:components.clientapp"
"""
import json
import os
import time
from typing import Dict, Iterable, List

__all__ = ["tree_cpu_seconds", "client_vector", "make_serverapp", "make_clientapp", "components"]

_CLOCK_TICKS = None


def _stat(pid: int):
    """(ppid, utime + stime + cutime + cstime in ticks) of `pid`, or None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    # After the command: state ppid ... utime(12) stime(13) cutime(14) cstime(15), 0-based from state.
    return int(fields[1]), sum(int(f) for f in fields[11:15])


def tree_cpu_seconds(roots: Iterable[int]) -> float:
    """CPU seconds so far of the processes `roots` and all their live descendants (reaped children included)."""
    global _CLOCK_TICKS  # pylint: disable=global-statement
    if _CLOCK_TICKS is None:
        _CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
    stats: Dict[int, tuple] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            found = _stat(int(entry))
            if found is not None:
                stats[int(entry)] = found
    children: Dict[int, List[int]] = {}
    for pid, (ppid, _) in stats.items():
        children.setdefault(ppid, []).append(pid)
    total, todo, seen = 0, [p for p in roots if p in stats], set()
    while todo:
        pid = todo.pop()
        if pid in seen:
            continue
        seen.add(pid)
        total += stats[pid][1]
        todo.extend(children.get(pid, []))
    return total / _CLOCK_TICKS


def client_vector(node_id: int, elements: int):
    """The float32 vector in [-1, 1) that the SuperNode `node_id` contributes (the server recomputes it to check)."""
    import numpy as np  # pylint: disable=import-outside-toplevel

    return np.random.default_rng(int(node_id) % 2**32).uniform(-1, 1, elements).astype(np.float32)


def make_clientapp():
    """Flower's ClientApp: one vector of the run config's ``elements`` per fit, under ``secaggplus_mod``."""
    from flwr.client import ClientApp, NumPyClient  # pylint: disable=import-outside-toplevel,import-error
    from flwr.client.mod import secaggplus_mod  # pylint: disable=import-outside-toplevel,import-error

    class VectorClient(NumPyClient):
        def __init__(self, vector):
            self.vector = vector

        def fit(self, parameters, config):  # pylint: disable=unused-argument
            return [self.vector], 1, {}

    def client_fn(context):
        return VectorClient(client_vector(context.node_id, int(context.run_config["elements"]))).to_client()

    return ClientApp(client_fn=client_fn, mods=[secaggplus_mod])


def make_serverapp():
    """Flower's ServerApp: ``rounds`` SecAgg+ rounds over ``clients`` SuperNodes, each round timed into ``out``."""
    import numpy as np  # pylint: disable=import-outside-toplevel
    import flwr.compat.common.recorddict_compat as compat  # pylint: disable=import-outside-toplevel,import-error
    from flwr.common import ndarrays_to_parameters, parameters_to_ndarrays  # pylint: disable=C0415,E0401
    from flwr.server.workflow.constant import MAIN_PARAMS_RECORD  # pylint: disable=C0415,E0401
    from flwr.server import LegacyContext, ServerApp, ServerConfig  # pylint: disable=C0415,E0401
    from flwr.server.strategy import FedAvg  # pylint: disable=import-outside-toplevel,import-error
    from flwr.server.workflow import DefaultWorkflow, SecAggPlusWorkflow  # pylint: disable=C0415,E0401

    app = ServerApp()

    @app.main()
    def main(grid, context) -> None:
        config = context.run_config
        clients, elements, rounds = int(config["clients"]), int(config["elements"]), int(config["rounds"])
        roots = [int(p) for p in str(config["pids"]).split(",")]
        out = str(config["out"])
        strategy = FedAvg(fraction_fit=1.0, fraction_evaluate=0.0, min_fit_clients=clients,
                          min_evaluate_clients=0, min_available_clients=clients,
                          initial_parameters=ndarrays_to_parameters([np.zeros(elements, np.float32)]))
        legacy = LegacyContext(context=context, config=ServerConfig(num_rounds=rounds), strategy=strategy)
        # Every client holds a share of every other's secrets and all are needed (as tools/bench/flower_secagg.py);
        # Flower takes these as fractions of the sampled clients (an integer must be > 2).
        secure = SecAggPlusWorkflow(num_shares=1.0, reconstruction_threshold=1.0)

        def timed_round(grid_, context_) -> None:
            wall, cpu = time.perf_counter(), [tree_cpu_seconds([root]) for root in roots]
            secure(grid_, context_)
            wall = time.perf_counter() - wall
            cpu = [tree_cpu_seconds([root]) - before for root, before in zip(roots, cpu)]
            row = {"elements": elements, "clients": clients, "wall_s": wall, "cpu_s": sum(cpu),
                   "cpu_s_by_root": cpu}
            # What SecAgg+ released (the mean of the clients' vectors) against the plain mean.
            released = parameters_to_ndarrays(compat.arrayrecord_to_parameters(
                context_.state.array_records[MAIN_PARAMS_RECORD], keep_input=True))[0]
            row["max_error"] = float(np.max(np.abs(released - np.mean(
                [client_vector(node, elements) for node in grid_.get_node_ids()], axis=0))))
            with open(out, "a", encoding="utf-8") as sink:
                sink.write(json.dumps(row) + "\n")

        DefaultWorkflow(fit_workflow=timed_round)(grid, legacy)

    return app


class _Components:  # pylint: disable=too-few-public-methods
    """The app's two components, each built when Flower looks it up (``components.serverapp``)."""

    @property
    def serverapp(self):
        return make_serverapp()

    @property
    def clientapp(self):
        return make_clientapp()


#: What the app's pyproject.toml names (Flower checks the first name statically, then follows the dots).
components = _Components()
