"""Certificates for mutual TLS between the tasks of a cluster (the `cryptography` library).

Every task gets a key and a certificate signed by its organisation's CA, carrying
its identity: subject ``O=<organisation>, CN=<job>-<index>``, a DNS name
``<job>-<index>.<cluster>`` (what the TLS sidecar's peer check, stunnel's
``checkHost``, matches) and a URI ``tfe://<cluster>/<organisation>/<job>/<index>``.
Keys are EC P-256; certificates are short-lived (30 days by default).

Two ways to make them:

- One party makes a whole test cluster's set (`make_cluster_certs`, or
  ``tfe-estimator certs --dir D --workers N``): ``ca.crt``, ``ca.key``,
  ``<job>-<index>.crt``, ``<job>-<index>.key`` (keys mode 0600). One lab only:
  whoever holds ``ca.key`` can mint any identity.
- Across organisations each organisation holds its own CA (`make_ca` with
  ``organisation=``; ``tfe-estimator certs ca``) and signs only its own
  parties (`sign_csr` refuses a request naming another organisation); no
  private key leaves the task it belongs to (`make_key_and_csr`). The public
  federation file (`tfe_estimator.identity.federation`) says which
  organisation's CA vouches for which party.

Key files are created exclusively (`tfe_estimator.identity.keyfiles`).

Example::

    make_cluster_certs("/tmp/certs", cluster_tasks(1, evaluator=False), cluster="demo")
    key_pem, csr_pem = make_key_and_csr("worker", 0, organisation="hospital-b", cluster="demo")
    cert_pem = sign_csr(csr_pem, ca_cert_pem, ca_key_pem, cluster="demo")
"""
import datetime
import logging
import os
import re
from typing import Dict, Iterable, Optional, Tuple

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from tfe_estimator.identity.keyfiles import make_private_dir, write_private, write_public
from tfe_estimator.validation import check_int

__all__ = ["make_ca", "make_key_and_csr", "sign_csr", "make_cluster_certs", "task_name", "task_dns_name",
           "task_uri", "identity_of_common_name", "certificate_identity", "ca_organisation", "load_certificate",
           "key_matches", "fingerprint",
           "CA_CERT", "CA_KEY", "DEFAULT_VALIDITY_DAYS"]

_LOG = logging.getLogger("tfe_estimator")

CA_CERT, CA_KEY = "ca.crt", "ca.key"
DEFAULT_VALIDITY_DAYS = 30
_NAME = re.compile(r"^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$")
_COMMON_NAME = re.compile(r"^([a-z0-9]([a-z0-9-]*[a-z0-9])?)-(\d+)$")


def _check_name(what: str, value: str) -> str:
    if not isinstance(value, str) or not _NAME.match(value):
        raise ValueError(f"{what}={value!r} must be a DNS label: lowercase letters, digits and '-', 1-63 "
                         "characters, not starting or ending with '-' (it becomes part of a DNS name).")
    return value


def task_name(job: str, index: int) -> str:
    """``<job>-<index>``: the task's file name stem and certificate CN."""
    check_int(index, f"task index {index!r} must be an integer >= 0.", minimum=0)
    return f"{_check_name('job', job)}-{index}"


def task_dns_name(job: str, index: int, cluster: str) -> str:
    """The DNS name in a task's certificate (what the sidecar's peer check matches)."""
    return f"{task_name(job, index)}.{_check_name('cluster', cluster)}"


def task_uri(job: str, index: int, cluster: str, organisation: str) -> str:
    return f"tfe://{_check_name('cluster', cluster)}/{_check_name('organisation', organisation)}/{job}/{index}"


def identity_of_common_name(common_name: str) -> Optional[str]:
    """``"chief-0"`` -> ``"chief:0"``; None for a CN that is not a task name."""
    match = _COMMON_NAME.match(common_name)
    return f"{match.group(1)}:{int(match.group(3))}" if match else None


def load_certificate(pem: bytes, source: str) -> x509.Certificate:
    """The first certificate of PEM bytes; a ValueError naming `source` if there is none."""
    try:
        return x509.load_pem_x509_certificate(pem)
    except ValueError as e:
        raise ValueError(f"{source} holds no PEM certificate ({e}): pass a certificate made by "
                         "`tfe-estimator certs`.") from None


def certificate_identity(cert: x509.Certificate) -> Optional[str]:
    """The task identity ``"job:index"`` a certificate's CN names, or None."""
    names = cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
    return identity_of_common_name(names[0].value) if len(names) == 1 else None


def _public_der(public_key) -> bytes:
    return public_key.public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)


