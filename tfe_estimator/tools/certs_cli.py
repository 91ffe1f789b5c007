"""`tfe-estimator certs`: identities for mutual TLS, one lab's or a federation of organisations'.

One lab (tests, one organisation; whoever holds ``ca.key`` can mint any identity)::

    $ tfe-estimator certs --dir certs --workers 2 --cluster demo

Across organisations (each holds its own CA; no private key leaves where it was made)::

    $ tfe-estimator certs ca --org hospital-a --name "Hospital A" --cluster hospitals --dir a/ca
    $ tfe-estimator certs request --identity chief:0 --org hospital-a --cluster hospitals --dir a/chief-0
    $ tfe-estimator certs sign --ca-dir a/ca --csr a/chief-0/chief-0.csr --cluster hospitals
    $ tfe-estimator certs federation --cluster hospitals --party chief:0=a/ca/ca.crt ... \\
          --server tfe:0=tfe0.example:7000 --server tfe:1=tfe1.example:7000 --out federation.json
    $ tfe-estimator certs verify --federation federation.json --dir a/chief-0 --identity chief:0
    $ tfe-estimator certs secret --dir a/chief-0 --identity chief:0 --name demo > chief-0-secret.yaml
"""
import argparse
import os
from typing import List

__all__ = ["add_parser", "run"]

_SUBCOMMANDS = ("ca", "request", "sign", "federation", "verify", "secret")


def add_parser(sub) -> argparse.ArgumentParser:
    """Adds ``certs`` (and its subcommands) to the `tfe-estimator` argparse tree."""
    certs = sub.add_parser("certs", help="certificates for mutual TLS: one lab's (--dir) or per organisation "
                                         "(ca, request, sign, federation, verify)",
                           formatter_class=argparse.RawDescriptionHelpFormatter,
                           description="Without a subcommand: one CA and every task's key and certificate in one "
                                       "directory (one lab: whoever holds ca.key can mint any identity). Across "
                                       "organisations use the subcommands (docs/deployment.md).")
    certs.add_argument("--dir", default=None, help="one lab: output directory (ca.crt, ca.key, "
                                                   "<job>-<index>.crt/.key)")
    certs.add_argument("--workers", type=int, default=1, help="one lab: workers besides the chief (default 1)")
    certs.add_argument("--evaluator", action="store_true", help="one lab: also an evaluator task")
    certs.add_argument("--cluster", default="tfe", help="cluster name in the certificates' DNS names (default tfe)")
    certs.add_argument("--validity-days", type=int, default=30, help="certificate lifetime (default 30)")
    steps = certs.add_subparsers(dest="certs_command", metavar="{" + ",".join(_SUBCOMMANDS) + "}")

    ca = steps.add_parser("ca", help="create an organisation's CA (ca.crt public, ca.key stays here)")
    ca.add_argument("--org", required=True, help="the organisation's id, a DNS label (e.g. hospital-a)")
    ca.add_argument("--name", default=None, help="its name for people (e.g. 'Hospital A')")
    ca.add_argument("--cluster", required=True, help="the federation's cluster name")
    ca.add_argument("--dir", required=True, help="where ca.crt and ca.key go (keep this directory private)")
    ca.add_argument("--validity-days", type=int, default=365, help="the CA's lifetime (default 365)")

    request = steps.add_parser("request", help="make a party's key and signing request (the key never leaves)")
    request.add_argument("--identity", required=True, help="the party, job:index (chief:0, worker:0, tfe:0, tfe:1)")
    request.add_argument("--org", required=True, help="its organisation's id")
    request.add_argument("--cluster", required=True, help="the federation's cluster name")
    request.add_argument("--dir", required=True, help="the party's TLS directory: <job>-<index>.key and .csr go here")

    sign = steps.add_parser("sign", help="sign a party's request with its organisation's CA")
    sign.add_argument("--ca-dir", required=True, help="the organisation's CA directory (ca.crt, ca.key)")
    sign.add_argument("--csr", required=True, help="the party's <job>-<index>.csr")
    sign.add_argument("--cluster", required=True, help="the federation's cluster name")
    sign.add_argument("--out", default=None, help="the certificate (default: next to the CSR, .crt)")
    sign.add_argument("--validity-days", type=int, default=30, help="certificate lifetime (default 30)")

    federation = steps.add_parser("federation", help="assemble the public federation file")
    federation.add_argument("--cluster", required=True, help="the federation's cluster name")
    federation.add_argument("--party", action="append", default=[], required=True, metavar="ID=CA_CERT",
                            help="a party and its organisation's ca.crt, e.g. worker:0=b/ca/ca.crt (repeat)")
    federation.add_argument("--server", action="append", default=[], metavar="tfe:K=HOST:PORT",
                            help="an aggregation server's address (repeat for tfe:0 and tfe:1)")
    federation.add_argument("--out", required=True, help="the federation file to write (e.g. federation.json)")

    verify = steps.add_parser("verify", help="check a federation file (and a party's files against it); prints the "
                                             "SHA-256 of the file and of each certificate, to compare out of band")
    verify.add_argument("--federation", required=True, help="the federation file")
    verify.add_argument("--dir", default=None, help="a party's TLS directory to check too")
    verify.add_argument("--identity", default=None, help="with --dir: the party, job:index")
    verify.add_argument("--install", action="store_true",
                        help="with --dir: copy the federation file into it as federation.json")

    secret = steps.add_parser("secret", help="print a party's Kubernetes Secret: its key, certificate and "
                                             "federation.json only (never a CA key)")
    secret.add_argument("--dir", required=True, help="the party's TLS directory")
    secret.add_argument("--identity", required=True, help="the party, job:index")
    secret.add_argument("--name", required=True, help="the cluster name of `tfe-estimator k8s --name`")
    secret.add_argument("--namespace", default=None, help="the Secret's namespace")
    secret.add_argument("--secret-name", default="{name}-{job}-{index}-tls",
                        help="as `tfe-estimator k8s --tls-secret` (default {name}-{job}-{index}-tls)")

    certs.epilog = "subcommands:\n" + "".join(
        "  " + p.format_usage().replace("usage: ", "") for p in (ca, request, sign, federation, verify, secret))
    return certs


