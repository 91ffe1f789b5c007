"""One model_dir per data owner: a claim file that refuses a second owner.

In service mode every data owner (the chief and each worker of TF_CONFIG)
trains and checkpoints its own copy of the model. Two owners pointed at one
directory would interleave their ``model.ckpt-*`` files and event files
without any error. So before anything is written, an owner claims its
model_dir: it creates ``tfe_owner.json`` there atomically (written to a
temporary file, then hard-linked into place) with its task name and its
cluster's identity. Another owner (any other task name) pointed at the
directory is refused with a `ValueError` naming the directory, both owners
and the fix; the same owner restarting (even on a cluster re-planned on new
ports, whose identity differs) is accepted. An evaluator reads its owner's directory and claims nothing.

Where a task's model_dir comes from when the script passes none:
``TFE_ESTIMATOR_MODEL_DIR`` (`MODEL_DIR_ENV`), which `tfe-estimator launch`
and the Kubernetes renderer set per task (each owner its own directory, the
evaluator its owner's: the chief's). A relative model_dir on an evaluator
resolves against its owner's working directory when the launcher exports it
as ``TFE_ESTIMATOR_OWNER_CWD`` (`OWNER_CWD_ENV`). A data owner in service mode
with neither is refused (`require_owner_model_dir`): Estimator would train it
into a fresh temporary directory, and a restart would lose its model.

On a remote filesystem (``gs://``, ``hdfs://``) the claim is a check then a
write through `tf.io.gfile`, not atomic: two owners starting in the same
instant could both pass.

Example::

    claim_model_dir("/data/chief", "chief:0", cluster_id("{...TF_CONFIG cluster...}"))
    claim_model_dir("/data/chief", "worker:0", "...")  # ValueError: ... claimed by chief:0 ...
"""
import json
import logging
import os
from typing import Mapping, Optional

from tfe_estimator.cluster.spec import cluster_digest

__all__ = ["CLAIM_FILE", "MODEL_DIR_ENV", "OWNER_CWD_ENV", "DefaultModelDir", "claim_model_dir", "cluster_id",
           "default_model_dir", "require_owner_model_dir"]

#: The claim file an owner writes into its model_dir.
CLAIM_FILE = "tfe_owner.json"
#: Set per task by `tfe-estimator launch` and the Kubernetes renderer: the model_dir used when none is passed.
MODEL_DIR_ENV = "TFE_ESTIMATOR_MODEL_DIR"
#: Set by `tfe-estimator launch` for an evaluator: its owner's working directory (relative model_dirs resolve there).
OWNER_CWD_ENV = "TFE_ESTIMATOR_OWNER_CWD"

_LOG = logging.getLogger("tfe_estimator")


def cluster_id(jobs: Mapping) -> str:
    """A short identity of a TF_CONFIG cluster (job -> addresses): 16 hex digits of `spec.cluster_digest`."""
    return cluster_digest(jobs).hex()[:16]


class DefaultModelDir(str):
    """A model_dir taken from `MODEL_DIR_ENV`, not from the script: it yields to `Estimator(model_dir=...)`.

    Estimator refuses a config whose model_dir differs from the one its
    constructor gets (``maybe_overwrite_model_dir_and_session_config`` tests
    ``config.model_dir != model_dir``). A script that names its Estimator's
    directory has chosen it: a default never differs, so the script's
    model_dir replaces it. Everywhere else it is the path it holds.

    Example::

        config = TfeRunConfig()  # under `launch`: model_dir = DefaultModelDir(".../model/chief-0")
        tf.estimator.LinearRegressor(columns, model_dir="runs/a", config=config).model_dir  # "runs/a"
    """

    def __ne__(self, other):
        return False if isinstance(other, str) else NotImplemented

    __hash__ = str.__hash__


def default_model_dir(model_dir: Optional[str], environ: Optional[Mapping[str, str]] = None) -> Optional[str]:
    """`model_dir`, else `MODEL_DIR_ENV` (a `DefaultModelDir`); a relative one on an evaluator resolved against
    `OWNER_CWD_ENV`."""
    environ = os.environ if environ is None else environ
    if not model_dir and environ.get(MODEL_DIR_ENV):
        resolved = default_model_dir(environ[MODEL_DIR_ENV], environ)
        return DefaultModelDir(resolved)
    model_dir = model_dir or None
    owner_cwd = environ.get(OWNER_CWD_ENV)
    if model_dir and owner_cwd and not _is_remote(model_dir) and not os.path.isabs(model_dir):
        resolved = os.path.join(owner_cwd, model_dir)
        _LOG.info("model_dir=%r is relative: this evaluator reads its owner's directory %s (%s=%s)",
                  model_dir, resolved, OWNER_CWD_ENV, owner_cwd)
        return resolved
    return model_dir


