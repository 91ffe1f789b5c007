"""The party audit on between-graph sums: every owner's partition graphs pass, planted leaks fail.

Two owners' graphs run in one process (devices stand for tasks, threads for the
owners' sessions, as in tests/test_between_graph.py); each owner's run returns
its own partition graphs, audited alone. The leaks are planted into copies of
those partition graphs (the graphs the audit reads), each beside the clean pass.
"""
import copy
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import tensorflow as tf

from tfe_estimator.audit.party_audit import PartyAuditError, audit_party_inputs
from tfe_estimator.distribute.step_sum import SHARED_NAME_PREFIX

DEVICES = [f"/job:localhost/replica:0/task:0/device:CPU:{i}" for i in range(4)]
SERVERS = DEVICES[2:]
VALUES = [np.array([1.5, -2.0], np.float32), np.array([0.25, 4.0], np.float32)]


@pytest.fixture(scope="module")
def owner_runs():
    """Each owner's partition graphs of one between-graph step (owner 0 is the chief)."""
    from tfe_estimator.distribute.step_sum import step_sum
    from tfe_estimator.secure.fused_sum import Encoding

    with tf.Graph().as_default():
        step = tf.compat.v1.placeholder(tf.int64, [])
        totals = []
        for owner in range(2):
            with tf.device(DEVICES[owner]):
                x = tf.constant(VALUES[owner], name="gradient")
            totals.append(step_sum([x], "sum_0", step, owner, ["owner 0", "owner 1"], owner == 0, DEVICES[owner], SERVERS,
                                   Encoding(64, 32, 2.0**24), tf.float32, "hint")[0])
        config = tf.compat.v1.ConfigProto(device_count={"CPU": 4}, operation_timeout_in_ms=20000)
        options = tf.compat.v1.RunOptions(output_partition_graphs=True)
        metadata = [tf.compat.v1.RunMetadata() for _ in totals]
        with tf.compat.v1.Session(config=config) as sess, ThreadPoolExecutor(2) as pool:
            runs = [pool.submit(sess.run, t, {step: 3}, options=options, run_metadata=m)
                    for t, m in zip(totals, metadata)]
            for run in runs:
                np.testing.assert_allclose(run.result(timeout=60), VALUES[0] + VALUES[1], atol=1e-6)
    return [list(m.partition_graphs) for m in metadata]


def _node(graphs, device, op, input_suffix=None):
    """The first node of type `op` on `device` (whose first input ends with `input_suffix`, if given)."""
    for graph in graphs:
        for node in graph.node:
            if node.op == op and node.device == device and (input_suffix is None or node.input[0].endswith(input_suffix)):
                return graph, node
    raise KeyError(op)


def _send_of(graphs, producer):
    """The owner's _Send node whose input is `producer` and whose receiver is server1."""
    for graph in graphs:
        for node in graph.node:
            if node.op == "_Send" and node.input[0] == producer and node.attr["recv_device"].s.decode() == SERVERS[1]:
                return node
    raise KeyError(producer)


def test_every_owners_partition_graphs_of_a_between_graph_step_pass_the_audit(owner_runs):
    for owner, graphs in enumerate(owner_runs):
        report = audit_party_inputs(graphs, SERVERS)
        assert report.parties == tuple(SERVERS), (owner, report)
        kinds = {e.producer_type for e in report.edges}
        assert {"TfeMaskShare"} <= kinds, (owner, kinds)  # the owner's key and its masked share reach the servers
    chief_ops = {n.op for g in owner_runs[0] for n in g.node}
    assert {"TfeStepTake", "TfeServerSum", "QueueEnqueueV2"} <= chief_ops
    assert "TfeStepTake" not in {n.op for g in owner_runs[1] for n in g.node}


def test_an_owner_putting_its_unmasked_gradient_into_an_accumulator_fails(owner_runs):
    graphs = copy.deepcopy(owner_runs[1])
    graph, share = _node(graphs, DEVICES[1], "TfeMaskShare")
    send = _send_of(graphs, share.name)
    raw = graph.node.add(name="raw_gradient", op="Const", device=DEVICES[1])  # the fixed-point gradient, no mask
    raw.attr["dtype"].type = tf.int64.as_datatype_enum
    raw.attr["value"].tensor.CopyFrom(tf.make_tensor_proto(np.array([3, -4], np.int64)))
    send.input[0] = "raw_gradient"
    with pytest.raises(PartyAuditError, match="not a masked share"):
        audit_party_inputs(graphs, SERVERS)


