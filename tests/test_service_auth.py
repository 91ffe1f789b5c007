"""Every row of the aggregation API's caller table, with a caller that must be refused, and a mutation beside each.

A check below is an attack that must fail; its mutation test plants the leak
(a server that reads identity from the request, skips the membership check,
serves a method on the wrong role, accepts no or foreign certificates, or a
client that pins the wrong server name) and asserts that the check catches it.
"""
import grpc
import numpy as np
import pytest

from service_helpers import (WAIT_SECS, ca_only_credentials, cert_dirs, credentials_of, health_call,  # noqa: F401
                             in_threads, make_service, owner_names, raw_call)
from tfe_estimator.service import TlsFiles, client as client_module, server as server_module, wire
from tfe_estimator.service.tls import server_name

MESSAGES = wire.messages()


def _detects(check, *args):
    """The planted leak makes `check` fail."""
    with pytest.raises((AssertionError, pytest.fail.Exception)):
        check(*args)


def _refused(code, call):
    with pytest.raises(grpc.RpcError) as e:
        call()
    assert e.value.code() == code, (e.value.code(), e.value.details())
    return e.value.details()


def _contribute(server, step=0, n=4, channel="c"):
    payload = bytes(16) if server == 0 else bytes(8 * n)
    return MESSAGES["ContributeRequest"](channel=channel, step=step, ring_bits=64, num_elements=n, payload=payload)


def _forward(step=0, n=4):
    return MESSAGES["ForwardRequest"](channel="c", step=step, ring_bits=64, num_elements=n, payload=bytes(8 * n))


# ---------------------------------------------------------------- transport --

def check_no_client_certificate_fails_the_tls_handshake(make_service, dirs):
    service = make_service(owner_names(2))
    for server, address in enumerate(service.addresses):
        _refused(grpc.StatusCode.UNAVAILABLE, lambda: raw_call(address, server, "Rewind", MESSAGES["RewindRequest"](),
                                                               ca_only_credentials(dirs[0]), timeout=5))


def test_no_client_certificate_fails_the_tls_handshake(make_service, cert_dirs):
    check_no_client_certificate_fails_the_tls_handshake(make_service, cert_dirs)


def _without_client_auth(tls):
    """The planted leak: server credentials that ask no client certificate."""
    ca, cert, key = tls.read()
    return grpc.ssl_server_credentials([(key, cert)], root_certificates=ca, require_client_auth=False)


def test_mutation_server_without_client_auth_is_detected(make_service, cert_dirs, monkeypatch):
    monkeypatch.setattr(TlsFiles, "server_credentials", _without_client_auth)
    _detects(check_no_client_certificate_fails_the_tls_handshake, make_service, cert_dirs)


def _foreign_owner_credentials(dirs):
    """chief-0's name from a foreign CA, trusting our CA (so only the server's check can stop it)."""
    ca = TlsFiles.from_dir(dirs[0], "chief", 0).read()[0]
    _, cert, key = TlsFiles.from_dir(dirs[1], "chief", 0).read()
    return grpc.ssl_channel_credentials(root_certificates=ca, private_key=key, certificate_chain=cert)


def check_foreign_ca_client_is_refused(make_service, dirs):
    service = make_service(owner_names(2))
    for server, address in enumerate(service.addresses):
        _refused(grpc.StatusCode.UNAVAILABLE, lambda: raw_call(address, server, "Rewind", MESSAGES["RewindRequest"](),
                                                               _foreign_owner_credentials(dirs), timeout=5))


def test_a_certificate_of_a_foreign_ca_is_refused(make_service, cert_dirs):
    check_foreign_ca_client_is_refused(make_service, cert_dirs)


def test_mutation_server_trusting_a_foreign_ca_is_detected(make_service, cert_dirs, monkeypatch):
    foreign_ca = TlsFiles.from_dir(cert_dirs[1], "tfe", 0).read()[0]

    def trusting_both(self):
        ca, cert, key = self.read()
        return grpc.ssl_server_credentials([(key, cert)], root_certificates=ca + foreign_ca, require_client_auth=True)

    monkeypatch.setattr(TlsFiles, "server_credentials", trusting_both)
    _detects(check_foreign_ca_client_is_refused, make_service, cert_dirs)


