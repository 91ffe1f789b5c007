"""Benchmark of distributed DP: the noise sampler, and secure DP-SGD against central DP-SGD.

Two measurements, in one run:

1. ``TfeDiscreteGaussian`` (the exact sampler of `tfe_estimator.privacy.dp`):
   ns per value with 1 and 2 intra-op threads (best of `repeats` runs of
   `n` values) at the workload's per-replica variance and at 2**40 / 2**88,
   each thread count in a process of its own (TensorFlow sizes its intra-op
   pool once per process, from the first session).
2. One DP-SGD training step, side by side in alternating rounds
   (`timing.run_alternating`): tensorflow-privacy's `DNNClassifier` with
   our clipping optimizer under `TfeRunConfig(dp=DistributedDP(...))`
   ("secure DP": per-example clipping, noise inside the secure sum) against
   the same estimator with tensorflow-privacy's central DP-SGD
   (`VectorizedDPKerasSGDOptimizer`) on the plaintext twin (MirroredStrategy,
   the same replica devices): the ratio is what secure DP costs over the
   central DP-SGD a user would otherwise pick.

Run::

    python -m tools.bench.dp_bench --out bench-results
"""
import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from typing import Dict, List, Optional, Sequence

from tools import checkout_on_pythonpath

__all__ = ["sampler_ns_per_value", "dp_step_case", "main"]

FEATURES = "x"


def sampler_ns_per_value(variance: float, threads: int, n: int = 1_000_000, repeats: int = 3) -> float:
    """Best-of-`repeats` ns per value of `TfeDiscreteGaussian` with `threads` intra-op threads."""
    import tensorflow as tf  # pylint: disable=import-outside-toplevel

    from tfe_estimator.secure.kernels import ops  # pylint: disable=import-outside-toplevel

    with tf.Graph().as_default():
        noise = ops.discrete_gaussian(n, variance)
        config = tf.compat.v1.ConfigProto(intra_op_parallelism_threads=threads, inter_op_parallelism_threads=1)
        with tf.compat.v1.Session(config=config) as session:
            session.run(noise.op)  # warm up (kernel load, thread pool)
            best = math.inf
            for _ in range(repeats):
                start = time.perf_counter()
                session.run(noise.op)
                best = min(best, time.perf_counter() - start)
    return 1e9 * best / n


def _input_fn(features: int, batch_size: int):
    import tensorflow as tf  # pylint: disable=import-outside-toplevel

    def fn(input_context=None):
        del input_context

        def make(_):
            x = tf.random.stateless_normal([batch_size, features], [0, 1]) / float(features) ** 0.5
            w = tf.random.stateless_normal([features], [0, 2])
            y = tf.cast(tf.reduce_sum(x * w, axis=1, keepdims=True) > 0, tf.int64)
            return {FEATURES: x}, y

        return tf.data.Dataset.range(1).map(make).cache().repeat()

    return fn


