"""A private network of Linux network namespaces: one per task, joined by a bridge.

`tfe-estimator launch --isolate` runs every task of a cluster in its own
network namespace, as separate hosts (or pods) would be: each task sees only
its own loopback and one interface ``eth0`` with its own address on a private
subnet. The bridge that joins them lives in a namespace of its own (the
"hub"), so nothing of the private network touches the machine's own
namespace: no route leads out, and no address of it is reachable from
outside. Namespace names carry a per-run id, so two runs never collide, and
`close` removes every namespace (and with them every link and firewall rule
inside) even after an error.

Needs root (``CAP_NET_ADMIN``) and iproute2's ``ip``; `missing_capabilities`
says what is missing.

Example::

    with PrivateNetwork(["chief-0", "worker-0", "tfe-0"]) as net:
        subprocess.run(net.exec_argv("chief-0", ["ip", "addr"]), check=True)
        print(net.address("worker-0"))          # 10.213.0.3
"""
import ipaddress
import itertools
import os
import shutil
import subprocess
import time
from typing import Dict, List, Optional, Sequence

__all__ = ["PrivateNetwork", "missing_capabilities", "join_network", "link_local_address", "SUBNET", "HUB_BRIDGE"]

#: The private subnet inside the namespaces (never routed: the hub has no link out).
SUBNET = ipaddress.ip_network("10.213.0.0/24")
_COUNTER = itertools.count()
_HUB = "hub"
#: The bridge's name inside the hub namespace.
HUB_BRIDGE = "br0"


def missing_capabilities(tools: Sequence[str] = ("ip",)) -> Optional[str]:
    """Why this process cannot build a private network, or None if it can.

    Args:
      tools: commands that must be on PATH besides ``ip`` (e.g. ``iptables``, ``stunnel4``).
    """
    missing = []
    if os.geteuid() != 0:
        missing.append("root (network namespaces need CAP_NET_ADMIN: run as root, e.g. in CI)")
    for tool in dict.fromkeys(("ip", *tools)):
        if shutil.which(tool) is None:
            package = {"ip": "iproute2", "stunnel4": "stunnel4", "iptables": "iptables",
                       "ip6tables": "iptables"}.get(tool, tool)
            missing.append(f"{tool} (Debian package {package}; scripts/system-deps.sh installs it as root)")
    return "; ".join(missing) if missing else None


def join_network(hub: str, namespace: str, address: str, port_name: str) -> None:
    """Creates `namespace` with one interface ``eth0`` at `address` on the bridge of namespace `hub`.

    Args:
      hub: the hub namespace of a `PrivateNetwork` (``PrivateNetwork.hub``).
      namespace: the new namespace's name (delete it with ``ip netns del``).
      address: a free address of `SUBNET`.
      port_name: the bridge port's name in the hub (unique there, at most 15 characters).
    """
    _ip("netns", "add", namespace)
    try:
        _ip("-n", namespace, "link", "set", "lo", "up")
        _ip("-n", hub, "link", "add", port_name, "type", "veth", "peer", "name", "eth0", "netns", namespace)
        _ip("-n", hub, "link", "set", port_name, "master", HUB_BRIDGE, "up")
        _ip("-n", namespace, "addr", "add", f"{address}/{SUBNET.prefixlen}", "dev", "eth0")
        _ip("-n", namespace, "link", "set", "eth0", "up")
    except BaseException:
        subprocess.run(["ip", "netns", "del", namespace], capture_output=True, check=False)
        raise


def link_local_address(namespace: str, device: str = "eth0", timeout: float = 10.0) -> Optional[str]:
    """The IPv6 link-local address (``fe80::…``) of `device` in `namespace` once usable; None if IPv6 is off there.

    The kernel gives every interface one as soon as it is up, whatever
    `SUBNET` says: a second way in that an IPv4-only view of the network
    misses. It is tentative (neither reachable nor usable as a source) until
    duplicate address detection ends, so this waits up to `timeout` s for that.
    """
    switch = subprocess.run(["ip", "netns", "exec", namespace, "cat", f"/proc/sys/net/ipv6/conf/{device}/disable_ipv6"],
                            capture_output=True, text=True, timeout=30, check=False)
    if switch.returncode != 0 or switch.stdout.strip() == "1":
        return None
    deadline = time.monotonic() + timeout
    while True:
        result = subprocess.run(["ip", "-n", namespace, "-6", "-o", "addr", "show", "dev", device, "scope", "link"],
                                capture_output=True, text=True, timeout=30, check=False)
        for line in result.stdout.splitlines():
            fields = line.split()
            if "inet6" in fields and "tentative" not in fields:
                return fields[fields.index("inet6") + 1].split("/")[0]
        if time.monotonic() > deadline:
            raise RuntimeError(f"{device} in {namespace} has no usable IPv6 link-local address after {timeout} s: "
                               f"{result.stdout.strip() or result.stderr.strip() or 'none'} (is IPv6 disabled?)")
        time.sleep(0.1)


def _tc(namespace: str, device: str, rate: str) -> None:
    """Limits `device`'s sending rate to `rate` (a token bucket; this kernel may lack netem for delay)."""
    argv = ["ip", "netns", "exec", namespace, "tc", "qdisc", "add", "dev", device, "root", "tbf", "rate", rate,
            "burst", "256kb", "latency", "50ms"]
    result = subprocess.run(argv, capture_output=True, text=True, timeout=30, check=False)
    if result.returncode != 0:
        raise RuntimeError(f"`{' '.join(argv)}` failed: {result.stderr.strip()} (link_rate={rate!r}: use tc's "
                           "notation, e.g. '1gbit' or '100mbit')")