# ------------------------------------------------------------ the health service --

def _health(address, server, credentials):
    """The status a health Check answers, or the code it was refused with."""
    try:
        return health_call(address, server, credentials, timeout=5)
    except grpc.RpcError as e:
        return e.code().name


def check_health_answers_the_federations_parties_only(make_service, dirs):
    """Health/Check and Status: answered to an owner, a server and an evaluator (parties of this one-CA cluster);
    no client certificate and a foreign CA's fail the TLS handshake (UNAVAILABLE); Watch is UNIMPLEMENTED even
    to an owner."""
    service = make_service(owner_names(2))
    for server, address in enumerate(service.addresses):
        for job, index in (("chief", 0), ("worker", 0), ("tfe", 1 - server), ("evaluator", 0)):
            assert _health(address, server, credentials_of(dirs[0], job, index)) == "SERVING", (job, index)
            reply = raw_call(address, server, "Status", MESSAGES["StatusRequest"](),
                             credentials_of(dirs[0], job, index), timeout=5)  # any party: names and steps
            assert list(reply.channels) == [] and list(reply.steps) == []
        for credentials in (ca_only_credentials(dirs[0]), _foreign_owner_credentials(dirs)):
            _refused(grpc.StatusCode.UNAVAILABLE, lambda: health_call(address, server, credentials, timeout=5))
            _refused(grpc.StatusCode.UNAVAILABLE, lambda: raw_call(address, server, "Status",
                                                                   MESSAGES["StatusRequest"](), credentials, timeout=5))
        details = _refused(grpc.StatusCode.UNIMPLEMENTED, lambda: health_call(
            address, server, credentials_of(dirs[0], "chief", 0), method="Watch", timeout=5))
        assert "poll Check" in details, details
    service.servers[1].stop(0)  # server0 (started second) stopped: it answers nothing, server1 still SERVING
    assert _health(service.addresses[1], 1, credentials_of(dirs[0], "chief", 0)) == "SERVING"
    _refused(grpc.StatusCode.UNAVAILABLE, lambda: health_call(service.addresses[0], 0,
                                                              credentials_of(dirs[0], "chief", 0), timeout=2))


def test_health_answers_the_federations_parties_only(make_service, cert_dirs):
    check_health_answers_the_federations_parties_only(make_service, cert_dirs)


def test_mutation_health_on_a_port_without_client_auth_is_detected(make_service, cert_dirs, monkeypatch):
    monkeypatch.setattr(TlsFiles, "server_credentials", _without_client_auth)
    _detects(check_health_answers_the_federations_parties_only, make_service, cert_dirs)


def check_client_pinning_tfe0_refuses_server1(make_service):
    service = make_service(owner_names(2))
    swapped = service.client("chief", 0, addresses=service.addresses[::-1], wait_for_ready=False, timeout_secs=5)
    with pytest.raises(client_module.ServiceError) as e:
        swapped.rewind(0)  # the "server0" it dials is server1, whose certificate is tfe-1
    assert e.value.code == grpc.StatusCode.UNAVAILABLE, e.value


def test_a_client_reaches_only_the_server_it_pins(make_service):
    check_client_pinning_tfe0_refuses_server1(make_service)


def test_mutation_client_pinning_whatever_it_reaches_is_detected(make_service, monkeypatch):
    monkeypatch.setattr(client_module, "server_name_option",
                        lambda tls, k: ("grpc.ssl_target_name_override", server_name(tls, 1 - k)))
    _detects(check_client_pinning_tfe0_refuses_server1, make_service)


