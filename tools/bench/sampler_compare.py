"""Two builds of ``TfeDiscreteGaussian`` side by side: ns per value of an old and a new kernel source.

Each kernel source directory is built into a cache of its own, and the two are
timed in alternating child processes (one per kernel and thread count, as
TensorFlow sizes its intra-op pool once per process), so both see the same
machine load; a shared machine's noise then shows in both columns alike.
Prints, per variance and thread count, best and median ns per value of the
wall clock (as `dp_bench` measures it) and of the process's CPU time.

Run::

    python -m tools.bench.sampler_compare --old main --rounds 7
    python -m tools.bench.sampler_compare --old main --pin   # one core (taskset -c 0)

``--old`` is a git revision of this repository (its ``kernels/src`` is
extracted) or a directory of kernel sources; ``--new`` defaults to the working
tree's sources.
"""
import argparse
import json
import math
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
from typing import Dict, List, Optional, Sequence, Tuple

__all__ = ["main"]

VARIANCES = (2.0**40, 1.21 * 2.0**64 + 2.0**20, 2.0**88)
SRC = "tfe_estimator/secure/kernels/src"
REPO = pathlib.Path(__file__).resolve().parents[2]

_CHILD = r"""
import json, math, pathlib, sys, time
from tfe_estimator.secure.kernels import _build
_build.SOURCE_DIR = pathlib.Path(sys.argv[1])
import tensorflow as tf
from tfe_estimator.secure import kernels
threads, n = int(sys.argv[2]), int(sys.argv[3])
out = []
for v in json.loads(sys.argv[4]):
    with tf.Graph().as_default():
        noise = kernels.load().tfe_discrete_gaussian(tf.constant([n], tf.int64), tf.constant(v, tf.float64))
        config = tf.compat.v1.ConfigProto(intra_op_parallelism_threads=threads, inter_op_parallelism_threads=1)
        with tf.compat.v1.Session(config=config) as session:
            session.run(noise.op)  # warm up
            wall = cpu = math.inf
            for _ in range(3):
                t, c = time.perf_counter(), time.process_time()
                session.run(noise.op)
                wall, cpu = min(wall, time.perf_counter() - t), min(cpu, time.process_time() - c)
    out.append([1e9 * wall / n, 1e9 * cpu / n])
print("RESULT", json.dumps(out))
"""


def _sources(spec: str, workdir: pathlib.Path, name: str) -> pathlib.Path:
    if pathlib.Path(spec).is_dir():
        return pathlib.Path(spec).resolve()
    target = workdir / name / "src"  # the cache key hashes the sources' contents: each version is built apart
    target.mkdir(parents=True)
    archive = subprocess.run(["git", "-C", str(REPO), "archive", spec, SRC], capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(target), "--strip-components", str(SRC.count("/") + 1)], input=archive,
                   check=True)
    return target


def _run(src: pathlib.Path, threads: int, n: int, pin: bool, cache: pathlib.Path) -> List[List[float]]:
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", PYTHONPATH=str(REPO), TFE_ESTIMATOR_KERNEL_CACHE=str(cache))
    command = (["taskset", "-c", "0"] if pin else []) + [sys.executable, "-c", _CHILD, str(src), str(threads), str(n),
                                                         json.dumps(VARIANCES)]
    out = subprocess.run(command, env=env, capture_output=True, text=True, check=True, cwd=str(REPO)).stdout
    return json.loads(out.split("RESULT")[-1])


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Builds both kernels, times them in alternating rounds, prints the table. Returns 0."""
    parser = argparse.ArgumentParser(prog="python -m tools.bench.sampler_compare",
                                     description="TfeDiscreteGaussian: old vs new kernel source, side by side.")
    parser.add_argument("--old", required=True, help="git revision or directory of the old kernel sources")
    parser.add_argument("--new", default=str(REPO / SRC), help="directory of the new sources (default: this tree)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--values", type=int, default=1_000_000)
    parser.add_argument("--threads", default="1,2", help="intra-op thread counts (default 1,2)")
    parser.add_argument("--pin", action="store_true", help="run every child on one core (taskset -c 0)")
    args = parser.parse_args(argv)
    thread_counts = [int(t) for t in args.threads.split(",")]
    with tempfile.TemporaryDirectory(prefix="tfe-sampler-compare-") as tmp:
        workdir = pathlib.Path(tmp)
        kernels = {"old": _sources(args.old, workdir, "old"), "new": _sources(args.new, workdir, "new")}
        results: Dict[Tuple[str, int], List] = {(k, t): [] for k in kernels for t in thread_counts}
        for r in range(args.rounds):
            order = ["old", "new"] if r % 2 == 0 else ["new", "old"]
            for threads in thread_counts:
                for name in order:
                    results[(name, threads)].append(
                        _run(kernels[name], threads, args.values, args.pin, workdir / f"cache-{name}"))
            print(f"[sampler compare] round {r + 1}/{args.rounds} done", flush=True)
    for threads in thread_counts:
        for i, v in enumerate(VARIANCES):
            for kind, col in (("wall", 0), ("cpu", 1)):
                old = [x[i][col] for x in results[("old", threads)]]
                new = [x[i][col] for x in results[("new", threads)]]
                pinned = " pinned" if args.pin else ""
                print(f"[sampler compare] v = 2**{math.log2(v):.1f}, {threads} thread(s){pinned}, {kind}: "
                      f"old best {min(old):.1f} median {statistics.median(old):.1f}, new best {min(new):.1f} "
                      f"median {statistics.median(new):.1f} ns per value; new/old {min(new) / min(old):.2f} (best), "
                      f"{statistics.median(new) / statistics.median(old):.2f} (median)", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
