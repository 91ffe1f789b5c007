"""The aggregation service: bit-exact sums against the kernels, the rules per channel, the API's one definition."""
import os
import pathlib
import re
import subprocess
import sys
import time

import grpc
import numpy as np
import pytest
import tensorflow as tf

from service_helpers import WAIT_SECS, cert_dirs, in_threads, make_service, owner_names  # noqa: F401 (fixtures)
from tfe_estimator.secure.kernels import ops
from tfe_estimator.service import AggregationServer, ServiceError, TlsFiles, get_client, release_client, ring, wire

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _run(fetches):
    config = tf.compat.v1.ConfigProto(intra_op_parallelism_threads=2, inter_op_parallelism_threads=1)
    with tf.compat.v1.Session(config=config) as sess:
        return sess.run(fetches)


def _ring_value(words, ring_bits, n):
    """Element values of ring words as Python ints modulo 2**ring_bits (for reference arithmetic)."""
    words = np.asarray(words).view(np.uint64).reshape(-1)
    if ring_bits == 32:
        return [int(v) for v in words.view(np.uint32)[:n]]
    if ring_bits == 64:
        return [int(v) for v in words]
    return [int(lo) | int(hi) << 64 for lo, hi in words.reshape(-1, 2)]


# ------------------------------------------------------------------ ring.py --

@pytest.mark.parametrize("ring_bits", [32, 64, 128])
def test_ring_add_and_sub_equal_integer_arithmetic_modulo_the_ring(ring_bits):
    rng = np.random.RandomState(ring_bits)
    n = 1001
    words = ring.ring_words(n, ring_bits)
    a, b = (rng.randint(0, 2**63, size=words, dtype=np.int64).view(np.uint64) * np.uint64(3) for _ in range(2))
    if ring_bits == 128:  # make carries and borrows certain in some elements
        a[0:8:2], b[0:8:2] = np.uint64(2**64 - 1), np.uint64(2**64 - 2)
    mod = 2**ring_bits
    va, vb = _ring_value(a, ring_bits, n), _ring_value(b, ring_bits, n)
    total, diff = ring.add_into(a.copy(), b, ring_bits), ring.sub_into(a.copy(), b, ring_bits)
    assert _ring_value(total, ring_bits, n) == [(x + y) % mod for x, y in zip(va, vb)]
    assert _ring_value(diff, ring_bits, n) == [(x - y) % mod for x, y in zip(va, vb)]


@pytest.mark.parametrize("ring_bits", [32, 64, 128])
def test_ring_elements_read_and_write_a_slice_of_elements_as_integers(ring_bits):
    n = 7  # odd: the 32-bit ring's last word holds one element and a zero lane
    words = np.random.RandomState(ring_bits).randint(0, 2**63, ring.ring_words(n, ring_bits), np.int64).view(np.uint64)
    reference = _ring_value(words, ring_bits, n)
    assert ring.elements(words, 0, n, ring_bits) == reference
    assert ring.elements(words, 2, 4, ring_bits) == reference[2:6]
    written = [2**ring_bits - 1, 0, 2**(ring_bits - 1), 12345]  # the ring's extremes, the sign bit alone, a small one
    ring.set_elements(words, 3, written, ring_bits)
    assert _ring_value(words, ring_bits, n) == reference[:3] + written + reference[7:]


@pytest.mark.parametrize("ring_bits", [32, 64, 128])
def test_keystream_elements_are_those_of_the_whole_keystream(ring_bits):
    # The masks of a few elements (riders, check coefficients): the whole keystream's elements there, and what the
    # riders' own loops read before (its bytes at element offsets, little-endian).
    key = np.arange(4, dtype=np.int32)
    n = 41  # odd: the 32-bit ring's elements 1, 3, ... are high lanes
    whole = _ring_value(ring.keystream_words(key, ring.ring_words(n, ring_bits)), ring_bits, n)
    per = ring_bits // 8
    for start, count in ((0, n), (1, 3), (13, 1), (40, 1), (7, 0)):
        pads = ring.keystream_elements(key, start, count, ring_bits)
        assert pads == whole[start:start + count]
        stream = ring.keystream_bytes_at(key, start * per, count * per)
        assert pads == [int.from_bytes(stream[i * per:(i + 1) * per], "little") for i in range(count)]


