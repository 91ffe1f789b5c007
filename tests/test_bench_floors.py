"""The bench's floors (`tools.bench.floors`): known per-byte costs give the known floors, targets below them are said.

In-process and arithmetic only, but for one measurement of this machine's costs (under a second).
"""
import pytest

from tools.bench import floors, report
from tools.bench.floors import ByteCosts

# Powers of two: every floor below is exact in binary floating point.
COSTS = ByteCosts(gcm=0.5, ctr=0.25, add=0.125, tls_send=1.0, tls_recv=2.0)
# svc-linear-1e6-like: 2 owners, 64-bit ring, 8 + 8 B/param per owner, MWMS owners 50 ms of CPU each and a
# 62.5 ms MWMS step (so the MWMS twin kept 100 / 62.5 = 1.6 of the 2 cores busy).
CASE = dict(params=1_000_000, owners=2, word_bytes=8, up_bytes=8e6, down_bytes=8e6, mwms_owner_cpu_ms=[50.0, 50.0],
            mwms_ms=62.5, cores=2)


def test_each_roles_floor_counts_its_bytes_keys_and_sums():
    # server0: 3 keystreams and sums, 8 B out; server1: 3 shares in and summed, 2 x 8 B out; client: 8 B each way.
    assert floors.role_floors(COSTS, 2, 8, "cipher") == {"server0": 8 * (3 * 0.375 + 0.5),
                                                         "server1": 8 * (3 * 0.625 + 2 * 0.5),
                                                         "client": 8.0}
    assert floors.role_floors(COSTS, 2, 8, "transport") == {"server0": 17.0, "server1": 8 * (3 * 2.125 + 2),
                                                            "client": 24.0}
    # The 32-bit ring halves every role; 4 owners add keystreams, shares and answers.
    assert floors.role_floors(COSTS, 2, 4, "transport") == {"server0": 8.5, "server1": 33.5, "client": 12.0}
    assert floors.role_floors(COSTS, 4, 8, "cipher") == {"server0": 8 * (5 * 0.375 + 0.5),
                                                         "server1": 8 * (5 * 0.625 + 4 * 0.5), "client": 8.0}


def test_the_owners_and_the_steps_floor_add_every_role():
    # Execute
    got = floors.case_floors(COSTS, **CASE)
    # Assert: cipher: an owner's security = masks 2 x 8 B x 0.25 + 16 B x 0.5 = 12 ns/param = 12 ms per step;
    # the step's CPU = MWMS owners 100 + 2 owners x 12 + server0 13 + server1 23 = 160 ms (1.6x MWMS's CPU):
    # over 2 cores 80 ms, 1.28x the MWMS step.
    cipher = got["cipher"]
    assert cipher["ns_per_param"] == {"server0": 13.0, "server1": 23.0, "owner_security": 12.0}
    assert cipher["owner_security_ms"] == 12.0 and cipher["owner_cpu_ms"] == 62.0 and cipher["owner_ratio"] == 1.24
    assert cipher["step_cpu_ms"] == 160.0 and cipher["step_ms"] == 80.0 and cipher["step_ratio"] == 1.28
    assert cipher["cpu_ratio"] == 1.6
    # transport: security = 4 + 8 x 1 + 8 x 2 = 28 ns/param; step CPU = 100 + 56 + 17 + 67 = 240 ms -> 120 ms.
    transport = got["transport"]
    assert transport["ns_per_param"] == {"server0": 17.0, "server1": 67.0, "owner_security": 28.0}
    assert transport["owner_ratio"] == 78.0 / 50.0 and transport["step_cpu_ms"] == 240.0
    assert transport["step_ratio"] == 1.92 and transport["cpu_ratio"] == 2.4


def test_the_step_floor_uses_the_owners_measured_bytes_and_each_mwms_owner():
    # Twice the bytes up: only the owner's send term grows (8e6 B x 1 ns more per owner, 2 owners: 16 ms more).
    base = floors.case_floors(COSTS, **CASE)["transport"]
    more = floors.case_floors(COSTS, **dict(CASE, up_bytes=16e6))["transport"]
    assert more["owner_security_ms"] - base["owner_security_ms"] == 8.0
    assert more["step_cpu_ms"] - base["step_cpu_ms"] == 16.0
    # One MWMS owner's CPU higher: the step's CPU grows by it, the owner's floor by the mean's growth.
    skewed = floors.case_floors(COSTS, **dict(CASE, mwms_owner_cpu_ms=[50.0, 70.0]))["transport"]
    assert skewed["step_cpu_ms"] - base["step_cpu_ms"] == 20.0 and skewed["owner_cpu_ms"] == 88.0


def test_the_step_floor_is_never_below_the_mwms_step_on_many_cores():
    # 64 cores: the CPU over them is far below the MWMS step, which bounds the floor; the CPU floor stays.
    got = floors.case_floors(COSTS, **dict(CASE, cores=64))
    assert got["cipher"]["step_ms"] == 62.5 and got["cipher"]["step_ratio"] == 1.0
    assert got["transport"]["step_ratio"] == 1.0 and got["transport"]["cpu_ratio"] == 2.4


