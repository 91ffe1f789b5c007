"""Server0's blind key sealed for each owner, carried by server1's answer (`sealed_blind`).

The owners finish a step on server1's answer alone (server0's answer, one server-to-server hop later, is not
waited for), and nothing server1 holds opens a seal: the blind key stays server0's and the owners'. In process,
loopback, steps of 8 elements.
"""
import os
import threading
import time

import grpc
import numpy as np
import pytest
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from service_helpers import cert_dirs, in_threads, make_service, owner_names  # noqa: F401 (fixtures)
from test_service_release_log import X, _put, _reveal
from tfe_estimator.service import AggregationServer, ring, sealed_blind, wire
from tfe_estimator.service import client as client_module
from tfe_estimator.service.sealed_blind import SEALED_BYTES, SealError, open_own, open_sealed, seal

SETTINGS = ("m/sum_0", 64, 8)


def test_a_seal_opens_only_under_its_owners_key_for_its_step():
    keys, blind = [os.urandom(16) for _ in range(3)], os.urandom(16)
    sealed = [seal(key, blind, *SETTINGS, step=5) for key in keys]
    assert all(len(s) == SEALED_BYTES for s in sealed)
    assert seal(keys[0], blind, *SETTINGS, step=5) != sealed[0]  # a fresh nonce each time
    for key in keys:
        assert open_sealed(key, sealed[keys.index(key)], *SETTINGS, step=5) == blind
        assert open_own(key, sealed, *SETTINGS, step=5) == blind  # its own among every owner's
    assert open_own(os.urandom(16), sealed, *SETTINGS, step=5) is None
    for args in ((keys[1], sealed[0], *SETTINGS, 5), (keys[0], sealed[0], *SETTINGS, 6),
                 (keys[0], sealed[0], "m/sum_1", 64, 8, 5), (keys[0], sealed[0], "m/sum_0", 32, 8, 5),
                 (keys[0], sealed[0], "m/sum_0", 64, 9, 5)):
        with pytest.raises(SealError, match="does not open under this owner's key"):
            open_sealed(*args)
    altered = bytearray(sealed[0])
    altered[20] ^= 1
    with pytest.raises(SealError):
        open_sealed(keys[0], bytes(altered), *SETTINGS, step=5)
    with pytest.raises(SealError, match="44 bytes, not 43"):
        open_sealed(keys[0], sealed[0][:-1], *SETTINGS, step=5)
    with pytest.raises(ValueError, match="owner_key has 15 bytes"):
        seal(keys[0][:15], blind, *SETTINGS, step=5)


def test_the_reply_with_sealed_keys_parses_as_protobuf():
    # The payload is written last (wire.encode's one copy), after the sealed keys' field: any protobuf reads it.
    sealed = [os.urandom(SEALED_BYTES) for _ in range(3)]
    data = wire.encode("ContributeReply", np.arange(5, dtype="<i8"), step=4, sealed_blinds=sealed)
    parsed = wire.messages()["ContributeReply"].FromString(data)
    assert parsed.step == 4 and list(parsed.sealed_blinds) == sealed
    assert parsed.payload == np.arange(5, dtype="<i8").tobytes()
    decoded = wire.decode("ContributeReply", data)
    assert list(decoded.sealed_blinds) == sealed and bytes(decoded.payload) == parsed.payload
    assert len(data) == wire.encoded_size("ContributeReply", 40, step=4, sealed_blinds=sealed)


def _server0_answers_held(monkeypatch, released: threading.Event):
    """Server0's answers to the owners leave only once `released` is set (or after 4 s); before the servers
    start (their gRPC handlers are bound then)."""
    contribute = AggregationServer._contribute  # pylint: disable=protected-access

    def held(self, *args):
        answer = contribute(self, *args)
        if self._role == 0:  # pylint: disable=protected-access
            released.wait(4.0)
        return answer

    monkeypatch.setattr(AggregationServer, "_contribute", held)


