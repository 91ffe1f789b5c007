"""The aggregation service's step at a distance: predicted from loopback, checked through a delaying relay.

`predict_step_ms` prices a step at a round-trip time and bandwidth from what
the loopback bench measures: its step time, its round trips per step and its
bytes per owner and step. `main` measures the service alone
(`tools.bench.service_alone.measure`: two server processes, N owner clients)
on loopback, predicts the step at ``--rtt-ms`` (and ``--bandwidth-mbps``),
then measures it with every owner-server and server0-server1 connection
through `tools.bench.relay` (a user-space TCP relay adding that round trip;
the kernel here has no ``netem``), and prints both: loopback and relayed runs
alternate ``--rounds`` times, the figures are their medians.

Run::

    PYTHONPATH=. python -m tools.bench.distance --elements 100000 1000000 --owners 3 --rtt-ms 20

Numbers on a shared 2-core machine are noisy (the relay's own CPU competes
with the servers and owners): compare predicted and measured of one run.
"""
import argparse
import json
import statistics
import sys
import tempfile
from typing import Dict, List, Optional, Sequence

__all__ = ["predict_step_ms", "service_hops", "SERVICE_HOPS", "main"]

#: Sequential round trips on the critical path of one Contribute call: the owner's to the servers, and half of
#: server0's to server1 (its ForwardBlinded leaves once every owner's key arrived; server1 answers the owners once
#: it holds it, with server0's blind key sealed for each owner in the answer, `service.sealed_blind`), so an owner
#: waits ``rtt_owner + rtt_servers / 2``. Until 2026-11-27 it waited for server0's answer, sent once server1's
#: release came back: ``rtt_owner + rtt_servers`` (2).
SERVICE_HOPS = 1.5