def _ip(*args: str) -> None:
    result = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30, check=False)
    if result.returncode != 0:
        raise RuntimeError(f"`ip {' '.join(args)}` failed: {result.stderr.strip() or result.stdout.strip()}")


class PrivateNetwork:
    """Namespaces named by `hosts`, each with an address on `SUBNET`, joined by a bridge.

    Args:
      hosts: one name per namespace (e.g. ``"worker-0"``); letters, digits and '-'.
      run_id: distinguishes this network's namespaces from any other run's
        (default: this process's pid and a counter).
      link_rate: if set (tc's notation, e.g. ``"1gbit"``), every host's link sends at most this
        rate (a token bucket, ``tc qdisc ... tbf``), as a network between hosts would.

    Raises:
      RuntimeError: naming what is missing (see `missing_capabilities`) or the
        ``ip`` command that failed; nothing is left behind.
    """

    def __init__(self, hosts: Sequence[str], run_id: Optional[str] = None, link_rate: Optional[str] = None) -> None:
        hosts = list(hosts)
        if len(set(hosts)) != len(hosts) or not hosts:
            raise ValueError(f"hosts must be distinct names, got {hosts!r}.")
        if len(hosts) > SUBNET.num_addresses - 3:
            raise ValueError(f"{len(hosts)} hosts do not fit {SUBNET}.")
        self.run_id = run_id or f"{os.getpid()}-{next(_COUNTER)}"
        self.hosts = hosts
        addresses = list(SUBNET.hosts())[1:]  # .1 stays free (no gateway: nothing is routed)
        self._addresses: Dict[str, str] = {h: str(a) for h, a in zip(hosts, addresses)}
        self._created: List[str] = []
        self.link_rate = link_rate

    # ------------------------------------------------------------------ names

    def namespace(self, host: str) -> str:
        """The network namespace of `host` (``tfe-<run id>-<host>``)."""
        if host != _HUB and host not in self._addresses:
            raise KeyError(f"{host!r} is not a host of this network: {self.hosts}")
        return f"tfe-{self.run_id}-{host}"

    def address(self, host: str) -> str:
        """`host`'s address on the private subnet."""
        if host not in self._addresses:
            raise KeyError(f"{host!r} is not a host of this network: {self.hosts}")
        return self._addresses[host]

    def link_local(self, host: str, timeout: float = 10.0) -> Optional[str]:
        """`host`'s IPv6 link-local address on its ``eth0`` once usable (`link_local_address`)."""
        return link_local_address(self.namespace(host), timeout=timeout)

    def port(self, host: str) -> str:
        """`host`'s link on the hub's bridge (where a capture of that host's traffic listens)."""
        return f"h{self.hosts.index(host)}"

    @property
    def hub(self) -> str:
        """The namespace that holds the bridge."""
        return self.namespace(_HUB)

    def exec_argv(self, host: str, argv: Sequence[str]) -> List[str]:
        """`argv` run inside `host`'s namespace (``ip netns exec``)."""
        return ["ip", "netns", "exec", self.namespace(host), *argv]

    def add_host(self, host: str) -> str:
        """Adds one more namespace on the bridge (e.g. an outside observer); returns its address."""
        if host in self._addresses:
            raise ValueError(f"{host!r} is already a host of this network.")
        self.hosts.append(host)
        self._addresses[host] = str(list(SUBNET.hosts())[len(self.hosts)])
        if self._created:  # the hub exists: join it now
            self._attach(host)
        return self._addresses[host]

    # ------------------------------------------------------------------ life cycle

    def create(self) -> "PrivateNetwork":
        """Creates the hub with its bridge and every host's namespace on it."""
        missing = missing_capabilities()
        if missing:
            raise RuntimeError(f"cannot build a private network of namespaces: missing {missing}.")
        try:
            hub = self.hub
            _ip("netns", "add", hub)
            self._created.append(hub)
            _ip("-n", hub, "link", "add", HUB_BRIDGE, "type", "bridge")
            _ip("-n", hub, "link", "set", HUB_BRIDGE, "up")
            for host in self.hosts:
                self._attach(host)
        except BaseException:
            self.close()
            raise
        return self

    def _attach(self, host: str) -> None:
        join_network(self.hub, self.namespace(host), self._addresses[host], self.port(host))
        self._created.append(self.namespace(host))
        if self.link_rate:  # both directions: the host's side and its port on the bridge
            for namespace, device in ((self.namespace(host), "eth0"), (self.hub, self.port(host))):
                _tc(namespace, device, self.link_rate)

    def close(self) -> None:
        """Deletes every namespace this network created (links and rules go with them).

        Stop the processes inside first: a namespace outlives its name while a
        process still runs in it.
        """
        errors = []
        for name in reversed(self._created):
            result = subprocess.run(["ip", "netns", "del", name], capture_output=True, text=True, check=False)
            if result.returncode != 0 and "No such file" not in result.stderr:
                errors.append(f"{name}: {result.stderr.strip()}")
        self._created = []
        if errors:
            raise RuntimeError(f"could not delete network namespaces: {errors}")

    def __enter__(self) -> "PrivateNetwork":
        return self.create()

    def __exit__(self, *exc) -> None:
        self.close()