@pytest.mark.parametrize("data_plane", [True, False])
def test_owners_finish_a_step_on_server1s_answer_without_server0s(make_service, monkeypatch, data_plane):
    released = threading.Event()
    _server0_answers_held(monkeypatch, released)
    service = make_service(owner_names(2), step_timeout_secs=15.0)
    owners = [service.client("chief", 0, data_plane=data_plane), service.client("worker", 0, data_plane=data_plane)]
    for step in range(3):
        keys = [np.frombuffer(os.urandom(16), np.int32) for _ in owners]
        start = time.monotonic()
        results = in_threads([lambda o=o: _put(owners[o], step, keys[o]) for o in range(2)])
        assert time.monotonic() - start < 3.0  # server0's answers are held for 4 s
        for result in results:
            assert isinstance(result, tuple), result
            np.testing.assert_array_equal(_reveal(result), 2 * X)
        assert bytes(results[0][0]) == bytes(results[1][0])  # one blind key per step, from server0's seal
    released.set()
    assert [o.answers["c"] for o in owners] == [[3, 0], [3, 0]]


def test_mutation_without_seals_the_owners_wait_for_server0(make_service, monkeypatch):
    monkeypatch.setattr(AggregationServer, "_seal", staticmethod(lambda *args: ()))
    _server0_answers_held(monkeypatch, threading.Event())
    service = make_service(owner_names(2), step_timeout_secs=15.0)
    owners = [service.client("chief", 0), service.client("worker", 0)]
    keys = [np.frombuffer(os.urandom(16), np.int32) for _ in owners]
    start = time.monotonic()
    results = in_threads([lambda o=o: _put(owners[o], 0, keys[o]) for o in range(2)])
    assert time.monotonic() - start >= 4.0
    for result in results:
        np.testing.assert_array_equal(_reveal(result), 2 * X)


def _server1_view(monkeypatch):
    """Every byte server1 will receive in its calls' fields and metadata (not the ring words): what a curious
    server1 could try to open the seals with (patched before the servers start)."""
    seen = []
    for name in ("_contribute", "_forwarded"):
        handler = getattr(AggregationServer, name)

        def recording(self, identity, request, context, reply, handler=handler):
            if self._role == 1:  # pylint: disable=protected-access
                seen.extend(v.encode() if isinstance(v, str) else bytes(v)
                            for _, v in context.invocation_metadata() or ())
                seen.extend(bytes(s) for s in getattr(request, "sealed_blinds", ()))
                seen.append(request.channel.encode())
            return handler(self, identity, request, context, reply)

        monkeypatch.setattr(AggregationServer, name, recording)
    return seen


def _server1_opens(seen, sealed, blind) -> bool:
    """Whether anything server1 saw is the blind key, or opens a seal as a key (directly or as the owners'
    mask key: hex metadata decoded too)."""
    associated = sealed_blind._associated("c", 64, 8, 0)  # pylint: disable=protected-access  # server1 knows them
    candidates = set()
    for value in seen:
        candidates.add(value)
        try:
            candidates.update(bytes.fromhex(part) for part in value.decode().split(","))
        except (UnicodeDecodeError, ValueError):
            pass
    if any(blind in value for value in seen):
        return True
    for candidate in (c for c in candidates if len(c) == 16):
        for entry in sealed:
            try:
                if open_sealed(candidate, entry, "c", 64, 8, 0) == blind:
                    return True
            except SealError:
                pass
            try:
                if AESGCM(candidate).decrypt(entry[:12], entry[12:], associated) == blind:
                    return True
            except Exception:  # pylint: disable=broad-except  # InvalidTag: it does not open
                pass
    return False


def _a_step_seen_by_server1(make_service, monkeypatch):
    seen = _server1_view(monkeypatch)
    service = make_service(owner_names(2), step_timeout_secs=15.0)
    owners = [service.client("chief", 0), service.client("worker", 0)]
    keys = [np.frombuffer(os.urandom(16), np.int32) for _ in owners]
    results = in_threads([lambda o=o: _put(owners[o], 0, keys[o]) for o in range(2)])
    for result in results:
        np.testing.assert_array_equal(_reveal(result), 2 * X)
    sealed = [s for s in seen if len(s) == SEALED_BYTES]
    assert len(sealed) == 2  # the forward carried one seal per owner
    return seen, sealed, bytes(results[0][0])


