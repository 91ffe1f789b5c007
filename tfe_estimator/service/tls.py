"""Mutual TLS for the aggregation service: credentials, pinned servers, caller identity.

There is no plaintext mode. A task's trust material is either one CA (``ca.crt``:
every party of one organisation, the single-directory layout) or the federation
file (``federation.json``, `tfe_estimator.identity.federation`: each party's
organisation and that organisation's CA). A server requires a client certificate
that chains to one of the organisations' CAs (gRPC's check) and is issued by the
CA of *the caller's own* organisation (`check_peer`); an owner pins each server by
its operator's CA only and by its name (``grpc.ssl_target_name_override`` =
``tfe-<k>.<cluster>``, the DNS name in that server's certificate). A caller's
identity is its certificate's CN, ``<job>-<index>``, read as ``"job:index"``.

Example::

    tls = TlsFiles.from_dir("/etc/tfe/worker-0", "worker", 0)   # federation.json or ca.crt there
    channel = grpc.secure_channel("tfe0.example:7000", tls.channel_credentials(0),
                                  options=[server_name_option(tls, 0)])
"""
import datetime
import functools
import logging
import os
import ssl
from typing import NamedTuple, Optional, Tuple

import grpc

from tfe_estimator.identity import certs, diagnose, expiry
from tfe_estimator.identity.certs import identity_of_common_name
from tfe_estimator.identity.federation import FEDERATION_FILE, Federation

__all__ = ["TlsFiles", "peer_identity", "peer_certificate", "check_peer", "server_name", "server_name_option",
           "server_mismatch", "identity_of_common_name", "FEDERATION_FILE", "ssl_peer", "SslPeer"]

_LOG = logging.getLogger("tfe_estimator")
#: TLS 1.2 suites the data plane accepts: forward-secret AEAD only, as gRPC's port (TLS 1.3's are all AEAD).
_TLS12_CIPHERS = "ECDHE+AESGCM:ECDHE+CHACHA20"


@functools.lru_cache(maxsize=32)
def _load_trust(path: str, stamp: Tuple[int, int], files: "TlsFiles") -> Federation:
    """The trust of `path` as of its modification `stamp` (a renewed file is read again)."""
    del stamp  # the cache key only
    if path.endswith(".json"):
        return Federation.load(path)
    with open(path, "rb") as f:
        return Federation.single_ca(f.read(), files.cluster(), source=path)


