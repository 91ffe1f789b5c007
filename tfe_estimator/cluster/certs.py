"""Certificates of a cluster's tasks: re-exported from `tfe_estimator.identity.certs`, where they live.

Identity sits below both the service and the cluster layer (`tfe_estimator.identity`);
this module keeps the old import path working.

Example::

    from tfe_estimator.cluster import certs
    certs.make_cluster_certs("/tmp/certs", [("chief", 0), ("tfe", 0), ("tfe", 1)], cluster="demo")
"""
from tfe_estimator.identity.certs import *  # noqa: F401,F403 pylint: disable=wildcard-import,unused-wildcard-import
from tfe_estimator.identity.certs import __all__  # noqa: F401
