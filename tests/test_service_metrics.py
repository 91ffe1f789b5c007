"""Each aggregation server's Prometheus metrics after a small in-process run: what an operator's monitoring reads."""
import urllib.request

import grpc
import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from service_helpers import cert_dirs, credentials_of, in_threads, make_service, owner_names, raw_call  # noqa: F401
from tfe_estimator.service import wire

CHANNEL = "0123456789abcdef/grads-of-a-secret-model"
STEPS, N = 3, 4


def _scrape(port):
    """``{(name, labels): value}`` of http://localhost:port/metrics, and the page's text."""
    text = urllib.request.urlopen(f"http://localhost:{port}/metrics", timeout=10).read().decode()
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for family in text_string_to_metric_families(text) for s in family.samples}
    return samples, text


def test_metrics_count_released_steps_refusals_bytes_and_owners(make_service, cert_dirs):
    # Prepare: two servers with metrics in one process (a registry each), two owners.
    service = make_service(owner_names(2), metrics_address="localhost:0")
    server1, server0 = service.servers
    chief, worker = service.clients_of(2)
    key, share = np.arange(4, dtype=np.int32), np.arange(N, dtype=np.int64)

    # Execute: STEPS steps, one replayed put (not a release), one refused caller per server.
    for step in range(STEPS):
        results = in_threads([lambda step=step: chief.contribute(CHANNEL, step, 64, N, key, share),
                              lambda step=step: worker.contribute(CHANNEL, step, 64, N, key, share)])
        assert all(isinstance(r, tuple) for r in results), results
    chief.contribute(CHANNEL, 0, 64, N, key, share)  # step 0 again: answered from the replay window
    for k, address in enumerate(service.addresses):
        request = wire.messages()["RewindRequest"](step=0)
        with pytest.raises(grpc.RpcError) as e:
            raw_call(address, k, "Rewind", request, credentials_of(cert_dirs[0], "tfe", 2), timeout=5)
        assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED

    # Assert: each server tells a party the newest released step (Status), and its own counts.
    for k, address in enumerate(service.addresses):
        reply = raw_call(address, k, "Status", wire.messages()["StatusRequest"](),
                         credentials_of(cert_dirs[0], "evaluator", 0), timeout=5)
        assert (list(reply.channels), list(reply.steps)) == ([CHANNEL], [STEPS - 1])
    (m0, text0), (m1, text1) = _scrape(server0.metrics_port), _scrape(server1.metrics_port)
    for m, role in ((m0, 0), (m1, 1)):
        assert m[("tfe_aggregation_steps_released_total", ())] == STEPS, role
        assert m[("tfe_aggregation_refusals_total", (("code", "PERMISSION_DENIED"),))] == 1, role
        assert m[("tfe_aggregation_owners_connected", ())] == 2 and m[("tfe_aggregation_owners", ())] == 2
        assert m[("tfe_aggregation_server_role", ())] == role
        assert m[("tfe_aggregation_step_latency_seconds_count", ())] == 2 * STEPS + 1  # each put, the replay too
        assert m[("tfe_aggregation_memory_budget_bytes", ())] == 4 << 30
        assert 0 <= m[("tfe_aggregation_memory_budget_used_bytes", ())] <= 4 << 30
    puts = 2 * STEPS + 1
    assert m0[("tfe_aggregation_received_bytes_total", ())] == 16 * puts  # the owners' keys
    assert m1[("tfe_aggregation_received_bytes_total", ())] == 8 * N * (puts + STEPS)  # shares + server0's parts
    assert m0[("tfe_aggregation_sent_bytes_total", ())] >= 16 * puts + 8 * N * STEPS  # blind keys + forwards
    assert m1[("tfe_aggregation_sent_bytes_total", ())] >= 8 * N * puts  # w to each put
    # Counts only: no channel or model name, no owner's name on the page.
    for text in (text0, text1):
        assert "secret-model" not in text and "0123456789abcdef" not in text and "chief" not in text, text


def test_servers_without_a_metrics_address_serve_none(make_service):
    service = make_service(owner_names(2))
    assert [server.metrics_port for server in service.servers] == [None, None]