def test_ring_refuses_bad_arguments_naming_them():
    with pytest.raises(ValueError, match="ring_bits=48"):
        ring.ring_words(3, 48)
    with pytest.raises(ValueError, match="16 bytes, got 8"):
        ring.keystream_words(b"12345678", 4)
    with pytest.raises(ValueError, match="3 words and 4 words"):
        ring.add_into(np.zeros(3, np.uint64), np.zeros(4, np.uint64), 64)


@pytest.mark.parametrize("ring_bits", [32, 64, 128])
def test_keystream_is_the_kernels_mask(ring_bits):
    # mask_share of zeros gives share = -AES(seed): the NumPy keystream plus the share is 0 in the ring.
    n = 777
    with tf.Graph().as_default():
        share, seed = _run(ops.mask_share(tf.zeros([n], tf.float32), 2.0**8, ring_bits, 16, "owner", "hint"))
    acc = share.reshape(-1).view(np.uint64).copy()
    ring.add_into(acc, ring.keystream_words(seed, acc.size), ring_bits)
    assert not acc.any()


# ------------------------------------------------------------ whole path --

def _mask(values, ring_bits, fraction_bits, bound):
    with tf.Graph().as_default():
        return _run([ops.mask_share(tf.constant(x), bound, ring_bits, fraction_bits, f"owner {i}", "hint")
                     for i, x in enumerate(values)])


def _contribute_all(clients, channel, step, ring_bits, n, masked):
    results = in_threads([lambda c=c, m=m: c.contribute(channel, step, ring_bits, n, m[1], m[0])
                          for c, m in zip(clients, masked)])
    for result in results:
        if isinstance(result, Exception):
            raise result
    return results


@pytest.mark.parametrize("num_owners", [2, 4, 8])
@pytest.mark.parametrize("ring_bits", [64, 128])
def test_int64_sums_are_exact_and_bit_identical_to_the_kernels(make_service, num_owners, ring_bits):
    rng = np.random.RandomState(num_owners)
    n = 1000
    values = [rng.randint(-2**40, 2**40, size=n).astype(np.int64) for _ in range(num_owners)]
    masked = _mask(values, ring_bits, 0, 2.0**41)
    service = make_service(owner_names(num_owners))
    results = _contribute_all(service.clients_of(num_owners), "grads", 0, ring_bits, n, masked)
    blind, w = results[0]
    for other_blind, other_w in results[1:]:  # every owner got the same answer
        np.testing.assert_array_equal(other_blind, blind)
        np.testing.assert_array_equal(other_w, w)
    with tf.Graph().as_default():
        seeds, shares = [tf.constant(m[1]) for m in masked], [tf.constant(m[0]) for m in masked]
        kernel_total = ops.server_sum(seeds, shares, ring_bits, n)  # the kernels' ring sum of the same inputs
        ring_total = ops.server_sum([tf.constant(blind)], [tf.constant(w)], ring_bits, n)  # w + AES(blind)
        revealed = ops.reveal_sum(tf.constant(w), None, tf.int64, ring_bits, 0, key=tf.constant(blind))
        kernel_total, ring_total, revealed = _run([kernel_total, ring_total, revealed])
    np.testing.assert_array_equal(ring_total, kernel_total)
    np.testing.assert_array_equal(revealed, np.sum(values, axis=0))


