"""Who each party is: certificates, exclusive key files and the federation of organisations.

Below both the service (`tfe_estimator.service`) and the cluster layer
(`tfe_estimator.cluster`): both import it, it imports neither.

- `certs`: CAs, keys, signing requests and task certificates (`cryptography`).
- `keyfiles`: private files created exclusively (mode 0600, never through another user's file).
- `federation`: the public federation file: each party's organisation and that organisation's CA,
  the servers' addresses and names; the per-organisation check of a caller's certificate.
- `local`: the launcher's federation on one machine (each task its own organisation and directory).
- `secret`: one party's Kubernetes Secret (its own files only).
- `expiry`: warnings ahead of a certificate's expiry.
- `diagnose`: what a server presented, when an owner's TLS handshake fails.

Example::

    from tfe_estimator.identity import certs, federation
    fed = federation.Federation.load("/etc/tfe/federation.json")
"""
__all__ = []