def predict_step_ms(loopback_ms: float, round_trips: float, up_bytes: float, down_bytes: float,
                    rtt_ms: float, bandwidth_bytes_per_s: Optional[float] = None) -> float:
    """The step time at round-trip time `rtt_ms` and link rate `bandwidth_bytes_per_s`, from loopback figures.

    ::

        step(rtt, bw) = loopback_ms + round_trips * rtt_ms + 1000 * (up_bytes + down_bytes) / bw

    - ``loopback_ms``: the step measured on loopback (compute, CPU of TLS and copies, the scheduler);
      none of it goes away at a distance.
    - ``round_trips``: sequential round trips on the step's critical path; for the service, Contribute
      calls per step x `SERVICE_HOPS` (each call waits for the owner's round trip and server0's forward
      to server1, one way, every link at ``rtt_ms``).
    - ``up_bytes``, ``down_bytes``: what one owner sends and receives per step; the upload to server1 and
      the download from it are sequential (the answer needs every owner's share), server0's forward of
      the same size overlaps the owners' uploads. ``bw`` is each owner's link (and the servers' links are
      assumed not the bottleneck: server1 receives N owners' uploads). None: no bandwidth term.

    It ignores TCP's congestion window at a distance (slow start after an idle link can add round trips
    per large message on a real WAN; the relay does not model it) and HTTP/2 flow-control stalls.

    Example::

        >>> predict_step_ms(10.0, 2, 800_000, 800_000, rtt_ms=20)
        50.0
        >>> round(predict_step_ms(10.0, 2, 800_000, 800_000, rtt_ms=20, bandwidth_bytes_per_s=125e6), 1)
        62.8
    """
    for name, value in (("loopback_ms", loopback_ms), ("round_trips", round_trips), ("up_bytes", up_bytes),
                        ("down_bytes", down_bytes), ("rtt_ms", rtt_ms)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
            raise ValueError(f"{name}={value!r} must be a number >= 0.")
    step = float(loopback_ms) + float(round_trips) * float(rtt_ms)
    if bandwidth_bytes_per_s is not None:
        if not bandwidth_bytes_per_s > 0:
            raise ValueError(f"bandwidth_bytes_per_s={bandwidth_bytes_per_s!r} must be > 0, or None.")
        step += 1e3 * (float(up_bytes) + float(down_bytes)) / float(bandwidth_bytes_per_s)
    return step


def service_hops(rtt_ms: float, compute_ms: float = 0.0, key_early: bool = False) -> float:
    """Sequential round trips of one Contribute call: `SERVICE_HOPS`; with the step's key put on server0 when the
    step starts (`key_early`), server0's forward travels during the owner's `compute_ms`, hiding up to its
    half round trip.

    Example::

        >>> service_hops(20.0), service_hops(20.0, compute_ms=4.0, key_early=True)
        (1.5, 1.3)
    """
    if not key_early or not rtt_ms:
        return SERVICE_HOPS
    return 1.0 + max(0.0, (SERVICE_HOPS - 1.0) - float(compute_ms) / float(rtt_ms))


def compare(elements: int, owners: int, steps: int, rtt_ms: float, bandwidth_mbps: Optional[float],
            certs_dir: str, rounds: int = 2, control: bool = False, compute_ms: float = 0.0,
            key_early: bool = False) -> Dict:
    """Loopback, predicted and relayed step of the service alone, alternating `rounds` times (medians).

    With `control`, also through the relay at 0 ms (what the relay itself costs). `compute_ms`, `key_early`:
    each owner's compute before its contribution, and its key put before it (`service_alone.measure`).
    """
    from tools.bench.service_alone import measure  # pylint: disable=import-outside-toplevel

    owner = dict(compute_ms=compute_ms, key_early=key_early)
    runs: Dict[str, List[Dict]] = {"loopback": [], "relayed": [], "control": []}
    for _ in range(max(1, rounds)):
        runs["loopback"].append(measure(elements, steps, owners, certs_dir, **owner))
        runs["relayed"].append(measure(elements, steps, owners, certs_dir, rtt_ms=rtt_ms,
                                       bandwidth_mbps=bandwidth_mbps, **owner))
        if control:
            runs["control"].append(measure(elements, steps, owners, certs_dir, rtt_ms=0.0, **owner))
    loopback = runs["loopback"][0]
    ms = {name: statistics.median(r["ms_per_step"] for r in rs) for name, rs in runs.items() if rs}
    round_trips = loopback["calls_per_step"] * service_hops(rtt_ms, compute_ms, key_early)
    rate = None if bandwidth_mbps is None else bandwidth_mbps * 1e6 / 8
    predicted = predict_step_ms(ms["loopback"], round_trips, loopback["up_bytes"], loopback["down_bytes"],
                                rtt_ms, rate)
    result = {"elements": elements, "owners": owners, "rtt_ms": rtt_ms, "bandwidth_mbps": bandwidth_mbps,
              "rounds": max(1, rounds), "steps": steps, "loopback_ms": ms["loopback"],
              "round_trips_per_step": round_trips, "calls_per_step": loopback["calls_per_step"],
              "up_bytes_per_owner": loopback["up_bytes"], "down_bytes_per_owner": loopback["down_bytes"],
              "predicted_ms": predicted, "measured_ms": ms["relayed"],
              "measured_over_predicted": ms["relayed"] / predicted,
              "runs_ms": {name: [r["ms_per_step"] for r in rs] for name, rs in runs.items() if rs},
              "compute_ms": compute_ms, "key_early": key_early}
    if control:  # the relay's own cost on this machine, apart from the distance it adds
        result["relay_0ms_ms"] = ms["control"]
        result["predicted_from_relay_0ms_ms"] = predict_step_ms(
            ms["control"], round_trips, loopback["up_bytes"], loopback["down_bytes"], rtt_ms, rate)
    return result


def _line(r: Dict) -> str:
    link = f"RTT {r['rtt_ms']:g} ms" + (f", {r['bandwidth_mbps']:g} Mbit/s" if r["bandwidth_mbps"] else "")
    control = (f"; through the relay at 0 ms {r['relay_0ms_ms']:.1f} ms/step, predicted from it "
               f"{r['predicted_from_relay_0ms_ms']:.1f}" if "relay_0ms_ms" in r else "")
    compute = (f" (with {r['compute_ms']:g} ms of compute per step"
               + (", the key put before it" if r["key_early"] else "") + ")") if r.get("compute_ms") else ""
    return (f"[distance] {r['elements']:,} elements, {r['owners']} owners, {link} (medians of {r['rounds']} runs of "
            f"{r['steps']} steps): loopback {r['loopback_ms']:.1f} "
            f"ms/step{compute}, {r['round_trips_per_step']:g} round trips/step ({r['calls_per_step']:g} Contribute x "
            f"{r['round_trips_per_step'] / r['calls_per_step']:g} hops), per owner {r['up_bytes_per_owner']:,.0f} B "
            f"up, {r['down_bytes_per_owner']:,.0f} B down; predicted {r['predicted_ms']:.1f} ms/step, measured "
            f"{r['measured_ms']:.1f} ({r['measured_over_predicted']:.2f}x){control}")


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.bench.distance", description=__doc__.split("\n")[0])
    parser.add_argument("--elements", type=int, nargs="+", default=[100_000, 1_000_000], help="vector sizes")
    parser.add_argument("--owners", type=int, default=3, help="owners (default 3)")
    parser.add_argument("--steps", type=int, default=20, help="timed steps per run (default 20)")
    parser.add_argument("--rtt-ms", type=float, default=20.0, help="round-trip time of every link (default 20)")
    parser.add_argument("--bandwidth-mbps", type=float, default=None, help="each connection's rate (default none)")
    parser.add_argument("--rounds", type=int, default=2, help="loopback/relayed alternations (default 2)")
    parser.add_argument("--control", action="store_true", help="also run through the relay at 0 ms")
    parser.add_argument("--compute-ms", type=float, default=0.0,
                        help="each owner's compute before each contribution (default 0)")
    parser.add_argument("--key-early", action="store_true",
                        help="each owner puts the step's key on server0 before its compute (an owner graph's key op)")
    parser.add_argument("--json", default=None, help="also write the results to this file")
    args = parser.parse_args(argv)
    from tfe_estimator.cluster import certs  # pylint: disable=import-outside-toplevel

    results: List[Dict] = []
    with tempfile.TemporaryDirectory(prefix="tfe-distance-") as certs_dir:
        tasks: List = [("chief", 0)] + [("worker", i) for i in range(args.owners - 1)] + [("tfe", 0), ("tfe", 1)]
        certs.make_cluster_certs(certs_dir, tasks, cluster="bench")
        for elements in args.elements:
            results.append(compare(elements, args.owners, args.steps, args.rtt_ms, args.bandwidth_mbps,
                                   certs_dir, args.rounds, args.control, args.compute_ms, args.key_early))
            print(_line(results[-1]), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