def test_nothing_server1_holds_opens_a_seal(make_service, monkeypatch):
    assert not _server1_opens(*_a_step_seen_by_server1(make_service, monkeypatch))


@pytest.mark.parametrize("leak", ["key digest as sealing key", "blind in clear"])
def test_mutation_a_seal_server1_can_open_is_caught(make_service, monkeypatch, leak):
    if leak == "key digest as sealing key":  # a key derived from what server1 sees (the digest of the mask key)
        monkeypatch.setattr(sealed_blind, "_cipher", lambda key: AESGCM(ring.key_digest(bytes(key))))
    else:
        monkeypatch.setattr(sealed_blind, "seal", lambda key, blind, *args: bytes(12) + bytes(blind) + bytes(16))
        monkeypatch.setattr(sealed_blind, "open_own", lambda key, sealed, *args: bytes(sealed[0][12:28]))
    assert _server1_opens(*_a_step_seen_by_server1(make_service, monkeypatch))


def _lying_server1(monkeypatch, lie):
    """Server1 answers ``lie`` instead of the seals server0 forwarded for the step (patched before start)."""
    contribute, earlier = AggregationServer._contribute, {}  # pylint: disable=protected-access

    def lying(self, identity, request, context, reply):
        answer = contribute(self, identity, request, context, reply)
        if self._role != 1:  # pylint: disable=protected-access
            return answer
        # pylint: disable=protected-access
        message = wire.messages()["ContributeReply"].FromString(bytes(answer))
        seals = list(message.sealed_blinds)
        altered = {"an earlier step's seals": earlier.get(identity, [os.urandom(SEALED_BYTES)]),
                   "no seals": [], "the other owner's seal": [seals[1 - self._owners.index(identity)]]}[lie]
        earlier[identity] = seals
        return wire.messages()["ContributeReply"](step=message.step, payload=message.payload,
                                                  sealed_blinds=altered).SerializeToString()

    monkeypatch.setattr(AggregationServer, "_contribute", lying)


def _three_steps(service):
    owners = [service.client("chief", 0), service.client("worker", 0)]
    results = []
    for step in range(3):
        keys = [np.frombuffer(os.urandom(16), np.int32) for _ in owners]
        results += in_threads([lambda o=o: _put(owners[o], step, keys[o]) for o in range(2)])
    return results


@pytest.mark.parametrize("lie", ["an earlier step's seals", "no seals", "the other owner's seal"])
def test_a_server1_that_alters_the_seals_only_costs_the_owners_server0s_reply(make_service, monkeypatch, caplog,
                                                                            lie):
    # Server1 answers other seals than server0's for the step (an earlier step's, none, the other owner's only):
    # an owner opens only a seal of its own key for that step, so it waits for server0's reply instead and still
    # reveals the true sum; a seal that does not open is said once per client (none at all: an older server0).
    _lying_server1(monkeypatch, lie)
    service = make_service(owner_names(2), step_timeout_secs=15.0)
    caplog.set_level("WARNING", logger="tfe_estimator")
    for result in _three_steps(service):
        assert isinstance(result, tuple), result
        np.testing.assert_array_equal(_reveal(result), 2 * X)
    said = [r for r in caplog.records if "none of which opens" in r.getMessage()]
    assert len(said) == (0 if lie == "no seals" else 2), said  # once per owner's client


def test_mutation_a_seal_taken_without_its_tag_gives_the_owners_a_wrong_sum(make_service, monkeypatch):
    monkeypatch.setattr(sealed_blind, "open_own", lambda key, sealed, *args: bytes(sealed[0][12:28]))
    _lying_server1(monkeypatch, "an earlier step's seals")
    service = make_service(owner_names(2), step_timeout_secs=15.0)
    results = _three_steps(service)
    assert not all(np.array_equal(_reveal(r), 2 * X) for r in results)


