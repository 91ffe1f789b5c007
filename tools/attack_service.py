"""Service-mode attacks of `tfe-estimator attack`: what one organisation holding a valid certificate tries.

Against a cluster started with ``tfe-estimator launch --cluster-mode service
--network-file NET.json`` (the file names TF_CONFIG's addresses and the run's
certificate directory; `tools.attack` dispatches here when its ``mode`` is
``"service"``), with the first owner's VALID certificate (the attacker) and
the second owner as the victim, against each aggregation server:

- ``put-as-other-owner``: a first Contribute to a fresh channel, then a
  second one for the same step from the same certificate whose metadata claims
  the victim's identity: must be refused ALREADY_EXISTS while the first one
  still waits (the victim's slot was not filled);
- ``get-other-result``: there is no method that returns another owner's
  result: a made-up ``GetResult`` must end UNIMPLEMENTED;
- ``tf-runtime``: TensorFlow's RPCs (run an op, reset, clean up) must end
  UNIMPLEMENTED: the service is not TensorFlow's runtime;
- ``forward-as-owner``: ForwardBlinded (server0's call to server1) as an
  owner: PERMISSION_DENIED;
- ``handshake-on-server1``: Handshake is server0's: UNIMPLEMENTED on server1;
- ``non-owner-cert``: a certificate of the run's own CA for ``tfe-2``, a task
  with no role (as tfe:2 of the TensorFlow-runtime modes): Contribute,
  Handshake and Rewind PERMISSION_DENIED;
- ``no-cert`` / ``foreign-ca`` / ``plaintext``: TLS without a client
  certificate, with the attacker's name issued by another CA, and plaintext
  HTTP/2: the server must never answer with HTTP/2 SETTINGS;

and on each server's data plane (its port is what the server announces to
the attacker's ``DataPlane`` call, as to every owner; a server without one
announces 0 and is not attacked there), in frames of
`tfe_estimator.service.frames` over Python's `ssl`:

- ``forward-as-owner``: ForwardBlinded with the attacker's valid
  certificate: a PERMISSION_DENIED reply frame (this is also the data plane's
  control: a valid certificate is read and answered there);
- ``non-owner-cert``: Contribute with the ``tfe-2`` certificate: refused by
  TLS or answered PERMISSION_DENIED / UNAUTHENTICATED;
- ``no-cert`` / ``foreign-ca`` / ``plaintext``: a Contribute frame through TLS
  without a client certificate, with the foreign CA's, and in the clear: the
  connection must end without any reply frame (a connection still open after
  the timeout counts as taken);

and ``owner-port``: a TCP connection to every owner's (and the evaluator's)
TF_CONFIG port on 127.0.0.1 and ::1 must be refused: nothing listens there.
On a cluster of ``launch --isolate`` (the network file has ``isolation``),
`isolated_scans` replaces that: every TCP port of every owner on its bridge
address and its IPv6 link-local address must be refused (``owner-port``),
every port of a server but its service port and its data port
(``server-ports``), and the TLS probes (of both ports) run against each
server's IPv6 address as well.
A ``control`` line per server (the attacker's valid certificate gets HTTP/2
SETTINGS back) proves the TLS probe itself works.

Owner Rewind on either server is not attacked: it is allowed by design
(`aggregation.proto`) and touches only the caller's own state, so running it
against a cluster in training would only rewind the attacker. Needs no root.

Example::

    $ tfe-estimator launch --cluster-mode service --workers 1 --network-file /tmp/net.json -- python train.py &
    $ python -m tools.attack --network /tmp/net.json
    [attack] chief:0 -> tfe:0 put-as-other-owner 127.0.0.1:41231: refused (ALREADY_EXISTS: ...)
    ...
"""
import os
import shutil
import socket
import ssl
import tempfile
import time
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

import grpc

from tfe_estimator.cluster import certs
from tfe_estimator.service import frames, ring, wire
from tfe_estimator.service.tls import FEDERATION_FILE, TlsFiles, server_name_option
from tools.portscan import link_local_host, scan_tcp, target, task_hosts

__all__ = ["service_attacks", "isolated_scans", "OWNER_JOBS", "NON_OWNER"]

OWNER_JOBS = ("chief", "worker")
#: The identity the non-owner certificate is made for (signed by the run's own CA).
NON_OWNER = ("tfe", 2)
_TIMEOUT = 3.0
#: How long the attacker's first put must still be waiting after the second one was answered.
_STILL_WAITING = 0.5
_TF_METHODS = ("/tensorflow.WorkerService/RunGraph", "/tensorflow.WorkerService/RecvTensor",
               "/tensorflow.WorkerService/CleanupAll", "/tensorflow.MasterService/Reset",
               "/tensorflow.eager.EagerService/Enqueue")