def check_owner_refuses_a_server_of_a_foreign_ca(make_service, dirs):
    service = make_service(owner_names(2))
    # An impostor with a foreign CA's tfe-1 certificate; it accepts our owners (our CA's certificate is public).
    foreign = TlsFiles.from_dir(dirs[1], "tfe", 1)
    impostor_tls = TlsFiles(TlsFiles.from_dir(dirs[0], "tfe", 1).ca, foreign.cert, foreign.key)
    impostor = server_module.AggregationServer(1, "localhost:0", owner_names(2), impostor_tls)
    port = impostor.start()
    try:
        client = service.client("chief", 0, addresses=(service.addresses[0], f"localhost:{port}"),
                                wait_for_ready=False, timeout_secs=5)
        with pytest.raises(client_module.ServiceError) as e:
            client.rewind(0)
        assert e.value.code == grpc.StatusCode.UNAVAILABLE and e.value.address.endswith(str(port)), e.value
    finally:
        impostor.stop(0)


def test_an_owner_refuses_a_server_certificate_of_a_foreign_ca(make_service, cert_dirs):
    check_owner_refuses_a_server_of_a_foreign_ca(make_service, cert_dirs)


def test_mutation_client_trusting_a_foreign_ca_is_detected(make_service, cert_dirs, monkeypatch):
    foreign_ca = TlsFiles.from_dir(cert_dirs[1], "tfe", 0).read()[0]

    def trusting_both(self, server=None):
        ca, cert, key = self.read()
        return grpc.ssl_channel_credentials(root_certificates=ca + foreign_ca, private_key=key, certificate_chain=cert)

    monkeypatch.setattr(TlsFiles, "channel_credentials", trusting_both)
    _detects(check_owner_refuses_a_server_of_a_foreign_ca, make_service, cert_dirs)


# ------------------------------------------------------------ the method table --

def check_non_owners_may_call_no_owner_method(make_service, dirs):
    service = make_service(owner_names(2))
    for job, index in (("tfe", 2), ("evaluator", 0), ("tfe", 0)):
        credentials = credentials_of(dirs[0], job, index)
        for server, address in enumerate(service.addresses):
            calls = {"Contribute": _contribute(server), "Rewind": MESSAGES["RewindRequest"](step=0),
                     "Handshake": MESSAGES["HandshakeRequest"](step=0, descriptor=[1])}
            for method, request in calls.items():
                details = _refused(grpc.StatusCode.PERMISSION_DENIED,
                                   lambda: raw_call(address, server, method, request, credentials, timeout=2))
                assert f"{job}:{index} may not call {method}" in details, details


def test_non_owners_may_call_no_owner_method(make_service, cert_dirs):
    check_non_owners_may_call_no_owner_method(make_service, cert_dirs)


def test_mutation_identity_fixed_to_an_owner_is_detected(make_service, cert_dirs, monkeypatch):
    monkeypatch.setattr(server_module, "peer_identity", lambda context: "chief:0")
    _detects(check_non_owners_may_call_no_owner_method, make_service, cert_dirs)


def test_mutation_skipped_membership_check_is_detected(make_service, cert_dirs, monkeypatch):
    monkeypatch.setattr(server_module.AggregationServer, "_callers",
                        lambda self, method: list(self._owners) + ["tfe:0", "tfe:2", "evaluator:0"])
    _detects(check_non_owners_may_call_no_owner_method, make_service, cert_dirs)


def check_only_server0_may_forward(make_service, dirs):
    service = make_service(owner_names(2))
    for job, index in (("chief", 0), ("worker", 0), ("tfe", 2)):
        details = _refused(grpc.StatusCode.PERMISSION_DENIED, lambda: raw_call(
            service.addresses[1], 1, "ForwardBlinded", _forward(), credentials_of(dirs[0], job, index), timeout=5))
        assert f"{job}:{index} may not call ForwardBlinded" in details
    # server0 serves no ForwardBlinded, even to itself.
    _refused(grpc.StatusCode.UNIMPLEMENTED, lambda: raw_call(service.addresses[0], 0, "ForwardBlinded", _forward(),
                                                             credentials_of(dirs[0], "tfe", 0), timeout=5))


def test_only_server0_may_forward_its_part(make_service, cert_dirs):
    check_only_server0_may_forward(make_service, cert_dirs)


