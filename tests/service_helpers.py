"""Fixtures of the aggregation service's tests: a cluster's certificates and servers on loopback ports."""
import concurrent.futures
import os

import grpc
import portpicker
import pytest

from tfe_estimator.cluster import certs
from tfe_estimator.service import AggregationServer, OwnerClient, TlsFiles, wire

#: Owner tasks in configured order (N = 2, 4, 8 use the first N).
OWNER_TASKS = [("chief", 0)] + [("worker", i) for i in range(7)]
CLUSTER = "t"
WAIT_SECS = 30.0  # the bound on any wait in these tests


def owner_names(n):
    return [f"{job}:{index}" for job, index in OWNER_TASKS[:n]]


@pytest.fixture(scope="session")
def cert_dirs(tmp_path_factory):
    """``(ours, foreign)``: the cluster's certificates, and a second CA's for the same task names."""
    tasks = OWNER_TASKS + [("tfe", 0), ("tfe", 1), ("tfe", 2), ("evaluator", 0)]
    ours, foreign = str(tmp_path_factory.mktemp("certs")), str(tmp_path_factory.mktemp("foreign_certs"))
    certs.make_cluster_certs(ours, tasks, cluster=CLUSTER)
    # The foreign CA has another name (an attacker's own CA) but issues the same task names of cluster "t".
    ca_cert, ca_key = certs.make_ca("evil")
    with open(os.path.join(foreign, certs.CA_CERT), "wb") as f:
        f.write(ca_cert)
    for job, index in tasks:
        key, csr = certs.make_key_and_csr(job, index, "evil", CLUSTER)
        stem = os.path.join(foreign, certs.task_name(job, index))
        with open(stem + ".crt", "wb") as f:
            f.write(certs.sign_csr(csr, ca_cert, ca_key, CLUSTER))
        with open(stem + ".key", "wb") as f:
            f.write(key)
    return ours, foreign


class Service:
    """server0 and server1 on free loopback ports, and the clients made for them."""

    def __init__(self, certs_dir, owners, step_timeout_secs=WAIT_SECS, data_plane=True, **limits):
        self.certs_dir, self.owners = certs_dir, owners
        ports = [portpicker.pick_unused_port() for _ in range(2)]
        self.addresses = tuple(f"localhost:{p}" for p in ports)
        self.servers, self.clients = [], []
        if data_plane:
            limits["data_address"] = "localhost:0"
        server1 = AggregationServer(1, self.addresses[1], owners, TlsFiles.from_dir(certs_dir, "tfe", 1),
                                    step_timeout_secs=step_timeout_secs, **limits)
        self.servers.append(server1)
        server1.start()
        server0 = AggregationServer(0, self.addresses[0], owners, TlsFiles.from_dir(certs_dir, "tfe", 0),
                                    peer_address=self.addresses[1], step_timeout_secs=step_timeout_secs, **limits)
        self.servers.append(server0)
        server0.start()

    def client(self, job, index, certs_dir=None, addresses=None, **kwargs):
        kwargs.setdefault("timeout_secs", WAIT_SECS)
        kwargs.setdefault("retry_secs", 0.0)  # the rules tests see every refusal; owners retry (client.py)
        client = OwnerClient(addresses or self.addresses, TlsFiles.from_dir(certs_dir or self.certs_dir, job, index),
                             **kwargs)
        self.clients.append(client)
        return client

    def clients_of(self, n):
        return [self.client(job, index) for job, index in OWNER_TASKS[:n]]

    def close(self):
        for client in self.clients:
            client.close()
        for server in self.servers:
            server.stop(0)


@pytest.fixture
def make_service(cert_dirs):
    """``make_service(owners, step_timeout_secs=...)`` -> a started `Service`; all stopped at teardown."""
    started = []

    def make(owners, **kwargs):
        started.append(Service(cert_dirs[0], owners, **kwargs))
        return started[-1]

    yield make
    for service in started:
        service.close()


def in_threads(calls):
    """Runs the callables at once; returns each one's result or exception (every wait bounded)."""
    with concurrent.futures.ThreadPoolExecutor(len(calls)) as pool:
        futures = [pool.submit(call) for call in calls]
        out = []
        for future in futures:
            try:
                out.append(future.result(timeout=2 * WAIT_SECS))
            except Exception as e:  # pylint: disable=broad-except
                out.append(e)
        return out


def raw_call(address, server, method, request, credentials, metadata=None, timeout=WAIT_SECS):
    """One call without `OwnerClient`: any credentials, any metadata, pinned to tfe-<server>; no waiting for ready."""
    options = [("grpc.ssl_target_name_override", certs.task_dns_name("tfe", server, CLUSTER))]
    m = wire.method(method)
    classes = wire.messages()
    with grpc.secure_channel(address, credentials, options=options) as channel:
        stub = channel.unary_unary(wire.method_path(method), request_serializer=classes[m.request].SerializeToString,
                                   response_deserializer=classes[m.reply].FromString)
        return stub(request, timeout=timeout, metadata=metadata, wait_for_ready=False)


def health_call(address, server, credentials, method="Check", timeout=WAIT_SECS):
    """The health service's `method` (Check; Watch: its first answer) with any credentials, pinned to tfe-<server>;
    returns the status name."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc  # pylint: disable=import-outside-toplevel

    options = [("grpc.ssl_target_name_override", certs.task_dns_name("tfe", server, CLUSTER))]
    with grpc.secure_channel(address, credentials, options=options) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        request = health_pb2.HealthCheckRequest()
        reply = stub.Check(request, timeout=timeout) if method == "Check" else \
            next(iter(stub.Watch(request, timeout=timeout)))
    return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


def credentials_of(certs_dir, job, index):
    return TlsFiles.from_dir(certs_dir, job, index).channel_credentials()


def ca_only_credentials(certs_dir):
    with open(os.path.join(certs_dir, certs.CA_CERT), "rb") as f:
        return grpc.ssl_channel_credentials(root_certificates=f.read())


def small_owner_data(workdir, owners=("chief-0", "worker-0"), rows=16):
    """Each owner's directory under `workdir` with a small ``data.csv`` (two features, their sum as label)."""
    import numpy as np  # pylint: disable=import-outside-toplevel

    rng = np.random.RandomState(0)
    for owner in owners:
        os.makedirs(os.path.join(workdir, owner))
        x = rng.randn(rows, 2)
        np.savetxt(os.path.join(workdir, owner, "data.csv"), np.column_stack([x, x.sum(1)]), delimiter=",")