class TlsFiles(NamedTuple):
    """Paths of one task's PEM files: its trust material, its certificate and its key.

    ``ca`` is a CA certificate (one organisation) or a federation file (``*.json``).

    Example::

        tls = TlsFiles.from_dir("/tmp/certs", "tfe", 0)
        server.add_secure_port("[::]:7000", tls.server_credentials())
    """
    ca: str
    cert: str
    key: str

    @classmethod
    def from_dir(cls, directory: str, job: str, index: int) -> "TlsFiles":
        """A task's files in `directory`: ``<job>-<index>.crt/.key`` and ``federation.json``, else ``ca.crt``."""
        stem = os.path.join(directory, certs.task_name(job, index))
        federation = os.path.join(directory, FEDERATION_FILE)
        trust = federation if os.path.isfile(federation) else os.path.join(directory, certs.CA_CERT)
        files = cls(trust, stem + ".crt", stem + ".key")
        for path in files:
            if not os.path.isfile(path):
                what = f"{FEDERATION_FILE} or {certs.CA_CERT}" if path == trust else os.path.basename(path)
                raise FileNotFoundError(
                    f"TLS file {path} ({what}) for task {job}:{index} does not exist. Make the cluster's "
                    f"certificates with `tfe-estimator certs --dir {directory}` (one organisation), or across "
                    "organisations with `tfe-estimator certs request/sign/federation` (see docs/deployment.md), "
                    "or pass the directory that holds them.")
        return files

    def trust(self) -> Federation:
        """Who vouches for whom (re-read when the file changes)."""
        info = os.stat(self.ca)
        return _load_trust(os.path.abspath(self.ca), (info.st_mtime_ns, info.st_size), self)

    def _own(self) -> Tuple[bytes, bytes]:
        with open(self.cert, "rb") as f:
            cert = f.read()
        with open(self.key, "rb") as f:
            key = f.read()
        return cert, key

    def read(self) -> Tuple[bytes, bytes, bytes]:
        """``(roots, cert, key)`` PEM bytes; roots: every organisation's CA certificate."""
        cert, key = self._own()
        return self.trust().roots_pem(), cert, key

    def warn_expiring(self) -> None:
        """Logs a warning for this task's certificate or a CA it trusts that expires within 7 days."""
        expiry.warn_expiring([(self.cert, self._own()[0])] +
                             [(f"{self.ca} (CA of {o.display_name})", o.ca_pem)
                              for o in self.trust().organisations.values()])

    def _stamp(self) -> Tuple:
        return tuple((os.stat(path).st_mtime_ns, os.stat(path).st_size) for path in self)

    def server_credentials(self) -> grpc.ServerCredentials:
        """Server credentials that require a client certificate of one of the federation's CAs.

        Renewed files (certificate, key, trust) are taken for new connections without a restart: gRPC asks
        before each handshake, and the files are read again when one of them changed."""
        self.warn_expiring()
        roots, cert, key = self.read()
        seen = {"stamp": self._stamp()}

        def renewed():
            try:
                stamp = self._stamp()
                if stamp == seen["stamp"]:
                    return None
                roots, cert, key = self.read()
            except (OSError, ValueError) as e:  # half-written files: keep serving with the old ones
                _LOG.warning("TLS files of %s changed but cannot be read yet (%s); keeping the old ones", self.cert, e)
                return None
            seen["stamp"] = stamp
            _LOG.info("TLS files of %s changed: new connections use them", self.cert)
            self.warn_expiring()
            return grpc.ssl_server_certificate_configuration([(key, cert)], root_certificates=roots)

        return grpc.dynamic_ssl_server_credentials(
            grpc.ssl_server_certificate_configuration([(key, cert)], root_certificates=roots), renewed,
            require_client_authentication=True)

    def channel_credentials(self, server: Optional[int] = None) -> grpc.ChannelCredentials:
        """Client credentials presenting this task's certificate; trusting server `server`'s operator's CA
        only (None: every organisation's CA)."""
        self.warn_expiring()
        roots, cert, key = self.read()
        if server is not None:
            roots = self.trust().server_ca_pem(server)
        return grpc.ssl_channel_credentials(root_certificates=roots, private_key=key, certificate_chain=cert)

    def ssl_server_context(self) -> ssl.SSLContext:
        """The same trust as `server_credentials` for Python's `ssl` (the data plane, `data_plane`): TLS 1.2
        or newer, a client certificate of one of the federation's CAs required. Make a new one to take
        renewed files (`data_plane.DataPlane` does on each connection when a file changed)."""
        roots, _, _ = self.read()
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        context.set_ciphers(_TLS12_CIPHERS)
        context.verify_mode = ssl.CERT_REQUIRED
        context.load_verify_locations(cadata=roots.decode("ascii"))
        context.load_cert_chain(self.cert, self.key)
        return context

    def ssl_client_context(self, server: int) -> ssl.SSLContext:
        """The same pinning as `channel_credentials(server)` for Python's `ssl`: server `server`'s operator's
        CA only; connect with ``server_hostname=server_name(tls, server)`` (its name is checked)."""
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        context.set_ciphers(_TLS12_CIPHERS)
        context.check_hostname = True
        context.verify_mode = ssl.CERT_REQUIRED
        context.load_verify_locations(cadata=self.trust().server_ca_pem(server).decode("ascii"))
        context.load_cert_chain(self.cert, self.key)
        return context

    def stamp(self) -> Tuple:
        """The files' modification stamps: changes when one of them is renewed."""
        return self._stamp()

    def _certificate(self):
        return certs.load_certificate(self._own()[0], self.cert)

    def identity(self) -> str:
        """This task's identity, ``"job:index"``, from its certificate's CN."""
        identity = certs.certificate_identity(self._certificate())
        if identity is None:
            raise ValueError(f"certificate {self.cert} has subject {self._certificate().subject.rfc4514_string()!r}, "
                             "not a task CN <job>-<index>: make it with `tfe-estimator certs`.")
        return identity

    def cluster(self) -> str:
        """The cluster name: the part after ``<job>-<index>.`` of this certificate's DNS name."""
        from cryptography import x509  # pylint: disable=import-outside-toplevel

        try:
            san = self._certificate().extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        except x509.ExtensionNotFound:
            san = None
        names = san.get_values_for_type(x509.DNSName) if san is not None else []
        if len(names) != 1 or "." not in names[0]:
            raise ValueError(f"certificate {self.cert} has DNS names {names}, not one <job>-<index>.<cluster>: "
                             "make it with `tfe-estimator certs`.")
        return names[0].split(".", 1)[1]


def server_name(tls: TlsFiles, server: int) -> str:
    """The DNS name a client pins for aggregation server `server` (0 or 1): ``tfe-<k>.<cluster>``."""
    return tls.trust().server_name(server)


def server_name_option(tls: TlsFiles, server: int) -> Tuple[str, str]:
    """The channel option that pins server `server`'s certificate name."""
    return ("grpc.ssl_target_name_override", server_name(tls, server))


