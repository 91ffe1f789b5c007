"""The aggregation service: the only API between data owners of different organisations and the servers.

Owners mask on their own devices and hand only a 16-byte key (to server0) and a
masked share (to server1) to two small grpcio servers with mutual TLS; they
reveal the sum locally. The servers import neither TensorFlow nor any module
that does. `aggregation.proto` is the API with the table of who may call what.

- `wire`: the messages and methods (one table; ``aggregation.proto`` says the same).
- `ring`: ring arithmetic and AES-CTR keystreams in NumPy, bit-identical to the kernels.
- `tls`: certificates, pinned server names, the caller's identity.
- `steps`: the rules of one channel's steps (no gRPC).
- `server`: `AggregationServer` (server0 or server1).
- `health`: the standard gRPC health service on a server's port, for its federation's parties.
- `metrics`: a server's Prometheus metrics (counts only), in a registry of its own.
- `client`: `OwnerClient`, `get_client`.

Example::

    from tfe_estimator.service import AggregationServer, OwnerClient, TlsFiles

    server1 = AggregationServer(1, "[::]:7001", ["chief:0", "worker:0"], TlsFiles.from_dir(d, "tfe", 1))
    server1.start()
    client = OwnerClient(("tfe0:7000", "tfe1:7001"), TlsFiles.from_dir(d, "chief", 0))
    blind_key, w = client.contribute("grads", step, 64, n, seed, share)
"""
from tfe_estimator.service.client import OwnerClient, ServiceError, get_client, release_client
from tfe_estimator.service.server import AggregationServer
from tfe_estimator.service.tls import TlsFiles, peer_identity

__all__ = ["AggregationServer", "OwnerClient", "ServiceError", "TlsFiles", "get_client", "release_client",
           "peer_identity"]
