"""The owner's per-step kernels in service mode, each timed per parameter beside the AES-CTR floor, in one run.

An owner's checked contribution (`tfe_estimator.owner.contribution`) runs, per step, on its update ring (64,
or 32 with ``update_ring_bits=32``):

- ``mask_share``: the graph's `TfeMaskShare` op (encode, mask with a fresh key's keystream);
- ``extend``: `SumCheck.extend` (the check pass reads the vector back, computes its check words, copies the
  share into the reused send buffer);
- ``verify``: `SumCheck.verify` (the check pass unmasks the answer into a reused array TensorFlow takes and
  recomputes the checks);
- ``hand-off``: the answer op's `tf.numpy_function` handing that array to TensorFlow (no copy when aligned);
- ``decode``: `TfeRevealSum` turning the revealed ring words into floats, as the graph builds it (``decode
  (zeros_like)``: two parts, the second a fresh zero tensor; ``decode (one part)``: the revealed words alone);
- ``verify + decode (one pass)``: where the checkout has it, `SumCheck.verify` decoding the floats in its pass
  into the arrays TensorFlow takes (in the call's thread), and ``hand-off (decoded floats -> tensor)``: the
  answer op handing them over; together they replace verify, hand-off and decode for a float sum.

Beside them, on the same vector size and in the same run: AES-128-CTR keystream alone (`cryptography`, into a
reused buffer: the floor of every pass that draws a mask or coefficients), our kernels' keystream (the check
pass with nothing to check), and a memcpy of the vector. Each stage's CPU time (the process's, so
TensorFlow's intra-op threads count) is the median of `--repeats` runs after one warm-up, in ns per parameter,
with its ratio to the AES floor of one ring word per parameter (8 bytes on the 64-bit ring, 4 on the 32-bit).

Against an older checkout (no `ops.decode_sum`, no decoding pass) those rows are left out, so the same file
times both::

    PYTHONPATH=/path/to/main python tools/bench/owner_kernels.py

Run::

    PYTHONPATH=. python -m tools.bench.owner_kernels --elements 100000 1000000 --rings 64 32
"""
import argparse
import statistics
import sys
import time
from typing import Callable, Dict, List, Optional, Sequence

import numpy as np

__all__ = ["measure", "main"]

#: Per ring, the encoding's fraction bits and bound: the 64-bit ring's default, the 32-bit ring's of clipped
#: updates (`aggregation.narrow_update_encoding(10.0, 2)`).
_ENCODINGS = {64: (32, 2.0**24), 32: (25, 2.0**4)}


def _median_ns(work: Callable[[], object], n: int, repeats: int) -> float:
    """Median process CPU ns per parameter of `work` over `repeats` runs (one warm-up first)."""
    work()
    times = []
    for _ in range(repeats):
        start = time.process_time_ns()
        work()
        times.append(time.process_time_ns() - start)
    return statistics.median(times) / n


