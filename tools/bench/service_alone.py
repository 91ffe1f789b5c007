"""The aggregation service alone, without TensorFlow: CPU per parameter of each server and of the owners' clients.

Two `AggregationServer` processes (server0, server1) with mutual TLS on
loopback, and N `OwnerClient` threads in this process putting random masked
shares of E elements for K timed steps (after 3 untimed). It isolates what the
service's data path costs (gRPC, TLS, copies, ring sums, key expansion) from
the model's step, for profiling (e.g. ``py-spy record -p <server pid>``, the
pids are printed) and for the floor of the `svc-*` cases of `tools.bench`.

Run::

    PYTHONPATH=. python -m tools.bench.service_alone --elements 100000 1000000 --steps 50 --owners 2

Prints per size: wall ms per step, CPU ms per step of server0, server1 and of
all owner clients together, and ns per parameter (per owner for the clients).
"""
import argparse
import subprocess
import sys
import tempfile
import threading
import time
from typing import List, Optional, Sequence

import numpy as np
import portpicker

from tools.bench.service_case import process_cpu_seconds

__all__ = ["main"]

_SERVER = """
import sys
from tfe_estimator.service import AggregationServer, TlsFiles
role, certs, addresses, owners = int(sys.argv[1]), sys.argv[2], sys.argv[3].split(","), sys.argv[4].split(",")
server = AggregationServer(role, addresses[role], owners, TlsFiles.from_dir(certs, "tfe", role),
                           peer_address=addresses[1] if role == 0 else None)
server.start()
print("up", flush=True)
server.wait()
"""


def _measure(elements: int, steps: int, owners: int, certs_dir: str) -> str:
    from tfe_estimator.service import OwnerClient, TlsFiles  # pylint: disable=import-outside-toplevel

    tasks = [("chief", 0)] + [("worker", i) for i in range(owners - 1)]
    addresses = [f"localhost:{portpicker.pick_unused_port()}" for _ in range(2)]
    servers = {}
    for role in (1, 0):  # server1 first: server0 connects to it
        servers[role] = subprocess.Popen(  # pylint: disable=consider-using-with
            [sys.executable, "-c", _SERVER, str(role), certs_dir, ",".join(addresses),
             ",".join(f"{j}:{i}" for j, i in tasks)], stdout=subprocess.PIPE, text=True)
        if servers[role].stdout.readline().strip() != "up":
            raise RuntimeError(f"aggregation server{role} did not start")
    clients = [OwnerClient(addresses, TlsFiles.from_dir(certs_dir, job, index)) for job, index in tasks]
    rng = np.random.default_rng(0)
    shares = [rng.integers(-2**62, 2**62, elements, dtype=np.int64) for _ in tasks]
    key = np.arange(4, dtype=np.int32)
    try:
        def run(first: int, count: int) -> None:
            def owner(k: int) -> None:
                for step in range(first, first + count):
                    clients[k].contribute("sum", step, 64, elements, key, shares[k])
            threads = [threading.Thread(target=owner, args=(k,)) for k in range(owners)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()

        run(0, 3)
        before = [process_cpu_seconds(servers[r].pid) for r in (0, 1)], time.process_time(), time.perf_counter()
        run(3, steps)
        after = [process_cpu_seconds(servers[r].pid) for r in (0, 1)], time.process_time(), time.perf_counter()
    finally:
        for client in clients:
            client.close()
        for server in servers.values():
            server.terminate()
            server.wait(timeout=30)
    server_ms = [1e3 * (a - b) / steps for a, b in zip(after[0], before[0])]
    owners_ms = 1e3 * (after[1] - before[1]) / steps
    wall_ms = 1e3 * (after[2] - before[2]) / steps
    per_param = [1e6 * ms / elements for ms in server_ms] + [1e6 * owners_ms / elements / owners]
    return (f"{elements:,} elements, {owners} owners (server pids {servers[0].pid}, {servers[1].pid}): wall "
            f"{wall_ms:.2f} ms/step; CPU ms/step server0 {server_ms[0]:.2f}, server1 {server_ms[1]:.2f}, owner "
            f"clients {owners_ms:.2f}; ns/param server0 {per_param[0]:.1f}, server1 {per_param[1]:.1f}, "
            f"each owner's client {per_param[2]:.1f}")


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.bench.service_alone", description=__doc__.split("\n")[0])
    parser.add_argument("--elements", type=int, nargs="+", default=[100_000, 1_000_000], help="vector sizes")
    parser.add_argument("--steps", type=int, default=30, help="timed steps per size (default 30)")
    parser.add_argument("--owners", type=int, default=2, help="owners (default 2)")
    args = parser.parse_args(argv)
    from tfe_estimator.cluster import certs  # pylint: disable=import-outside-toplevel

    with tempfile.TemporaryDirectory(prefix="tfe-service-alone-") as certs_dir:
        tasks: List = [("chief", 0)] + [("worker", i) for i in range(args.owners - 1)] + [("tfe", 0), ("tfe", 1)]
        certs.make_cluster_certs(certs_dir, tasks, cluster="bench")
        for elements in args.elements:
            print(f"[service-alone] {_measure(elements, args.steps, args.owners, certs_dir)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
