"""The federation file: which organisation vouches for which party, and where the servers are.

A small public JSON file, the same at every site, with no secret in it::

    {"format": "tfe-estimator-federation/1", "cluster": "hospitals",
     "organisations": {"hospital-a": {"display_name": "Hospital A", "ca_certificate": "-----BEGIN ..."},
                       "operator-x": {"display_name": "Operator X", "ca_certificate_file": "operator-x.crt"}},
     "parties": {"chief:0": {"organisation": "hospital-a"},
                 "tfe:0": {"organisation": "operator-x", "address": "tfe0.operator-x.example:7000",
                           "dns_name": "tfe-0.hospitals"}}}

(``ca_certificate`` inline PEM, or ``ca_certificate_file`` relative to the file.) A server
accepts a caller only if its certificate is issued by the CA of *the organisation the file
names for that identity* (`Federation.check_peer`), on top of gRPC's chain check against the
bundle of every organisation's CA (`Federation.roots_pem`); so no organisation can mint
another's parties. An owner pins each server by that server's operator's CA
(`Federation.server_ca_pem`) and its name (`Federation.server_name`).

The single-CA layout (``ca.crt`` and the tasks' files in one directory, as `make_cluster_certs`
writes) is a federation whose parties all belong to one organisation (`Federation.single_ca`).

Example::

    fed = Federation.load("/etc/tfe/federation.json")
    problem = fed.check_peer("worker:0", leaf_pem)   # None: accepted; else why not
"""
import dataclasses
import datetime
import functools
import json
import os
import re
from typing import Dict, Iterable, List, Mapping, Optional, Tuple

from cryptography import exceptions as crypto_exceptions
from cryptography import x509
from cryptography.x509.oid import NameOID

from tfe_estimator.identity import certs

__all__ = ["Federation", "Organisation", "Party", "owners_of", "FORMAT", "FEDERATION_FILE", "SERVERS"]

FORMAT = "tfe-estimator-federation/1"
#: The federation file's name in a task's TLS directory (`tfe_estimator.service.tls.TlsFiles.from_dir`).
FEDERATION_FILE = "federation.json"
#: The aggregation servers' identities.
SERVERS = ("tfe:0", "tfe:1")
_IDENTITY = re.compile(r"^[a-z0-9]([a-z0-9-]*[a-z0-9])?:\d+$")


@functools.lru_cache(maxsize=256)
def _certificate(pem: bytes) -> x509.Certificate:
    return x509.load_pem_x509_certificate(pem)


@functools.lru_cache(maxsize=1024)
def _issued_by(leaf_pem: bytes, ca_pem: bytes) -> bool:
    try:
        _certificate(leaf_pem).verify_directly_issued_by(_certificate(ca_pem))
    except (ValueError, TypeError, crypto_exceptions.InvalidSignature):
        return False
    return True


def _now() -> datetime.datetime:
    return datetime.datetime.now(datetime.timezone.utc)


@dataclasses.dataclass(frozen=True)
class Organisation:
    """One organisation: its id (a DNS label), its name for people, its CA certificate (PEM)."""

    id: str
    display_name: str
    ca_pem: bytes

    @property
    def ca(self) -> x509.Certificate:
        return _certificate(self.ca_pem)


@dataclasses.dataclass(frozen=True)
class Party:
    """One party: its identity (``"job:index"``) and organisation; a server also its address and DNS name."""

    identity: str
    organisation: str
    address: Optional[str] = None
    dns_name: Optional[str] = None


