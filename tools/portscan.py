"""A TCP connect scan of every port of one address, IPv4 or IPv6 (link-local too), for `tfe-estimator attack`.

An outsider on the cluster's bridge does not know which port a task might
have left open, so `tools.attack` asks every one: a non-blocking ``connect``
per port, many at once, each ending in an answer (connected: the port is
open; refused: closed) or in silence (dropped by a firewall: unanswered).
Only the machine's own kernel is involved; nothing is sent past the bridge
the caller stands on.

Example::

    scan = scan_tcp("fe80::1c2e:4ff:fe5a:1%eth0")
    print(scan.open, scan.refused, scan.unanswered)     # [] 65535 0
"""
import errno
import resource
import select
import socket
import time
from typing import Dict, Iterable, List, NamedTuple, Optional, Tuple, Union

__all__ = ["Scan", "scan_tcp", "ALL_PORTS", "ZONE", "link_local_host", "task_hosts", "target"]

#: Every TCP port.
ALL_PORTS = range(1, 65536)
#: The interface of every namespace of `launch --isolate` and of the attack's own: a link-local address's zone.
ZONE = "eth0"
_BATCH = 2048


class Scan(NamedTuple):
    """What every port of `host` answered."""
    host: str
    open: List[int]
    refused: int
    unanswered: int

    def describe(self) -> str:
        tried = len(self.open) + self.refused + self.unanswered
        return (f"{tried} ports tried: {len(self.open)} open {self.open[:20]}, {self.refused} refused, "
                f"{self.unanswered} unanswered")


def link_local_host(task: Dict) -> Optional[str]:
    """`task`'s IPv6 link-local address with its zone (``fe80::…%eth0``), from a network file's task entry
    (`IsolatedCluster.describe`); None when it has none."""
    return f"{task['ipv6_link_local']}%{ZONE}" if task.get("ipv6_link_local") else None


def task_hosts(task: Dict) -> List[str]:
    """Every address of `task` an outsider on the bridge can try: its IPv4 address, then its IPv6 link-local one."""
    return [task["address"]] + [host for host in (link_local_host(task),) if host]


def target(host: str, port: Union[int, str]) -> str:
    """``host:port``, with an IPv6 host in brackets."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _sockaddr(host: str) -> Tuple[int, tuple]:
    """(family, address without port) of `host`; an IPv6 link-local address needs its zone (``%eth0``)."""
    family, _, _, _, sockaddr = socket.getaddrinfo(host, 1, proto=socket.IPPROTO_TCP)[0]
    return family, sockaddr


def scan_tcp(host: str, ports: Iterable[int] = ALL_PORTS, timeout: float = 2.0) -> Scan:
    """Tries a TCP connection to every port of `ports` on `host`, `_BATCH` at a time.

    Args:
      host: an IPv4 or IPv6 address (a link-local one with its zone, ``fe80::…%eth0``).
      timeout: how long a batch waits for its last answers; ports still silent count as unanswered.
    """
    family, base = _sockaddr(host)
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    batch = max(16, min(_BATCH, soft - 64))
    found, refused, unanswered = [], 0, 0
    ports = list(ports)
    for start in range(0, len(ports), batch):
        o, r, u = _scan_batch(family, base, ports[start:start + batch], timeout)
        found += o
        refused += r
        unanswered += u
    return Scan(host, sorted(found), refused, unanswered)


def _scan_batch(family: int, base: tuple, ports: List[int], timeout: float) -> Tuple[List[int], int, int]:
    poller = select.epoll()
    pending = {}
    found, refused = [], 0
    try:
        for port in ports:
            sock = socket.socket(family, socket.SOCK_STREAM)
            sock.setblocking(False)
            code = sock.connect_ex((base[0], port, *base[2:]))
            if code == 0:
                found.append(port)
                sock.close()
            elif code == errno.EINPROGRESS:
                pending[sock.fileno()] = (sock, port)
                poller.register(sock.fileno(), select.EPOLLOUT | select.EPOLLERR | select.EPOLLHUP)
            else:
                sock.close()
                if code != errno.ECONNREFUSED:  # no route, no source port left...: not an answer of the host
                    raise OSError(code, f"cannot scan port {port} of {base[0]}: {errno.errorcode.get(code, code)}")
                refused += 1
        deadline = time.monotonic() + timeout
        while pending and time.monotonic() < deadline:
            for fd, _ in poller.poll(max(0.0, deadline - time.monotonic())):
                sock, port = pending.pop(fd)
                poller.unregister(fd)
                code = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
                sock.close()
                if code == 0:
                    found.append(port)
                elif code == errno.ECONNREFUSED:
                    refused += 1
                else:
                    raise OSError(code, f"cannot scan port {port} of {base[0]}: {errno.errorcode.get(code, code)}")
        unanswered = len(pending)
    finally:
        for sock, _ in pending.values():
            sock.close()
        poller.close()
    return found, refused, unanswered
