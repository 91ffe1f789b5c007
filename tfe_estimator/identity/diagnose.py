"""What a server presented, when an owner's TLS handshake with it fails.

gRPC reports a refused server certificate as a bare ``UNAVAILABLE`` (or, with
``wait_for_ready``, as ``DEADLINE_EXCEEDED`` when the call's deadline ends). This
module connects once more with Python's `ssl` (presenting the owner's own
certificate, verifying nothing), reads the certificate the server presents and
says how it differs from the one the owner pins: its name (swapped server
addresses) or its issuer (another organisation's CA).

Example::

    message = server_mismatch("tfe1.example:7000", "tfe-1.hospitals", operator_y_ca_pem,
                              "/etc/tfe/worker-0/worker-0.crt", "/etc/tfe/worker-0/worker-0.key")
    if message:
        log.error(message)
"""
import socket
import ssl
from typing import Optional, Tuple

from cryptography import x509
from cryptography.x509.oid import NameOID

from tfe_estimator.identity.certs import ca_organisation, certificate_identity

__all__ = ["presented_certificate", "describe_mismatch", "server_mismatch", "looks_like_handshake_failure"]

#: Substrings of gRPC's details when the TLS handshake (not the network) failed.
_HANDSHAKE_SIGNS = ("handshake", "ssl", "certificate", "peer name", "tsi_", "x509")


def looks_like_handshake_failure(details: Optional[str]) -> bool:
    """Whether gRPC's error details speak of TLS (worth `server_mismatch`), not of a refused connection."""
    text = (details or "").lower()
    return any(sign in text for sign in _HANDSHAKE_SIGNS)


def _host_port(address: str) -> Tuple[str, int]:
    for prefix in ("ipv4:", "ipv6:", "dns:///", "dns:"):
        if address.startswith(prefix):
            address = address[len(prefix):]
    host, _, port = address.rpartition(":")
    return host.strip("[]"), int(port)


def presented_certificate(address: str, cert_path: str, key_path: str, timeout: float = 5.0,
                          server_hostname: Optional[str] = None) -> Optional[x509.Certificate]:
    """The certificate the TLS server at `address` presents (None if it cannot be reached or reads none)."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE  # we only read what is presented; gRPC already refused it
    context.load_cert_chain(cert_path, key_path)
    context.set_alpn_protocols(["h2"])
    try:
        host, port = _host_port(address)
        with socket.create_connection((host, port), timeout=timeout) as raw:
            with context.wrap_socket(raw, server_hostname=server_hostname) as tls:
                der = tls.getpeercert(binary_form=True)
    except (OSError, ValueError):
        return None
    return x509.load_der_x509_certificate(der) if der else None


def _dns_names(cert: x509.Certificate):
    try:
        return cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value.get_values_for_type(
            x509.DNSName)
    except x509.ExtensionNotFound:
        return []


def describe_mismatch(presented: x509.Certificate, what: str, address: str, expected_name: str,
                      expected_ca_pem: bytes) -> Optional[str]:
    """How `presented` differs from a certificate named `expected_name` issued by `expected_ca_pem`; None if
    it does not."""
    expected_ca = x509.load_pem_x509_certificate(expected_ca_pem)
    names = _dns_names(presented)
    try:
        presented.verify_directly_issued_by(expected_ca)
        issued = True
    except Exception:  # pylint: disable=broad-except  (ValueError, TypeError, InvalidSignature)
        issued = False
    if expected_name in names and issued:
        return None
    org, ca_name = ca_organisation(expected_ca)
    issuer_orgs = [a.value for a in presented.issuer.get_attributes_for_oid(NameOID.ORGANIZATION_NAME)]
    who = certificate_identity(presented) or presented.subject.rfc4514_string()
    shown = f"{who} ({', '.join(names) or 'no DNS name'}), issued by {presented.issuer.rfc4514_string()!r}"
    expected = f"{expected_name}, issued by {ca_name!r}" + (f" (organisation {org})" if org else "")
    hint = []
    if expected_name not in names:
        hint.append("the name differs: the servers' addresses may be swapped or point at another party (check the "
                    "order of the 'tfe' job in TF_CONFIG, or the federation file's addresses)")
    if not issued:
        hint.append("the issuer differs: the server uses another organisation's certificate, or the federation "
                    "file names another CA for it" + (f" (the presented one is of {issuer_orgs[0]})"
                                                      if issuer_orgs else ""))
    return (f"TLS: {what} at {address} presented {shown}, but this owner expects {expected}: "
            + "; ".join(hint) + ".")


def server_mismatch(address: str, expected_name: str, expected_ca_pem: bytes, cert_path: str, key_path: str,
                    what: str = "the aggregation server", timeout: float = 5.0) -> Optional[str]:
    """A message naming the expected and the presented identity if the server at `address` presents another
    certificate than the one pinned; None if it matches or cannot be reached."""
    presented = presented_certificate(address, cert_path, key_path, timeout, server_hostname=expected_name)
    if presented is None:
        return None
    return describe_mismatch(presented, what, address, expected_name, expected_ca_pem)
