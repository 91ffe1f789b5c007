"""A federation on one machine (`tfe-estimator launch`): every task its own organisation and directory.

`issue_task_dirs` gives each task ``root/<job>-<index>/`` holding only its own key
(mode 0600), its own certificate and the public ``federation.json``; each task is
its own organisation with its own CA, whose key lives only in memory while its one
certificate is signed. So no task's directory holds a CA key or another task's key,
and a task could not mint another's identity even with its own organisation's CA.

Example::

    dirs = issue_task_dirs("/tmp/run-certs", [("chief", 0), ("worker", 0), ("tfe", 0), ("tfe", 1)], "launch")
    env["TFE_ESTIMATOR_TLS_DIR"] = dirs[("worker", 0)]
"""
import os
from typing import Dict, Iterable, Tuple

from tfe_estimator.identity import certs
from tfe_estimator.identity.federation import FEDERATION_FILE, Federation
from tfe_estimator.identity.keyfiles import make_private_dir, write_private, write_public

__all__ = ["issue_task_dirs"]

Task = Tuple[str, int]


def issue_task_dirs(root: str, tasks: Iterable[Task], cluster: str,
                    validity_days: int = certs.DEFAULT_VALIDITY_DAYS) -> Dict[Task, str]:
    """One private directory per task under `root` (see the module docstring); returns task -> directory."""
    tasks = list(tasks)
    make_private_dir(root)
    issued, party_cas = {}, {}
    for job, index in tasks:
        org = certs.task_name(job, index)  # each task is its own organisation
        ca_cert, ca_key = certs.make_ca(cluster, validity_days, organisation=org, display_name=f"{org} (launch)")
        key, csr = certs.make_key_and_csr(job, index, org, cluster)
        issued[(job, index)] = (key, certs.sign_csr(csr, ca_cert, ca_key, cluster, validity_days))
        party_cas[f"{job}:{index}"] = ca_cert
        del ca_key  # never written anywhere: nothing more is signed for this run
    federation = Federation.assemble(cluster, party_cas).dumps().encode("utf-8")
    dirs = {}
    for (job, index), (key, cert) in issued.items():
        own = make_private_dir(os.path.join(root, certs.task_name(job, index)))
        write_private(os.path.join(own, certs.task_name(job, index) + ".key"), key)
        write_public(os.path.join(own, certs.task_name(job, index) + ".crt"), cert)
        write_public(os.path.join(own, FEDERATION_FILE), federation)
        dirs[(job, index)] = own
    return dirs