def _result(origin: str, to: str, attack: str, target: str, ok: bool, detail: str, control: bool = False):
    """One attempt; `ok`: it went the way it must (an attack refused, a `control` accepted)."""
    return {"from": origin, "to": to, "attack": attack, "target": target, "ok": bool(ok), "detail": detail,
            "control": control}


def _host_port(address: str) -> Tuple[str, int]:
    host, port = address.rsplit(":", 1)
    return host.strip("[]"), int(port)


class _Caller:
    """Raw calls to one aggregation server with one identity's credentials (the server's name pinned)."""

    def __init__(self, address: str, server: int, tls: TlsFiles):
        self.address = address
        self._channel = grpc.secure_channel(address, tls.channel_credentials(server),
                                            options=[server_name_option(tls, server)])

    def stub(self, path: str):
        return self._channel.unary_unary(path)  # bytes in, bytes out: any method name

    def expect(self, path: str, request: bytes, refusals, metadata=None) -> Tuple[bool, str]:
        """(refused with one of `refusals`, what happened)."""
        try:
            self.stub(path)(request, timeout=_TIMEOUT, metadata=metadata, wait_for_ready=False)
        except grpc.RpcError as e:
            return e.code() in refusals, f"{e.code().name}: {(e.details() or '').splitlines()[0][:140]}"
        return False, "answered OK"

    def close(self):
        self._channel.close()


def _contribute_request(channel: str, server: int) -> bytes:
    payload = bytes(ring.KEY_BYTES) if server == 0 else bytes(8 * ring.ring_words(1, 64))
    return wire.messages()["ContributeRequest"](channel=channel, step=0, ring_bits=64, num_elements=1,
                                                payload=payload).SerializeToString()


def _put_as_other_owner(caller: _Caller, server: int, victim: str) -> Tuple[bool, str]:
    """A first put waits for the step; a second one for the same step, claiming `victim`, must be ALREADY_EXISTS."""
    stub = caller.stub(wire.method_path("Contribute"))
    request = _contribute_request(f"attack-{os.getpid()}-{time.time_ns()}-{server}", server)
    first = stub.future(request, timeout=10 * _TIMEOUT, wait_for_ready=False)
    try:
        deadline = time.monotonic() + _STILL_WAITING
        while not first.done() and time.monotonic() < deadline:
            time.sleep(0.05)
        if first.done():
            return False, f"the first put did not wait for the other owners: {_outcome(first)}"
        victim_job, victim_index = victim.split(":")
        victim_cn = certs.task_name(victim_job, int(victim_index))
        claims = [("tfe-identity", victim), ("x-tfe-owner", victim), ("x-ssl-client-cn", victim_cn)]
        try:
            stub(request, timeout=_TIMEOUT, metadata=claims, wait_for_ready=False)
            return False, f"a second contribution claiming {victim} was accepted and its step released"
        except grpc.RpcError as e:
            if e.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                return False, f"a second contribution claiming {victim} was taken (it waited for the step)"
            detail = f"{e.code().name}: {(e.details() or '').splitlines()[0][:140]}"
            if e.code() != grpc.StatusCode.ALREADY_EXISTS:
                return False, detail
        time.sleep(_STILL_WAITING)
        if first.done():
            return False, f"{detail}; but the first put ended: the victim's slot was filled ({_outcome(first)})"
        return True, f"{detail}; the first put still waits for {victim}"
    finally:
        first.cancel()


def _outcome(future) -> str:
    try:
        future.result(timeout=0)
        return "OK"
    except grpc.RpcError as e:
        return f"{e.code().name}: {(e.details() or '')[:140]}"
    except Exception as e:  # pylint: disable=broad-except
        return f"{type(e).__name__}: {e}"