class Federation:
    """The organisations, the parties and the servers of one cluster (see the module docstring).

    Args:
      cluster: the cluster name (the part after ``<job>-<index>.`` in certificates' DNS names).
      organisations: id -> `Organisation`.
      parties: identity -> `Party`.
      any_party: the single-CA layout: every identity belongs to this organisation.
      source: where it came from (for messages).
    """

    def __init__(self, cluster: str, organisations: Mapping[str, Organisation], parties: Mapping[str, Party],
                 any_party: Optional[str] = None, source: str = "the federation"):
        self.cluster, self.source, self.any_party = cluster, source, any_party
        self.organisations, self.parties = dict(organisations), dict(parties)
        for party in self.parties.values():
            if not _IDENTITY.match(party.identity):
                raise ValueError(f"{source}: party {party.identity!r} is not an identity 'job:index' like "
                                 "'worker:0'.")
            if party.organisation not in self.organisations:
                raise ValueError(f"{source}: party {party.identity} names organisation {party.organisation!r}, "
                                 f"which is not among its organisations {sorted(self.organisations)}.")
        if any_party is not None and any_party not in self.organisations:
            raise ValueError(f"{source}: any_party={any_party!r} is not an organisation of it.")

    # ----------------------------------------------------------------- making

    @classmethod
    def single_ca(cls, ca_pem: bytes, cluster: str, source: str = "ca.crt") -> "Federation":
        """One CA for every party (the single-directory layout of `make_cluster_certs`)."""
        org_id, display = certs.ca_organisation(certs.load_certificate(ca_pem, source))
        org = Organisation(org_id or "cluster", display, ca_pem)
        return cls(cluster, {org.id: org}, {}, any_party=org.id, source=source)

    @classmethod
    def assemble(cls, cluster: str, party_cas: Mapping[str, bytes],
                 servers: Optional[Mapping[str, str]] = None,
                 display_names: Optional[Mapping[str, str]] = None) -> "Federation":
        """A federation from each party's organisation CA certificate (the organisation's id and name come
        from the CA's O= and CN=, `certs.make_ca`) and the servers' addresses.

        Args:
          party_cas: identity -> PEM of its organisation's CA certificate.
          servers: ``"tfe:k"`` -> ``host:port``.
        """
        organisations: Dict[str, Organisation] = {}
        parties: Dict[str, Party] = {}
        for identity, ca_pem in party_cas.items():
            org_id, display = certs.ca_organisation(certs.load_certificate(ca_pem, f"the CA of {identity}"))
            if org_id is None:
                raise ValueError(f"the CA certificate given for {identity} names no organisation (O=): make each "
                                 "organisation's CA with `tfe-estimator certs ca --org ID`.")
            display = (display_names or {}).get(org_id, display)
            known = organisations.get(org_id)
            if known is not None and known.ca_pem.strip() != ca_pem.strip():
                raise ValueError(f"two different CA certificates claim organisation {org_id!r} (one given for "
                                 f"{identity}): each organisation has one CA; pass the same ca.crt for its parties.")
            organisations[org_id] = Organisation(org_id, display, ca_pem)
            address = (servers or {}).get(identity)
            dns = certs.task_dns_name(*_split(identity), cluster) if identity in SERVERS else None
            parties[identity] = Party(identity, org_id, address, dns)
        for identity in (servers or {}):
            if identity not in parties:
                raise ValueError(f"server {identity} has an address but no organisation: give its operator's CA "
                                 f"with --party {identity}=CA_CERT.")
        return cls(cluster, organisations, parties, source="the assembled federation")

    # ------------------------------------------------------------ file format

    @classmethod
    def load(cls, path: str) -> "Federation":
        """Reads a federation file (see the module docstring)."""
        try:
            with open(path, encoding="utf-8") as f:
                data = json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"federation file {path} is not JSON ({e}): make it with "
                             "`tfe-estimator certs federation`.") from None
        return cls.from_dict(data, os.path.dirname(os.path.abspath(path)), source=f"federation file {path}")

    @classmethod
    def from_dict(cls, data: Mapping, base_dir: str = ".", source: str = "the federation") -> "Federation":
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            got = data.get("format") if isinstance(data, dict) else data
            raise ValueError(f"{source}: 'format' must be {FORMAT!r} (got {got!r}); make it with "
                             "`tfe-estimator certs federation`.")
        cluster = data.get("cluster")
        if not isinstance(cluster, str) or not cluster:
            raise ValueError(f"{source}: 'cluster' (the name in the certificates' DNS names) is missing.")
        organisations = {}
        for org_id, entry in (data.get("organisations") or {}).items():
            if "ca_certificate" in entry:
                pem = entry["ca_certificate"].encode("ascii")
            elif "ca_certificate_file" in entry:
                with open(os.path.join(base_dir, entry["ca_certificate_file"]), "rb") as f:
                    pem = f.read()
            else:
                raise ValueError(f"{source}: organisation {org_id!r} has no 'ca_certificate' (PEM) or "
                                 "'ca_certificate_file'.")
            certs.load_certificate(pem, f"{source}, organisation {org_id!r}")
            organisations[org_id] = Organisation(org_id, entry.get("display_name") or org_id, pem)
        parties = {}
        for identity, entry in (data.get("parties") or {}).items():
            if not isinstance(entry, dict) or "organisation" not in entry:
                raise ValueError(f"{source}: party {identity!r} needs an 'organisation'.")
            parties[identity] = Party(identity, entry["organisation"], entry.get("address"),
                                      entry.get("dns_name") or (certs.task_dns_name(*_split(identity), cluster)
                                                                if identity in SERVERS else None))
        return cls(cluster, organisations, parties, source=source)

    def to_dict(self) -> Dict:
        parties = {}
        for identity, p in sorted(self.parties.items()):
            entry = {"organisation": p.organisation}
            if p.address:
                entry["address"] = p.address
            if p.dns_name:
                entry["dns_name"] = p.dns_name
            parties[identity] = entry
        return {"format": FORMAT, "cluster": self.cluster,
                "organisations": {o.id: {"display_name": o.display_name, "ca_certificate": o.ca_pem.decode("ascii")}
                                  for o in sorted(self.organisations.values(), key=lambda o: o.id)},
                "parties": parties}

    def dumps(self) -> str:
        return json.dumps(self.to_dict(), indent=2) + "\n"

    # ------------------------------------------------------------------ trust

    def organisation_of(self, identity: str) -> Optional[Organisation]:
        """The organisation that vouches for `identity`, or None if it is no party."""
        party = self.parties.get(identity)
        org_id = party.organisation if party is not None else self.any_party
        return self.organisations.get(org_id) if org_id is not None else None

    def roots_pem(self) -> bytes:
        """Every organisation's CA certificate, one PEM bundle (what gRPC's own chain check trusts)."""
        seen, out = set(), []
        for org in self.organisations.values():
            pem = org.ca_pem.strip() + b"\n"
            if pem not in seen:
                seen.add(pem)
                out.append(pem)
        return b"".join(out)

    def _server(self, server: int) -> Tuple[str, Optional[Party]]:
        if server not in (0, 1) or isinstance(server, bool):
            raise ValueError(f"server={server!r} must be 0 or 1 (aggregation server0 or server1).")
        identity = SERVERS[server]
        return identity, self.parties.get(identity)

    def server_ca_pem(self, server: int) -> bytes:
        """The CA certificate an owner pins server `server` by: its operator's only."""
        identity, _ = self._server(server)
        org = self.organisation_of(identity)
        if org is None:
            raise ValueError(f"{self.source} names no organisation for aggregation server {identity}: add it "
                             f"with `tfe-estimator certs federation --party {identity}=OPERATOR_CA.crt`.")
        return org.ca_pem

    def server_name(self, server: int) -> str:
        """The DNS name an owner pins server `server` by (in its certificate): ``tfe-<k>.<cluster>`` by default."""
        identity, party = self._server(server)
        return (party.dns_name if party is not None and party.dns_name
                else certs.task_dns_name(*_split(identity), self.cluster))

    def server_address(self, server: int) -> Optional[str]:
        _, party = self._server(server)
        return party.address if party is not None else None

    def describe(self, identity: str) -> str:
        """``"worker:0 (Hospital B, organisation hospital-b)"``."""
        org = self.organisation_of(identity)
        return f"{identity} ({org.display_name}, organisation {org.id})" if org is not None else identity

    def check_peer(self, identity: str, leaf_pem: bytes, now: Optional[datetime.datetime] = None) -> Optional[str]:
        """Why the certificate `leaf_pem` does not prove `identity` in this federation, or None if it does.

        It must be issued directly by the CA of the organisation this federation names for `identity`,
        be valid now, and (in a federation file) name that organisation in its O=.
        """
        org = self.organisation_of(identity)
        if org is None:
            return (f"{identity} is not a party of {self.source} (its parties: {sorted(self.parties)}); add it "
                    "with `tfe-estimator certs federation --party`.")
        if not _issued_by(bytes(leaf_pem), org.ca_pem):
            leaf = _certificate(bytes(leaf_pem))
            return (f"the certificate of {identity} was issued by {leaf.issuer.rfc4514_string()!r}, not by the CA "
                    f"of {identity}'s organisation {org.display_name!r} ({org.id}, "
                    f"{org.ca.subject.rfc4514_string()!r}) that {self.source} names: only {org.id}'s CA can vouch "
                    f"for {identity}.")
        leaf = _certificate(bytes(leaf_pem))
        now = now or _now()
        if not leaf.not_valid_before_utc <= now <= leaf.not_valid_after_utc:
            return (f"the certificate of {identity} is valid from {leaf.not_valid_before_utc} to "
                    f"{leaf.not_valid_after_utc}, not now ({now:%Y-%m-%d %H:%M} UTC): renew it.")
        if self.any_party is None:
            orgs = [a.value for a in leaf.subject.get_attributes_for_oid(NameOID.ORGANIZATION_NAME)]
            if orgs != [org.id]:
                return (f"the certificate of {identity} names organisation {orgs}, but {self.source} says "
                        f"{identity} belongs to {org.id!r}.")
        return None

    def servers_organisation(self) -> Optional[str]:
        """The organisation that runs both aggregation servers, if one does (then they could collude)."""
        operators = {self.parties[s].organisation for s in SERVERS if s in self.parties}
        return operators.pop() if len(operators) == 1 and all(s in self.parties for s in SERVERS) else None

    def verify(self, now: Optional[datetime.datetime] = None, expiry_days: float = 7.0) -> List[str]:
        """Problems of the federation itself (empty: fine): CAs that are no CA, expired or expiring, missing
        servers, one CA claimed by two organisations, an operator that is also an owner, both servers run by
        one organisation."""
        now = now or _now()
        problems = []
        by_pem: Dict[bytes, str] = {}
        for org in self.organisations.values():
            ca = org.ca
            try:
                is_ca = ca.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
            except x509.ExtensionNotFound:
                is_ca = False
            if not is_ca:
                problems.append(f"organisation {org.id}: its certificate {ca.subject.rfc4514_string()!r} is not a CA.")
            if ca.not_valid_after_utc < now:
                problems.append(f"organisation {org.id}: its CA expired on {ca.not_valid_after_utc:%Y-%m-%d}.")
            elif ca.not_valid_after_utc < now + datetime.timedelta(days=expiry_days):
                problems.append(f"organisation {org.id}: its CA expires on {ca.not_valid_after_utc:%Y-%m-%d %H:%M} "
                                f"UTC, within {expiry_days:g} days: renew it and send the new federation file.")
            other = by_pem.setdefault(org.ca_pem.strip(), org.id)
            if other != org.id:
                problems.append(f"organisations {other} and {org.id} share one CA: each organisation needs its own.")
        if self.any_party is None:
            for identity in SERVERS:
                party = self.parties.get(identity)
                if party is None:
                    problems.append(f"aggregation server {identity} is not in the federation.")
                elif not party.address:
                    problems.append(f"aggregation server {identity} has no address.")
            owners = [i for i in self.parties if i not in SERVERS]
            if not owners:
                problems.append("the federation names no data owner.")
            for server in SERVERS:
                for owner in owners:
                    operator = self.parties.get(server)
                    if operator is not None and operator.organisation == self.parties[owner].organisation:
                        problems.append(f"{owner} and aggregation server {server} belong to one organisation "
                                        f"({self.parties[owner].organisation}): a server operator must not be a "
                                        "data owner.")
            if self.servers_organisation() is not None:
                problems.append(f"both aggregation servers belong to {self.servers_organisation()}: the "
                                "two servers must be run by two organisations that do not collude.")
        return problems


def _split(identity: str) -> Tuple[str, int]:
    job, index = identity.rsplit(":", 1)
    return job, int(index)


def owners_of(federation: Federation) -> Iterable[str]:
    """The data owners' identities (every party but the servers)."""
    return [i for i in federation.parties if i not in SERVERS]
