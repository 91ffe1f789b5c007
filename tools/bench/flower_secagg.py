"""Flower's SecAgg+ protocol in one process: its clients' and its server's CPU per secure round.

Runs in Flower's own virtualenv (``make bench-flower`` builds ``.venv-flower`` with the pinned
``tools/bench/requirements-flower.txt``; Flower and TensorFlow 2.15 do not share one environment),
without TensorFlow and without importing `tfe_estimator`. It drives Flower's own SecAgg+ code,
stage by stage, for N clients that each hold one float32 vector of E elements:

- each client: ``secaggplus_mod``'s ``_setup`` (two key pairs), ``_share_keys`` (Shamir shares of
  its mask seed and key, encrypted per neighbour), ``_collect_masked_vectors`` (quantize, private
  and pairwise masks from ``pseudo_rand_gen``) and ``_unmask`` (its shares for the server);
- the server: what ``SecAggPlusWorkflow``'s collect and unmask stages compute (sum of the masked
  vectors mod the modulus, Shamir reconstruction of every client's seed, removing the private
  masks, dequantizing), with Flower's own functions and the workflow's default ranges.

Messages are handed over in memory: no SuperLink, no SuperNodes, no TLS, no serialization, no
3-second polls, which is what a deployed Flower round adds (52-125 s per round at 2-4 clients on
this machine, issue 34); so this is the protocol's own CPU, the fair anchor for
`tools.bench.service_alone`'s CPU of one secure sum. The decoded sum is checked against the plain
mean (what Flower releases) to its quantization step. `tools.bench.flower_compare` runs both side by side.

Run (prints one JSON line per size)::

    .venv-flower/bin/python tools/bench/flower_secagg.py --elements 100000 1000000 --clients 2 --rounds 3
"""
import argparse
import importlib
import json
import sys
import time
from typing import Dict, List, Optional, Sequence

import numpy as np

__all__ = ["measure", "main"]

#: SecAggPlusWorkflow's defaults (flwr 1.42).
CLIPPING_RANGE = 8.0
QUANTIZATION_RANGE = 4194304
MODULUS_RANGE = 4294967296
MAX_WEIGHT = 1000.0


