"""docs/deployment.md's flow through `tfe-estimator certs`, shared by the federation and Kubernetes-site tests.

Each organisation makes its own CA, each party its key and CSR (the key never
leaves its directory), each CA signs its own party, the public federation file
is assembled and every party verifies and installs it.

Example::

    fed = make_federation(tmp_path, {"tfe:0": ("localhost", 7000), "tfe:1": ("localhost", 7001)})
"""
import os

from tfe_estimator.identity import certs
from tfe_estimator.tools import cli

CLUSTER = "hospitals"
#: organisation -> (identity, display name)
PARTIES = {"hospital-a": ("chief:0", "Hospital A"), "hospital-b": ("worker:0", "Hospital B"),
           "operator-x": ("tfe:0", "Operator X"), "operator-y": ("tfe:1", "Operator Y")}


def run_cli(*argv):
    assert cli.main(list(argv)) == 0, argv


def stem(identity):
    """``"worker:0"`` -> ``"worker-0"``: the party's file stem and directory name."""
    job, index = identity.split(":")
    return certs.task_name(job, int(index))


def make_federation(root, servers):
    """Runs the flow under `root` (a pathlib.Path); `servers` maps ``tfe:K`` to ``(host, port)``.

    Returns the federation file's path; party P of organisation O has its directory at ``root/O/stem(P)``.
    """
    party_args = []
    for org, (identity, name) in PARTIES.items():
        ca_dir, own = str(root / org / "ca"), str(root / org / stem(identity))
        run_cli("certs", "ca", "--org", org, "--name", name, "--cluster", CLUSTER, "--dir", ca_dir)
        run_cli("certs", "request", "--identity", identity, "--org", org, "--cluster", CLUSTER, "--dir", own)
        run_cli("certs", "sign", "--ca-dir", ca_dir, "--csr", os.path.join(own, stem(identity) + ".csr"),
                "--cluster", CLUSTER)
        party_args += ["--party", f"{identity}={ca_dir}/ca.crt"]
    fed = str(root / "federation.json")
    run_cli("certs", "federation", "--cluster", CLUSTER, *party_args,
            *[a for s, (host, port) in servers.items() for a in ("--server", f"{s}={host}:{port}")], "--out", fed)
    for org, (identity, _) in PARTIES.items():
        run_cli("certs", "verify", "--federation", fed, "--dir", str(root / org / stem(identity)),
                "--identity", identity, "--install")
    return fed