@pytest.mark.parametrize("ring_bits,fraction_bits,bound", [(32, 16, 2.0**8), (64, 32, 2.0**24), (128, 40, 2.0**24)])
def test_float_sums_are_within_fixed_point(make_service, ring_bits, fraction_bits, bound):
    rng = np.random.RandomState(ring_bits)
    num_owners, n = 4, 2001
    values = [(rng.randn(n) * 50).astype(np.float32) for _ in range(num_owners)]
    masked = _mask(values, ring_bits, fraction_bits, bound)
    service = make_service(owner_names(num_owners))
    blind, w = _contribute_all(service.clients_of(num_owners), "grads", 3, ring_bits, n, masked)[0]
    with tf.Graph().as_default():
        revealed = _run(ops.reveal_sum(tf.constant(w), None, tf.float64, ring_bits, fraction_bits,
                                       shapes=[[n // 2], [n - n // 2]], key=tf.constant(blind)))
    expected = np.sum(np.asarray(values, np.float64), axis=0)
    np.testing.assert_allclose(np.concatenate(revealed), expected, rtol=0, atol=num_owners * 2.0**-fraction_bits)


def test_consecutive_steps_and_channels_at_once(make_service):
    rng = np.random.RandomState(5)
    n, owners = 64, owner_names(2)
    service = make_service(owners)
    clients = service.clients_of(2)
    for step in range(3):
        values = {c: [rng.randint(-1000, 1000, n).astype(np.int64) for _ in owners] for c in ("a", "b")}
        masked = {c: _mask(values[c], 64, 0, 2.0**20) for c in values}
        calls = [lambda c=c, k=k: clients[k].contribute(c, step, 64, n, masked[c][k][1], masked[c][k][0])
                 for c in values for k in range(2)]
        results = in_threads(calls)
        for c, (blind, w) in zip([c for c in values for _ in range(2)], results):
            total = (w.view(np.uint64) + ring.keystream_words(blind, n)).view(np.int64)
            np.testing.assert_array_equal(total, values[c][0] + values[c][1])


# ------------------------------------------------------------ bad input --

def _numpy_mask(x, ring_bits=64):
    """share, key of int64 values at ring 64 (NumPy: the tests of rules need no kernels)."""
    key = np.frombuffer(os.urandom(16), np.int32)
    share = (x.view(np.uint64) - ring.keystream_words(key, x.size)).view(np.int64)
    return share, key


def _put(client, step, n=8, channel="c"):
    share, key = _numpy_mask(np.arange(n, dtype=np.int64))
    return client.contribute(channel, step, 64, n, key, share)


def _error(result):
    assert isinstance(result, ServiceError), f"expected a refusal, got {result!r}"
    return result


# The rules of channels, steps, the replay window, aborts and limits: tests/test_service_limits.py.


def test_a_step_not_complete_in_time_is_aborted_naming_each_missing_owner_and_its_last_step(make_service):
    service = make_service(owner_names(3), step_timeout_secs=1.0)
    chief, worker0, worker1 = service.clients_of(3)
    in_threads([lambda: _put(chief, 0), lambda: _put(worker0, 0), lambda: _put(worker1, 0)])
    results = in_threads([lambda: _put(chief, 1), lambda: _put(worker0, 1)])
    for result in results:
        error = _error(result)
        assert error.code == grpc.StatusCode.ABORTED
        assert "step 1 was aborted: it was not complete 1 s after it was opened (--step-timeout-secs)" in \
            error.details
        assert "still missing worker:1 (last contributed step 0)" in error.details
        assert "chief:0 (" not in error.details and "nothing was released" in error.details


def test_a_duplicate_is_refused_and_an_aborted_step_can_be_put_again(make_service):
    service = make_service(owner_names(2), step_timeout_secs=1.5)
    chief, worker = service.clients_of(2)
    results = in_threads([lambda: _put(chief, 0), lambda: (time.sleep(0.3), _put(chief, 0))[1]])
    assert _error(results[0]).code == grpc.StatusCode.ABORTED
    assert _error(results[1]).code == grpc.StatusCode.ALREADY_EXISTS
    assert "chief:0 already contributed to step 0" in results[1].details
    # The chief's client got ABORTED from one server and cancelled its call on the other, which aborts the step
    # within its poll (0.25 s): put the step again once neither server holds the chief's contribution.
    deadline = time.monotonic() + 3.0
    held = lambda: any(s._budget.held("chief:0") for s in service.servers)  # noqa: E731  # pylint: disable=W0212
    while held() and time.monotonic() < deadline:
        time.sleep(0.02)
    results = in_threads([lambda: _put(chief, 0), lambda: _put(worker, 0)])
    assert all(isinstance(r, tuple) for r in results), results
    blind, w = results[0]
    total = (w.view(np.uint64) + ring.keystream_words(blind, 8)).view(np.int64)
    np.testing.assert_array_equal(total, 2 * np.arange(8))  # the aborted contribution is not counted


def test_a_rewind_touches_only_the_callers_contribution(make_service):
    service = make_service(owner_names(2))
    chief, worker = service.clients_of(2)

    def chief_rewinds_then_puts():
        time.sleep(0.3)
        chief.rewind(0)
        return _put(chief, 0)

    results = in_threads([lambda: _put(worker, 0), chief_rewinds_then_puts])
    assert all(isinstance(r, tuple) for r in results), results


def _rows(reply):
    return [(model, None if row is None else row.tolist()) for model, row, _ in reply]


def test_handshake_keeps_rows_per_model_and_an_owners_row_never_blocks_another(make_service):
    service = make_service(owner_names(3))
    chief, worker0, _ = service.clients_of(3)
    assert _rows(worker0.handshake(4, [7, 8], model=1)) == [(0, None), (1, [7, 8]), (0, None)]
    assert _rows(chief.handshake(4, [5, 6], model=1)) == [(1, [5, 6]), (1, [7, 8]), (0, None)]
    assert _rows(worker0.handshake(5, [9, 9], model=1)) == [(1, [5, 6]), (1, [9, 9]), (0, None)]  # replaced
    # A row of another length (another model, another version) is stored beside, refused nowhere.
    assert _rows(worker0.handshake(5, [1, 2, 3], model=2)) == [(1, [5, 6]), (2, [1, 2, 3]), (0, None)]
    # The chief asking for model 1 still sees worker:0's model-1 row; asking for model 2, its latest (model 1).
    assert _rows(chief.handshake(4, [5, 6], model=1)) == [(1, [5, 6]), (1, [9, 9]), (0, None)]
    reply = chief.handshake(4, [5, 6], model=3)
    assert _rows(reply) == [(3, [5, 6]), (2, [1, 2, 3]), (0, None)]
    assert reply[0][2] is not None and reply[2][2] is None  # seconds since the last call; never


def test_client_checks_its_arguments_before_any_call(make_service):
    service = make_service(owner_names(2))
    chief = service.client("chief", 0)
    with pytest.raises(ValueError, match="int64 with 8"):
        chief.contribute("c", 0, 64, 8, np.zeros(4, np.int32), np.zeros(7, np.int64))
    with pytest.raises(ValueError, match="key has 8 bytes"):
        chief.contribute("c", 0, 64, 8, np.zeros(2, np.int32), np.zeros(8, np.int64))


def test_get_client_makes_one_client_per_key():
    made = []

    class Fake:
        def close(self):
            made.append("closed")

    first = get_client("test-key", lambda: made.append("made") or Fake())
    assert get_client("test-key", lambda: made.append("made") or Fake()) is first
    release_client("test-key")
    assert made == ["made", "closed"]


# ------------------------------------------------------------ the API --

def _parse_proto(text):
    code = re.sub(r"//[^\n]*", "", text)
    package = re.search(r"^\s*package\s+([\w.]+);", code, re.M).group(1)
    messages = []
    for name, body in re.findall(r"message\s+(\w+)\s*\{(.*?)\}", code, re.S):
        fields = [(("repeated " if rep else "") + kind, field, int(number))
                  for rep, kind, field, number in re.findall(r"(repeated\s+)?(\w+)\s+(\w+)\s*=\s*(\d+);", body)]
        messages.append((name, tuple(fields)))
    service = re.search(r"service\s+(\w+)\s*\{(.*?)\}", code, re.S)
    rpcs = re.findall(r"rpc\s+(\w+)\s*\(\s*(\w+)\s*\)\s*returns\s*\(\s*(\w+)\s*\)", service.group(2))
    return package, service.group(1), tuple(messages), tuple(rpcs)


def _from_descriptor(proto):
    names = {9: "string", 12: "bytes", 5: "int32", 3: "int64"}  # FieldDescriptorProto.TYPE_*
    messages = tuple((m.name, tuple((("repeated " if f.label == f.LABEL_REPEATED else "") + names[f.type], f.name,
                                     f.number) for f in m.field)) for m in proto.message_type)
    rpcs = tuple((m.name, m.input_type.rsplit(".", 1)[1], m.output_type.rsplit(".", 1)[1])
                 for m in proto.service[0].method)
    return proto.package, proto.service[0].name, messages, rpcs


def test_the_proto_file_and_the_runtime_descriptor_are_the_same_api():
    text = (ROOT / "tfe_estimator" / "service" / "aggregation.proto").read_text()
    assert _parse_proto(text) == _from_descriptor(wire.file_descriptor())
    for method in wire.METHODS:  # the table of who may call what has a row per method
        assert re.search(rf"^// {method.name}\s+\|", text, re.M), method.name


def test_messages_round_trip():
    classes = wire.messages()
    request = classes["HandshakeRequest"](step=3, descriptor=[1, -1, 2**40])
    assert classes["HandshakeRequest"].FromString(request.SerializeToString()) == request


def test_the_service_imports_without_tensorflow():
    # The parent package imports TensorFlow; a server image runs only the service (and cluster.certs).
    package = str(ROOT / "tfe_estimator")
    code = (f"import sys, types\npkg = types.ModuleType('tfe_estimator')\npkg.__path__ = [{package!r}]\n"
            "sys.modules['tfe_estimator'] = pkg\nimport tfe_estimator.service, tfe_estimator.service.server\n"
            "tfe_estimator.service.wire.messages()\n"
            "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('tensorflow', 'keras'))\n"
            "assert not bad, bad\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=WAIT_SECS)


def test_server_checks_its_arguments(cert_dirs):
    from tfe_estimator.service import AggregationServer, TlsFiles  # pylint: disable=import-outside-toplevel
    tls = TlsFiles.from_dir(cert_dirs[0], "tfe", 0)
    with pytest.raises(ValueError, match="role=2"):
        AggregationServer(2, "localhost:0", ["chief:0"], tls)
    with pytest.raises(ValueError, match="server0 needs server1's address"):
        AggregationServer(0, "localhost:0", ["chief:0"], tls)
    with pytest.raises(ValueError, match=r"owners=\['chief-0'\] must be distinct task identities"):
        AggregationServer(1, "localhost:0", ["chief-0"], tls)
    with pytest.raises(ValueError, match="includes tfe:0"):
        AggregationServer(1, "localhost:0", ["chief:0", "tfe:0"], tls)
    with pytest.raises(TypeError, match="there is no plaintext mode"):
        AggregationServer(1, "localhost:0", ["chief:0"], None)
    with pytest.raises(FileNotFoundError, match="tfe-estimator certs"):
        TlsFiles.from_dir(cert_dirs[0], "tfe", 9)


def test_an_owner_cannot_make_a_server_allocate_past_its_limits(make_service):
    # An authenticated owner may name new channels and sizes: both are bounded (its memory too:
    # tests/test_service_limits.py), so one owner cannot exhaust a server.
    service = make_service(owner_names(1), max_elements=8, max_channels=2)
    (chief,) = service.clients_of(1)
    with pytest.raises(ServiceError) as e:
        _put(chief, 0, n=9)
    assert e.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "num_elements=9 is above this server's max_elements=8" in e.value.details
    _put(chief, 0, channel="a")
    _put(chief, 0, channel="b")
    with pytest.raises(ServiceError) as e:
        _put(chief, 0, channel="c")
    assert e.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED and "--max-channels=2" in e.value.details
    with pytest.raises(ValueError, match=r"max_waiting_puts=1 must be at least 2: an owner keeps up to 2 sums"):
        AggregationServer(1, "localhost:0", ["chief:0"], TlsFiles.from_dir(service.certs_dir, "tfe", 1),
                          max_waiting_puts=1)
    with pytest.raises(ValueError, match=r"max_elements=0 must be an integer >= 1"):
        AggregationServer(1, "localhost:0", ["chief:0"], TlsFiles.from_dir(service.certs_dir, "tfe", 1), max_elements=0)


def test_encode_is_byte_identical_to_protobuf():
    # The one-copy encoding of the payload messages is the same wire bytes protobuf writes.
    import numpy as np

    from tfe_estimator.service import wire

    classes = wire.messages()
    for n in (0, 1, 5, 1000):
        payload = np.arange(n, dtype="<i8")
        for name, fields in (("ContributeRequest", dict(channel="sum_0", step=7, ring_bits=64, num_elements=n)),
                             ("ContributeReply", dict(step=3)),
                             ("ForwardRequest", dict(channel="x", step=0, ring_bits=32, num_elements=2 * n))):
            expected = classes[name](payload=payload.tobytes(), **fields).SerializeToString()
            assert wire.encode(name, payload, **fields) == expected, (name, n)
            assert wire.encoded_size(name, payload.nbytes, **fields) == len(expected)
            assert classes[name].FromString(wire.encode(name, payload, **fields)).payload == payload.tobytes()


def test_decode_equals_protobuf_keeps_the_payload_in_place_and_names_a_truncated_message():
    # The receiving end's one copy: every field as protobuf parses it, the payload a view of the received bytes.
    import numpy as np

    from tfe_estimator.service import wire

    classes = wire.messages()
    for n in (0, 1, 1000):
        payload = np.arange(n, dtype="<i8")
        data = wire.encode("ContributeRequest", payload, channel="sum_0", step=-7, ring_bits=64, num_elements=n)
        expected = classes["ContributeRequest"].FromString(data)
        decoded = wire.decode("ContributeRequest", data)
        for field in ("channel", "step", "ring_bits", "num_elements"):
            assert getattr(decoded, field) == getattr(expected, field), field
        assert decoded.payload.tobytes() == expected.payload and decoded.payload.readonly
        if n:
            assert np.shares_memory(np.frombuffer(decoded.payload, np.uint8), np.frombuffer(data, np.uint8))
    # Another writer's order, an unknown field and a repeated payload (the last wins, as in protobuf).
    shuffled = classes["ContributeReply"](payload=b"first").SerializeToString() + \
        b"\x58\x05" + classes["ContributeReply"](step=9, payload=b"second").SerializeToString()
    decoded = wire.decode("ContributeReply", shuffled)
    assert decoded.step == 9 and bytes(decoded.payload) == b"second"
    assert bytes(decoded.payload) == classes["ContributeReply"].FromString(shuffled).payload
    assert wire.decoder("HandshakeReply") == classes["HandshakeReply"].FromString  # no payload: protobuf's own
    data = wire.encode("ContributeReply", np.arange(4, dtype="<i8"), step=1)
    with pytest.raises(ValueError, match=r"ContributeReply: field 2 says 32 bytes at byte \d+, but only 31 follow"):
        wire.decode("ContributeReply", data[:-1])
    with pytest.raises(ValueError, match="truncated or overlong varint"):
        wire.decode("ContributeReply", b"\x08\xff")
    with pytest.raises(ValueError, match="wire type 3 of field 1"):
        wire.decode("ContributeReply", b"\x0b")


def test_service_tasks_start_with_huge_pages_unless_the_user_chose():
    from tfe_estimator.cluster.huge_pages import with_huge_pages

    assert with_huge_pages({})["GLIBC_TUNABLES"] == "glibc.malloc.hugetlb=1"
    assert with_huge_pages({"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"})["GLIBC_TUNABLES"] == \
        "glibc.malloc.arena_max=2:glibc.malloc.hugetlb=1"
    assert with_huge_pages({"GLIBC_TUNABLES": "glibc.malloc.hugetlb=0"})["GLIBC_TUNABLES"] == "glibc.malloc.hugetlb=0"