def _round(vectors: List[np.ndarray]) -> Dict[str, float]:
    """One SecAgg+ round over `vectors` (one per client); CPU seconds of the clients and of the server."""
    # Flower's modules are imported here, in its own virtualenv: importing this file costs nothing.
    from flwr.common import ndarrays_to_parameters  # pylint: disable=import-outside-toplevel,import-error
    # The package's __init__ exports a function of the module's name: take the module itself.
    mod = importlib.import_module("flwr.client.mod.secure_aggregation.secaggplus_mod")
    from flwr.common.secure_aggregation.crypto.shamir import combine_shares  # pylint: disable=import-error,C0415
    from flwr.common.secure_aggregation import ndarrays_arithmetic as arith  # pylint: disable=import-error,C0415
    from flwr.common.secure_aggregation.quantization import dequantize  # pylint: disable=import-error,C0415
    from flwr.common.secure_aggregation.secaggplus_utils import pseudo_rand_gen  # pylint: disable=E0401,C0415
    from flwr.common.secure_aggregation.secaggplus_constants import Key  # pylint: disable=import-error,C0415

    n = len(vectors)
    nids = list(range(1, n + 1))
    clients_cpu = 0.0
    configs = {Key.SAMPLE_NUMBER: n, Key.SHARE_NUMBER: n, Key.THRESHOLD: n, Key.CLIPPING_RANGE: CLIPPING_RANGE,
               Key.TARGET_RANGE: QUANTIZATION_RANGE, Key.MOD_RANGE: MODULUS_RANGE, Key.MAX_WEIGHT: MAX_WEIGHT}

    def timed(fn, *args):
        nonlocal clients_cpu
        start = time.process_time()
        out = fn(*args)
        clients_cpu += time.process_time() - start
        return out

    states = {nid: mod.SecAggPlusState(nid=nid) for nid in nids}
    keys = {nid: timed(mod._setup, states[nid], configs) for nid in nids}  # pylint: disable=protected-access
    public = {str(nid): (keys[nid][Key.PUBLIC_KEY_1], keys[nid][Key.PUBLIC_KEY_2]) for nid in nids}
    sent = {nid: timed(mod._share_keys, states[nid], public) for nid in nids}  # pylint: disable=protected-access
    inbox: Dict[int, Dict[str, list]] = {nid: {Key.CIPHERTEXT_LIST: [], Key.SOURCE_LIST: []} for nid in nids}
    for src in nids:
        for dst, ciphertext in zip(sent[src][Key.DESTINATION_LIST], sent[src][Key.CIPHERTEXT_LIST]):
            inbox[dst][Key.CIPHERTEXT_LIST].append(ciphertext)
            inbox[dst][Key.SOURCE_LIST].append(src)
    masked = {nid: timed(mod._collect_masked_vectors, states[nid], inbox[nid], 1,  # pylint: disable=W0212
                         ndarrays_to_parameters([vectors[k]])) for k, nid in enumerate(nids)}
    unmask_configs = {Key.ACTIVE_NODE_ID_LIST: nids, Key.DEAD_NODE_ID_LIST: []}
    shares = {nid: timed(mod._unmask, states[nid], unmask_configs) for nid in nids}  # pylint: disable=W0212

    from flwr.common import bytes_to_ndarray  # pylint: disable=import-outside-toplevel,import-error
    start = time.process_time()
    total = None
    for nid in nids:
        vector = [bytes_to_ndarray(b) for b in masked[nid][Key.MASKED_PARAMETERS]]
        total = vector if total is None else arith.parameters_addition(total, vector)
    total = arith.parameters_mod(total, MODULUS_RANGE)
    collected: Dict[int, List[bytes]] = {nid: [] for nid in nids}
    for nid in nids:
        for owner, share in zip(shares[nid][Key.NODE_ID_LIST], shares[nid][Key.SHARE_LIST]):
            collected[owner].append(share)
    for nid in nids:
        seed = combine_shares(collected[nid])
        total = arith.parameters_subtraction(total, pseudo_rand_gen(seed, MODULUS_RANGE,
                                                                    arith.get_parameters_shape(total)))
    total = arith.parameters_mod(total, MODULUS_RANGE)
    ratio, total = arith.factor_extract(total)
    decoded = dequantize(total, CLIPPING_RANGE, QUANTIZATION_RANGE)
    decoded = [(v - (n - 1) * CLIPPING_RANGE) * (QUANTIZATION_RANGE / ratio) for v in decoded]
    server_cpu = time.process_time() - start
    # SecAgg+ in Flower releases the mean weighted by each client's number of examples (1 each here).
    error = float(np.max(np.abs(decoded[0] - np.mean(vectors, axis=0))))
    return {"clients_cpu_s": clients_cpu, "server_cpu_s": server_cpu, "max_error": error,
            "tolerance": n * 2 * CLIPPING_RANGE / float(ratio)}


def measure(elements: int, clients: int, rounds: int) -> Dict:
    """CPU ms per round (clients together, server) of Flower's SecAgg+ on `clients` vectors of `elements`."""
    rng = np.random.default_rng(0)
    vectors = [rng.uniform(-1, 1, elements).astype(np.float32) for _ in range(clients)]
    _round(vectors)  # warm-up: imports, first allocations
    runs = [_round(vectors) for _ in range(rounds)]
    worst = max(r["max_error"] for r in runs)
    if worst > runs[0]["tolerance"]:
        raise RuntimeError(f"Flower's decoded mean is off by {worst} (more than {clients} quantization steps, "
                           f"{runs[0]['tolerance']})")
    import flwr  # pylint: disable=import-outside-toplevel,import-error
    return {"elements": elements, "clients": clients, "flwr": flwr.__version__,
            "clients_cpu_ms": 1e3 * sum(r["clients_cpu_s"] for r in runs) / rounds,
            "server_cpu_ms": 1e3 * sum(r["server_cpu_s"] for r in runs) / rounds, "max_error": worst}


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--elements", type=int, nargs="+", default=[1_000_000])
    parser.add_argument("--clients", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    for elements in args.elements:
        print(json.dumps(measure(elements, args.clients, args.rounds)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