def require_owner_model_dir(model_dir: Optional[str], owner_name: str) -> None:
    """Refuses a service-mode data owner `owner_name` (e.g. ``"worker:0"``) that has no model_dir.

    Without one (none passed to `TfeRunConfig`, `MODEL_DIR_ENV` unset) Estimator
    trains into a new temporary directory: the owner's only copy of the model
    is lost with it, and a restarted owner can neither resume from its
    checkpoint nor catch up from the servers' replay window. A model_dir given
    only to the Estimator does not count: `TfeRunConfig` must know it to claim
    it (`claim_model_dir`) before anything is written.

    Raises:
      ValueError: if `model_dir` is empty, naming the owner, the sources of a model_dir and the fix.
    """
    if model_dir:
        return
    raise ValueError(
        f"Data owner {owner_name} has no model_dir: TfeRunConfig got no model_dir and {MODEL_DIR_ENV} is not set, "
        "so Estimator would train into a new temporary directory (/tmp/tmpXXXXXXXX). In service mode each owner's "
        "model_dir holds its own copy of the model: a restarted owner resumes from its checkpoint there and catches "
        "up from the servers' replay window; a temporary directory loses both. Pass TfeRunConfig(model_dir=...) "
        "(e.g. from `python train.py --model-dir hospital-a/model`) or set "
        f"{MODEL_DIR_ENV}=<this owner's directory> (`tfe-estimator launch` and `tfe-estimator k8s` set it for every "
        "owner). A model_dir given only to the Estimator is not enough: TfeRunConfig claims this owner's directory "
        "before anything is written.")


def claim_model_dir(model_dir: str, owner_name: str, cluster_id: str) -> None:  # pylint: disable=redefined-outer-name
    """Claims `model_dir` for the data owner `owner_name` (e.g. ``"worker:0"``), or refuses it.

    Creates `model_dir` if needed and writes `CLAIM_FILE` there unless it
    exists. Writes nothing else.

    Raises:
      ValueError: if another owner (another task name) claimed `model_dir`,
        naming the directory, both owners and the fix; or if the claim file
        is not ours.
    """
    path = _join(model_dir, CLAIM_FILE)
    record = json.dumps({"owner": owner_name, "cluster_id": cluster_id}, sort_keys=True)
    if _create_exclusive(model_dir, path, record):
        _LOG.info("model_dir %s claimed by data owner %s (cluster %s): no other owner may train into it",
                  model_dir, owner_name, cluster_id)
        return
    claimed = _read_claim(path)
    if claimed.get("owner") == owner_name:
        if claimed.get("cluster_id") != cluster_id:
            _LOG.info("model_dir %s was claimed by %s of cluster %s; this is %s of cluster %s: the same owner, "
                      "resuming", model_dir, owner_name, claimed.get("cluster_id"), owner_name, cluster_id)
        return
    raise ValueError(
        f"model_dir={model_dir!r} belongs to data owner {claimed.get('owner')} (cluster "
        f"{claimed.get('cluster_id')}, recorded in {path}), but this is data owner {owner_name} (cluster "
        f"{cluster_id}): in service mode every owner checkpoints its own copy, and two owners in one directory "
        "would interleave their checkpoints and event files. Give every owner its own model_dir, e.g. "
        "model_dir=f'/data/{task}' with task from TF_CONFIG, or pass no model_dir under `tfe-estimator launch` "
        f"(it sets {MODEL_DIR_ENV} per owner). If {path} is left over from an earlier run of another owner, "
        "delete the directory.")


def _is_remote(path: str) -> bool:
    return "://" in path


def _join(directory: str, name: str) -> str:
    return f"{directory.rstrip('/')}/{name}" if _is_remote(directory) else os.path.join(directory, name)


def _create_exclusive(model_dir: str, path: str, record: str) -> bool:
    """Writes `record` to `path` unless it exists; True if this call created it."""
    if _is_remote(model_dir):
        import tensorflow as tf  # pylint: disable=import-outside-toplevel

        tf.io.gfile.makedirs(model_dir)
        if tf.io.gfile.exists(path):
            return False
        with tf.io.gfile.GFile(path, "w") as f:
            f.write(record)
        return True
    os.makedirs(model_dir, exist_ok=True)
    # Write a private file, then link it into place: the claim appears whole or not at all.
    temp = f"{path}.{os.getpid()}.tmp"
    with open(temp, "w", encoding="utf-8") as f:
        f.write(record)
    try:
        os.link(temp, path)
    except FileExistsError:
        return False
    finally:
        os.unlink(temp)
    return True


def _read_claim(path: str) -> dict:
    if _is_remote(path):
        import tensorflow as tf  # pylint: disable=import-outside-toplevel

        text = tf.io.gfile.GFile(path).read()
    else:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    try:
        claimed = json.loads(text)
    except ValueError:
        claimed = None
    if not isinstance(claimed, dict) or not isinstance(claimed.get("owner"), str):
        raise ValueError(f"{path} is not a tfe_estimator owner claim ({text[:200]!r}): delete it, or give this "
                         "owner another model_dir.")
    return claimed