def _mint(ca_dir: str, job: str, index: int, cluster: str, into: str, foreign: bool = False) -> TlsFiles:
    """A key and certificate for `job`-`index` of `cluster`: from the run's CA, or from a new `foreign` one."""
    if foreign or not os.path.isfile(os.path.join(ca_dir, certs.CA_KEY)):  # no CA key to read: mint with one's own
        ca_cert, ca_key = certs.make_ca(cluster)
    else:
        with open(os.path.join(ca_dir, certs.CA_CERT), "rb") as f:
            ca_cert = f.read()
        with open(os.path.join(ca_dir, certs.CA_KEY), "rb") as f:
            ca_key = f.read()
    key, csr = certs.make_key_and_csr(job, index, "intruder", cluster)
    stem = os.path.join(into, certs.task_name(job, index))
    for path, data in ((os.path.join(into, certs.CA_CERT), ca_cert), (stem + ".crt", certs.sign_csr(
            csr, ca_cert, ca_key, cluster)), (stem + ".key", key)):
        with open(path, "wb") as f:
            f.write(data)
    trust = os.path.join(ca_dir, FEDERATION_FILE)
    if not foreign and os.path.isfile(trust):  # the run's public trust: the minted identity reaches the real servers
        shutil.copy(trust, into)
    return TlsFiles.from_dir(into, job, index)


def service_attacks(network: Dict, attacker: Optional[str] = None) -> List[Dict]:
    """Every service-mode attempt against the cluster `network` describes (see the module's docstring)."""
    from tools.attack import _grpc_answers, _tcp  # pylint: disable=import-outside-toplevel

    jobs, cert_dir = network["jobs"], network["cert_dir"]
    servers = list(jobs["tfe"])
    owners = [f"{job}:{index}" for job in OWNER_JOBS for index in range(len(jobs.get(job, ())))]
    attacker = attacker or owners[0]
    if attacker not in owners:
        raise ValueError(f"--as {attacker!r} is not an owner of this cluster: use one of {owners}.")
    victims = [o for o in owners if o != attacker]
    job, index = attacker.split(":")
    cert_dir = network.get("cert_dirs", {}).get(attacker, cert_dir)  # the launcher: each task its own directory
    mine = TlsFiles.from_dir(cert_dir, job, int(index))
    cluster = mine.cluster()
    scratch = tempfile.mkdtemp(prefix="tfe-attack-")
    os.makedirs(os.path.join(scratch, "foreign"))
    try:
        non_owner = _mint(cert_dir, *NON_OWNER, cluster, scratch)
        foreign = _mint(cert_dir, job, int(index), cluster, os.path.join(scratch, "foreign"), foreign=True)
        results, data_ports = [], {}
        for k, address in enumerate(servers):
            results += _attack_server(k, address, attacker, victims, mine, non_owner, foreign, _grpc_answers)
            data_ports[k], asked = _data_port(address, k, mine)
            hosts = [_host_port(address)[0]]
            for task in network.get("isolation", {}).get("tasks", ()):
                if (task["job"], task["index"]) == ("tfe", k) and link_local_host(task):
                    results += _tls_probes(f"tfe:{k}", attacker, link_local_host(task), _host_port(address)[1],
                                           mine, foreign, _grpc_answers)
                    hosts.append(link_local_host(task))
            if asked is not None:  # the DataPlane call itself failed: say so (the scans would miss the port)
                results.append(_result(attacker, f"tfe:{k}", "data-port", address, False, asked, control=True))
            for host in hosts if data_ports[k] else ():
                results += _data_plane_probes(f"tfe:{k}", attacker, host, data_ports[k], mine, non_owner, foreign)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    if network.get("isolation"):  # on the bridge: every port of every task, on IPv4 and IPv6
        return results + isolated_scans(network["isolation"], "outside", data_ports)
    for owner_job in OWNER_JOBS + ("evaluator",):
        for owner_index, address in enumerate(jobs.get(owner_job, ())):
            port = _host_port(address)[1]
            for host in ("127.0.0.1", "::1"):
                connected, detail = _tcp(host, port)
                results.append(_result(attacker, f"{owner_job}:{owner_index}", "owner-port", target(host, port),
                                       not connected, detail))
    return results


