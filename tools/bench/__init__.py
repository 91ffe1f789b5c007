"""`tfe-estimator bench`: secure aggregation vs its plaintext twin, side by side.

Runs every case's secure Estimator (`TfeRunConfig`) and its plaintext twin
(`MirroredStrategy` + `ReductionToOneDevice` on the same devices) in one run,
alternating rounds of steps between them (see `tools.bench.timing`),
and reports the median ms/step and the ratio per case; the bytes each
replica uploads to the TFE servers per parameter and step, counted from the
training graph (`tools.bench.traffic`); and the secure sum alone
against `ReductionToOneDevice` (`tools.bench.secure_sum_micro`).

Writes ``results.json``, ``benchmark.png`` and ``BENCHMARKS.md`` into
``--out`` (default ``bench-results/``) and prints one line per case.

Example::

    $ python -m tools.bench                  # the default cases, a few minutes on 2 cores
    $ python -m tools.bench --quick --out /tmp/b   # tiny sizes, a smoke test
"""
import argparse
import json
import os
import shutil
import sys
import tempfile
from typing import Dict, List, Optional, Sequence

from tools import checkout_on_pythonpath
from tools.bench.workloads import Workload

__all__ = ["main", "parse_args", "default_cases", "quick_cases", "cluster_case_supported"]


def cluster_case_supported() -> bool:
    """Whether this TensorFlow runs the loopback-cluster case (TF 2.9 only, for now).

    The case drives two Estimators' `train()` in threads against the chief's
    server without the distribute coordinator; on TensorFlow 2.15 the remote
    worker's input iterator then fails ("Attempted create an iterator on
    device /job:worker/... from handle defined on device /job:chief/...").
    `train_and_evaluate` on a cluster (the demo, the launch and fault tests)
    is not affected.
    """
    import tensorflow as tf  # pylint: disable=import-outside-toplevel

    return tuple(int(p) for p in tf.__version__.split(".")[:2]) < (2, 10)


def _cases(cases: List[Workload]) -> List[Workload]:
    return [c for c in cases if not c.cluster or cluster_case_supported()]


def default_cases() -> List[Workload]:
    return _cases([
        Workload("linear-1e3", "linear", 1_000),
        Workload("linear-1e5", "linear", 100_000),
        Workload("linear-1e6", "linear", 1_000_000),
        Workload("dnn-256", "dnn", 256, hidden_units=(512, 256, 128)),
        Workload("linear-1e5-4rep", "linear", 100_000, replicas=4),
        Workload("cluster-linear-1e5", "linear", 100_000, cluster=True),
    ] + service_cases())


def service_cases() -> List[Workload]:
    """Service mode (owners through the aggregation service, mTLS) vs MultiWorkerMirroredStrategy, loopback."""
    service = dict(service=True)
    return [
        Workload("svc-linear-1e5", "linear", 100_000, **service),
        Workload("svc-dnn-256", "dnn", 256, hidden_units=(512, 256, 128), **service),
        Workload("svc-linear-1e6", "linear", 1_000_000, **service),
        Workload("svc-linear-1e5-3own", "linear", 100_000, replicas=3, **service),  # docs: three hospitals
        Workload("svc-linear-1e5-4own", "linear", 100_000, replicas=4, **service),
        Workload("svc-linear-1e5-8own", "linear", 100_000, replicas=8, **service),
        Workload("svc-linear-1e5-ring32", "linear", 100_000, update_ring_bits=32, clip_norm=10.0, **service),
        Workload("svc-linear-1e7", "linear", 10_000_000, **service),
    ]


