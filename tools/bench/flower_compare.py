"""Our service's CPU per secure sum side by side with Flower's SecAgg+ protocol, in one run.

For each size, in one run on one machine: `tools.bench.service_alone` (two server processes,
mutual TLS on loopback, the owners' clients, on the servers' data planes) and
`tools.bench.flower_secagg` (Flower's own SecAgg+ code in its own virtualenv, ``.venv-flower``, one
process). It prints both CPU totals per secure sum,
their ratio and the goal of issue 34 (ours at most a quarter of Flower's at 1e6 elements, 2 owners).

What each side counts: ours is the servers' CPU plus the owners' transport (a share and a key
handed to the client; masking is in the owner's TensorFlow graph, about 1 ns per parameter with
our AES-CTR kernel); Flower's is its clients' whole protocol (key agreement, Shamir shares,
quantization, masks) and its server's unmasking, without its deployment runtime (SuperLink,
SuperNodes, polls), which costs far more than either. So the comparison flatters neither side's
deployment: it is the data path against the protocol. `tools.bench.flower_deployed` measures the
deployed side: SecAgg+ rounds through Flower's SuperLink and SuperNodes with TLS on loopback.

Run (``make bench-flower`` builds ``.venv-flower`` first)::

    PYTHONPATH=. .venv/bin/python -m tools.bench.flower_compare --elements 100000 1000000 --owners 2
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
from typing import Dict, List, Optional, Sequence

from tools.bench import service_alone

__all__ = ["compare", "main"]

FLOWER_PYTHON = os.path.join(".venv-flower", "bin", "python")
FLOWER_SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "flower_secagg.py")


def flower(elements: Sequence[int], clients: int, rounds: int, python: str = FLOWER_PYTHON) -> List[Dict]:
    """Flower's SecAgg+ CPU per round at each size (`tools.bench.flower_secagg`, run by Flower's `python`)."""
    if not os.path.exists(python):
        raise FileNotFoundError(f"{python} does not exist: run `make bench-flower` (it builds Flower's "
                                "virtualenv from tools/bench/requirements-flower.txt), or pass --flower-python.")
    out = subprocess.run([python, FLOWER_SCRIPT, "--elements", *map(str, elements), "--clients", str(clients),
                          "--rounds", str(rounds)], check=True, capture_output=True, text=True, timeout=1800)
    return [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]


def compare(elements: Sequence[int], owners: int, steps: int, rounds: int, certs_dir: str,
            python: str = FLOWER_PYTHON) -> List[Dict]:
    """Per size: our CPU ms per secure sum, Flower's, and their ratio."""
    theirs = {m["elements"]: m for m in flower(elements, owners, rounds, python)}
    rows = []
    for size in elements:
        ours = service_alone.measure(size, steps, owners, certs_dir, data_plane=True)
        ours_ms = sum(ours["server_cpu_ms"]) + ours["owners_cpu_ms"]
        flower_ms = theirs[size]["clients_cpu_ms"] + theirs[size]["server_cpu_ms"]
        rows.append({"elements": size, "owners": owners, "ours_cpu_ms": ours_ms, "ours": ours,
                     "flower_cpu_ms": flower_ms, "flower": theirs[size], "ratio": ours_ms / flower_ms})
    return rows


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.bench.flower_compare", description=__doc__.split("\n")[0])
    parser.add_argument("--elements", type=int, nargs="+", default=[100_000, 1_000_000])
    parser.add_argument("--owners", type=int, default=2)
    parser.add_argument("--steps", type=int, default=20, help="our timed steps per size")
    parser.add_argument("--rounds", type=int, default=3, help="Flower's timed rounds per size")
    parser.add_argument("--flower-python", default=FLOWER_PYTHON, help="the python of Flower's virtualenv")
    args = parser.parse_args(argv)
    from tfe_estimator.cluster import certs  # pylint: disable=import-outside-toplevel

    with tempfile.TemporaryDirectory(prefix="tfe-flower-compare-") as certs_dir:
        tasks: List = [("chief", 0)] + [("worker", i) for i in range(args.owners - 1)] + [("tfe", 0), ("tfe", 1)]
        certs.make_cluster_certs(certs_dir, tasks, cluster="bench")
        for row in compare(args.elements, args.owners, args.steps, args.rounds, certs_dir, args.flower_python):
            ours, theirs = row["ours"], row["flower"]
            print(f"[flower-compare] {row['elements']:,} elements, {row['owners']} owners: ours "
                  f"{row['ours_cpu_ms']:.1f} ms CPU per secure sum (server0 {ours['server_cpu_ms'][0]:.1f}, server1 "
                  f"{ours['server_cpu_ms'][1]:.1f}, owners' clients {ours['owners_cpu_ms']:.1f}); Flower "
                  f"{theirs['flwr']} SecAgg+ {row['flower_cpu_ms']:.1f} ms (clients {theirs['clients_cpu_ms']:.1f}, "
                  f"server {theirs['server_cpu_ms']:.1f}); ratio {row['ratio']:.2f} (goal <= 0.25)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