def _first(context: grpc.ServicerContext, key: str) -> Optional[bytes]:
    values = context.auth_context().get(key) or []
    if len(values) != 1:
        return None
    value = values[0]
    return value if isinstance(value, bytes) else str(value).encode("utf-8")


def peer_identity(context: grpc.ServicerContext) -> Optional[str]:
    """The caller's ``"job:index"`` from its verified certificate's CN; None without one."""
    name = _first(context, "x509_common_name")
    return identity_of_common_name(name.decode("utf-8", "replace")) if name is not None else None


def peer_certificate(context: grpc.ServicerContext) -> Optional[bytes]:
    """The caller's certificate (PEM), as gRPC verified it; None without one."""
    return _first(context, "x509_pem_cert")


class SslPeer:
    """The caller of one open Python `ssl` connection (the data plane), proved again on every call.

    `problem` checks the connection's certificate against `tls`'s CURRENT trust (the federation file or
    ``ca.crt``, re-read when it changes) and the certificate's validity period, as gRPC's port does on every
    call (`check_peer`): an organisation removed from the federation, or a certificate that expired, is
    refused on the next call of a connection opened before. The answer is kept while the trust is the same
    (`TlsFiles.trust` gives one object per version of the file) and the certificate is within its validity,
    so a call costs a ``stat`` and a comparison.

    Example::

        peer = ssl_peer(tls, connection)
        problem = peer.problem()      # None: peer.identity is proved now
    """

    def __init__(self, tls: "TlsFiles", identity: Optional[str], pem: Optional[bytes],
                 problem: Optional[str] = None):
        self._tls, self.identity, self._pem, self._fixed = tls, identity, pem, problem
        self._trust, self._answer = None, None
        if pem is not None:
            cert = certs.load_certificate(pem, "the caller's certificate")
            self._valid = (cert.not_valid_before_utc, cert.not_valid_after_utc)

    def problem(self, now: Optional[datetime.datetime] = None) -> Optional[str]:
        """Why the certificate does not prove `identity` now, or None if it does (see the class docstring)."""
        if self._fixed is not None:
            return self._fixed
        try:
            trust = self._tls.trust()
        except (OSError, ValueError) as e:  # a half-written file: refuse, never fall back to the old trust
            return f"this server's trust file {self._tls.ca} cannot be read now ({e}); try again."
        now = now or datetime.datetime.now(datetime.timezone.utc)
        if trust is not self._trust or not self._valid[0] <= now <= self._valid[1]:
            self._trust, self._answer = trust, trust.check_peer(self.identity, self._pem, now)
        return self._answer


def ssl_peer(tls: TlsFiles, connection: ssl.SSLSocket) -> SslPeer:
    """A Python `ssl` connection's caller (`SslPeer`): its identity from its verified certificate's CN, and
    ``problem()``: None while that certificate proves it in `tls`'s federation (issued by the CA of that
    identity's own organisation and valid now, the check `check_peer` makes for gRPC), else why not."""
    der = connection.getpeercert(binary_form=True)
    if not der:
        return SslPeer(tls, None, None, "the caller presented no certificate.")
    pem = ssl.DER_cert_to_PEM_cert(der).encode("ascii")
    identity = certs.certificate_identity(certs.load_certificate(pem, "the caller's certificate"))
    if identity is None:
        return SslPeer(tls, None, None, "the caller's certificate names no task (CN <job>-<index>).")
    return SslPeer(tls, identity, pem)


def check_peer(tls: TlsFiles, identity: str, context: grpc.ServicerContext) -> Optional[str]:
    """Why the caller's certificate does not prove `identity` in `tls`'s federation, or None if it does."""
    leaf = peer_certificate(context)
    if leaf is None:
        return f"the caller {identity} presented no certificate gRPC could report."
    return tls.trust().check_peer(identity, leaf)


def server_mismatch(tls: TlsFiles, server: int, address: str, details: Optional[str] = None,
                    timeout: float = 5.0) -> Optional[str]:
    """For an owner whose calls to server `server` at `address` fail: if that server presents another
    certificate than the one `tls` pins (name ``tfe-<k>.<cluster>``, issued by its operator's CA), a
    message naming the expected and the presented identity; else None (also when it cannot be reached).

    `details` (gRPC's error details), when given, must look like a TLS failure (else None at once: a
    refused connection is not a certificate problem).

    Example::

        except grpc.RpcError as e:
            message = server_mismatch(tls, 1, "tfe1.example:7000", e.details())
    """
    if details is not None and not diagnose.looks_like_handshake_failure(details):
        return None
    return diagnose.server_mismatch(address, server_name(tls, server), tls.trust().server_ca_pem(server), tls.cert,
                                    tls.key, what=f"aggregation server{server}", timeout=timeout)