def test_an_owners_key_put_into_server1s_accumulator_beside_its_share_fails(owner_runs):
    graphs = copy.deepcopy(owner_runs[1])
    _, share = _node(graphs, DEVICES[1], "TfeMaskShare")
    send = _send_of(graphs, share.name)
    send.input[0] = share.name + ":1"  # the key goes where the share went
    with pytest.raises(PartyAuditError, match="into server1's accumulator, which holds the masked shares"):
        audit_party_inputs(graphs, SERVERS)


def test_the_chief_handing_one_owners_share_to_an_owner_fails(owner_runs):
    graphs = copy.deepcopy(owner_runs[0])
    _, enqueue = _node(graphs, SERVERS[1], "QueueEnqueueV2")
    _, take = _node(graphs, SERVERS[1], "TfeStepTake")
    enqueue.input[2] = take.name + ":1"  # owner 1's share instead of the partial sum
    with pytest.raises(PartyAuditError, match="may only reach this server's TfeServerSum"):
        audit_party_inputs(graphs, SERVERS)


def test_a_take_whose_output_is_sent_to_an_owner_device_fails(owner_runs):
    graphs = copy.deepcopy(owner_runs[0])
    graph, take = _node(graphs, SERVERS[1], "TfeStepTake")
    send = graph.node.add(name="leak_send", op="_Send", device=take.device, input=[take.name + ":1"])
    send.attr["T"].type = tf.int64.as_datatype_enum
    send.attr["tensor_name"].s = b"leak_edge"
    send.attr["send_device"].s = take.device.encode()
    send.attr["recv_device"].s = DEVICES[0].encode()
    with pytest.raises(PartyAuditError, match=r"_Send 'leak_send' uses them"):
        audit_party_inputs(graphs, SERVERS)


@pytest.mark.parametrize("shared_name", ["my_accumulator", f"{SHARED_NAME_PREFIX}/sum_0/server1"])
def test_an_accumulator_outside_step_sums_scheme_or_on_the_wrong_server_fails(owner_runs, shared_name):
    graphs = copy.deepcopy(owner_runs[1])
    _, accumulator = _node(graphs, SERVERS[0], "TfeStepAccumulator")
    accumulator.attr["shared_name"].s = shared_name.encode()
    with pytest.raises(PartyAuditError, match=r"between-graph sums use only accumulators named"):
        audit_party_inputs(graphs, SERVERS)


@pytest.mark.multiprocess
@pytest.mark.slow
def test_each_owner_of_a_loopback_cluster_audits_its_own_training_steps(tmp_path):
    import io
    import os
    import sys

    from test_between_graph import OWNERS, _owner_data
    from test_launch import _alive
    from tfe_estimator.cluster.launcher import Launcher

    script = os.path.join(os.path.dirname(__file__), "scripts", "between_graph_audit_owner.py")

    def run(workdir, *flags):
        os.makedirs(workdir)
        _owner_data(workdir)
        out = io.StringIO()
        launcher = Launcher([sys.executable, script, "3", *flags], workers=1,
                            task_cwd=os.path.join(workdir, "{job}-{index}"), out=out, cluster_mode="between-graph")
        status = launcher.run()
        assert not [t.name for t in launcher.tasks if t.process.poll() is None or _alive(t.process.pid)]
        return status, out.getvalue()

    status, log = run(str(tmp_path / "clean"))
    assert status == 0, log[-5000:]
    assert log.count("audit passed:") == len(OWNERS), log[-5000:]
    assert "TfeMaskShare" in log and "ops on 2 parties" in log, log[-3000:]
    # Mutation: every owner's accumulators and queues renamed out of step_sum's scheme; training works, the audit
    # fails.
    status, log = run(str(tmp_path / "planted"), "--plant-foreign-channel")
    assert status != 0 and "audit passed:" not in log, log[-5000:]
    assert "between-graph sums use only accumulators named" in log or "use only queues named" in log, log[-5000:]
