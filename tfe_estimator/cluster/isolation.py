"""A launched cluster as separate hosts: one network namespace per task, and optionally mutual TLS.

`IsolatedCluster` is what `tfe-estimator launch --isolate [--tls]` adds to
the launcher (`cluster.launcher`):

- ``--isolate``: every task runs in its own namespace of a `PrivateNetwork`
  (its own loopback and address on a private bridge). TF_CONFIG names each
  task at ``<its address>:<its TF port>``: TensorFlow's plaintext gRPC goes
  over the bridge, as between hosts on a network.
- ``--tls`` (with ``--isolate``): the verified sidecar design. Certificates
  for the run (`tfe_estimator.identity.certs`; each task's directory holds only
  its own key, the CA's key is never written); one stunnel
  sidecar per task in its namespace (`cluster.sidecar`: ``[in]`` accepts
  mutual TLS from the tasks the cluster mode's peer table allows,
  ``[out-<task>]`` per task it may call); every task's TF_CONFIG says
  ``localhost:<TF port of task k>`` for every task k; and a firewall
  (iptables, in each namespace) that drops every packet to the task except on
  loopback, to the TLS port, and replies to connections it opened; on IPv6
  (ip6tables; TensorFlow listens on ``[::]``, and every interface has a
  link-local address) the same without the TLS port, which is IPv4 only.
  TensorFlow's own port is reachable from nowhere but its own namespace, on
  either IP family.
- service mode (``--cluster-mode service --isolate``): namespaces only. The
  aggregation servers speak mutual TLS themselves and the owners open no
  port, so there are no sidecars and no firewall to add (``tls`` is refused);
  `describe` names each task's IPv6 link-local address too, for the scans of
  `tfe-estimator attack`.

Example::

    iso = IsolatedCluster(cluster_tasks(1, evaluator=False), tls=True, mode="in-graph")
    iso.start(workdir)                      # namespaces, certificates, firewall, sidecars
    argv = iso.exec_argv(("worker", 0), ["python", "train.py"])
    ...
    iso.close()                             # sidecars stopped, namespaces deleted
"""
import os
import shutil
import signal
import subprocess
import tempfile
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

from tfe_estimator.cluster import peers
from tfe_estimator.identity import certs, keyfiles
from tfe_estimator.cluster.netns import SUBNET, PrivateNetwork, missing_capabilities
from tfe_estimator.cluster.sidecar import stunnel_config
from tfe_estimator.cluster.spec import cluster_jobs

__all__ = ["IsolatedCluster", "TLS_PORT", "TF_PORT_BASE", "CLUSTER_NAME", "STUNNEL"]

Task = Tuple[str, int]
#: Where each task's sidecar accepts mutual TLS (the same port in every namespace, as in pods).
TLS_PORT = 8443
#: Task k's TensorFlow port is TF_PORT_BASE + k (distinct: with TLS, each task's TF_CONFIG names
#: every task at localhost:<its port>, where the caller's sidecar listens for it).
TF_PORT_BASE = 7000
#: The cluster name in the certificates' DNS names.
CLUSTER_NAME = "launch"
#: The firewall command for IPv6 (from Debian's iptables package).
FIREWALL_IPV6 = "ip6tables"
#: The host number on SUBNET an outside observer (`tfe-estimator attack`) takes: 10.213.0.200.
OBSERVER_HOST = 199
#: The stunnel executable (Debian's stunnel4 package installs it as `stunnel4`).
STUNNEL = ("stunnel4", "stunnel")


#: util-linux's unshare: a task's own mount and PID namespaces (`IsolatedCluster.set_private_dirs`).
_UNSHARE = "unshare"
#: Run as PID 1 of the task's PID namespace: hides each directory before ``--`` under an empty tmpfs, runs
#: the command as its child and passes SIGTERM/SIGINT on as SIGTERM (PID 1 ignores signals it does not handle,
#: and a background child of sh ignores SIGINT); exits with the command's status.
_HIDE_AND_RUN = (
    'while [ "$1" != -- ]; do mount -t tmpfs -o size=16k,mode=000 tfe-hidden "$1" || exit 111; shift; done; '
    'shift; "$@" & child=$!; trap \'kill -TERM $child 2>/dev/null\' TERM INT; '
    'while :; do wait $child; status=$?; kill -0 $child 2>/dev/null || exit $status; done')


def _stunnel() -> Optional[str]:
    return next((path for path in map(shutil.which, STUNNEL) if path), None)