def test_a_key_put_before_its_share_lets_server0s_part_reach_server1_first(make_service, monkeypatch):
    # put_key when the step starts, contribute once the share is computed (here 0.3 s later): server0 forwards
    # its part while the owners compute, so server1 holds it before any share arrives, and server0 gets each
    # owner's key once (the contribution does not put it again).
    order, contribute, forwarded = [], AggregationServer._contribute, AggregationServer._forwarded

    def noting(name, handler):
        def noted(self, identity, *args):
            order.append((self._role, name, identity))  # pylint: disable=protected-access
            return handler(self, identity, *args)
        return noted

    monkeypatch.setattr(AggregationServer, "_contribute", noting("put", contribute))
    monkeypatch.setattr(AggregationServer, "_forwarded", noting("forward", forwarded))
    service = make_service(owner_names(2), step_timeout_secs=15.0)
    owners = [service.client("chief", 0, early_key="on"), service.client("worker", 0, early_key="on")]
    for step in range(2):
        order.clear()
        keys = [np.frombuffer(os.urandom(16), np.int32) for _ in owners]
        for o, owner in enumerate(owners):
            owner.put_key("c", step, 64, 8, keys[o])
        time.sleep(0.3)  # the owners' compute
        for result in in_threads([lambda o=o: _put(owners[o], step, keys[o]) for o in range(2)]):
            np.testing.assert_array_equal(_reveal(result), 2 * X)
        assert [e for e in order if e[0] == 0].count((0, "put", "chief:0")) == 1
        first_share = order.index(next(e for e in order if e[:2] == (1, "put")))
        assert order.index((1, "forward", "tfe:0")) < first_share, order
    # A key put for a step whose contribution uses another key (its session run failed and ran again): the
    # contribution puts its own key, the early one is never used.
    owners[0].put_key("c", 2, 64, 8, np.frombuffer(os.urandom(16), np.int32))
    assert owners[0]._taken_early("c", 2, 64, 8, os.urandom(16)) is None  # pylint: disable=protected-access


def _open_steps(server, channel="c"):
    return {step for (name, _, _), c in list(server._channels.items()) if name == channel  # pylint: disable=protected-access
            for step in list(c._open)}  # pylint: disable=protected-access


@pytest.mark.parametrize("cancel", [True, False])
def test_a_key_put_never_taken_ends_on_server0_when_the_channels_next_key_is_put(make_service, monkeypatch, cancel):
    # An owner's session run failed after its key op: the key put for step 2 is never taken. Its next key put
    # of the channel ends that call, so server0 drops step 2 at once (not after the step timeout) and the owners'
    # step 3 goes through. Mutation (cancel=False): the put stays open on server0 until the step timeout.
    if not cancel:
        monkeypatch.setattr(client_module._Put, "cancel", lambda self: True)  # pylint: disable=protected-access
    service = make_service(owner_names(2), step_timeout_secs=20.0)
    server0 = service.servers[1]  # started second
    owners = [service.client("chief", 0, early_key="on"), service.client("worker", 0, early_key="on")]
    owners[0].put_key("c", 2, 64, 8, np.frombuffer(os.urandom(16), np.int32))
    deadline = time.monotonic() + 5.0
    while _open_steps(server0) != {2} and time.monotonic() < deadline:
        time.sleep(0.02)
    assert _open_steps(server0) == {2}
    keys = [np.frombuffer(os.urandom(16), np.int32) for _ in owners]
    owners[0].put_key("c", 3, 64, 8, keys[0])
    deadline = time.monotonic() + 3.0
    while 2 in _open_steps(server0) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert (2 not in _open_steps(server0)) == cancel
    if cancel:  # the owners' step 3 (the early put of step 3 may have been refused while step 2 was open)
        for result in in_threads([lambda o=o: _put(owners[o], 3, keys[o]) for o in range(2)]):
            np.testing.assert_array_equal(_reveal(result), 2 * X)


