"""What the sums' integrity checks cost an owner (`tfe_estimator.owner.sum_check`), beside the unchecked path.

Two `AggregationServer` processes (mutual TLS on loopback, with their data
planes as users run them: `tools.bench.servers`) and N owner
processes (as in service mode: each owner its own process). Per step each
owner does what its contribution op does: masks its vector with a fresh key
(share = x - AES(key), numpy), contributes through
`sum_check.checked_contribute` and reveals (w + AES(blind key)); the checked
twin with a `SumCheck` (its 4 check words appended, verified on the answer),
the anchor without (``check=None``: exactly the unchecked call). The twins take
turns in rounds (order alternating), on channels of their own.

Run::

    PYTHONPATH=. python -m tools.bench.check_cost --elements 100000 1000000 --rounds 6 --steps 10

Prints per size: the median wall ms per step of each twin and their ratio, the
extra ms per step and in % of the unchecked step; and the owner's own check
work alone (coefficients, reading its vector back, both products: the CPU
time of those calls in the owner's thread, averaged over the owners) in ms per step and ns per parameter,
and the same work alone (one owner's coefficients, extend and verify in one
thread, no service: the CPU it needs on an otherwise idle core), with its
share of the Estimator step of docs/benchmarks.md when given
(``--estimator-step-ms``, e.g. 23.5 for svc-linear-1e5).
"""
import argparse
import statistics
import sys
import tempfile
import time
from typing import Dict, List, Optional, Sequence

import numpy as np
import portpicker

from tools.bench import servers as bench_servers

__all__ = ["main", "measure"]


class _Timed:
    """A `SumCheck` whose check work (extend, verify) is timed in CPU seconds of its thread."""

    def __init__(self, check):
        self._check = check
        self.seconds = 0.0

    def _timed(self, name, *args):
        start = time.thread_time()
        try:
            return getattr(self._check, name)(*args)
        finally:
            self.seconds += time.thread_time() - start

    def extend(self, *args):
        return self._timed("extend", *args)

    def verify(self, *args):
        return self._timed("verify", *args)


def _owner(index: int, task, addresses, certs_dir: str, elements: int, rounds: int, steps: int, owners: int,
           results) -> None:
    """One owner process: warm-up, then per round both twins (order alternating); its times to `results`."""
    # pylint: disable=import-outside-toplevel
    from tfe_estimator.owner import sum_check
    from tfe_estimator.service import OwnerClient, TlsFiles, ring

    client = OwnerClient(addresses, TlsFiles.from_dir(certs_dir, *task))
    vector = np.random.default_rng(index).integers(-2**50, 2**50, elements, dtype=np.int64).view(np.uint64)
    check = _Timed(sum_check.SumCheck(bytes(32), num_owners=owners))

    def run(checked: bool, first: int, count: int) -> float:
        start = time.perf_counter()
        for step in range(first, first + count):
            key = np.frombuffer(np.random.bytes(16), np.int32)
            share = vector.copy()
            ring.sub_into(share, ring.keystream_words(key, share.size), 64)
            blind_key, w = sum_check.checked_contribute(client.contribute, check if checked else None,
                                                        "checked" if checked else "plain", step, 64, elements,
                                                        key, share.view(np.int64))
            revealed = np.array(w.view(np.uint64), copy=True)
            ring.add_into(revealed, ring.keystream_words(blind_key, revealed.size), 64)
        return 1e3 * (time.perf_counter() - start) / count

    try:
        run(False, 0, 3)
        run(True, 0, 3)
        check.seconds = 0.0
        times: Dict[bool, List[float]] = {False: [], True: []}
        for r in range(rounds):
            for checked in ((False, True) if r % 2 == 0 else (True, False)):
                times[checked].append(run(checked, 3 + r * steps, steps))
        results.put((index, times[False], times[True], check.seconds / (rounds * steps)))
    finally:
        client.close()


