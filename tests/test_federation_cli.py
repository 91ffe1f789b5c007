"""`tfe-estimator certs federation` refuses a federation it finds a problem in, before writing anything."""
import pytest

from tfe_estimator.identity import certs
from tfe_estimator.tools import cli

CLUSTER = "hospitals"


@pytest.fixture(name="cas")
def _cas(tmp_path):
    """organisation -> path of its ca.crt (public only: the keys are not needed to assemble a federation)."""
    paths = {}
    for org in ("hospital-a", "hospital-b", "operator-x", "operator-y"):
        cert, _ = certs.make_ca(CLUSTER, organisation=org)
        paths[org] = tmp_path / f"{org}.crt"
        paths[org].write_bytes(cert)
    return paths


def _federation(cas, out, server_orgs):
    parties = {"chief:0": "hospital-a", "worker:0": "hospital-b", "tfe:0": server_orgs[0], "tfe:1": server_orgs[1]}
    return cli.main(["certs", "federation", "--cluster", CLUSTER,
                     *[a for party, org in parties.items() for a in ("--party", f"{party}={cas[org]}")],
                     "--server", "tfe:0=localhost:7000", "--server", "tfe:1=localhost:7001", "--out", str(out)])


def test_both_servers_in_one_organisation_are_refused_and_nothing_is_written(cas, tmp_path, capsys):
    """Issue 41: the file was written, the problem printed as a warning, and the command exited 1."""
    out = tmp_path / "federation.json"
    assert _federation(cas, out, ("operator-x", "operator-x")) == 2
    err = capsys.readouterr().err
    assert f"tfe-estimator: error: {out} not written: both aggregation servers belong to operator-x: the two " \
           "servers must be run by two organisations that do not collude." in err
    assert "For a trial inside one organisation, `tfe-estimator certs --dir DIR`" in err
    assert not out.exists()


def test_an_operator_that_is_also_an_owner_is_refused_without_the_trial_hint(cas, tmp_path, capsys):
    out = tmp_path / "federation.json"
    assert _federation(cas, out, ("hospital-a", "operator-y")) == 2
    err = capsys.readouterr().err
    assert "not written: chief:0 and aggregation server tfe:0 belong to one organisation (hospital-a)" in err
    assert "trial" not in err and not out.exists()


def test_a_federation_without_problems_is_written_and_exits_0(cas, tmp_path, capsys):
    out = tmp_path / "federation.json"
    assert _federation(cas, out, ("operator-x", "operator-y")) == 0
    assert out.exists() and capsys.readouterr().out.startswith(f"wrote {out}: 4 organisations")