@pytest.mark.parametrize("setting, expected", [(None, False), ("auto", False), ("on", True), ("off", False)])
def test_keys_go_early_only_where_server0_is_far_or_the_owner_says_so(make_service, monkeypatch, caplog, setting,
                                                                      expected):
    # On loopback server0 is well under EARLY_KEY_MIN_RTT_MS away: "auto" (the default) keeps the key for the
    # share (nothing to hide, and the servers' work would compete with the owner's compute); "on" puts it.
    # (At a distance "auto" puts it: the test below.)
    monkeypatch.delenv(client_module.EARLY_KEY_ENV, raising=False)
    service = make_service(owner_names(2), step_timeout_secs=15.0)
    owner = service.client("chief", 0, early_key=setting)
    with caplog.at_level("INFO", logger="tfe_estimator"):
        owner.put_key("c", 0, 64, 8, np.frombuffer(os.urandom(16), np.int32))
    deadline = time.monotonic() + (3.0 if expected else 0.5)
    while _open_steps(service.servers[1]) != {0} and time.monotonic() < deadline:
        time.sleep(0.02)
    assert (_open_steps(service.servers[1]) == {0}) == expected
    if setting in (None, "auto"):
        assert "keys are put with the shares (TFE_ESTIMATOR_EARLY_KEY=auto)" in caplog.text


def test_an_unknown_early_key_setting_is_refused_naming_it(make_service, monkeypatch):
    service = make_service(owner_names(2))
    with pytest.raises(ValueError, match=r"early_key='sometimes' \(TFE_ESTIMATOR_EARLY_KEY\): use 'auto', 'on'"):
        service.client("chief", 0, early_key="sometimes")
    monkeypatch.setenv(client_module.EARLY_KEY_ENV, "yes")
    with pytest.raises(ValueError, match=r"early_key='yes'"):
        service.client("chief", 0)


def test_a_server0_that_does_not_answer_the_measurement_is_measured_again_a_minute_later(make_service, monkeypatch):
    service = make_service(owner_names(2))
    owner = service.client("chief", 0, early_key="auto")
    asked = []

    class Unavailable(grpc.RpcError):
        def code(self):
            return grpc.StatusCode.UNAVAILABLE

    def probe(*args, **kwargs):
        asked.append(0)
        raise Unavailable()

    owner._probes[0] = probe  # pylint: disable=protected-access
    for step in range(3):  # each key goes with its share; server0 is asked once, not at every step
        owner.put_key("c", step, 64, 8, np.frombuffer(os.urandom(16), np.int32))
    assert asked == [0] and owner._early_on is None  # pylint: disable=protected-access
    monkeypatch.setattr(time, "monotonic", lambda real=time.monotonic: real() + 61.0)
    owner.put_key("c", 3, 64, 8, np.frombuffer(os.urandom(16), np.int32))
    assert asked == [0, 0]


def test_auto_puts_keys_early_when_server0_is_a_distance_away(make_service, monkeypatch, caplog):
    # Server0 reached through a relay adding 10 ms per round trip (server1 directly): "auto" measures it and
    # puts the step's key when the step starts.
    from tools.bench.relay import DelayRelay  # pylint: disable=import-outside-toplevel

    monkeypatch.delenv(client_module.EARLY_KEY_ENV, raising=False)
    service = make_service(owner_names(2), step_timeout_secs=15.0)
    with DelayRelay(service.addresses[0], rtt_ms=10) as relay:
        owner = service.client("chief", 0, addresses=(f"localhost:{relay.port}", service.addresses[1]))
        with caplog.at_level("INFO", logger="tfe_estimator"):
            owner.put_key("c", 0, 64, 8, np.frombuffer(os.urandom(16), np.int32))
        deadline = time.monotonic() + 5.0
        while _open_steps(service.servers[1]) != {0} and time.monotonic() < deadline:
            time.sleep(0.02)
        assert _open_steps(service.servers[1]) == {0}
        assert "keys are put when the step starts (TFE_ESTIMATOR_EARLY_KEY=auto)" in caplog.text
        owner.close()