def quick_cases() -> List[Workload]:
    return _cases([
        Workload("linear-1e2", "linear", 100),  # one linear size: a second (1e3) ran the same code again
        Workload("dnn-16", "dnn", 16, hidden_units=(16, 8)),
        Workload("linear-1e2-4rep", "linear", 100, replicas=4),
        Workload("cluster-linear-1e2", "linear", 100, cluster=True),
        Workload("svc-linear-1e2", "linear", 100, service=True),
    ])


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="tfe-estimator bench",
                                     description="Secure aggregation vs plaintext, side by side.")
    parser.add_argument("--out", default="bench-results", help="output directory (default bench-results/)")
    parser.add_argument("--quick", action="store_true", help="tiny sizes and few steps: a smoke test")
    parser.add_argument("--batch-size", type=int, default=32, help="examples per replica per step (default 32)")
    parser.add_argument("--rounds", type=int, default=None, help="alternating rounds per case (default 6; quick 2)")
    parser.add_argument("--steps", type=int, default=None, help="steps per twin per round (default 10; quick 3)")
    parser.add_argument("--warmup", type=int, default=None, help="untimed steps per twin first (default 5; quick 2)")
    parser.add_argument("--cases", default=None, help="comma-separated case names to run (default all)")
    parser.add_argument("--no-cluster", action="store_true", help="skip the loopback cluster cases")
    parser.add_argument("--no-secure-sum", action="store_true", help="skip the secure-sum microbenchmark")
    parser.add_argument("--no-owner-kernels", action="store_true",
                        help="skip the service-mode owner's kernels beside the AES-CTR floor (owner_kernels)")
    parser.add_argument("--protocol", default="pond", help="tf-encrypted protocol (default pond)")
    parser.add_argument("--relay-rtt-ms", type=float, default=None,
                        help="svc-* cases: also run the service with each owner's links to the servers through a "
                             "relay adding this round-trip time, measured beside the predicted step")
    parser.add_argument("--markdown", default=None, help="also write the Markdown report to this path")
    parser.add_argument("--plot", default=None, help="also copy the PNG plot to this path")
    parser.add_argument("--cluster-task", default=None, help=argparse.SUPPRESS)  # JSON of one case, for tasks
    parser.add_argument("--owner-task", default=None, help=argparse.SUPPRESS)  # JSON of a service-mode owner
    return parser.parse_args(argv)