def key_matches(key_pem: bytes, cert_pem: bytes) -> bool:
    """Whether the private key `key_pem` belongs to the certificate `cert_pem`."""
    key = serialization.load_pem_private_key(key_pem, password=None)
    return _public_der(key.public_key()) == _public_der(load_certificate(cert_pem, "the certificate").public_key())


def fingerprint(cert_pem: bytes, source: str = "the certificate") -> str:
    """The certificate's SHA-256 fingerprint as ``openssl x509 -noout -fingerprint -sha256`` prints it
    (``AB:CD:...``, of its DER bytes): what two sites read to each other to compare out of band.

    Example::

        print(f"SHA-256 {fingerprint(ca_pem)}")
    """
    digest = load_certificate(cert_pem, source).fingerprint(hashes.SHA256())
    return ":".join(f"{b:02X}" for b in digest)


def ca_organisation(cert: x509.Certificate) -> Tuple[Optional[str], str]:
    """``(organisation id or None, display name)`` of a CA certificate (`make_ca`'s O= and CN=)."""
    orgs = cert.subject.get_attributes_for_oid(NameOID.ORGANIZATION_NAME)
    names = cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
    return (orgs[0].value if len(orgs) == 1 else None), (names[0].value if names else cert.subject.rfc4514_string())


def _key():
    return ec.generate_private_key(ec.SECP256R1())


def _pem_key(key) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def _validity(days: int, not_before: Optional[datetime.datetime]) -> Tuple[datetime.datetime, datetime.datetime]:
    check_int(days, f"validity_days={days!r} must be an integer >= 1.", minimum=1)
    start = not_before or datetime.datetime.now(datetime.timezone.utc) - datetime.timedelta(minutes=5)
    return start, start + datetime.timedelta(days=days)


def make_ca(cluster: str, validity_days: int = DEFAULT_VALIDITY_DAYS,
            not_before: Optional[datetime.datetime] = None, organisation: Optional[str] = None,
            display_name: Optional[str] = None) -> Tuple[bytes, bytes]:
    """A new CA: ``(cert_pem, key_pem)``.

    Args:
      cluster: the cluster (federation) name.
      organisation: an organisation's id (a DNS label, e.g. ``"hospital-a"``): its CA then signs only
        that organisation's parties (`sign_csr`). None: one CA for a whole test cluster.
      display_name: the organisation's name for people (e.g. ``"Hospital A"``), the CA's CN.
    """
    key = _key()
    attributes = []
    if organisation is not None:
        attributes.append(x509.NameAttribute(NameOID.ORGANIZATION_NAME, _check_name("organisation", organisation)))
    common = display_name or f"tfe-estimator CA {_check_name('cluster', cluster)}"
    if not isinstance(common, str) or not common.strip() or len(common) > 64:
        raise ValueError(f"display_name={display_name!r} must be a non-empty name of at most 64 characters.")
    attributes.append(x509.NameAttribute(NameOID.COMMON_NAME, common))
    name = x509.Name(attributes)
    start, end = _validity(validity_days, not_before)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(start).not_valid_after(end)
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=False, content_commitment=False, key_encipherment=False,
                                         data_encipherment=False, key_agreement=False, key_cert_sign=True,
                                         crl_sign=True, encipher_only=False, decipher_only=False), critical=True)
            .sign(key, hashes.SHA256()))
    return cert.public_bytes(serialization.Encoding.PEM), _pem_key(key)


def make_key_and_csr(job: str, index: int, organisation: str, cluster: str) -> Tuple[bytes, bytes]:
    """Run by the organisation that owns the task: ``(key_pem, csr_pem)``; only the CSR is sent to the CA."""
    key = _key()
    subject = x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, _check_name("organisation", organisation)),
                         x509.NameAttribute(NameOID.COMMON_NAME, task_name(job, index))])
    san = x509.SubjectAlternativeName([x509.DNSName(task_dns_name(job, index, cluster)),
                                       x509.UniformResourceIdentifier(task_uri(job, index, cluster, organisation))])
    csr = x509.CertificateSigningRequestBuilder().subject_name(subject).add_extension(san, critical=False) \
        .sign(key, hashes.SHA256())
    return _pem_key(key), csr.public_bytes(serialization.Encoding.PEM)


