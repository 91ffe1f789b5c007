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
all owner clients together, ns per parameter (per owner for the clients), and
per owner and step the round trips (Contribute calls) and bytes up and down;
then, measured in the same run on this CPU, each role's floor (`floor`): the
AES its bytes need at one core's speed (AES-128-GCM for TLS, AES-128-CTR for
key expansion, `cryptography`'s OpenSSL) plus its ring sums, and the ratio
to it. ``--huge-pages`` starts the servers as the launcher and the Kubernetes
manifests do (`tfe_estimator.cluster.huge_pages`).
`measure` also runs the owners through a latency-adding relay
(`tools.bench.distance`).
"""
import argparse
import os
import subprocess
import sys
import tempfile
import threading
import time
from typing import Dict, List, Optional, Sequence

import numpy as np
import portpicker

from tools.bench import servers as bench_servers
from tools.bench.floors import measure_costs, role_floors
from tools.bench.service_case import process_cpu_seconds

__all__ = ["main", "measure", "floor"]

def _start_relays(addresses: List[str], rtt_ms: float, bandwidth_mbps: Optional[float]):
    """A `tools.bench.relay` process relaying to each server; returns it and its addresses, in order."""
    from tools.bench import relay as relay_module  # pylint: disable=import-outside-toplevel

    # The file as a script: `-m tools.bench.relay` would import the package, and TensorFlow with it.
    command = [sys.executable, relay_module.__file__, "--rtt-ms", str(rtt_ms)]
    command += [f"--target={a}" for a in addresses]
    if bandwidth_mbps is not None:
        command += ["--bandwidth-mbps", str(bandwidth_mbps)]
    relay = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE,  # pylint: disable=consider-using-with
                             text=True)
    line = relay.stdout.readline().strip()
    if not line.startswith("relay ports "):
        relay.kill()
        relay.wait()
        raise RuntimeError(f"the relay did not start (it printed {line!r})")
    return relay, [f"localhost:{p}" for p in line.split()[-1].split(",")]


def floor(owners: int, certs_dir: Optional[str] = None) -> Dict[str, float]:
    """Each role's floor in ns per parameter (per owner for ``client``) at 64-bit ring words on this CPU, one core.

    Measured here (`tools.bench.floors.measure_costs`, cache-resident 1 MiB blocks, like ``openssl speed``):
    AES-128-GCM (TLS records) and AES-128-CTR (key expansion) with `cryptography`, and NumPy's uint64 addition.
    With N owners, per parameter: server1 decrypts 8 (N + 1) B (the shares and server0's part), encrypts 8 N B
    (w to each owner) and adds N + 1 vectors; server0 expands N + 1 keys (the owners' and its blind key), adds
    them and encrypts its 8 B forward; an owner's client encrypts 8 B and decrypts 8 B
    (`tools.bench.floors.role_floors`). Copies, the kernel and gRPC come on top.

    With `certs_dir`, also each role's transport floor (``*_tls``): the same bytes at the measured cost of
    the data plane's TLS on loopback TCP (`tools.bench.floors.tls_costs`: the kernel's socket copies and
    OpenSSL's included), plus the ring sums and key expansion: what the data plane cannot go below with TLS
    on TCP here.
    """
    costs = measure_costs(certs_dir)
    out = dict(role_floors(costs, owners, 8, "cipher"), gcm_gb_s=1 / costs.gcm, ctr_gb_s=1 / costs.ctr)
    if certs_dir is not None:
        out.update({f"{role}_tls": ns for role, ns in role_floors(costs, owners, 8, "transport").items()},
                   tls_send_ns_b=costs.tls_send, tls_recv_ns_b=costs.tls_recv)
    return out


def measure(elements: int, steps: int, owners: int, certs_dir: str, rtt_ms: Optional[float] = None,
            bandwidth_mbps: Optional[float] = None, huge_pages: bool = False, data_plane: bool = False,
            data_link: Optional[str] = None, compute_ms: float = 0.0, key_early: bool = False) -> Dict:
    """Times `steps` secure sums of `elements` between `owners` owner threads and two server processes.

    With `rtt_ms`, every owner reaches each server, and server0 reaches server1, through a
    `tools.bench.relay` process adding that round-trip time (and `bandwidth_mbps` per connection).
    With `data_plane`, the servers also serve their data planes (`tfe_estimator.service.data_plane`) and the
    owners and server0 put on them (not with `rtt_ms`: the relay relays the gRPC ports only).
    With `huge_pages`, the servers start with glibc's huge-page tunable, as deployed
    (`tfe_estimator.cluster.huge_pages`). `data_link`: the owners' data-plane client (`OwnerClient`'s
    ``data_link``: ``"python"`` or ``"c"``; None: ``$TFE_ESTIMATOR_DATA_LINK``, else Python's).
    `compute_ms`: each owner waits that long before each contribution (its model's compute); with `key_early`
    it puts the step's key on server0 before that wait (`OwnerClient.put_key`, as an owner graph's key op does).

    Returns wall ``ms_per_step``; CPU ms per step of ``server_cpu_ms`` (server0, server1) and ``owners_cpu_ms``
    (all owner clients); per owner and step the Contribute calls (``calls_per_step``: one round trip to both
    servers each) and the serialized bytes sent and received (``up_bytes``, ``down_bytes``), counted by the
    clients' counters (`OwnerClient.bytes_sent`, ``bytes_received``, ``contributions``); the server pids.
    """
    from tfe_estimator.cluster.huge_pages import with_huge_pages  # pylint: disable=import-outside-toplevel
    from tfe_estimator.service import OwnerClient, TlsFiles  # pylint: disable=import-outside-toplevel

    tasks = [("chief", 0)] + [("worker", i) for i in range(owners - 1)]
    addresses = [f"localhost:{portpicker.pick_unused_port()}" for _ in range(2)]
    relay, reached = None, addresses
    if rtt_ms is not None and data_plane:
        raise ValueError("data_plane=True with rtt_ms: the relay relays the servers' gRPC ports only.")
    if rtt_ms is not None:
        relay, reached = _start_relays(addresses, rtt_ms, bandwidth_mbps)
    servers = {}
    clients: List = []
    try:
        servers = bench_servers.start(certs_dir, addresses, [f"{j}:{i}" for j, i in tasks], peer_address=reached[1],
                                      data_plane=data_plane, env=with_huge_pages(os.environ) if huge_pages else None)
        clients = [OwnerClient(reached, TlsFiles.from_dir(certs_dir, job, index), data_plane=data_plane,
                               data_link=data_link, early_key="on" if key_early else "off") for job, index in tasks]
        rng = np.random.default_rng(0)
        shares = [rng.integers(-2**62, 2**62, elements, dtype=np.int64) for _ in tasks]
        key = np.arange(4, dtype=np.int32)

        def run(first: int, count: int) -> None:
            def owner(k: int) -> None:
                for step in range(first, first + count):
                    if key_early:
                        clients[k].put_key("sum", step, 64, elements, key)
                    if compute_ms:
                        time.sleep(compute_ms / 1e3)
                    clients[k].contribute("sum", step, 64, elements, key, shares[k])
            threads = [threading.Thread(target=owner, args=(k,)) for k in range(owners)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()

        def counters():
            return ([process_cpu_seconds(servers[r].pid) for r in (0, 1)], time.process_time(), time.perf_counter(),
                    [sum(getattr(c, n) for c in clients) for n in ("contributions", "bytes_sent", "bytes_received")])

        run(0, 3)
        before = counters()
        run(3, steps)
        after = counters()
    finally:
        for client in clients:
            client.close()
        bench_servers.stop(servers)
        if relay is not None:
            relay.stdin.close()
            relay.wait(timeout=30)
    calls, sent, received = [(a - b) / steps / owners for a, b in zip(after[3], before[3])]
    return {"elements": elements, "owners": owners, "rtt_ms": rtt_ms, "bandwidth_mbps": bandwidth_mbps,
            "ms_per_step": 1e3 * (after[2] - before[2]) / steps,
            "server_cpu_ms": [1e3 * (a - b) / steps for a, b in zip(after[0], before[0])],
            "owners_cpu_ms": 1e3 * (after[1] - before[1]) / steps,
            "calls_per_step": calls, "up_bytes": sent, "down_bytes": received,
            "server_pids": [servers[0].pid, servers[1].pid]}


def _measure(elements: int, steps: int, owners: int, certs_dir: str, huge_pages: bool = False,
             data_plane: bool = False, data_link: Optional[str] = None) -> str:
    m = measure(elements, steps, owners, certs_dir, huge_pages=huge_pages, data_plane=data_plane,
                data_link=data_link)
    low = floor(owners, certs_dir)
    server_ms, owners_ms, wall_ms = m["server_cpu_ms"], m["owners_cpu_ms"], m["ms_per_step"]
    per_param = [1e6 * ms / elements for ms in server_ms] + [1e6 * owners_ms / elements / owners]
    return (f"{elements:,} elements, {owners} owners, "
            f"{'data plane (' + (data_link or 'python') + ' link)' if data_plane else 'gRPC'} "
            f"(server pids {m['server_pids'][0]}, {m['server_pids'][1]}): "
            f"wall {wall_ms:.2f} ms/step; CPU ms/step server0 {server_ms[0]:.2f}, server1 {server_ms[1]:.2f}, owner "
            f"clients {owners_ms:.2f}; ns/param server0 {per_param[0]:.1f}, server1 {per_param[1]:.1f}, "
            f"each owner's client {per_param[2]:.1f}; per owner and step {m['calls_per_step']:.0f} round trip(s), "
            f"{m['up_bytes']:,.0f} B up, {m['down_bytes']:,.0f} B down; floor ns/param (AES-GCM "
            f"{low['gcm_gb_s']:.1f} GB/s, AES-CTR {low['ctr_gb_s']:.1f} GB/s, ring sums) s0 {low['server0']:.1f}, "
            f"s1 {low['server1']:.1f}, owner {low['client']:.1f}; x floor s0 {per_param[0] / low['server0']:.1f}, "
            f"s1 {per_param[1] / low['server1']:.1f}, owner {per_param[2] / low['client']:.1f}; transport floor "
            f"(Python ssl on loopback TCP: send {low['tls_send_ns_b']:.2f}, receive {low['tls_recv_ns_b']:.2f} ns/B) "
            f"s0 {low['server0_tls']:.1f}, s1 {low['server1_tls']:.1f}, owner {low['client_tls']:.1f}; x transport "
            f"floor s0 {per_param[0] / low['server0_tls']:.1f}, s1 {per_param[1] / low['server1_tls']:.1f}, owner "
            f"{per_param[2] / low['client_tls']:.1f}"
            + ("; servers with huge pages" if huge_pages else ""))


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.bench.service_alone", description=__doc__.split("\n")[0])
    parser.add_argument("--elements", type=int, nargs="+", default=[100_000, 1_000_000], help="vector sizes")
    parser.add_argument("--steps", type=int, default=30, help="timed steps per size (default 30)")
    parser.add_argument("--owners", type=int, default=2, help="owners (default 2)")
    parser.add_argument("--huge-pages", action="store_true",
                        help="start the servers with glibc's huge-page tunable, as the launcher does")
    parser.add_argument("--transport", choices=("both", "data-plane", "grpc"), default="both",
                        help="the owners' and server0's puts: on the servers' data planes, on gRPC, or both side "
                             "by side (default)")
    parser.add_argument("--link", choices=("python", "c"), nargs="+", default=[None],
                        help="the owners' data-plane client, each in turn on every size: python (Python's ssl) or c "
                             "(BoringSSL from C, tfe_estimator.service.native_link); default: "
                             "$TFE_ESTIMATOR_DATA_LINK, else python")
    args = parser.parse_args(argv)
    planes = {"both": (True, False), "data-plane": (True,), "grpc": (False,)}[args.transport]
    from tfe_estimator.cluster import certs  # pylint: disable=import-outside-toplevel

    with tempfile.TemporaryDirectory(prefix="tfe-service-alone-") as certs_dir:
        tasks: List = [("chief", 0)] + [("worker", i) for i in range(args.owners - 1)] + [("tfe", 0), ("tfe", 1)]
        certs.make_cluster_certs(certs_dir, tasks, cluster="bench")
        for elements in args.elements:
            for plane in planes:
                for link in args.link if plane else [None]:
                    line = _measure(elements, args.steps, args.owners, certs_dir, args.huge_pages, plane, link)
                    print(f"[service-alone] {line}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