class IsolatedCluster:
    """The namespaces, addresses and (with `tls`) the sidecars and firewall of a launched cluster.

    Args:
      tasks: every task, ``(job, index)`` (`spec.cluster_tasks`).
      tls: add mutual TLS sidecars, certificates and the firewall.
      mode: the cluster mode, whose peer table (`cluster.peers`) decides who may call whom.
      link_rate: each task's link rate limit (`PrivateNetwork`), e.g. ``"1gbit"``.
    """

    def __init__(self, tasks: Sequence[Task], tls: bool, mode: str, link_rate: Optional[str] = None) -> None:
        self.tasks = list(tasks)
        self.tls = tls
        self.mode = peers.validate_mode(mode)
        if tls and self.mode == peers.SERVICE:
            raise ValueError("service mode has no sidecars: its aggregation servers speak mutual TLS themselves "
                             "and the owners open no port. Use tls=False.")
        self.network = PrivateNetwork([certs.task_name(*t) for t in self.tasks], link_rate=link_rate)
        self.tf_ports: Dict[Task, int] = {t: TF_PORT_BASE + k for k, t in enumerate(self.tasks)}
        self.cert_dir: Optional[str] = None
        self.sidecars: Dict[Task, subprocess.Popen] = {}
        self._workdir: Optional[str] = None
        self._private: Dict[Task, str] = {}

    @staticmethod
    def missing(tls: bool) -> Optional[str]:
        """What this machine lacks for `--isolate` (and `--tls`), or None."""
        missing = missing_capabilities(("iptables", "ip6tables") if tls else ())
        if tls and _stunnel() is None:
            stunnel = "stunnel4 (Debian package stunnel4; scripts/system-deps.sh installs it as root)"
            missing = f"{missing}; {stunnel}" if missing else stunnel
        return missing

    def host(self, task: Task) -> str:
        return certs.task_name(*task)

    def jobs(self) -> Dict[str, Tuple[str, ...]]:
        """job -> addresses for TF_CONFIG (the same for every task)."""
        if self.tls:
            return cluster_jobs(self.tasks, lambda job, i: f"localhost:{self.tf_ports[(job, i)]}")
        return cluster_jobs(self.tasks, lambda job, i: f"{self.network.address(self.host((job, i)))}:"
                                                       f"{self.tf_ports[(job, i)]}")

    def set_private_dirs(self, dirs: Mapping[Task, str]) -> None:
        """Each task's private directory (e.g. its TLS directory): `exec_argv` then runs a task in its own mount
        and PID namespaces, where every other task's directory is an empty tmpfs and no other task's process
        (nor its ``/proc/<pid>/root`` or ``environ``) is visible."""
        self._private = {task: os.path.abspath(path) for task, path in dirs.items()}

    def exec_argv(self, task: Task, argv: Sequence[str]) -> List[str]:
        """`argv` run in `task`'s namespace (and, with `set_private_dirs`, its own mount and PID namespaces)."""
        others = [path for other, path in self._private.items() if other != task]
        if others:
            # unshare --fork ignores SIGTERM itself: stop the task by its process group (as the launcher does).
            argv = [_UNSHARE, "--mount", "--pid", "--fork", "--kill-child=SIGTERM", "--mount-proc",
                    "--propagation", "private", "--", "sh", "-c", _HIDE_AND_RUN, "tfe-hide", *others, "--", *argv]
        return self.network.exec_argv(self.host(task), argv)

    def probe_argv(self, task: Task) -> List[str]:
        """A command that exits 0 once `task`'s TensorFlow port accepts connections (in its namespace)."""
        return self.exec_argv(task, ["bash", "-c", f"exec 3<>/dev/tcp/127.0.0.1/{self.tf_ports[task]}"])

    # ------------------------------------------------------------------ life cycle

    def start(self) -> None:
        """Creates the namespaces; with TLS also the certificates, firewall and sidecars."""
        missing = self.missing(self.tls)
        if missing:
            flags = "--isolate --tls" if self.tls else "--isolate"
            raise RuntimeError(f"{flags} needs {missing}.")
        self._workdir = tempfile.mkdtemp(prefix="tfe-estimator-isolate-")
        try:
            self.network.create()
            if self.tls:
                self._make_certs()
                for task in self.tasks:
                    self._firewall(task)
                    self._start_sidecar(task)
        except BaseException:
            self.close()
            raise

    def _make_certs(self) -> None:
        """One directory per task with the CA certificate and only that task's key and certificate; the CA's
        key stays in memory while the run's certificates are signed and is never written."""
        ca_cert, ca_key = certs.make_ca(CLUSTER_NAME)
        self.cert_dir = keyfiles.make_private_dir(os.path.join(self._workdir, "tls"))
        for job, index in self.tasks:
            own = keyfiles.make_private_dir(os.path.join(self.cert_dir, self.host((job, index))))
            key, csr = certs.make_key_and_csr(job, index, certs.task_name(job, index), CLUSTER_NAME)
            stem = os.path.join(own, certs.task_name(job, index))
            keyfiles.write_private(stem + ".key", key)
            keyfiles.write_public(stem + ".crt", certs.sign_csr(csr, ca_cert, ca_key, CLUSTER_NAME))
            keyfiles.write_public(os.path.join(own, certs.CA_CERT), ca_cert)
        del ca_key

    def _tls_addresses(self) -> Dict[Task, str]:
        return {t: f"{self.network.address(self.host(t))}:{TLS_PORT}" for t in self.tasks}

    def _firewall(self, task: Task) -> None:
        """Drops everything to `task` but loopback, its TLS port and replies to its own connections; on IPv6
        (no TLS port there: the sidecars listen on the bridge's IPv4 address) everything but loopback and replies."""
        common = [["-P", "INPUT", "DROP"],
                  ["-A", "INPUT", "-i", "lo", "-j", "ACCEPT"],
                  ["-A", "INPUT", "-m", "conntrack", "--ctstate", "ESTABLISHED,RELATED", "-j", "ACCEPT"]]
        tls_port = ["-A", "INPUT", "-p", "tcp", "--dport", str(TLS_PORT), "-j", "ACCEPT"]
        for tool, rules in (("iptables", [*common, tls_port]), (FIREWALL_IPV6, common)):
            for rule in rules:
                result = subprocess.run(self.exec_argv(task, [tool, "-w", *rule]), capture_output=True,
                                        text=True, timeout=30, check=False)
                if result.returncode != 0:
                    raise RuntimeError(f"{tool} {' '.join(rule)} in {self.host(task)}'s namespace failed: "
                                       f"{result.stderr.strip()}")

    def _start_sidecar(self, task: Task) -> None:
        config = stunnel_config(task, self.tasks, self.mode, os.path.join(self.cert_dir, self.host(task)),
                                CLUSTER_NAME, self.tf_ports, self._tls_addresses())
        path = os.path.join(self._workdir, f"{self.host(task)}.stunnel.conf")
        with open(path, "w", encoding="utf-8") as f:
            f.write(config)
        log = open(os.path.join(self._workdir, f"{self.host(task)}.stunnel.log"), "w")  # pylint: disable=consider-using-with
        self.sidecars[task] = subprocess.Popen(self.exec_argv(task, [_stunnel(), path]), stdout=log,
                                               stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                               start_new_session=True)
        log.close()

    def describe(self) -> Dict:
        """Every namespace, address and port (and, with TLS, each task's certificate directory):
        what `tfe-estimator attack` and a packet capture need to find the cluster."""
        return {
            "hub": self.network.hub, "cluster": CLUSTER_NAME, "mode": self.mode, "tls": self.tls,
            "observer_address": str(list(SUBNET.hosts())[OBSERVER_HOST]),
            "tasks": [{"name": self.host(t), "job": t[0], "index": t[1],
                       "namespace": self.network.namespace(self.host(t)),
                       "address": self.network.address(self.host(t)), "tf_port": self.tf_ports[t],
                       "ipv6_link_local": self.network.link_local(self.host(t)),
                       "hub_port": self.network.port(self.host(t)),
                       "tls_port": TLS_PORT if self.tls else None,
                       "cert_dir": os.path.join(self.cert_dir, self.host(t)) if self.tls else None}
                      for t in self.tasks],
        }

    def sidecar_log(self, task: Task) -> str:
        """The sidecar's log so far (for a failing run's diagnosis)."""
        with open(os.path.join(self._workdir, f"{self.host(task)}.stunnel.log"), encoding="utf-8",
                  errors="replace") as f:
            return f.read()

    def close(self) -> None:
        """Stops the sidecars, deletes the namespaces (and their rules) and the certificates."""
        for process in self.sidecars.values():
            if process.poll() is None:
                try:
                    os.killpg(process.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        for process in self.sidecars.values():
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait(timeout=10)
        self.sidecars = {}
        try:
            self.network.close()
        finally:
            if self._workdir:
                shutil.rmtree(self._workdir, ignore_errors=True)
                self._workdir = None