def _stages(n: int, ring_bits: int = 64) -> Dict[str, Callable[[], object]]:
    """The stages for a vector of `n` parameters on `ring_bits` (module docstring), each a callable that runs it
    once."""
    # pylint: disable=import-outside-toplevel
    import tensorflow as tf
    from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

    from tfe_estimator.owner import sum_check
    from tfe_estimator.secure.kernels import check_pass, ops
    from tfe_estimator.service import ring

    fraction, bound = _ENCODINGS[ring_bits]
    rng = np.random.default_rng(0)
    values = (rng.standard_normal(n) * 0.01).astype(np.float32)
    check = sum_check.SumCheck(bytes(32))
    words = ring.ring_words(n, ring_bits)

    graph = tf.Graph()
    with graph.as_default():
        source = tf.compat.v1.Variable(values, use_resource=True)
        share_t, key_t = ops.mask_share([source.read_value()], bound, ring_bits, fraction, "owner", "hint")
        mask_op = tf.group(share_t, key_t)
        session = tf.compat.v1.Session(graph=graph, config=tf.compat.v1.ConfigProto(inter_op_parallelism_threads=1))
        session.run(source.initializer)
    share, key = session.run([share_t, key_t])

    extended = check.extend("c", 7, ring_bits, n, key, share)
    plain = extended.view(np.uint64).copy()
    ring.add_into(plain, ring.keystream_words(key, plain.size), ring_bits)
    blind = np.arange(4, dtype=np.int32)
    masked = plain.copy()
    ring.sub_into(masked, ring.keystream_words(blind, masked.size), ring_bits)
    masked = masked.view(np.int64)
    revealed = check.verify("c", 7, ring_bits, n, blind, masked)[:words].view(np.int64).copy()
    aligned = sum_check._for_tensorflow(words).view(np.int64)  # pylint: disable=protected-access
    aligned[...] = revealed

    with graph.as_default():
        handed = tf.numpy_function(lambda: aligned, [], tf.int64, stateful=True)
        handed.set_shape([words])
        hand_off = tf.group(handed)
        # fetched: one element of the decoded floats (a group of unfetched pure ops may be pruned)
        decode_two = ops.reveal_sum(handed, tf.zeros_like(handed), tf.float32, ring_bits, fraction, 1.0,
                                    [tf.TensorShape([n])])[0][:1]
        decode_one = None
        if hasattr(ops, "decode_sum"):
            decode_one = ops.decode_sum(handed, tf.float32, ring_bits, fraction, 1.0, [tf.TensorShape([n])])[0][:1]
        empty = tf.no_op()

    stream = bytearray(ring_bits // 8 * n)
    zeros = bytes(ring_bits // 8 * n)

    def aes_floor():
        Cipher(algorithms.AES(bytes(16)), modes.CTR(bytes(16))).encryptor().update_into(zeros, stream)

    source_words, target_words = plain[:words].copy(), np.empty(words, np.uint64)
    out = np.empty(words, np.uint64)
    stages = {
        "AES-128-CTR keystream (cryptography)": aes_floor,
        "AES-128-CTR keystream (our check pass)": lambda: check_pass.check_pass(
            source_words, 0, n, 0, ring_bits, key, bytes(16), out, copy=False),
        "memcpy": lambda: np.copyto(target_words, source_words),
        "session.run overhead (no-op)": lambda: session.run(empty),
        "mask_share (TfeMaskShare)": lambda: session.run(mask_op),
        "extend (check words, copy to send buffer)": lambda: check.extend("c", 7, ring_bits, n, key, share),
        "verify (unmask + checks)": lambda: check.verify("c", 7, ring_bits, n, blind, masked),
        "hand-off (numpy_function -> tensor)": lambda: session.run(hand_off),
        "hand-off + decode (zeros_like)": lambda: session.run(decode_two),
    }
    if decode_one is not None:
        stages["hand-off + decode (one part)"] = lambda: session.run(decode_one)
    if hasattr(sum_check, "_decoded_arrays"):  # the fused pass: verify decoding the floats
        factor = ops.decode_factor(fraction)
        sizes = [n]

        def verify_decoded():
            arrays = sum_check._decoded_arrays(np.float32, sizes)  # pylint: disable=protected-access
            check.verify("c", 7, ring_bits, n, blind, masked, arrays, factor)
            return arrays

        decoded = verify_decoded()
        with graph.as_default():  # as the answer op does: the arrays the call decoded, handed to TensorFlow
            fused = tf.numpy_function(lambda: decoded, [], [tf.float32], stateful=True)[0][:1]
        stages["verify + decode (one pass)"] = verify_decoded
        stages["hand-off (decoded floats -> tensor)"] = lambda: session.run(fused)
    return stages


def measure(n: int, repeats: int, ring_bits: int = 64) -> List[Dict]:
    """Per stage: its name, ns per parameter and ratio to the AES floor (one ring word per parameter)."""
    results = [(name, _median_ns(work, n, repeats)) for name, work in _stages(n, ring_bits).items()]
    floor = results[0][1]
    return [{"elements": n, "ring_bits": ring_bits, "stage": name, "ns_per_param": ns, "x_aes_floor": ns / floor}
            for name, ns in results]


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.bench.owner_kernels", description=__doc__.split("\n")[0])
    parser.add_argument("--elements", type=int, nargs="+", default=[100_000, 1_000_000], help="vector sizes")
    parser.add_argument("--repeats", type=int, default=30, help="timed runs per stage (default 30)")
    parser.add_argument("--rings", type=int, nargs="+", default=[64, 32], choices=sorted(_ENCODINGS),
                        help="update rings (default 64 32)")
    args = parser.parse_args(argv)
    with open("/proc/loadavg") as f:
        load = " ".join(f.read().split()[:3])
    print(f"[owner-kernels] load average {load}; process CPU ns/param, median of {args.repeats}", flush=True)
    for ring_bits in args.rings:
        for n in args.elements:
            for row in measure(n, args.repeats, ring_bits):
                print(f"[owner-kernels] ring {ring_bits} {n:>9,} {row['stage']:<45} {row['ns_per_param']:7.2f} "
                      f"ns/param {row['x_aes_floor']:6.2f}x AES", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