def _read(path: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except FileNotFoundError:
        raise ValueError(f"{path} does not exist.") from None


def _pairs(values: List[str], flag: str) -> dict:
    out = {}
    for value in values:
        key, sep, rest = value.partition("=")
        if not sep or not key or not rest:
            raise ValueError(f"{flag} {value!r} must be ID=VALUE, e.g. {flag} worker:0=b/ca/ca.crt.")
        if key in out:
            raise ValueError(f"{flag} names {key} twice.")
        out[key] = rest
    return out


def _split_identity(identity: str):
    job, sep, index = identity.partition(":")
    if not sep or not index.isdigit():
        raise ValueError(f"--identity {identity!r} must be job:index, e.g. worker:0 or tfe:1.")
    return job, int(index)


def _print_fingerprints(path: str, federation, certs) -> None:
    """Prints the SHA-256 of the federation file and of each organisation's CA certificate: what the sites
    compare out of band (by phone, on paper) before they install the file (docs/security.md)."""
    import hashlib  # pylint: disable=import-outside-toplevel

    print(f"{path}: file SHA-256 {hashlib.sha256(_read(path)).hexdigest()}")
    for org in sorted(federation.organisations.values(), key=lambda o: o.id):
        print(f"organisation {org.id} ({org.display_name}): CA certificate SHA-256 "
              f"{certs.fingerprint(org.ca_pem, f'the CA of {org.id}')}")


def run(args: argparse.Namespace) -> int:
    """Runs ``tfe-estimator certs ...``; returns the exit status."""
    from tfe_estimator.identity import certs, expiry, keyfiles  # pylint: disable=import-outside-toplevel
    from tfe_estimator.identity.federation import FEDERATION_FILE, Federation  # pylint: disable=import-outside-toplevel

    command = args.certs_command
    if command is None:
        from tfe_estimator.cluster.spec import cluster_tasks  # pylint: disable=import-outside-toplevel

        if not args.dir:
            raise ValueError("`tfe-estimator certs` needs --dir (one lab's certificates) or a subcommand: "
                             + ", ".join(_SUBCOMMANDS) + " (across organisations, docs/deployment.md).")
        paths = certs.make_cluster_certs(args.dir, cluster_tasks(args.workers, args.evaluator), args.cluster,
                                         validity_days=args.validity_days)
        print(f"wrote {certs.CA_CERT}, {certs.CA_KEY} and {len(paths)} task keys and certificates to {args.dir} "
              "(one lab: whoever reads ca.key can mint any identity)")
        return 0
    if command == "ca":
        keyfiles.make_private_dir(args.dir)
        cert, key = certs.make_ca(args.cluster, args.validity_days, organisation=args.org, display_name=args.name)
        keyfiles.write_private(os.path.join(args.dir, certs.CA_KEY), key)
        keyfiles.write_public(os.path.join(args.dir, certs.CA_CERT), cert)
        print(f"organisation {args.org}: wrote {os.path.join(args.dir, certs.CA_CERT)} (public: send it to whoever "
              f"assembles the federation file) and {os.path.join(args.dir, certs.CA_KEY)} (private: never copy it)")
        return 0
    if command == "request":
        job, index = _split_identity(args.identity)
        keyfiles.make_private_dir(args.dir)
        key, csr = certs.make_key_and_csr(job, index, args.org, args.cluster)
        stem = os.path.join(args.dir, certs.task_name(job, index))
        keyfiles.write_private(stem + ".key", key)
        keyfiles.write_public(stem + ".csr", csr)
        print(f"{args.identity}: wrote {stem}.key (stays here) and {stem}.csr (send it to {args.org}'s CA)")
        return 0
    if command == "sign":
        ca_key = keyfiles.read_private(os.path.join(args.ca_dir, certs.CA_KEY))  # the caller's own private file
        cert = certs.sign_csr(_read(args.csr), _read(os.path.join(args.ca_dir, certs.CA_CERT)), ca_key,
                              args.cluster, args.validity_days)
        out = args.out or os.path.splitext(args.csr)[0] + ".crt"
        keyfiles.write_public(out, cert)
        print(f"wrote {out}")
        return 0
    if command == "federation":
        party_cas = {identity: _read(path) for identity, path in _pairs(args.party, "--party").items()}
        federation = Federation.assemble(args.cluster, party_cas, _pairs(args.server, "--server"))
        problems = federation.verify()
        if problems:  # refused before anything is written: every party's `certs verify` would refuse it too
            trial = "" if federation.servers_organisation() is None else (
                " For a trial inside one organisation, `tfe-estimator certs --dir DIR` makes one lab's certificates "
                "(`tfe-estimator launch` makes its own).")
            raise ValueError(f"{args.out} not written: " + " ".join(problems) + trial)
        keyfiles.write_public(args.out, federation.dumps().encode("utf-8"))
        print(f"wrote {args.out}: {len(federation.organisations)} organisations, parties "
              f"{', '.join(federation.describe(i) for i in sorted(federation.parties))}")
        return 0
    if command == "verify":
        federation = Federation.load(args.federation)
        problems = federation.verify()
        _print_fingerprints(args.federation, federation, certs)
        if args.dir:
            if not args.identity:
                raise ValueError("certs verify --dir needs --identity job:index (whose files they are).")
            job, index = _split_identity(args.identity)
            stem = os.path.join(args.dir, certs.task_name(job, index))
            cert = _read(stem + ".crt")
            print(f"{args.identity}: certificate {stem}.crt SHA-256 {certs.fingerprint(cert, stem + '.crt')}")
            problem = federation.check_peer(args.identity, cert)
            if problem:
                problems.append(problem)
            if certs.certificate_identity(certs.load_certificate(cert, stem + ".crt")) != args.identity:
                problems.append(f"{stem}.crt does not name {args.identity}.")
            problems += expiry.expiring([(stem + ".crt", cert)])
            if os.path.exists(stem + ".key") and not certs.key_matches(_read(stem + ".key"), cert):
                problems.append(f"{stem}.key is not the key of {stem}.crt: sign this party's own request.")
            if args.install and not problems:
                keyfiles.write_public(os.path.join(args.dir, FEDERATION_FILE), _read(args.federation))
                print(f"installed {os.path.join(args.dir, FEDERATION_FILE)}")
        for problem in problems:
            print(f"problem: {problem}")
        if not problems:
            print(f"{args.federation}: fine ({', '.join(federation.describe(i) for i in sorted(federation.parties))})")
        return 1 if problems else 0
    if command == "secret":
        import yaml  # pylint: disable=import-outside-toplevel

        from tfe_estimator.identity.secret import party_secret  # pylint: disable=import-outside-toplevel

        job, index = _split_identity(args.identity)
        print(yaml.safe_dump(party_secret(args.dir, job, index, args.name, args.namespace, args.secret_name),
                             sort_keys=False), end="")
        return 0
    raise AssertionError(command)  # argparse allows only the subcommands above