def sign_csr(csr_pem: bytes, ca_cert_pem: bytes, ca_key_pem: bytes, cluster: str,
             validity_days: int = DEFAULT_VALIDITY_DAYS, not_before: Optional[datetime.datetime] = None) -> bytes:
    """Run by the CA: checks a task's CSR (signature, identity form) and signs it; returns the cert PEM.

    Raises:
      ValueError: for a CSR whose signature does not verify, whose identity is
        not a task of `cluster` (CN ``<job>-<index>``, the matching DNS name and URI),
        or that names another organisation than an organisation's CA (its O=).
    """
    csr = x509.load_pem_x509_csr(csr_pem)
    if not csr.is_signature_valid:
        raise ValueError("The CSR's signature does not verify: it was not made with the key it names. "
                         "Make it again with make_key_and_csr.")
    common = csr.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
    orgs = csr.subject.get_attributes_for_oid(NameOID.ORGANIZATION_NAME)
    match = re.match(r"^([a-z0-9-]+)-(\d+)$", common[0].value) if len(common) == 1 else None
    if match is None or len(orgs) != 1:
        raise ValueError(f"CSR subject {csr.subject.rfc4514_string()!r} is not a task identity: it needs "
                         "O=<organisation> and CN=<job>-<index> (make it with make_key_and_csr).")
    job, index, organisation = match.group(1), int(match.group(2)), orgs[0].value
    try:
        san = csr.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        raise ValueError("CSR has no subjectAltName: make it with make_key_and_csr.") from None
    want_dns, want_uri = task_dns_name(job, index, cluster), task_uri(job, index, cluster, organisation)
    if san.get_values_for_type(x509.DNSName) != [want_dns] or \
            san.get_values_for_type(x509.UniformResourceIdentifier) != [want_uri]:
        raise ValueError(f"CSR names {san.get_values_for_type(x509.DNSName)} / "
                         f"{san.get_values_for_type(x509.UniformResourceIdentifier)}, not task {job}-{index} "
                         f"of cluster {cluster!r} ({want_dns}, {want_uri}).")
    ca_cert = load_certificate(ca_cert_pem, "the CA certificate")
    ca_org, ca_name = ca_organisation(ca_cert)
    if ca_org is not None and ca_org != organisation:
        raise ValueError(f"CSR of {job}-{index} names organisation {organisation!r}, but this CA is {ca_name!r} of "
                         f"organisation {ca_org!r}: an organisation's CA signs only its own parties. Send the CSR "
                         f"to {organisation!r}'s CA, or make it again with --org {ca_org}.")
    ca_key = serialization.load_pem_private_key(ca_key_pem, password=None)
    if _public_der(ca_key.public_key()) != _public_der(ca_cert.public_key()):
        raise ValueError(f"the CA key does not belong to the CA certificate {ca_name!r}: pass the ca.key made with "
                         "that ca.crt.")
    start, end = _validity(validity_days, not_before)
    if end > ca_cert.not_valid_after_utc + datetime.timedelta(hours=1):
        _LOG.warning("certificate of %s-%d: cut to end with its CA %r on %s (asked for %d days)", job, index,
                     ca_name, ca_cert.not_valid_after_utc.date(), validity_days)
    end = min(end, ca_cert.not_valid_after_utc)
    cert = (x509.CertificateBuilder().subject_name(csr.subject).issuer_name(ca_cert.subject)
            .public_key(csr.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(start).not_valid_after(end)
            .add_extension(san, critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
                           critical=False)
            .sign(ca_key, hashes.SHA256()))
    return cert.public_bytes(serialization.Encoding.PEM)


def _write(path: str, data: bytes, private: bool = False) -> None:
    (write_private if private else write_public)(path, data)


def make_cluster_certs(directory: str, tasks: Iterable[Tuple[str, int]], cluster: str,
                       organisations: Optional[Dict[Tuple[str, int], str]] = None,
                       validity_days: int = DEFAULT_VALIDITY_DAYS) -> Dict[Tuple[str, int], Tuple[str, str]]:
    """A CA and every task's key and certificate in `directory` (one operator: tests, one organisation).

    Args:
      tasks: ``(job, index)`` of each task (`tfe_estimator.cluster.spec.cluster_tasks`).
      organisations: task -> organisation; default each task its own (``<job>-<index>``).

    Returns:
      task -> ``(cert path, key path)``.
    """
    make_private_dir(directory)
    ca_cert, ca_key = make_ca(cluster, validity_days)
    _write(os.path.join(directory, CA_CERT), ca_cert)
    _write(os.path.join(directory, CA_KEY), ca_key, private=True)
    paths = {}
    for job, index in tasks:
        organisation = (organisations or {}).get((job, index), task_name(job, index))
        key, csr = make_key_and_csr(job, index, organisation, cluster)
        cert = sign_csr(csr, ca_cert, ca_key, cluster, validity_days)
        stem = os.path.join(directory, task_name(job, index))
        _write(stem + ".crt", cert)
        _write(stem + ".key", key, private=True)
        paths[(job, index)] = (stem + ".crt", stem + ".key")
    return paths
