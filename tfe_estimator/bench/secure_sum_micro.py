"""Microbenchmark: the secure sum alone against a plaintext sum, in a plain graph session.

Per size P: a vector of P float32 parameters on each of 2 replica devices is
reduced (SUM, to both replicas) by `SecureAggregation` and by
`ReductionToOneDevice` (`tf.add_n` on one device, copied back), and each
replica adds the result into an accumulator variable, as an optimizer
update would use it (a result nobody consumes could be pruned by Grappler).
Rounds alternate between the two graphs; parameters per second are P over
the median seconds per reduction.
"""
import statistics
import time
from typing import Dict, List

import tensorflow as tf

from tfe_estimator.bench.traffic import cross_device_bytes

__all__ = ["run_secure_sum"]

_LOCAL = "/job:localhost/replica:0/task:0/device:CPU:{}"


def _build(cross_device_ops, params, replicas):
    graph = tf.Graph()
    with graph.as_default():
        strategy = tf.compat.v1.distribute.MirroredStrategy(devices=replicas, cross_device_ops=cross_device_ops)
        with strategy.scope():
            source = tf.Variable(tf.random.stateless_normal([params], [0, 0]) * 0.01)

            def replica_fn():
                rid = tf.distribute.get_replica_context().replica_id_in_sync_group
                return source * tf.cast(rid + 1, tf.float32)

            values = strategy.extended.call_for_each_replica(replica_fn)
            reduced = strategy.extended.batch_reduce_to(tf.distribute.ReduceOp.SUM, [(values, values)])[0]
            updates = []
            for tensor in strategy.experimental_local_results(reduced):
                with tf.device(tensor.device):
                    acc = tf.compat.v1.Variable(tf.zeros([params]), trainable=False, use_resource=True)
                    updates.append(acc.assign_add(tensor * 1e-9).op)
            step = tf.group(*updates)
        init = tf.compat.v1.global_variables_initializer()
    return graph, step, init


def run_secure_sum(sizes: List[int], rounds: int, steps: int, replicas: int = 2, protocol: str = "pond") -> List[Dict]:
    """Times secure vs plaintext reductions of vectors of each size; returns one dict per size."""
    from tfe_estimator.aggregation import SecureAggregation  # pylint: disable=import-outside-toplevel

    devices = [_LOCAL.format(i) for i in range(replicas + 3)]
    replica_devices, servers = devices[:replicas], devices[replicas:]
    config = tf.compat.v1.ConfigProto(device_count={"CPU": len(devices)})
    results = []
    for params in sizes:
        twins = {}
        for name, ops in (("secure", SecureAggregation(protocol=protocol, server_devices=servers)),
                          ("plaintext", tf.distribute.ReductionToOneDevice())):
            graph, step, init = _build(ops, params, replica_devices)
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
        upload, _ = cross_device_bytes(twins["secure"][0], replica_devices, servers)
        for _, session, _ in twins.values():
            session.close()
        s, p = statistics.median(times["secure"]), statistics.median(times["plaintext"])
        results.append({
            "params": params, "replicas": replicas,
            "secure_ms": 1e3 * s, "plaintext_ms": 1e3 * p, "ratio": s / p,
            "secure_params_per_s": params / s, "plaintext_params_per_s": params / p,
            "upload_bytes_per_param_per_replica": upload / replicas / params,
            "graph_ops": {"secure": len(twins["secure"][0].get_operations()),
                          "plaintext": len(twins["plaintext"][0].get_operations())},
        })
    return results