def measure(elements: int, rounds: int, steps: int, owners: int, certs_dir: str) -> Dict:
    """Times `rounds` x `steps` checked and unchecked sums of `elements`, one process per owner (module docstring)."""
    import multiprocessing  # pylint: disable=import-outside-toplevel

    tasks = [("chief", 0)] + [("worker", i) for i in range(owners - 1)]
    addresses = [f"localhost:{portpicker.pick_unused_port()}" for _ in range(2)]
    servers, procs = {}, []
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    try:
        servers = bench_servers.start(certs_dir, addresses, [f"{j}:{i}" for j, i in tasks])  # data planes, as run
        procs = [context.Process(target=_owner, args=(k, task, addresses, certs_dir, elements, rounds, steps, owners,
                                                      results)) for k, task in enumerate(tasks)]
        for proc in procs:
            proc.start()
        per_owner = sorted(results.get(timeout=1800) for _ in procs)
        for proc in procs:
            proc.join(timeout=60)
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.terminate()
        bench_servers.stop(servers)
    _, plain_times, checked_times, check_seconds = per_owner[0]  # the chief's view (owners move in lockstep)
    plain, checked = statistics.median(plain_times), statistics.median(checked_times)
    check_ms = 1e3 * statistics.mean(o[3] for o in per_owner)
    return {"elements": elements, "owners": owners, "plain_ms": plain, "checked_ms": checked,
            "ratio": statistics.median(c / p for c, p in zip(checked_times, plain_times)),
            "extra_ms": checked - plain, "check_ms": check_ms, "check_ns_per_param": 1e6 * check_ms / elements}


def micro(elements: int, repeats: int = 20) -> float:
    """The check work of one owner and step alone (no service, one thread, best of 5): ms."""
    # pylint: disable=import-outside-toplevel
    from tfe_estimator.owner import sum_check
    from tfe_estimator.service import ring

    vector = np.random.default_rng(0).integers(-2**50, 2**50, elements, dtype=np.int64).view(np.uint64)
    check = sum_check.SumCheck(bytes(32))
    key = np.arange(4, dtype=np.int32)
    share = vector.copy()
    ring.sub_into(share, ring.keystream_words(key, share.size), 64)
    total = ring.ring_words(elements + sum_check.CHECK_WORDS, 64)

    def once(step: int) -> None:
        extended = check.extend("c", step, 64, elements, key, share.view(np.int64))
        # Stand-in answer of one owner: its own extended share, unmasked by its key (blind key = key).
        check.verify("c", step, 64, elements, key, extended[:total])

    once(0)
    best = float("inf")
    for _ in range(5):
        start = time.thread_time()
        for step in range(repeats):
            once(step)
        best = min(best, (time.thread_time() - start) / repeats)
    return 1e3 * best


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.bench.check_cost", description=__doc__.split("\n")[0])
    parser.add_argument("--elements", type=int, nargs="+", default=[100_000, 1_000_000], help="vector sizes")
    parser.add_argument("--rounds", type=int, default=6, help="rounds per twin (default 6)")
    parser.add_argument("--steps", type=int, default=10, help="steps per round (default 10)")
    parser.add_argument("--owners", type=int, default=2, help="owners (default 2)")
    parser.add_argument("--estimator-step-ms", type=float, nargs="*", default=[],
                        help="per size, an Estimator step to state the owner's check work against (ms)")
    args = parser.parse_args(argv)
    from tfe_estimator.cluster import certs  # pylint: disable=import-outside-toplevel

    with tempfile.TemporaryDirectory(prefix="tfe-check-cost-") as certs_dir:
        tasks: List = [("chief", 0)] + [("worker", i) for i in range(args.owners - 1)] + [("tfe", 0), ("tfe", 1)]
        certs.make_cluster_certs(certs_dir, tasks, cluster="bench")
        for i, elements in enumerate(args.elements):
            alone = micro(elements)
            m = measure(elements, args.rounds, args.steps, args.owners, certs_dir)
            line = (f"[check-cost] {elements:,} elements, {args.owners} owners: step unchecked {m['plain_ms']:.2f} ms, "
                    f"checked {m['checked_ms']:.2f} ms (ratio {m['ratio']:.3f}; extra {m['extra_ms']:+.2f} ms = "
                    f"{100 * m['extra_ms'] / m['plain_ms']:+.1f}% of the unchecked step); the owner's check work "
                    f"{m['check_ms']:.3f} ms/step = {m['check_ns_per_param']:.2f} ns/param")
            line += f"; alone (one thread, no service) {alone:.3f} ms = {1e6 * alone / elements:.2f} ns/param"
            if i < len(args.estimator_step_ms):
                step_ms = args.estimator_step_ms[i]
                line += (f" = {100 * alone / step_ms:.1f}% of a {step_ms} ms Estimator step (in the run: "
                         f"{100 * m['check_ms'] / step_ms:.1f}%)")
            print(line, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