def test_targets_below_a_floor_are_said_and_targets_above_are_not():
    got = floors.case_floors(COSTS, **CASE)  # step floors 1.28x / 1.92x, owner floors 1.24x / 1.56x
    said = floors.below_floor(got, [1.5, 1.25], 1.25)
    assert said == ["the step target 1.50x is below the transport floor 1.92x",
                    "the step target 1.25x is below the cipher floor 1.28x and the transport floor 1.92x",
                    "the owner CPU target 1.25x is below the transport floor 1.56x"]
    assert floors.below_floor(got, [1.92], 1.56) == []


def test_without_the_tls_costs_only_the_cipher_floor_is_given_and_the_transport_floor_is_refused():
    cipher_only = ByteCosts(gcm=0.5, ctr=0.25, add=0.125)
    assert list(floors.case_floors(cipher_only, **CASE)) == ["cipher"]
    with pytest.raises(ValueError, match=r"measure_costs\(certs_dir\)"):
        floors.role_floors(cipher_only, 2, 8, "transport")


def test_the_least_of_several_measurements_is_each_costs_minimum():
    # Before and after a case's launches: a burst of load on one measurement must not raise the floor.
    before = ByteCosts(gcm=0.5, ctr=0.25, add=0.125, tls_send=2.0, tls_recv=1.0)
    after = ByteCosts(gcm=0.25, ctr=0.5, add=0.125, tls_send=1.0)
    assert floors.least(before, after) == ByteCosts(gcm=0.25, ctr=0.25, add=0.125, tls_send=1.0, tls_recv=1.0)
    assert floors.least(ByteCosts(1.0, 1.0, 1.0)).tls_send is None


def test_bad_case_inputs_are_named():
    with pytest.raises(ValueError, match=r"one positive MWMS owner CPU per owner \(2: got \[50.0\]\)"):
        floors.case_floors(COSTS, **dict(CASE, mwms_owner_cpu_ms=[50.0]))
    with pytest.raises(ValueError, match=r"word_bytes=3"):
        floors.role_floors(COSTS, 2, 3)


def test_the_printed_goals_are_the_issues_acceptance():
    from tools import bench

    cases = {w.name: dict(name=w.name, model=w.model, features=w.features, replicas=w.replicas, cluster=w.cluster,
                          service=w.service) for w in bench.service_cases()}
    targets = {name: report.target_text(case) for name, case in cases.items()}
    assert targets["svc-linear-1e5"] == targets["svc-linear-1e6"] == "target <= 1.50, moonshot 1.30"
    assert targets["svc-dnn-256"] == "target <= 1.80"
    assert targets["svc-linear-1e5-4own"] == targets["svc-linear-1e5-8own"] == "target <= 1.40"
    assert targets["svc-linear-1e7"] == "target <= 2.00"


def test_the_report_prints_and_tabulates_each_roles_floors_and_the_targets_below_them():
    # Prepare: a service row as `service_case._floor_figures` makes it.
    figures = floors.case_floors(COSTS, **CASE)
    row = {"name": "svc-linear-1e6", "model": "linear", "features": 1_000_000, "replicas": 2, "cluster": False,
           "service": True, "ratio": 1.8,
           "floors": {"ns_per_byte": vars(COSTS), "cores": 2, "owner_cpu_ratio": 1.6,
                      "measured_ns_per_param": {"servers": [20.0, 60.0], "owners": {"chief": 80.0, "worker-0": 82.0},
                                                "mwms_owners": {"chief": 50.0, "worker-0": 50.0}},
                      "cpu_ratio": 2.5, **figures, "targets": {"step": 1.5, "step_moonshot": 1.3, "owner_cpu": 1.25},
                      "below_floor": floors.below_floor(figures, [1.5, 1.3], 1.25)}}
    # Execute
    text = report.floors_text(row)
    table = "\n".join(report._service_floors([row]))  # pylint: disable=protected-access
    # Assert
    assert "server0 20.0 (13.0 / 17.0), server1 60.0 (23.0 / 67.0)" in text, text
    assert "owners 80.0, 82.0 (MWMS 50.0, 50.0, + security 12.0 / 28.0)" in text, text
    assert "owner CPU 1.60x MWMS (floor 1.24 / 1.56, target 1.25)" in text, text
    assert ("step floor 1.28 / 1.92x MWMS on 2 cores (target 1.50, moonshot 1.30); step CPU 2.50x MWMS's (floor "
            "1.60 / 2.40)") in text, text
    assert "the step target 1.30x is below the transport floor 1.92x" in text, text
    assert ("| svc-linear-1e6 | 2 | 0.50, 0.25, 1.00 / 2.00 | 20.0 (13.0 / 17.0) | 60.0 (23.0 / 67.0) | "
            "80.0, 82.0 (50.0, 50.0; + 12.0 / 28.0) | **1.60** (1.24 / 1.56; 1.25) | **1.80** (1.28 / 1.92; "
            "1.50, moonshot 1.30) | **2.50** (1.60 / 2.40) | the step target 1.50x") in table, table


def test_this_machines_costs_are_measured_with_the_data_planes_tls(tmp_path):
    from tfe_estimator.cluster import certs

    certs.make_cluster_certs(str(tmp_path), [("chief", 0), ("tfe", 1)], cluster="floors-test")
    costs = floors.measure_costs(str(tmp_path))
    assert all(v > 0 for v in vars(costs).values()), costs
    assert set(floors.case_floors(costs, **CASE)) == {"cipher", "transport"}