def _settings(args) -> Dict:
    quick = args.quick
    return {
        "batch_size": args.batch_size,
        "rounds": args.rounds or (2 if quick else 6),
        "steps": args.steps or (3 if quick else 10),
        "warmup": args.warmup if args.warmup is not None else (2 if quick else 5),
        "protocol": args.protocol,
        "precision": "low",
        "quick": quick,
        "relay_rtt_ms": args.relay_rtt_ms,
    }


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Runs the benchmark; returns 0. See the module docstring."""
    args = parse_args(argv)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    checkout_on_pythonpath()  # the cluster cases' tasks run `-m tools.bench` in their own directories
    if args.cluster_task:
        from tools.bench.cluster_task import run_task  # pylint: disable=import-outside-toplevel

        return run_task(json.loads(args.cluster_task))
    if args.owner_task:
        from tools.bench.service_case import run_owner_task  # pylint: disable=import-outside-toplevel

        return run_owner_task(json.loads(args.owner_task))
    import tensorflow as tf  # pylint: disable=import-outside-toplevel

    from tools.bench import report  # pylint: disable=import-outside-toplevel
    from tools.bench.cases import run_cluster_case, run_local_case  # pylint: disable=import-outside-toplevel
    from tools.bench.secure_sum_micro import run_secure_sum  # pylint: disable=import-outside-toplevel
    from tools.bench.service_case import run_service_case  # pylint: disable=import-outside-toplevel

    tf.compat.v1.logging.set_verbosity(tf.compat.v1.logging.ERROR)
    settings = _settings(args)
    out = os.path.abspath(str(args.out))
    os.makedirs(out, exist_ok=True)
    cases = quick_cases() if args.quick else default_cases()
    if not cluster_case_supported():
        print(f"[bench] the loopback-cluster case is skipped on TensorFlow {tf.__version__} "
              "(see tools.bench.cluster_case_supported)", flush=True)
    if args.cases:
        wanted = set(args.cases.split(","))
        cases = [c for c in cases if c.name in wanted]
    if args.no_cluster:
        cases = [c for c in cases if not (c.cluster or c.service)]
    results = {"machine": report.machine(), "settings": settings, "cases": [], "secure_sum": [], "owner_kernels": []}
    workdir = tempfile.mkdtemp(prefix="tfe-estimator-bench-")
    try:
        for case in cases:
            run = (run_service_case if case.service else
                   run_cluster_case if case.cluster else run_local_case)
            row = run(case, settings, os.path.join(workdir, case.name))
            results["cases"].append(row)
            service = ""
            if case.service:
                cpu = row["cpu_ms_per_step"]
                service = (f"; CPU ms/step: servers {', '.join(f'{v:.1f}' for v in cpu['servers'])}, owners "
                           f"{', '.join(f'{v:.1f}' for v in cpu['service_owners'].values())} (MWMS owners "
                           f"{', '.join(f'{v:.1f}' for v in cpu['mwms_owners'].values())}); "
                           f"{row['round_trips_per_step']:g} round trips/step, per owner "
                           f"{row['bytes_per_owner_per_step']['up']:,.0f} B up, "
                           f"{row['bytes_per_owner_per_step']['down']:,.0f} B down; predicted "
                           + ", ".join(f"{v:.1f} ms/step at {k}" for k, v in row["predicted_ms_per_step"].items()))
                service += report.floors_text(row)
                if "relayed_owner_links" in row:
                    r = row["relayed_owner_links"]
                    service += (f"; owners' links through the relay at {r['rtt_ms']:g} ms: predicted "
                                f"{r['predicted_ms_per_step']:.1f} ms/step, measured {r['measured_ms_per_step']:.1f}")
            anchor = "MultiWorkerMirroredStrategy" if case.service else "plaintext"
            print(f"[bench] {case.name:>20}: {case.describe()}: secure {row['secure_ms_per_step']:.2f} ms/step, "
                  f"{anchor} {row['plaintext_ms_per_step']:.2f} ms/step, ratio {row['ratio']:.2f} "
                  f"({report.target_text(row)}), upload "
                  f"{row['upload_bytes_per_param_per_replica_per_step']:.3f} B/param/replica/step, download "
                  f"{row['download_bytes_per_param_per_replica_per_step']:.3f}{service}", flush=True)
            report.write_json(os.path.join(out, "results.json"), results)
        if not args.no_secure_sum:
            sizes = [1_000] if args.quick else [10_000, 100_000, 1_000_000]  # quick: one size, a smoke test
            for row in run_secure_sum(sizes, rounds=settings["rounds"], steps=settings["steps"] * 2,
                                      protocol=args.protocol):
                results["secure_sum"].append(row)
                print(f"[bench] {'secure-sum':>20}: {row['params']:,} params x {row['replicas']} replicas: "
                      f"secure {row['secure_ms']:.2f} ms, reference (tf-encrypted) {row['reference_ms']:.2f} ms, "
                      f"plaintext {row['plaintext_ms']:.2f} ms: extra {row['extra_ns_per_param_per_replica']:.2f} "
                      f"ns/param/replica (target <= {report.TARGET_EXTRA_NS:g}; reference "
                      f"{row['reference_extra_ns_per_param_per_replica']:.2f}), up + down "
                      f"{row['upload_bytes_per_param_per_replica']:.3f} + "
                      f"{row['download_bytes_per_param_per_replica']:.3f} B/param/replica (plaintext "
                      f"{row['plaintext_bytes_per_param_per_replica']:.3f}); 32-bit ring: extra "
                      f"{row['secure32_extra_ns_per_param_per_replica']:.2f} ns, "
                      f"{row['secure32_bytes_per_param_per_replica']:.3f} B/param/replica", flush=True)
        if not args.no_owner_kernels:
            _owner_kernels(results, args.quick)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    report.write_json(os.path.join(out, "results.json"), results)
    png = os.path.join(out, "benchmark.png")
    report.write_plot(png, results)
    md = report.markdown(results, png_name="benchmark.png")
    with open(os.path.join(out, "BENCHMARKS.md"), "w") as f:
        f.write(md)
    if args.plot:
        os.makedirs(os.path.dirname(os.path.abspath(args.plot)), exist_ok=True)
        shutil.copyfile(png, args.plot)
    if args.markdown:
        png_ref = os.path.relpath(args.plot, os.path.dirname(os.path.abspath(args.markdown))) if args.plot else png
        with open(args.markdown, "w") as f:
            f.write(report.markdown(results, png_name=png_ref))
    print(f"[bench] wrote {out}/results.json, benchmark.png, BENCHMARKS.md", flush=True)
    return 0


def _owner_kernels(results: Dict, quick: bool) -> None:
    """The service-mode owner's kernels per parameter beside the AES-CTR floor, into `results` (and printed)."""
    from tools.bench import owner_kernels  # pylint: disable=import-outside-toplevel

    for n in [10_000] if quick else [100_000, 1_000_000]:  # quick: one size, a smoke test
        for row in owner_kernels.measure(n, repeats=3 if quick else 21):
            results["owner_kernels"].append(row)
            print(f"[bench] {'owner-kernels':>20}: {n:,} params: {row['stage']}: {row['ns_per_param']:.2f} "
                  f"ns/param CPU, {row['x_aes_floor']:.2f}x the AES-128-CTR floor", flush=True)


if __name__ == "__main__":
    sys.exit(main())
