"""`tfe-estimator health` (a server task's own probe) and `tfe-estimator status` (both servers, as the caller)."""
import json

import numpy as np
import pytest

from service_helpers import cert_dirs, in_threads, make_service, owner_names  # noqa: F401
from tfe_estimator.tools import cli


def _tf_config(service, job, index):
    return json.dumps({"cluster": {"chief": ["localhost:1"], "worker": ["localhost:2"], "tfe": list(service.addresses)},
                       "task": {"type": job, "index": index}})


def test_health_prints_one_line_and_exits_0_when_serving_1_when_not(make_service, cert_dirs, monkeypatch, capsys):
    service = make_service(owner_names(2))
    monkeypatch.setenv("TFE_ESTIMATOR_TLS_DIR", cert_dirs[0])
    for k in (0, 1):
        monkeypatch.setenv("TF_CONFIG", _tf_config(service, "tfe", k))
        assert cli.main(["health"]) == 0
        assert capsys.readouterr().out == f"tfe:{k} at {service.addresses[k]}: SERVING\n"
    assert cli.main(["health", "--target", service.addresses[1]]) == 0  # tfe:1's identity pins tfe-1
    assert capsys.readouterr().out == f"tfe:1 at {service.addresses[1]}: SERVING\n"
    # tfe:1 calling server0's port pins its own name there: server0's certificate does not match
    assert cli.main(["health", "--target", service.addresses[0], "--timeout", "2"]) == 1
    out = capsys.readouterr().out
    assert out.startswith(f"tfe:1 at {service.addresses[0]}: unreachable or refused (") and out.count("\n") == 1, out
    service.servers[0].stop(0)  # server1 (started first) is down
    assert cli.main(["health", "--timeout", "2"]) == 1
    assert capsys.readouterr().out.startswith(f"tfe:1 at {service.addresses[1]}: unreachable or refused (UNAVAILABLE")


def test_health_outside_a_server_task_names_the_fix(cert_dirs, monkeypatch, capsys):
    monkeypatch.delenv("TF_CONFIG", raising=False)
    assert cli.main(["health"]) == 2
    assert "runs in an aggregation server's environment (TF_CONFIG naming task tfe:0 or tfe:1), but no TF_CONFIG" \
        in capsys.readouterr().err
    monkeypatch.setenv("TF_CONFIG", json.dumps({"cluster": {"chief": ["a:1"], "tfe": ["b:1", "c:1"]},
                                                "task": {"type": "chief", "index": 0}}))
    assert cli.main(["health"]) == 2
    assert "but TF_CONFIG says chief:0. An owner or an operator elsewhere uses `tfe-estimator status" in \
        capsys.readouterr().err
    monkeypatch.setenv("TF_CONFIG", json.dumps({"cluster": {"chief": ["a:1"], "tfe": ["b:1", "c:1"]},
                                                "task": {"type": "tfe", "index": 0}}))
    monkeypatch.delenv("TFE_ESTIMATOR_TLS_DIR", raising=False)
    assert cli.main(["health"]) == 2
    assert "set TFE_ESTIMATOR_TLS_DIR to the directory with its certificate" in capsys.readouterr().err


def test_status_prints_a_row_per_server_and_exits_1_when_one_is_down(make_service, cert_dirs, monkeypatch, capsys):
    service = make_service(owner_names(2))
    chief, worker = service.clients_of(2)
    key, share = np.zeros(4, np.int32), np.zeros(4, np.int64)
    for channel, step in (("00000000000000ab/grads", 6), ("00000000000000ab/loss", 7), ("00000000000000cd/grads", 2)):
        assert all(isinstance(r, tuple) for r in in_threads([
            lambda c=channel, s=step: chief.contribute(c, s, 64, 4, key, share),
            lambda c=channel, s=step: worker.contribute(c, s, 64, 4, key, share)]))
    monkeypatch.setenv("TF_CONFIG", _tf_config(service, "chief", 0))  # one CA names no addresses: TF_CONFIG's
    monkeypatch.delenv("TFE_ESTIMATOR_TLS_DIR", raising=False)
    assert cli.main(["status", "--tls-dir", cert_dirs[0], "--identity", "evaluator:0"]) == 0  # any party
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["server", "address", "health", "released"], lines
    released = "model 00000000000000ab: step 7, model 00000000000000cd: step 2"
    assert lines[1:] == [f"tfe:{k}   {service.addresses[k]}  SERVING  {released}" for k in (0, 1)], lines
    service.servers[0].stop(0)  # server1
    assert cli.main(["status", "--tls-dir", cert_dirs[0], "--identity", "worker:0", "--timeout", "2"]) == 1
    lines = capsys.readouterr().out.splitlines()
    assert lines[1].split()[2] == "SERVING" and "unreachable or refused (UNAVAILABLE" in lines[2], lines


def test_status_names_the_certificate_to_use(cert_dirs, capsys):
    assert cli.main(["status", "--tls-dir", cert_dirs[0]]) == 2  # a directory of every task's certificate
    assert "task certificates with their keys" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main(["status", "--tls-dir"])
