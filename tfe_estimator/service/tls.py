"""Mutual TLS for the aggregation service: credentials, pinned server names, caller identity.

There is no plaintext mode. Every server requires a client certificate of the
cluster's CA; every client pins the server task it means to reach
(``grpc.ssl_target_name_override`` = ``tfe-<k>.<cluster>``, the DNS name in that
task's certificate, see `tfe_estimator.cluster.certs`), so an owner talks only
to the genuine tfe-k. The cluster name is read from the client's own
certificate. A caller's identity is its certificate's CN, ``<job>-<index>``,
read as ``"job:index"``.

Example::

    tls = TlsFiles.from_dir("/etc/tfe/certs", "worker", 0)
    channel = grpc.secure_channel("tfe0.example:7000", tls.channel_credentials(),
                                  options=[server_name_option(tls, 0)])
"""
import os
import re
from typing import NamedTuple, Optional, Tuple

import grpc
from cryptography import x509
from cryptography.x509.oid import NameOID

from tfe_estimator.cluster import certs

__all__ = ["TlsFiles", "peer_identity", "server_name", "server_name_option", "identity_of_common_name"]

_COMMON_NAME = re.compile(r"^([a-z0-9]([a-z0-9-]*[a-z0-9])?)-(\d+)$")


def identity_of_common_name(common_name: str) -> Optional[str]:
    """``"chief-0"`` -> ``"chief:0"``; None for a CN that is not a task name."""
    match = _COMMON_NAME.match(common_name)
    return f"{match.group(1)}:{int(match.group(3))}" if match else None


class TlsFiles(NamedTuple):
    """Paths of one task's PEM files: the cluster CA's certificate, the task's certificate and key.

    Example::

        tls = TlsFiles.from_dir("/tmp/certs", "tfe", 0)
        server.add_secure_port("[::]:7000", tls.server_credentials())
    """
    ca: str
    cert: str
    key: str

    @classmethod
    def from_dir(cls, directory: str, job: str, index: int) -> "TlsFiles":
        """The files `tfe_estimator.cluster.certs.make_cluster_certs` writes: ``ca.crt``, ``<job>-<index>.crt/.key``."""
        stem = os.path.join(directory, certs.task_name(job, index))
        files = cls(os.path.join(directory, certs.CA_CERT), stem + ".crt", stem + ".key")
        for path in files:
            if not os.path.isfile(path):
                raise FileNotFoundError(
                    f"TLS file {path} for task {job}:{index} does not exist. Make the cluster's certificates with "
                    f"`tfe-estimator certs --dir {directory}` (or certs.make_cluster_certs), or pass the directory "
                    "that holds them.")
        return files

    def read(self) -> Tuple[bytes, bytes, bytes]:
        """``(ca, cert, key)`` PEM bytes."""
        out = []
        for path in self:
            with open(path, "rb") as f:
                out.append(f.read())
        return out[0], out[1], out[2]

    def server_credentials(self) -> grpc.ServerCredentials:
        """Server credentials that require a client certificate signed by the cluster's CA."""
        ca, cert, key = self.read()
        return grpc.ssl_server_credentials([(key, cert)], root_certificates=ca, require_client_auth=True)

    def channel_credentials(self) -> grpc.ChannelCredentials:
        """Client credentials: trusts the cluster's CA only and presents this task's certificate."""
        ca, cert, key = self.read()
        return grpc.ssl_channel_credentials(root_certificates=ca, private_key=key, certificate_chain=cert)

    def _certificate(self) -> x509.Certificate:
        return x509.load_pem_x509_certificate(self.read()[1])

    def identity(self) -> str:
        """This task's identity, ``"job:index"``, from its certificate's CN."""
        names = self._certificate().subject.get_attributes_for_oid(NameOID.COMMON_NAME)
        identity = identity_of_common_name(names[0].value) if len(names) == 1 else None
        if identity is None:
            raise ValueError(f"certificate {self.cert} has subject {self._certificate().subject.rfc4514_string()!r}, "
                             "not a task CN <job>-<index>: make it with tfe_estimator.cluster.certs.")
        return identity

    def cluster(self) -> str:
        """The cluster name: the part after ``<job>-<index>.`` of this certificate's DNS name."""
        try:
            san = self._certificate().extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        except x509.ExtensionNotFound:
            san = None
        names = san.get_values_for_type(x509.DNSName) if san is not None else []
        if len(names) != 1 or "." not in names[0]:
            raise ValueError(f"certificate {self.cert} has DNS names {names}, not one <job>-<index>.<cluster>: "
                             "make it with tfe_estimator.cluster.certs.")
        return names[0].split(".", 1)[1]


def server_name(tls: TlsFiles, server: int) -> str:
    """The DNS name a client pins for aggregation server `server` (0 or 1): ``tfe-<k>.<cluster>``."""
    return certs.task_dns_name("tfe", server, tls.cluster())


def server_name_option(tls: TlsFiles, server: int) -> Tuple[str, str]:
    """The channel option that pins server `server`'s certificate name."""
    return ("grpc.ssl_target_name_override", server_name(tls, server))


def peer_identity(context: grpc.ServicerContext) -> Optional[str]:
    """The caller's ``"job:index"`` from its verified certificate's CN; None without one."""
    names = context.auth_context().get("x509_common_name") or []
    if len(names) != 1:
        return None
    name = names[0].decode("utf-8", "replace") if isinstance(names[0], bytes) else str(names[0])
    return identity_of_common_name(name)
