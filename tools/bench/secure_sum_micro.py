"""Microbenchmark: the secure sum alone against a plaintext sum, in a plain graph session.

Per size P: a vector of P float32 parameters on each of 2 replica devices is
reduced (SUM, to both replicas) by `TfeStrategy` on the fused AES-CTR kernels
("secure"), by the same strategy on tf-encrypted's own Pond ("reference"),
by the fused kernels with clipped updates on the 32-bit ring ("secure32"),
and by `ReductionToOneDevice` (`tf.add_n` on one device, copied back:
"plaintext"), and each replica adds the result into an accumulator variable,
as an optimizer update would use it (a result nobody consumes could be
pruned by Grappler). Rounds alternate between the graphs; the secure sum's
extra cost is ``(secure - plaintext) / (P * replicas)`` nanoseconds per
parameter per replica. Bytes per parameter per replica are counted from
the graphs' cross-device edges: replica -> server (upload), server -> replica
(download), and, for the plaintext anchor, between replicas. One traced step of the secure graph splits its op
time by kind (mask, server sum, reveal, other).
"""
import collections
import statistics
import time
from typing import Dict, List

import tensorflow as tf

from tools.bench.traffic import cross_device_bytes

__all__ = ["run_secure_sum"]

_LOCAL = "/job:localhost/replica:0/task:0/device:CPU:{}"


#: Op types of the fused path, by the party step they implement.
_KINDS = {"TfeMaskShare": "mask (replicas)", "TfeServerSum": "server sum", "TfeRevealSum": "reveal (destinations)"}


def _build(make_strategy, params):
    graph = tf.Graph()
    with graph.as_default():
        strategy = make_strategy()
        with strategy.scope():
            source = tf.Variable(tf.random.stateless_normal([params], [0, 0]) * 0.01)

            def replica_fn():
                rid = tf.distribute.get_replica_context().replica_id_in_sync_group
                return source * tf.cast(rid + 1, tf.float32)

            values = strategy.extended.call_for_each_replica(replica_fn)
            reduced = strategy.extended.batch_reduce_to(tf.distribute.ReduceOp.SUM, [(values, values)])[0]
        updates = []
        for tensor in strategy.experimental_local_results(reduced):
            # Outside the scope: a plain variable on the replica's device (a mirrored one
            # would also copy replica 0's result to the other replica).
            with tf.device(tensor.device):
                acc = tf.compat.v1.Variable(tf.zeros([params]), trainable=False, use_resource=True)
                updates.append(acc.assign_add(tensor * 1e-9).op)
        step = tf.group(*updates)
        init = tf.compat.v1.global_variables_initializer()
    return graph, step, init


def _op_time_by_kind(session, step) -> Dict[str, float]:
    """Milliseconds of op time per kind in one traced run of `step`."""
    options = tf.compat.v1.RunOptions(trace_level=tf.compat.v1.RunOptions.FULL_TRACE)
    metadata = tf.compat.v1.RunMetadata()
    session.run(step, options=options, run_metadata=metadata)
    kinds = collections.Counter()
    for device in metadata.step_stats.dev_stats:
        for node in device.node_stats:
            op_type = node.timeline_label.split("(")[0].split(" = ")[-1] if node.timeline_label else ""
            kind = _KINDS.get(op_type, "other ops")
            kinds[kind] += (node.op_end_rel_micros - node.op_start_rel_micros) / 1e3
    return dict(kinds)


def run_secure_sum(sizes: List[int], rounds: int, steps: int, replicas: int = 2, protocol: str = "pond") -> List[Dict]:
    """Times secure, reference and plaintext reductions of each size; returns one dict per size."""
    from tfe_estimator.distribute.strategy import TfeStrategy  # pylint: disable=import-outside-toplevel

    devices = [_LOCAL.format(i) for i in range(replicas + 3)]
    replica_devices, servers = devices[:replicas], devices[replicas:]
    config = tf.compat.v1.ConfigProto(device_count={"CPU": len(devices)})
    makers = {
        "secure": lambda: TfeStrategy(devices=replica_devices, protocol=protocol, server_devices=servers),
        # Clipped updates on the 32-bit ring (clip far above the values: the norm is computed, nothing scaled).
        "secure32": lambda: TfeStrategy(devices=replica_devices, protocol=protocol, server_devices=servers,
                                        clip_norm=1e3, update_ring_bits=32),
        "reference": lambda: TfeStrategy(devices=replica_devices, protocol=protocol, server_devices=servers,
                                         implementation="tf-encrypted"),
        "plaintext": lambda: tf.compat.v1.distribute.MirroredStrategy(
            devices=replica_devices, cross_device_ops=tf.distribute.ReductionToOneDevice()),
    }
    results = []
    for params in sizes:
        twins = {}
        for name, make in makers.items():
            graph, step, init = _build(make, params)
            session = tf.compat.v1.Session(graph=graph, config=config)
            session.run(init)
            for _ in range(3):
                session.run(step)
            twins[name] = (graph, session, step)
        times = {name: [] for name in twins}
        for k in range(rounds):
            for name in (list(twins) if k % 2 == 0 else list(reversed(list(twins)))):
                _, session, step = twins[name]
                for _ in range(steps):
                    start = time.perf_counter()
                    session.run(step)
                    times[name].append(time.perf_counter() - start)
        def count(name, src, dst, twins=twins):  # the edges one step needs (not the initializers' copies)
            graph, _, step = twins[name]
            return cross_device_bytes(graph, src, dst, fetches=[step])[0]

        upload, download = count("secure", replica_devices, servers), count("secure", servers, replica_devices)
        up32, down32 = count("secure32", replica_devices, servers), count("secure32", servers, replica_devices)
        # The plaintext anchor moves values between replicas only (to the reducing device and back).
        plain_bytes = count("plaintext", replica_devices, replica_devices)
        op_time = _op_time_by_kind(twins["secure"][1], twins["secure"][2])
        for _, session, _ in twins.values():
            session.close()
        s, r, p, s32 = (statistics.median(times[n]) for n in ("secure", "reference", "plaintext", "secure32"))
        results.append({
            "params": params, "replicas": replicas,
            "secure_ms": 1e3 * s, "reference_ms": 1e3 * r, "plaintext_ms": 1e3 * p, "ratio": s / p,
            "extra_ns_per_param_per_replica": 1e9 * (s - p) / (params * replicas),
            "reference_extra_ns_per_param_per_replica": 1e9 * (r - p) / (params * replicas),
            "secure32_ms": 1e3 * s32, "secure32_extra_ns_per_param_per_replica": 1e9 * (s32 - p) / (params * replicas),
            "secure32_bytes_per_param_per_replica": (up32 + down32) / replicas / params,
            "secure_params_per_s": params / s, "plaintext_params_per_s": params / p,
            "upload_bytes_per_param_per_replica": upload / replicas / params,
            "download_bytes_per_param_per_replica": download / replicas / params,
            "plaintext_bytes_per_param_per_replica": plain_bytes / replicas / params,
            "secure_op_ms_by_kind": op_time,
            "graph_ops": {n: len(twins[n][0].get_operations()) for n in twins},
        })
    return results