def _attack_server(k: int, address: str, attacker: str, victims: Sequence[str], mine: TlsFiles,
                   non_owner: TlsFiles, foreign: TlsFiles, grpc_answers) -> List[Dict]:
    to, results = f"tfe:{k}", []
    denied, unimplemented = {grpc.StatusCode.PERMISSION_DENIED}, {grpc.StatusCode.UNIMPLEMENTED}
    messages = wire.messages()
    caller, outsider = _Caller(address, k, mine), _Caller(address, k, non_owner)
    try:
        if victims:
            results.append(_result(attacker, to, "put-as-other-owner", address,
                                   *_put_as_other_owner(caller, k, victims[0])))
        get = f"/{wire.SERVICE_NAME}/GetResult"
        request = messages["ContributeRequest"](channel="grads", step=0).SerializeToString()
        results.append(_result(attacker, to, "get-other-result", get, *caller.expect(get, request, unimplemented)))
        for path in _TF_METHODS:
            results.append(_result(attacker, to, "tf-runtime", path, *caller.expect(path, b"", unimplemented)))
        forward = messages["ForwardRequest"](channel=f"attack-forward-{os.getpid()}", step=0, ring_bits=64,
                                             num_elements=1, payload=bytes(8)).SerializeToString()
        path = wire.method_path("ForwardBlinded")
        results.append(_result(attacker, to, "forward-as-owner", path, *caller.expect(path, forward, denied)))
        if k == 1:
            path = wire.method_path("Handshake")
            handshake = messages["HandshakeRequest"](step=0, descriptor=[1]).SerializeToString()
            results.append(_result(attacker, to, "handshake-on-server1", path,
                                   *caller.expect(path, handshake, unimplemented)))
        who = ":".join(map(str, NON_OWNER))
        for method, request in (("Contribute", _contribute_request(f"attack-{os.getpid()}-{k}", k)),
                                ("Handshake", messages["HandshakeRequest"](step=0, descriptor=[1]).SerializeToString()),
                                ("Rewind", messages["RewindRequest"](step=0).SerializeToString())):
            path = wire.method_path(method)
            # A certificate for a non-owner from the run's CA (one-lab certificates), else from a CA of the
            # attacker's own making (no CA key is readable): refused by the membership check or by TLS.
            refused = denied | {grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.UNAVAILABLE}
            results.append(_result(who, to, "non-owner-cert", path, *outsider.expect(path, request, refused)))
    finally:
        caller.close()
        outsider.close()
    return results + _tls_probes(to, attacker, *_host_port(address), mine, foreign, grpc_answers)


def _tls_probes(to: str, attacker: str, host: str, port: int, mine: TlsFiles, foreign: TlsFiles,
                grpc_answers) -> List[Dict]:
    """The server's port at `host`: HTTP/2 answers through TLS with the attacker's valid certificate (the
    control), never without a certificate, with a foreign CA's, or in plaintext."""
    where = target(host, port)
    with tempfile.TemporaryDirectory(prefix="tfe-attack-ca-") as scratch:
        ca = os.path.join(scratch, "server-ca.crt")  # the server's operator's CA (mine.ca may be a federation file)
        with open(ca, "wb") as f:
            f.write(mine.trust().server_ca_pem(int(to.split(":")[1])))
        answered, detail = grpc_answers(host, port, tls=(mine.cert, mine.key), ca=ca)
        results = [_result(attacker, to, "valid-cert", where, answered, detail, control=True)]
        for attack, tls in (("no-cert", (None, None)), ("foreign-ca", (foreign.cert, foreign.key)),
                            ("plaintext", None)):
            answered, detail = grpc_answers(host, port, tls=tls, ca=ca)
            results.append(_result("outside", to, attack, where, not answered, detail))
    return results


def _data_port(address: str, server: int, tls: TlsFiles) -> Tuple[int, Optional[str]]:
    """``(port, None)``: the data port server `server` announces to `tls`'s identity (0: none; UNIMPLEMENTED: a
    server older than the call), or ``(0, why the call failed)``."""
    caller = _Caller(address, server, tls)
    try:
        reply = caller.stub(wire.method_path("DataPlane"))(
            wire.messages()["DataPlaneRequest"]().SerializeToString(), timeout=_TIMEOUT, wait_for_ready=False)
        return wire.messages()["DataPlaneReply"].FromString(reply).port, None
    except grpc.RpcError as e:
        if e.code() == grpc.StatusCode.UNIMPLEMENTED:
            return 0, None
        return 0, f"the DataPlane call failed: {e.code().name}: {(e.details() or '')[:140]}"
    finally:
        caller.close()