def test_mutation_owners_allowed_to_forward_is_detected(make_service, cert_dirs, monkeypatch):
    monkeypatch.setattr(server_module.AggregationServer, "_callers",
                        lambda self, method: list(self._owners) + ["tfe:0"])
    _detects(check_only_server0_may_forward, make_service, cert_dirs)


def check_server1_serves_no_handshake(make_service, dirs):
    service = make_service(owner_names(2))
    details = _refused(grpc.StatusCode.UNIMPLEMENTED, lambda: raw_call(
        service.addresses[1], 1, "Handshake", MESSAGES["HandshakeRequest"](step=0, descriptor=[1]),
        credentials_of(dirs[0], "chief", 0), timeout=5))
    assert "Handshake is served by aggregation server0" in details


def test_server1_serves_no_handshake(make_service, cert_dirs):
    check_server1_serves_no_handshake(make_service, cert_dirs)


def test_mutation_every_role_serving_every_method_is_detected(make_service, cert_dirs, monkeypatch):
    monkeypatch.setattr(server_module.AggregationServer, "_serves", lambda self, method: True)
    _detects(check_server1_serves_no_handshake, make_service, cert_dirs)


# ------------------------------------------------------------ identity is the certificate --

def check_an_owner_cannot_put_as_another(make_service, dirs):
    """chief:0 puts twice, the second time claiming worker:0 in every way a request could: refused, and
    worker:0's slot still waits (the first call times out naming it); the refused call gets no answer."""
    service = make_service(owner_names(2), step_timeout_secs=1.0)
    chief = credentials_of(dirs[0], "chief", 0)
    claim = (("x-tfe-owner", "worker:0"),)

    def second():
        import time  # pylint: disable=import-outside-toplevel
        time.sleep(0.2)
        return raw_call(service.addresses[0], 0, "Contribute", _contribute(0, channel="worker:0"), chief,
                        metadata=claim, timeout=5)

    first = lambda: raw_call(service.addresses[0], 0, "Contribute", _contribute(0, channel="worker:0"), chief,
                             timeout=5)
    results = in_threads([first, second])
    assert isinstance(results[1], grpc.RpcError), f"the second put was answered: {results[1]!r}"
    assert results[1].code() == grpc.StatusCode.ALREADY_EXISTS, results[1].details()
    assert "chief:0 already contributed to step 0" in results[1].details()
    assert isinstance(results[0], grpc.RpcError), f"the step completed without worker:0: {results[0]!r}"
    assert results[0].code() == grpc.StatusCode.ABORTED, results[0].details()  # aborted for everyone
    assert "missing worker:0 (no contribution yet)" in results[0].details()


def test_an_owner_cannot_put_as_another(make_service, cert_dirs):
    check_an_owner_cannot_put_as_another(make_service, cert_dirs)


def test_mutation_identity_from_the_request_is_detected(make_service, cert_dirs, monkeypatch):
    real = server_module.peer_identity

    def from_request(context):
        claimed = dict(context.invocation_metadata()).get("x-tfe-owner")
        return claimed or real(context)

    monkeypatch.setattr(server_module, "peer_identity", from_request)
    _detects(check_an_owner_cannot_put_as_another, make_service, cert_dirs)


def test_each_owner_gets_its_answer_on_its_own_call_only(make_service):
    service = make_service(owner_names(2), step_timeout_secs=WAIT_SECS)
    chief, worker = service.clients_of(2)
    key, share = np.zeros(4, np.int32), np.zeros(4, np.int64)
    results = in_threads([lambda: chief.contribute("c", 0, 64, 4, key, share),
                          lambda: worker.contribute("c", 0, 64, 4, key, share)])
    assert all(isinstance(r, tuple) for r in results), results
    # The step is released and answered: a later call of an owner (restored from a checkpoint) gets the same
    # answer from the replay window, its payload not added; nothing is released again.
    again = chief.contribute("c", 0, 64, 4, key, np.ones(4, np.int64))
    for first, replayed in zip(results[0], again):
        np.testing.assert_array_equal(first, replayed)
