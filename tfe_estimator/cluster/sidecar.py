"""A task's TLS sidecar: the stunnel configuration that puts mutual TLS on every link it may use.

TensorFlow's gRPC server has no TLS and no authentication. The sidecar
(Debian's ``stunnel4``) sits beside the task (same host or pod):

- ``[in]`` accepts mutual TLS on the task's TLS address (TLS 1.3, a
  certificate from the cluster CA required) and forwards to TensorFlow on
  ``127.0.0.1:<the task's TF port>``. Only the tasks the cluster mode's peer
  table lets call this task get through: one ``checkHost`` line per allowed
  task (its certificate's DNS name, `certs.task_dns_name`). A task nobody may
  call gets no ``[in]`` at all.
- ``[out-<job>-<index>]`` for each task this one may call listens on
  ``127.0.0.1:<that task's TF port>`` and connects, with this task's
  certificate, to that task's TLS address, checking that the far end is that
  task. So every task's TF_CONFIG can say ``localhost:<TF port of task k>`` for
  every task k, and TensorFlow needs no change.

Who may call whom is `tfe_estimator.cluster.peers` (in-graph: every training
task accepts every other; the evaluator neither accepts nor calls). What this does not do by
itself: close TensorFlow's own port to everything but the host's loopback
(a firewall rule, or a pod NetworkPolicy) — without that a peer could still
reach TensorFlow directly.

Example::

    text = stunnel_config(("worker", 0), tasks, "in-graph", "/etc/tfe-tls", "demo",
                          tf_ports={t: 7000 + i for i, t in enumerate(tasks)},
                          tls_addresses={t: f"{certs.task_name(*t)}.demo:8443" for t in tasks})
"""
import os
from typing import Mapping, Sequence, Tuple

from tfe_estimator.cluster import certs, peers

__all__ = ["stunnel_config", "TLS_VERSION_MIN"]

TLS_VERSION_MIN = "TLSv1.3"
Task = Tuple[str, int]


def _credentials(task: Task, cert_dir: str):
    stem = os.path.join(cert_dir, certs.task_name(*task))
    return [f"cert = {stem}.crt", f"key = {stem}.key", f"CAfile = {os.path.join(cert_dir, certs.CA_CERT)}",
            "verifyChain = yes", f"sslVersionMin = {TLS_VERSION_MIN}"]


def stunnel_config(task: Task, tasks: Sequence[Task], mode: str, cert_dir: str, cluster: str,
                   tf_ports: Mapping[Task, int], tls_addresses: Mapping[Task, str]) -> str:
    """The stunnel configuration of `task`'s sidecar.

    Args:
      task: ``(job, index)`` of this task.
      tasks: every task of the cluster (`spec.cluster_tasks`).
      mode: the cluster mode (`peers.CLUSTER_MODES`): whose connections are allowed.
      cert_dir: where ``ca.crt`` and this task's ``<job>-<index>.crt``/``.key`` are (`certs`).
      cluster: the cluster name in the certificates' DNS names.
      tf_ports: task -> its TensorFlow port (on the loopback of its host).
      tls_addresses: task -> ``host:port`` where its sidecar accepts TLS.

    Raises:
      ValueError: for a task missing from `tasks`, `tf_ports` or `tls_addresses`, or an unknown mode.
    """
    peers.validate_mode(mode)
    for t in [task, *tasks]:
        if t not in tf_ports or t not in tls_addresses:
            raise ValueError(f"task {t} has no TF port or TLS address: pass both for every task of the cluster.")
    if task not in tasks:
        raise ValueError(f"task {task} is not a task of the cluster {list(tasks)}.")
    job, _ = task
    lines = ["; tfe-estimator TLS sidecar of " + certs.task_name(*task) + f" ({mode})",
             "foreground = yes", "pid =", "debug = notice", ""]
    callers = [t for t in tasks if t[0] in peers.allowed_callers(mode, job) and t != task]
    if callers:
        port = tls_addresses[task].rsplit(":", 1)[1]
        lines += ["[in]", f"accept = 0.0.0.0:{port}", f"connect = 127.0.0.1:{tf_ports[task]}",
                  "requireCert = yes", *_credentials(task, cert_dir)]
        lines += [f"checkHost = {certs.task_dns_name(*t, cluster)}" for t in callers]
        lines.append("")
    for peer in tasks:
        if peer == task or peer[0] not in peers.allowed_callees(mode, job):
            continue
        lines += [f"[out-{certs.task_name(*peer)}]", "client = yes", f"accept = 127.0.0.1:{tf_ports[peer]}",
                  f"connect = {tls_addresses[peer]}", *_credentials(task, cert_dir),
                  f"checkHost = {certs.task_dns_name(*peer, cluster)}", ""]
    return "\n".join(lines)