def _data_plane_call(host: str, port: int, server: int, method: str, request, payload: bytes,
                     tls: Optional[Tuple[Optional[str], Optional[str]]], ca: str):
    """One frame to the data plane at `host`:`port`: ``(grpc.StatusCode of its reply, or "closed" (TLS or the
    server ended the connection without a reply) or "open" (no reply within the timeout), what happened)``.

    `tls`: None for plaintext, else ``(cert, key)`` (``(None, None)``: no client certificate); `ca` is server
    `server`'s operator's CA (the server's certificate is checked, its name is not: the attack is the client's)."""
    try:
        raw = socket.create_connection((host, port), timeout=_TIMEOUT)
    except OSError as e:
        return "closed", f"data plane: no connection: {e.strerror or e}"
    conn = raw
    try:
        if tls is not None:
            context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
            context.load_verify_locations(ca)
            context.check_hostname = False
            if tls[0]:
                context.load_cert_chain(*tls)
            try:
                conn = context.wrap_socket(raw)
            except (ssl.SSLError, OSError) as e:
                return "closed", f"data plane: TLS refused: {e}"
        head = request.SerializeToString()
        try:
            conn.sendall(frames.request_header(method, len(head), 0, len(payload)) + head + payload)
            header = frames.read_exact(conn, frames.REPLY.size)
            if header is None:
                return "closed", "data plane: the server closed the connection without a reply"
            code, _, length = frames.parse_reply(header)
            message = frames.read_exact(conn, min(length, 4096)) or b""
        except socket.timeout:
            return "open", f"data plane: no reply within {_TIMEOUT:g} s, the connection still open: the call was taken"
        except (ssl.SSLError, OSError, ConnectionError) as e:
            return "closed", f"data plane: the connection ended without a reply: {e}"
        text = message.decode("utf-8", "replace").splitlines()[0][:140] if message else ""
        return code, f"data plane: {code.name}: {text}"
    finally:
        conn.close()


def _data_plane_probes(to: str, attacker: str, host: str, port: int, mine: TlsFiles, non_owner: TlsFiles,
                       foreign: TlsFiles) -> List[Dict]:
    """The data plane of server `to` at `host`:`port` (see the module's docstring)."""
    k, where, messages = int(to.split(":")[1]), target(host, port), wire.messages()
    results = []
    with tempfile.TemporaryDirectory(prefix="tfe-attack-ca-") as scratch:
        ca = os.path.join(scratch, "server-ca.crt")
        with open(ca, "wb") as f:
            f.write(mine.trust().server_ca_pem(k))
        forward = messages["ForwardRequest"](channel=f"attack-forward-{os.getpid()}", step=0, ring_bits=64,
                                             num_elements=1)
        outcome, detail = _data_plane_call(host, port, k, "ForwardBlinded", forward, bytes(8),
                                           (mine.cert, mine.key), ca)
        results.append(_result(attacker, to, "forward-as-owner", where,
                               outcome == grpc.StatusCode.PERMISSION_DENIED, detail))
        channel = f"attack-data-{os.getpid()}-{time.time_ns()}-{k}"
        contribute = messages["ContributeRequest"](channel=channel, step=0, ring_bits=64, num_elements=1)
        payload = bytes(ring.KEY_BYTES) if k == 0 else bytes(8 * ring.ring_words(1, 64))
        outcome, detail = _data_plane_call(host, port, k, "Contribute", contribute, payload,
                                           (non_owner.cert, non_owner.key), ca)
        refused = outcome == "closed" or outcome in (grpc.StatusCode.PERMISSION_DENIED,
                                                     grpc.StatusCode.UNAUTHENTICATED)
        results.append(_result(":".join(map(str, NON_OWNER)), to, "non-owner-cert", where, refused, detail))
        for attack, tls in (("no-cert", (None, None)), ("foreign-ca", (foreign.cert, foreign.key)),
                            ("plaintext", None)):
            outcome, detail = _data_plane_call(host, port, k, "Contribute", contribute, payload, tls, ca)
            results.append(_result("outside", to, attack, where, outcome == "closed", detail))
    return results


def isolated_scans(isolation: Dict, origin: str, data_ports: Optional[Mapping[int, int]] = None) -> List[Dict]:
    """From the namespace this runs in, every TCP port of every task of `isolation` (`IsolatedCluster.describe`)
    on its bridge address and its IPv6 link-local address: nothing may answer on an owner (``owner-port``),
    only the service port and the data port (`data_ports`: tfe index -> the port it announced, 0 or absent:
    none) on a server (``server-ports``; skipped when `origin` is a server itself). Every closed port must be
    refused, not silent: a scan that never reached the task proves nothing."""

    results = []
    for task in isolation["tasks"]:
        server = task["job"] == "tfe"
        if server and origin != "outside":
            continue
        data_port = (data_ports or {}).get(task["index"]) if server else None
        expected = sorted([task["tf_port"]] + ([data_port] if data_port else [])) if server else []
        for host in task_hosts(task):
            scan = scan_tcp(host)
            ok = scan.open == expected and scan.refused == 65535 - len(expected)
            results.append(_result(origin, f"{task['job']}:{task['index']}", "server-ports" if server else
                                   "owner-port", target(host, "1-65535"), ok, scan.describe()))
    return results
