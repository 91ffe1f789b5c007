"""The service-mode owner graph audit: what a contribution may send, with a planted leak beside each rule."""
import numpy as np
import pytest
import tensorflow as tf

from tfe_estimator.audit.owner_graph import OwnerGraphAuditError, audit_owner_graph
from tfe_estimator.owner import riders
from tfe_estimator.owner.contribution import service_sum
from tfe_estimator.secure.fused_sum import Encoding
from tfe_estimator.secure.kernels import ops

ENCODING = Encoding(64, 32, 2.0**24)


def _echo(channel, step, ring_bits, num_elements, key, share):
    return key, share  # stands in for the service: the graph, not the answer, is audited here


def _graph(leak=None):
    graph = tf.Graph()
    with graph.as_default():
        step = tf.constant(3, tf.int64)
        grads = [tf.constant([1.0, 2.0]), tf.constant([[3.0]])]
        if leak is None:
            service_sum([grads], ["/cpu:0"], ["/cpu:0"], ENCODING, tf.float32, "chief:0", "hint", 1.0, "sum_0",
                        step, _echo)
        else:
            share, key = ops.mask_share(grads, ENCODING.bound, 64, 32, "chief:0", "hint")
            inputs = {"raw": [step, key, tf.bitcast(tf.cast(tf.concat([tf.reshape(g, [-1]) for g in grads], 0),
                                                            tf.float64), tf.int64)],
                      "zero_key": [step, tf.zeros([4], tf.int32), share],
                      "other_key": [step, ops.mask_share(grads, ENCODING.bound, 64, 32, "x", "h")[1], share]}[leak]
            tf.numpy_function(lambda *a: (a[1], a[2]), inputs, [tf.int32, tf.int64], name="service_contribute")
    return graph


def test_an_owners_contribution_sends_the_step_a_fresh_key_and_its_masked_share():
    assert audit_owner_graph(_graph()) == 1


@pytest.mark.parametrize("leak", ["raw", "zero_key", "other_key"])
def test_a_contribution_of_anything_else_is_refused_naming_it(leak):
    with pytest.raises(OwnerGraphAuditError, match=r"service_contribute would send \[.*\], but a contribution"):
        audit_owner_graph(_graph(leak))


def test_an_answer_op_that_takes_anything_but_its_contributions_ticket_is_refused():
    # The answer op (which waits for the call) is a numpy_function too: fed the gradients, it could send them.
    graph = _graph()
    with graph.as_default():
        grads = tf.constant([1.0, 2.0])
        tf.numpy_function(lambda g: g, [grads], tf.float32, name="service_answer")
    with pytest.raises(OwnerGraphAuditError, match=r"the answer op service_answer.* takes \[Const.*\], but an answer "
                                                   r"op may take only its contribution's ticket"):
        audit_owner_graph(graph)


def test_an_op_on_another_task_is_refused():
    graph = _graph()
    with graph.as_default(), tf.device("/job:worker/task:0/device:CPU:0"):
        tf.constant(1.0, name="elsewhere")
    with pytest.raises(OwnerGraphAuditError, match=r"elsewhere \(Const\) is placed on /job:worker/task:0"):
        audit_owner_graph(graph)


def test_the_audited_sum_reveals_each_part_through_a_stand_in_service():
    # With a service that hands back the owner's own key and share (one owner), the reveal is the owner's values.
    graph = tf.Graph()
    with graph.as_default():
        grads = [tf.constant([1.0, 2.0]), tf.constant([[3.0]])]
        totals = service_sum([grads], ["/cpu:0"], ["/cpu:0"], ENCODING, tf.float32, "chief:0", "hint", 1.0,
                             "sum_0", tf.constant(3, tf.int64), _echo)
        with tf.compat.v1.Session(graph=graph) as session:
            first, second = session.run(totals[0])
    np.testing.assert_allclose(first, [1.0, 2.0])
    np.testing.assert_allclose(second, [[3.0]])


