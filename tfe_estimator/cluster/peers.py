"""Who calls whom on a cluster: the one table transport authorisation derives from.

TensorFlow's rendezvous is pull-based: a ``_Recv`` on task B issues a
``RecvTensor`` RPC to the task that produced the tensor. So a link is needed
in each direction in which a tensor or a session's graph travels:

Service mode (the default; across organisations): owners run no TensorFlow
server and accept no connection; each owner calls the aggregation service's
two servers (`tfe_estimator.service`: Contribute, Handshake, Rewind over
mutual TLS), and server0 calls server1 (ForwardBlinded). The table below is
the TensorFlow-runtime modes'.

The between-graph mode (a TensorFlow-runtime strategy per owner, the servers
TensorFlow servers) is retired: service mode does the same job across
organisations; `validate_mode` refuses ``"between-graph"`` naming both.

In-graph mode (one organisation on a trusted network): the chief's session
places ops on every task, so every training task may call every other one.

An owner is a task of a job in `spec.DATA_OWNER_JOBS` (chief, worker).

Example::

    >>> allowed_callers("service", "worker")
    ()
    >>> allowed_callers("in-graph", "tfe")
    ('chief', 'worker', 'tfe')
"""
import os
from typing import Dict, Mapping, Optional, Tuple

from tfe_estimator.cluster.spec import DATA_OWNER_JOBS, LAUNCH_CLUSTER_MODE_ENV, TFE_JOB

__all__ = ["CLUSTER_MODES", "DEFAULT_MODE", "SERVICE", "IN_GRAPH", "RETIRED_MODES", "allowed_callers",
           "allowed_callees", "cluster_mode", "validate_mode"]

IN_GRAPH = "in-graph"
SERVICE = "service"
CLUSTER_MODES = (SERVICE, IN_GRAPH)
#: Modes of earlier releases, refused with what to use instead.
RETIRED_MODES = ("between-graph",)
#: The mode of a TF_CONFIG cluster unless `TfeRunConfig(cluster_mode=...)` or the launcher says otherwise.
DEFAULT_MODE = SERVICE

_TRAINING_JOBS = DATA_OWNER_JOBS + (TFE_JOB,)

#: mode -> callee job -> the jobs whose tasks may open a connection to it.
_CALLERS: Dict[str, Dict[str, Tuple[str, ...]]] = {
    IN_GRAPH: {
        **{job: _TRAINING_JOBS for job in _TRAINING_JOBS},
        "evaluator": (),
    },
    # Owners only connect out to the aggregation service; server0 forwards its blinded part to server1.
    SERVICE: {
        **{owner: () for owner in DATA_OWNER_JOBS},
        TFE_JOB: DATA_OWNER_JOBS + (TFE_JOB,),
        "evaluator": (),
    },
}


def validate_mode(mode: str, source: str = "cluster_mode") -> str:
    """Returns `mode` if it is one of `CLUSTER_MODES`.

    Raises:
      ValueError: naming the value, where it came from and the choices; for the retired
        ``"between-graph"``, naming service mode (across organisations) and in-graph (one organisation).
    """
    if mode in RETIRED_MODES:
        raise ValueError(
            f"{source}={mode!r}: the between-graph mode is retired. Use {SERVICE!r} (the default: each data "
            "owner trains its own graph and only connects out to the aggregation service's two servers over "
            "mutual TLS; it does everything between-graph did, faster, and across organisations), or "
            f"{IN_GRAPH!r} for a TensorFlow-runtime cluster inside one organisation on a trusted network.")
    if mode not in CLUSTER_MODES:
        raise ValueError(
            f"{source}={mode!r} is not a cluster mode: use {SERVICE!r} (across organisations: each data "
            f"owner trains alone and only connects out to the aggregation service) or {IN_GRAPH!r} (one "
            "organisation on a trusted network: the chief runs ops on every task)."
        )
    return mode


def cluster_mode(requested: Optional[str] = None, environ: Optional[Mapping[str, str]] = None,
                 requester: str = "TfeRunConfig") -> str:
    """The mode of this task's cluster: `requested`, else the one it was launched for, else `DEFAULT_MODE`.

    `tfe-estimator launch`, the Kubernetes renderers and the deployment page set ``$TFE_ESTIMATOR_CLUSTER_MODE``
    for every task; this is the one place that reads it (a server, `TfeRunConfig`, `TfeStrategy`).

    Args:
      requested: the mode the program asks for (``TfeRunConfig(cluster_mode=...)``), or None.
      environ: where to read the launched mode (default `os.environ`).
      requester: named in the error, e.g. ``"TfeRunConfig"``.

    Raises:
      ValueError: `requested` differs from the launched mode, or either is not a mode (naming the fix).

    Example::

        >>> cluster_mode(environ={})
        'service'
        >>> cluster_mode(environ={"TFE_ESTIMATOR_CLUSTER_MODE": "in-graph"})
        'in-graph'
    """
    environ = os.environ if environ is None else environ
    launched = environ.get(LAUNCH_CLUSTER_MODE_ENV)
    if launched and requested and launched != requested:
        raise ValueError(
            f"{requester}(cluster_mode={requested!r}) but this task was launched for {launched!r} "
            f"({LAUNCH_CLUSTER_MODE_ENV}={launched}): every task of a cluster must run the same "
            f"mode. Drop cluster_mode (the launched one applies) or launch with --cluster-mode {requested}.")
    source = "cluster_mode" if requested else LAUNCH_CLUSTER_MODE_ENV
    return validate_mode(requested or launched or DEFAULT_MODE, source)


def allowed_callers(mode: str, job: str) -> Tuple[str, ...]:
    """The jobs whose tasks may connect to a task of `job` in cluster mode `mode`.

    A task of the same job counts only when the job is listed (in service
    mode, a worker never accepts another worker).

    Raises:
      ValueError: for an unknown mode or job.
    """
    table = _CALLERS[validate_mode(mode)]
    if job not in table:
        raise ValueError(f"job {job!r} has no entry in the {mode} peer table: use one of {sorted(table)}.")
    return table[job]


def allowed_callees(mode: str, job: str) -> Tuple[str, ...]:
    """The jobs whose tasks a task of `job` may connect to in cluster mode `mode`."""
    table = _CALLERS[validate_mode(mode)]
    if job not in table:
        raise ValueError(f"job {job!r} has no entry in the {mode} peer table: use one of {sorted(table)}.")
    return tuple(callee for callee, callers in table.items() if job in callers)
