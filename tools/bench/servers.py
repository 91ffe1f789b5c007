"""The benches' two aggregation server processes on loopback, with mutual TLS and, as users run them, data planes.

Each server is its own Python process (`AggregationServer`, no TensorFlow); server1 starts first (server0
connects to it). With ``data_plane=True`` (as ``tfe-estimator server --data-port`` and the bench's service cases)
each serves its data plane on a free port and the owners' `OwnerClient` and server0 put on it; without, the
shares come on gRPC and server1 warns that it has no data port.

Example::

    servers = start(certs_dir, addresses, ["chief:0", "worker:0"])
    try:
        ...  # OwnerClient(addresses, ...).contribute(...)
    finally:
        stop(servers)
"""
import subprocess
import sys
from typing import Dict, Mapping, Optional, Sequence

__all__ = ["start", "stop"]

_SERVER = """
import sys
from tfe_estimator.service import AggregationServer, TlsFiles
role, certs, addresses, owners = int(sys.argv[1]), sys.argv[2], sys.argv[3].split(","), sys.argv[4].split(",")
server = AggregationServer(role, addresses[role], owners, TlsFiles.from_dir(certs, "tfe", role),
                           peer_address=sys.argv[5] if role == 0 else None,
                           data_address=sys.argv[6] if sys.argv[6] != "-" else None)
server.start()
print("up", flush=True)
server.wait()
"""


def start(certs_dir: str, addresses: Sequence[str], owners: Sequence[str], peer_address: Optional[str] = None,
          data_plane: bool = True, env: Optional[Mapping[str, str]] = None) -> Dict[int, subprocess.Popen]:
    """Starts server1, then server0, at ``addresses`` (``(server0, server1)``) for `owners` (``"job:index"``);
    returns ``{role: process}`` once both serve. `peer_address`: where server0 reaches server1 (default
    ``addresses[1]``; e.g. a relay's port); `env`: the servers' environment (default this process's).

    Raises:
      RuntimeError: a server did not start (the ones started are stopped).
    """
    servers: Dict[int, subprocess.Popen] = {}
    try:
        for role in (1, 0):  # server1 first: server0 connects to it
            servers[role] = subprocess.Popen(  # pylint: disable=consider-using-with
                [sys.executable, "-c", _SERVER, str(role), certs_dir, ",".join(addresses), ",".join(owners),
                 peer_address or addresses[1], "localhost:0" if data_plane else "-"],
                stdout=subprocess.PIPE, text=True, env=dict(env) if env is not None else None)
            if servers[role].stdout.readline().strip() != "up":
                raise RuntimeError(f"aggregation server{role} did not start (its stderr above)")
    except BaseException:
        stop(servers)
        raise
    return servers


def stop(servers: Dict[int, subprocess.Popen]) -> None:
    """Terminates `servers` (`start`'s) and waits for each."""
    for server in servers.values():
        server.terminate()
    for server in servers.values():
        server.wait(timeout=30)
        if server.stdout is not None:
            server.stdout.close()