def _early_graph(leak=None):
    """A sum whose key is drawn when the step starts and put early (`put_key`); `leak` plants a key op that
    sends something else."""
    puts, keys = [], []

    def echo(channel, step, ring_bits, num_elements, key, share):
        keys.append(np.array(key))
        return _echo(channel, step, ring_bits, num_elements, key, share)

    graph = tf.Graph()
    with graph.as_default():
        step = tf.constant(3, tf.int64)
        grads = [tf.constant([1.0, 2.0]), tf.constant([[3.0]])]
        totals = service_sum([grads], ["/cpu:0"], ["/cpu:0"], ENCODING, tf.float32, "chief:0", "hint", 1.0, "sum_0",
                             step, echo, put_key=lambda *args: puts.append(args[:4] + (np.array(args[4]),)))
        if leak == "gradients":
            tf.numpy_function(lambda s, g: s, [step, grads[0]], tf.int64, name="service_key")
        elif leak == "a key read elsewhere":
            key = next(op for op in graph.get_operations() if op.type == "TfeAesSeed").outputs[0]
            tf.identity(key, name="copied")
    return graph, totals, (puts, keys)


def test_a_key_put_when_the_step_starts_is_the_mask_ops_key_and_the_sum_is_revealed():
    graph, totals, (puts, keys) = _early_graph()
    assert audit_owner_graph(graph) == 1
    with tf.compat.v1.Session(graph=graph) as session:
        first, second = session.run(totals[0])
    np.testing.assert_allclose(first, [1.0, 2.0])  # the stand-in service's answer, unmasked with the put key
    np.testing.assert_allclose(second, [[3.0]])
    (channel, step, ring_bits, num_elements, key), = puts
    assert (channel, step, ring_bits, num_elements) == ("sum_0", 3, 64, 3)
    np.testing.assert_array_equal(key, keys[0])  # the key put early is the one the share is masked with


@pytest.mark.parametrize("leak", ["gradients", "a key read elsewhere"])
def test_a_key_op_that_sends_anything_else_is_refused_naming_it(leak):
    with pytest.raises(OwnerGraphAuditError, match=r"the key op service_key.* would send \[.*\], but a key op may"):
        audit_owner_graph(_early_graph(leak)[0])


def test_only_the_chains_first_sum_puts_its_key_when_the_step_starts():
    # An evaluation makes dozens of sums; each key put early waits on server0 as one of the owner's calls there
    # (--max-waiting-puts): only the chain's first puts early, the others put their keys with their shares.
    # Sums above riders.MAX_ELEMENTS make calls of their own.
    puts, keys = [], []

    def echo(channel, step, ring_bits, num_elements, key, share):
        keys.append((channel, np.array(key)))
        return _echo(channel, step, ring_bits, num_elements, key, share)

    graph = tf.Graph()
    size = riders.MAX_ELEMENTS + 1
    with graph.as_default():
        step = tf.constant(3, tf.int64)
        totals = [service_sum([[tf.fill([size], float(k))]], ["/cpu:0"], ["/cpu:0"], ENCODING, tf.float32,
                              "chief:0", "hint", 1.0, f"sum_{k}", step, echo,
                              put_key=lambda *args: puts.append(args[:4] + (np.array(args[4]),)))
                  for k in range(5)]
        assert [op.type for op in graph.get_operations() if op.type == "TfeAesSeed"] == ["TfeAesSeed"]
        assert audit_owner_graph(graph) == 5
        with tf.compat.v1.Session(graph=graph) as session:
            values = session.run([t[0][0] for t in totals])
    for k, value in enumerate(values):
        np.testing.assert_allclose(value, np.full(size, float(k)))
    (channel, step, _, num_elements, key), = puts
    assert (channel, step, num_elements) == ("sum_0", 3, size)
    np.testing.assert_array_equal(key, dict(keys)["sum_0"])