def dp_step_case(settings: Dict, workdir: str) -> Dict:
    """Secure DP-SGD vs tensorflow-privacy's central DP-SGD on one DNN; ms per step and ratio."""
    import tensorflow as tf  # pylint: disable=import-outside-toplevel
    import tensorflow_privacy  # pylint: disable=import-outside-toplevel
    from tensorflow_privacy.privacy.optimizers.dp_optimizer_keras_vectorized import (  # pylint: disable=import-outside-toplevel
        VectorizedDPKerasSGDOptimizer)

    from tfe_estimator.distribute.run_config import TfeRunConfig, plaintext_twin_config  # pylint: disable=import-outside-toplevel
    from tfe_estimator.privacy.dp import DistributedDP, make_dp_optimizer  # pylint: disable=import-outside-toplevel
    from tools.bench import timing  # pylint: disable=import-outside-toplevel
    from tools.bench.traffic import trainable_parameters  # pylint: disable=import-outside-toplevel
    from tools.bench.workloads import estimator_settings  # pylint: disable=import-outside-toplevel

    clip, multiplier, rate = 1.0, 1.1, 0.05
    columns = [tf.feature_column.numeric_column(FEATURES, shape=[settings["features"]])]
    hidden = list(settings["hidden_units"])
    dp = DistributedDP(l2_norm_clip=clip, noise_multiplier=multiplier)
    secure_cfg = TfeRunConfig(num_replicas=settings["replicas"], dp=dp,
                              **estimator_settings(os.path.join(workdir, "secure_dp")))
    devices = secure_cfg.train_distribute.extended.worker_devices
    central_cfg = plaintext_twin_config(devices, **estimator_settings(os.path.join(workdir, "central_dp")))
    estimators = {
        "secure DP": tensorflow_privacy.DNNClassifier(
            hidden_units=hidden, feature_columns=columns, config=secure_cfg,
            optimizer=lambda: make_dp_optimizer(tf.keras.optimizers.legacy.SGD(rate), clip)),
        "central DP": tensorflow_privacy.DNNClassifier(
            hidden_units=hidden, feature_columns=columns, config=central_cfg,
            optimizer=lambda: VectorizedDPKerasSGDOptimizer(
                l2_norm_clip=clip, noise_multiplier=multiplier, learning_rate=rate)),
    }
    data = _input_fn(settings["features"], settings["batch_size"])
    params = {}

    def on_begin(name):
        return lambda graph: params.__setitem__(name, trainable_parameters(graph))

    def train_fn(name):
        return lambda hooks, steps: estimators[name].train(data, steps=steps, hooks=hooks)

    times = timing.run_alternating({n: train_fn(n) for n in estimators}, settings["warmup"], settings["rounds"],
                                   settings["steps"], on_begin={n: on_begin(n) for n in estimators})
    row = timing.summarize(times, secure="secure DP", plain="central DP")
    row.update(params=params["secure DP"], hidden_units=hidden, features=settings["features"],
               replicas=settings["replicas"], batch_size_per_replica=settings["batch_size"],
               description=f"tensorflow_privacy.DNNClassifier{hidden}, {settings['features']} features, "
                           f"{settings['replicas']} replicas, batch {settings['batch_size']} per replica")
    return row


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m tools.bench.dp_bench",
                                     description="Distributed DP: sampler ns/value; secure vs central DP-SGD.")
    parser.add_argument("--out", default="bench-results", help="output directory (default bench-results/)")
    parser.add_argument("--features", type=int, default=256)
    parser.add_argument("--hidden-units", default="512,256,128")
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=32, help="examples per replica per step")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--sampler-values", type=int, default=1_000_000)
    parser.add_argument("--no-step", action="store_true", help="only the sampler")
    parser.add_argument("--sampler-threads", type=int, default=None, help=argparse.SUPPRESS)  # child process
    parser.add_argument("--variances", default=None, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def _sampler_in_child(variances: Sequence[float], threads: int, n: int) -> List[float]:
    # A process per thread count: the intra-op pool is sized once per process.
    command = [sys.executable, "-m", "tools.bench.dp_bench", "--sampler-threads", str(threads),
               "--variances", ",".join(repr(v) for v in variances), "--sampler-values", str(n)]
    out = subprocess.run(command, capture_output=True, text=True, check=True, timeout=600).stdout
    return json.loads(out.strip().splitlines()[-1])


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Runs both measurements; prints them and writes <out>/dp_bench.json. Returns 0."""
    args = parse_args(argv)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    checkout_on_pythonpath()  # the sampler runs in a child `-m tools.bench.dp_bench`
    if args.sampler_threads:
        values = [float(v) for v in args.variances.split(",")]
        print(json.dumps([sampler_ns_per_value(v, args.sampler_threads, args.sampler_values) for v in values]))
        return 0
    import tensorflow as tf  # pylint: disable=import-outside-toplevel

    from tfe_estimator.privacy.dp import DistributedDP, replica_noise_variance  # pylint: disable=import-outside-toplevel
    from tools.bench import report  # pylint: disable=import-outside-toplevel

    tf.compat.v1.logging.set_verbosity(tf.compat.v1.logging.ERROR)
    settings = dict(features=args.features, hidden_units=[int(h) for h in args.hidden_units.split(",")],
                    replicas=args.replicas, batch_size=args.batch_size, rounds=args.rounds, steps=args.steps,
                    warmup=args.warmup)
    workload_variance = replica_noise_variance(DistributedDP(1.0, 1.1), args.replicas, 32, 300_000)
    sampler: List[Dict] = []
    variances = (2.0**40, workload_variance, 2.0**88)
    for threads in (1, 2):
        for variance, ns in zip(variances, _sampler_in_child(variances, threads, args.sampler_values)):
            sampler.append({"log2_variance": math.log2(variance), "threads": threads, "ns_per_value": ns})
            print(f"[dp bench] TfeDiscreteGaussian v = 2**{math.log2(variance):.1f}, {threads} thread(s): "
                  f"{ns:.1f} ns per value (wall)", flush=True)
    results = {"machine": report.machine(), "settings": settings, "sampler": sampler}
    if not args.no_step:
        workdir = tempfile.mkdtemp(prefix="tfe-estimator-dp-bench-")
        row = dp_step_case(settings, workdir)
        results["step"] = row
        print(f"[dp bench] {row['description']}, {row['params']:,} parameters: secure DP "
              f"{row['secure_ms_per_step']:.1f} ms/step, central DP-SGD (tensorflow-privacy "
              f"VectorizedDPKerasSGDOptimizer) {row['plaintext_ms_per_step']:.1f} ms/step, ratio "
              f"{row['ratio']:.2f} (goal <= 1.1)", flush=True)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "dp_bench.json"), "w") as f:
        json.dump(results, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
