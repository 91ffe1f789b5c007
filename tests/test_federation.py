"""Trust per organisation: two hospitals and two server operators, each with its own CA, made by the CLI.

Every check below is an attack that must fail or a flow that must work; the
mutation beside a check disables the property (the per-organisation check, the
per-server pin, exclusive key files) and asserts that the check catches it.
All in process, on loopback.
"""
import json
import os

import grpc
import numpy as np
import portpicker
import pytest

from tfe_estimator.identity import certs, diagnose, expiry, federation as federation_lib, keyfiles
from tfe_estimator.service import AggregationServer, OwnerClient, ServiceError, TlsFiles, ring, tls as tls_lib, wire
from tfe_estimator.service import health as health_lib
from tfe_estimator.tools import cli

from federation_helpers import CLUSTER, PARTIES, make_federation, stem as _stem

OWNERS = ["chief:0", "worker:0"]
WAIT = 10.0


@pytest.fixture(scope="module")
def sites(tmp_path_factory):
    """The deployment page's flow through `tfe-estimator certs` (`federation_helpers.make_federation`)."""
    root = tmp_path_factory.mktemp("sites")
    ports = [portpicker.pick_unused_port() for _ in range(2)]
    make_federation(root, {"tfe:0": ("localhost", ports[0]), "tfe:1": ("localhost", ports[1])})
    return root, ports


def _tls(root, identity):
    org = next(o for o, (i, _) in PARTIES.items() if i == identity)
    job, index = identity.split(":")
    return TlsFiles.from_dir(str(root / org / _stem(identity)), job, int(index))


class _Servers:
    def __init__(self, root, ports, tls0=None, tls1=None):
        self.addresses = [f"localhost:{p}" for p in ports]
        self.servers = [AggregationServer(1, self.addresses[1], OWNERS, tls1 or _tls(root, "tfe:1"),
                                          step_timeout_secs=WAIT)]
        self.servers[0].start()
        self.servers.insert(0, AggregationServer(0, self.addresses[0], OWNERS, tls0 or _tls(root, "tfe:0"),
                                                 peer_address=self.addresses[1], step_timeout_secs=WAIT))
        self.servers[0].start()

    def close(self):
        for server in self.servers:
            server.stop(0)


@pytest.fixture
def servers(sites):
    started = _Servers(*sites)
    yield started
    started.close()


def _forged(root, tmp_path, ca_org):
    """worker:0's name in a certificate signed by `ca_org`'s CA (with `ca_org`'s key: a minting insider)."""
    ca_dir = root / ca_org / "ca"
    key, csr = certs.make_key_and_csr("worker", 0, ca_org, CLUSTER)  # the honest sign_csr signs only its own org
    cert = certs.sign_csr(csr, (ca_dir / "ca.crt").read_bytes(), (ca_dir / "ca.key").read_bytes(), CLUSTER)
    out = tmp_path / f"forged-by-{ca_org}"
    out.mkdir()
    (out / "worker-0.crt").write_bytes(cert)
    (out / "worker-0.key").write_bytes(key)
    (out / "federation.json").write_bytes((root / "federation.json").read_bytes())
    return TlsFiles.from_dir(str(out), "worker", 0)


def _raw(address, server, method, request, tls, timeout=5.0):
    messages = wire.messages()
    m = wire.method(method)
    with grpc.secure_channel(address, tls.channel_credentials(server),
                             options=[tls_lib.server_name_option(tls, server)]) as channel:
        stub = channel.unary_unary(wire.method_path(method), request_serializer=messages[m.request].SerializeToString,
                                   response_deserializer=messages[m.reply].FromString)
        return stub(request, timeout=timeout)


# ------------------------------------------------------------------ the flow works --

def _masked(x, key):
    """An owner's masked share of `x` (ring 64) under `key`: x - AES-CTR(key) (what ops.mask_share computes)."""
    share = x.astype(np.uint64)
    ring.sub_into(share, ring.keystream_words(key.tobytes(), x.size), 64)
    return share.view(np.int64)


def test_the_cli_flow_gives_a_working_federation_and_a_real_sum(sites, servers):
    root, _ = sites
    data = json.loads((root / "federation.json").read_text())
    assert set(data["organisations"]) == set(PARTIES) and data["parties"]["worker:0"]["organisation"] == "hospital-b"
    for org, (identity, _) in PARTIES.items():  # each party's directory: its own key, certificate and public trust
        own = root / org / _stem(identity)
        assert sorted(os.listdir(own)) == sorted([f"{_stem(identity)}.{e}" for e in ("crt", "csr", "key")]
                                                 + ["federation.json"])
        assert oct(os.stat(own / f"{_stem(identity)}.key").st_mode & 0o777) == "0o600"
    rng = np.random.RandomState(3)
    xs = [rng.randint(0, 2**40, size=16).astype(np.int64) for _ in OWNERS]
    clients = [OwnerClient(servers.addresses, _tls(root, o), timeout_secs=WAIT) for o in OWNERS]
    try:
        import concurrent.futures  # pylint: disable=import-outside-toplevel

        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            futures = []
            for client, x in zip(clients, xs):
                key = np.frombuffer(os.urandom(16), np.int32)
                futures.append(pool.submit(client.contribute, "grads", 0, 64, x.size, key, _masked(x, key)))
            results = [f.result(timeout=2 * WAIT) for f in futures]
    finally:
        for client in clients:
            client.close()
    for blind, w in results:
        total = w.reshape(-1).view(np.uint64).copy()
        ring.add_into(total, ring.keystream_words(np.asarray(blind, "<i4").tobytes(), total.size), 64)
        assert (total.view(np.int64) == xs[0] + xs[1]).all()


# ------------------------------------------------------------ no organisation mints another's party --

def check_forged_worker_is_refused_by_both_servers(sites, servers, tmp_path):
    root, _ = sites
    for ca_org in ("hospital-a", "operator-x"):
        forged = _forged(root, tmp_path, ca_org)
        for server, address in enumerate(servers.addresses):
            for method in ("Rewind", "Status"):  # an owner's method, and one any party may call
                request = wire.messages()[wire.method(method).request]()
                with pytest.raises(grpc.RpcError) as e:
                    _raw(address, server, method, request, forged)
                assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED, (ca_org, method, e.value.details())
                assert "not by the CA of worker:0's organisation 'Hospital B'" in e.value.details()


def test_a_worker_certificate_of_another_organisations_ca_is_refused(sites, servers, tmp_path):
    check_forged_worker_is_refused_by_both_servers(sites, servers, tmp_path)


def test_mutation_no_per_organisation_check_is_detected(sites, servers, tmp_path, monkeypatch):
    monkeypatch.setattr(federation_lib.Federation, "check_peer", lambda self, identity, leaf, now=None: None)
    with pytest.raises((AssertionError, pytest.fail.Exception)):
        check_forged_worker_is_refused_by_both_servers(sites, servers, tmp_path)


def check_health_refuses_a_forged_worker(sites, servers, tmp_path):
    """The health service answers a party (an owner, each server as itself) and refuses a certificate its
    organisation's CA did not issue, though it passes the TLS handshake (the CA is one of the federation's)."""
    root, _ = sites
    forged = _forged(root, tmp_path, "hospital-a")
    for server, address in enumerate(servers.addresses):
        for identity in ("chief:0", "worker:0", "tfe:0", "tfe:1"):
            assert health_lib.check_health(address, _tls(root, identity), server) == "SERVING", identity
        with pytest.raises(grpc.RpcError) as e:
            health_lib.check_health(address, forged, server)
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED, e.value.details()
        assert "not by the CA of worker:0's organisation 'Hospital B'" in e.value.details()


def test_health_answers_parties_and_refuses_a_forged_worker(sites, servers, tmp_path, monkeypatch, capsys):
    check_health_refuses_a_forged_worker(sites, servers, tmp_path)
    # `tfe-estimator status` as Hospital A: the federation file's server addresses, its own certificate.
    root, _ = sites
    monkeypatch.delenv("TF_CONFIG", raising=False)
    assert cli.main(["status", "--federation", str(root / "federation.json"),
                     "--tls-dir", str(root / "hospital-a" / "chief-0")]) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines()[1:]]
    assert rows == [[f"tfe:{k}", servers.addresses[k], "SERVING", "none", "yet"] for k in (0, 1)], rows


def test_mutation_health_open_to_everyone_is_detected(sites, tmp_path, monkeypatch):
    monkeypatch.setattr(AggregationServer, "_health_refusal", lambda self, context: None)
    started = _Servers(*sites)  # after the plant: a server binds its health check when it starts
    try:
        with pytest.raises((AssertionError, pytest.fail.Exception)):
            check_health_refuses_a_forged_worker(sites, started, tmp_path)
    finally:
        started.close()


def test_the_honest_worker_passes_the_per_organisation_check(sites, servers):
    root, _ = sites
    for server, address in enumerate(servers.addresses):
        _raw(address, server, "Rewind", wire.messages()["RewindRequest"](step=0), _tls(root, "worker:0"))


# ------------------------------------------------------------ owners pin each server by its operator --

def _pinning_wrong_operator(root, tmp_path):
    """worker:0 with a federation file that names operator-x's CA for tfe:1 too."""
    data = json.loads((root / "federation.json").read_text())
    data["parties"]["tfe:1"]["organisation"] = "operator-x"
    own = tmp_path / "misled"
    own.mkdir()
    for ext in ("crt", "key"):
        (own / f"worker-0.{ext}").write_bytes((root / "hospital-b" / "worker-0" / f"worker-0.{ext}").read_bytes())
    (own / "federation.json").write_text(json.dumps(data))
    return TlsFiles.from_dir(str(own), "worker", 0)


def check_owner_pinning_the_wrong_operator_fails_clearly(sites, servers, tmp_path):
    root, _ = sites
    misled = _pinning_wrong_operator(root, tmp_path)
    client = OwnerClient(servers.addresses, misled, timeout_secs=3, wait_for_ready=False)
    try:
        with pytest.raises(ServiceError) as e:
            client.rewind(0)
    finally:
        client.close()
    assert e.value.code == grpc.StatusCode.UNAVAILABLE and e.value.address == servers.addresses[1], e.value
    message = tls_lib.server_mismatch(misled, 1, servers.addresses[1], e.value.details)
    assert message is not None, e.value.details
    assert "expects tfe-1.hospitals, issued by 'Operator X'" in message, message
    assert "presented tfe:1 (tfe-1.hospitals), issued by" in message and "operator-y" in message, message


def test_an_owner_pinning_the_wrong_operator_ca_fails_clearly(sites, servers, tmp_path):
    check_owner_pinning_the_wrong_operator_fails_clearly(sites, servers, tmp_path)


def test_mutation_one_trust_bundle_for_every_server_is_detected(sites, servers, tmp_path, monkeypatch):
    real = TlsFiles.channel_credentials
    monkeypatch.setattr(TlsFiles, "channel_credentials", lambda self, server=None: real(self, None))
    with pytest.raises((AssertionError, pytest.fail.Exception)):
        check_owner_pinning_the_wrong_operator_fails_clearly(sites, servers, tmp_path)


def test_swapped_server_addresses_are_named_with_both_identities(sites, servers):
    root, _ = sites
    tls = _tls(root, "chief:0")
    message = tls_lib.server_mismatch(tls, 0, servers.addresses[1])
    assert message is not None and "presented tfe:1 (tfe-1.hospitals)" in message, message
    assert "expects tfe-0.hospitals" in message and "swapped" in message, message
    assert tls_lib.server_mismatch(tls, 0, servers.addresses[0]) is None
    assert tls_lib.server_mismatch(tls, 0, servers.addresses[1], details="connection refused") is None
    assert diagnose.looks_like_handshake_failure("Ssl handshake failed: SSL_ERROR_SSL: CERTIFICATE_VERIFY_FAILED")


# ------------------------------------------------------------ a CA signs only its own organisation --

def test_an_organisations_ca_refuses_another_organisations_request(sites):
    root, _ = sites
    ca = root / "hospital-a" / "ca"
    _, csr = certs.make_key_and_csr("worker", 0, "hospital-b", CLUSTER)
    with pytest.raises(ValueError, match="an organisation's CA signs only its own parties"):
        certs.sign_csr(csr, (ca / "ca.crt").read_bytes(), (ca / "ca.key").read_bytes(), CLUSTER)


def test_federation_verify_names_a_shared_operator_and_missing_servers():
    ca, _ = certs.make_ca(CLUSTER, organisation="operator-x", display_name="Operator X")
    owner_ca, _ = certs.make_ca(CLUSTER, organisation="hospital-a")
    fed = federation_lib.Federation.assemble(CLUSTER, {"chief:0": owner_ca, "tfe:0": ca, "tfe:1": ca},
                                             {"tfe:0": "a:1"})
    problems = " ".join(fed.verify())
    assert "both aggregation servers belong to operator-x" in problems and "tfe:1 has no address" in problems


# ------------------------------------------------------------ key files --

def test_a_foreign_pre_created_key_file_is_refused(tmp_path):
    target = tmp_path / "ca.key"
    target.write_bytes(b"")
    os.chmod(target, 0o666)
    os.chown(target, 12345, 12345)  # another local user's file (the tests run as root)
    with pytest.raises(ValueError, match="belongs to uid 12345"):
        keyfiles.write_private(str(target), b"secret")
    assert target.read_bytes() == b""
    with pytest.raises(ValueError, match="belongs to uid 12345"):  # `tfe-estimator certs --dir` into that directory
        certs.make_cluster_certs(str(tmp_path), [("chief", 0)], cluster="t")
    assert target.read_bytes() == b"" and os.stat(target).st_uid == 12345


def test_an_own_pre_created_key_file_is_replaced_not_written_through(tmp_path):
    target = tmp_path / "worker-0.key"
    target.write_bytes(b"old")
    os.chmod(target, 0o666)
    link = tmp_path / "hardlink"
    os.link(target, link)  # someone holding the old inode sees nothing new
    keyfiles.write_private(str(target), b"secret")
    assert oct(os.stat(target).st_mode & 0o777) == "0o600" and target.read_bytes() == b"secret"
    assert link.read_bytes() == b"old"


def test_mutation_writing_through_a_pre_created_file_is_detected(tmp_path, monkeypatch):
    monkeypatch.setattr(keyfiles, "_clear", lambda path: None)
    monkeypatch.setattr(keyfiles.os, "O_EXCL", 0)
    with pytest.raises((AssertionError, pytest.fail.Exception)):
        test_an_own_pre_created_key_file_is_replaced_not_written_through(tmp_path)


def test_a_world_writable_key_directory_is_refused(tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)
    with pytest.raises(ValueError, match="writable by every user"):
        keyfiles.write_private(str(shared / "ca.key"), b"secret")


def check_a_group_writable_key_directory_is_refused(tmp_path, capsys):
    """Members of the directory's group could swap the CA key after it is written (umask 002 leaves 0775)."""
    shared = tmp_path / "group-shared"
    shared.mkdir()
    os.chmod(shared, 0o775)
    with pytest.raises(ValueError, match="writable by its group"):
        keyfiles.write_private(str(shared / "ca.key"), b"secret")
    assert cli.main(["certs", "ca", "--org", "x", "--cluster", CLUSTER, "--dir", str(shared)]) == 2
    err = capsys.readouterr().err
    assert f"directory {shared} is writable by its group" in err and f"chmod g-w {shared}" in err, err
    assert not (shared / "ca.key").exists()


def test_a_group_writable_key_directory_is_refused(tmp_path, capsys):
    check_a_group_writable_key_directory_is_refused(tmp_path, capsys)


def test_mutation_only_world_writable_directories_refused_is_detected(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(keyfiles.stat, "S_IWGRP", 0)
    with pytest.raises((AssertionError, pytest.fail.Exception)):
        check_a_group_writable_key_directory_is_refused(tmp_path, capsys)


def check_sign_uses_only_the_callers_own_private_ca_key(root, tmp_path, capsys):
    """`certs sign` with a ca.key another user owns, or that others may read, is refused naming the file; the
    organisation's own private ca.key signs."""
    ca = tmp_path / "ca"
    assert cli.main(["certs", "ca", "--org", "hospital-c", "--cluster", CLUSTER, "--dir", str(ca)]) == 0
    own = tmp_path / "worker-1"
    assert cli.main(["certs", "request", "--identity", "worker:1", "--org", "hospital-c", "--cluster", CLUSTER,
                     "--dir", str(own)]) == 0
    sign = ["certs", "sign", "--ca-dir", str(ca), "--csr", str(own / "worker-1.csr"), "--cluster", CLUSTER]
    key = ca / "ca.key"
    capsys.readouterr()
    for change, expected in ((lambda: os.chown(key, 12345, 12345), f"{key} belongs to uid 12345, not to you"),
                             (lambda: os.chmod(key, 0o640), f"{key} has mode 0o640: other users may read")):
        change()
        assert cli.main(sign) == 2
        assert expected in capsys.readouterr().err
        assert not (own / "worker-1.crt").exists()
        os.chown(key, os.getuid(), os.getgid())
        os.chmod(key, 0o600)
    assert cli.main(sign) == 0 and (own / "worker-1.crt").exists()


def test_sign_uses_only_the_callers_own_private_ca_key(sites, tmp_path, capsys):
    check_sign_uses_only_the_callers_own_private_ca_key(sites[0], tmp_path, capsys)


def test_mutation_sign_reading_any_ca_key_is_detected(sites, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(keyfiles, "read_private", lambda path: open(path, "rb").read())
    with pytest.raises((AssertionError, pytest.fail.Exception)):
        check_sign_uses_only_the_callers_own_private_ca_key(sites[0], tmp_path, capsys)


def test_certs_verify_prints_the_sha256_of_the_file_and_of_each_certificate(sites, capsys):
    """What two sites read to each other before installing: computed here with hashlib from the DER bytes (as
    ``openssl x509 -fingerprint -sha256``) and from the file's bytes."""
    import hashlib  # pylint: disable=import-outside-toplevel
    import ssl  # pylint: disable=import-outside-toplevel

    root, _ = sites
    fed, own = root / "federation.json", root / "hospital-b" / "worker-0"
    capsys.readouterr()
    assert cli.main(["certs", "verify", "--federation", str(fed), "--dir", str(own), "--identity", "worker:0"]) == 0
    out = capsys.readouterr().out

    def sha256(pem):
        digest = hashlib.sha256(ssl.PEM_cert_to_DER_cert(pem.decode("ascii"))).hexdigest().upper()
        return ":".join(digest[i:i + 2] for i in range(0, len(digest), 2))

    assert f"{fed}: file SHA-256 {hashlib.sha256(fed.read_bytes()).hexdigest()}" in out, out
    for org, (identity, name) in PARTIES.items():
        ca_pem = (root / org / "ca" / "ca.crt").read_bytes()
        assert f"organisation {org} ({name}): CA certificate SHA-256 {sha256(ca_pem)}" in out, out
    cert = own / "worker-0.crt"
    assert f"worker:0: certificate {cert} SHA-256 {sha256(cert.read_bytes())}" in out, out


# ------------------------------------------------------------ expiry --

def test_a_certificate_expiring_soon_is_named_with_its_date(tmp_path, caplog):
    import datetime  # pylint: disable=import-outside-toplevel

    ca_cert, ca_key = certs.make_ca("t", validity_days=30)
    _, csr = certs.make_key_and_csr("chief", 0, "chief-0", "t")
    soon = datetime.datetime.now(datetime.timezone.utc) - datetime.timedelta(days=1)
    cert = certs.sign_csr(csr, ca_cert, ca_key, "t", validity_days=3, not_before=soon)
    with caplog.at_level("WARNING", logger="tfe_estimator"):
        messages = expiry.warn_expiring([("/x/chief-0.crt", cert), ("/x/ca.crt", ca_cert)])
    assert len(messages) == 1 and "/x/chief-0.crt" in messages[0] and "expires on" in messages[0]
    assert "/x/chief-0.crt" in caplog.text


# ------------------------------------------------------------ the launcher's task directories --

def _private_keys(directory):
    out = []
    for dirpath, _, files in os.walk(directory):
        for name in files:
            with open(os.path.join(dirpath, name), "rb") as f:
                if b"PRIVATE KEY" in f.read():
                    out.append(os.path.relpath(os.path.join(dirpath, name), directory))
    return sorted(out)


def check_launcher_task_dirs_hold_only_their_own_key(tmp_path):
    from tfe_estimator.cluster.launcher import Launcher  # pylint: disable=import-outside-toplevel
    from tfe_estimator.cluster.spec import TLS_DIR_ENV  # pylint: disable=import-outside-toplevel

    launcher = Launcher(["true"], workers=2, evaluator=True, cluster_mode="service",
                        task_cwd=str(tmp_path / "{job}-{index}"))
    launcher._write_certs()  # pylint: disable=protected-access  (what `run` does first; no process started)
    try:
        assert len(launcher.tasks) == 6
        for task in launcher.tasks:
            own = task.env[TLS_DIR_ENV]
            assert own == launcher.task_tls_dir(task.job, task.index)
            stem = f"{task.job}-{task.index}"
            assert sorted(os.listdir(own)) == sorted([f"{stem}.crt", f"{stem}.key", "federation.json"]), own
            assert _private_keys(own) == [f"{stem}.key"], own
            assert TlsFiles.from_dir(own, task.job, task.index).identity() == f"{task.job}:{task.index}"
        root = os.path.dirname(launcher.task_tls_dir("chief", 0))
        assert sorted(os.listdir(root)) == sorted(f"{t.job}-{t.index}" for t in launcher.tasks)  # nothing else
        assert oct(os.stat(root).st_mode & 0o777) == "0o700"
    finally:
        import shutil  # pylint: disable=import-outside-toplevel

        shutil.rmtree(os.path.dirname(launcher.task_tls_dir("chief", 0)), ignore_errors=True)


def test_launcher_task_dirs_hold_no_ca_key_and_no_other_tasks_key(tmp_path):
    check_launcher_task_dirs_hold_only_their_own_key(tmp_path)


def test_mutation_one_shared_certificate_directory_is_detected(tmp_path, monkeypatch):
    from tfe_estimator.identity import local  # pylint: disable=import-outside-toplevel

    def one_lab(root, tasks, cluster, validity_days=30):  # the old layout: CA key and every key in one directory
        tasks = list(tasks)
        certs.make_cluster_certs(root, tasks, cluster)
        for job, index in tasks:
            os.symlink(root, os.path.join(root, certs.task_name(job, index)))

    monkeypatch.setattr(local, "issue_task_dirs", one_lab)
    with pytest.raises((AssertionError, pytest.fail.Exception)):
        check_launcher_task_dirs_hold_only_their_own_key(tmp_path)


def test_launcher_identities_are_per_task_organisations(tmp_path):
    """The launcher's federation: a task's certificate is refused for any other identity."""
    from tfe_estimator.identity.local import issue_task_dirs  # pylint: disable=import-outside-toplevel

    dirs = issue_task_dirs(str(tmp_path / "run"), [("chief", 0), ("worker", 0), ("tfe", 0), ("tfe", 1)], "launch")
    chief = TlsFiles.from_dir(dirs[("chief", 0)], "chief", 0)
    fed = chief.trust()
    leaf = open(chief.cert, "rb").read()
    assert fed.check_peer("chief:0", leaf) is None
    assert "not by the CA of worker:0's organisation" in fed.check_peer("worker:0", leaf)
    assert fed.server_ca_pem(0) != fed.server_ca_pem(1)


# ------------------------------------------------------------ --isolate: each task its own mount and PID namespace --

def _isolated_reads(tmp_path, hide=True):
    """What chief:0, run as `launch --isolate` runs it, reads of its own and of worker:0's key; its visible PIDs."""
    import subprocess  # pylint: disable=import-outside-toplevel

    from tfe_estimator.cluster.isolation import IsolatedCluster  # pylint: disable=import-outside-toplevel

    missing = IsolatedCluster.missing(tls=False)
    if missing:
        pytest.skip(f"--isolate needs {missing}")
    tasks = [("chief", 0), ("worker", 0)]
    dirs = {}
    for job, index in tasks:
        own = tmp_path / f"{job}-{index}"
        own.mkdir()
        (own / f"{job}-{index}.key").write_text(f"key of {job}:{index}")
        dirs[(job, index)] = str(own)
    isolation = IsolatedCluster(tasks, tls=False, mode="service")
    if hide:
        isolation.set_private_dirs(dirs)
    isolation.start()
    try:
        def run(*argv):
            done = subprocess.run(isolation.exec_argv(("chief", 0), list(argv)), capture_output=True, text=True,
                                  timeout=30, check=False)
            return done.returncode, done.stdout.strip()

        return (run("cat", os.path.join(dirs[("chief", 0)], "chief-0.key")),
                run("cat", os.path.join(dirs[("worker", 0)], "worker-0.key")),
                run("sh", "-c", "ls /proc | grep -c '^[0-9]'"))
    finally:
        isolation.close()


def check_isolated_task_reads_only_its_own_key(tmp_path, hide=True):
    own, other, pids = _isolated_reads(tmp_path, hide)
    assert own == (0, "key of chief:0")
    assert other[0] != 0 and "key of" not in other[1], other
    assert pids[0] == 0 and int(pids[1]) < 10, pids  # its own PID namespace: no other task's /proc/<pid>/environ


def test_an_isolated_task_reads_its_own_key_and_no_other_tasks(tmp_path):
    check_isolated_task_reads_only_its_own_key(tmp_path)


def test_mutation_isolation_without_private_dirs_is_detected(tmp_path):
    with pytest.raises(AssertionError):
        check_isolated_task_reads_only_its_own_key(tmp_path, hide=False)


# ------------------------------------------------------------ renewal without a restart --

def test_a_server_takes_a_renewed_certificate_without_a_restart(sites, tmp_path):
    import shutil  # pylint: disable=import-outside-toplevel

    root, _ = sites
    own = tmp_path / "tfe-1"
    shutil.copytree(root / "operator-y" / "tfe-1", own)
    tls = TlsFiles.from_dir(str(own), "tfe", 1)
    server = AggregationServer(1, "localhost:0", OWNERS, tls, step_timeout_secs=WAIT)
    port = server.start()
    owner = _tls(root, "chief:0")
    try:
        before = diagnose.presented_certificate(f"localhost:{port}", owner.cert, owner.key)
        # Operator Y renews: a new key and certificate written in place, the server keeps running.
        ca = root / "operator-y" / "ca"
        key, csr = certs.make_key_and_csr("tfe", 1, "operator-y", CLUSTER)
        new_cert = certs.sign_csr(csr, (ca / "ca.crt").read_bytes(), (ca / "ca.key").read_bytes(), CLUSTER)
        keyfiles.write_private(tls.key, key)
        keyfiles.write_public(tls.cert, new_cert)
        after = diagnose.presented_certificate(f"localhost:{port}", owner.cert, owner.key)
        assert before.serial_number != after.serial_number
        assert after.serial_number == certs.load_certificate(new_cert, "new").serial_number
        _raw(f"localhost:{port}", 1, "Rewind", wire.messages()["RewindRequest"](step=0), owner)  # still serves
    finally:
        server.stop(0)


def test_certs_cli_refuses_foreign_key_files_and_a_swapped_key(sites, tmp_path, capsys):
    target = tmp_path / "ca.key"
    target.write_bytes(b"")
    os.chown(target, 12345, 12345)
    assert cli.main(["certs", "ca", "--org", "x", "--cluster", CLUSTER, "--dir", str(tmp_path)]) == 2
    assert "belongs to uid 12345" in capsys.readouterr().err
    root, _ = sites
    swapped = tmp_path / "swapped"
    swapped.mkdir()
    (swapped / "worker-0.crt").write_bytes((root / "hospital-b" / "worker-0" / "worker-0.crt").read_bytes())
    (swapped / "worker-0.key").write_bytes((root / "hospital-a" / "chief-0" / "chief-0.key").read_bytes())
    assert cli.main(["certs", "verify", "--federation", str(root / "federation.json"), "--dir", str(swapped),
                     "--identity", "worker:0"]) == 1
    assert "worker-0.key is not the key of" in capsys.readouterr().out


# ------------------------------------------------------------ Kubernetes: one party's Secret --

def check_party_secret_holds_only_its_own_files(root, tmp_path):
    import base64  # pylint: disable=import-outside-toplevel
    import shutil  # pylint: disable=import-outside-toplevel

    import yaml  # pylint: disable=import-outside-toplevel

    from tfe_estimator.identity.secret import party_secret  # pylint: disable=import-outside-toplevel

    own = tmp_path / "worker-0"
    shutil.copytree(root / "hospital-b" / "worker-0", own)
    shutil.copy(root / "hospital-b" / "ca" / "ca.key", own)  # careless: the organisation's CA key beside it
    shutil.copy(root / "hospital-a" / "chief-0" / "chief-0.key", own)  # and another party's key
    manifest = party_secret(str(own), "worker", 0, name="demo", namespace="hospital-b")
    assert sorted(manifest["data"]) == ["federation.json", "worker-0.crt", "worker-0.key"]
    keys = [k for k, v in manifest["data"].items() if b"PRIVATE KEY" in base64.b64decode(v)]
    assert keys == ["worker-0.key"], keys
    assert manifest["metadata"]["name"] == "demo-worker-0-tls"
    try:
        from kubernetes_validate import utils  # pylint: disable=import-outside-toplevel
    except ImportError:
        return
    utils.validate(yaml.safe_load(yaml.safe_dump(manifest)), utils.latest_version(), strict=True)


def test_a_partys_secret_holds_its_key_certificate_and_federation_only(sites, tmp_path):
    check_party_secret_holds_only_its_own_files(sites[0], tmp_path)


def test_mutation_a_secret_of_the_whole_directory_is_detected(sites, tmp_path, monkeypatch):
    import base64  # pylint: disable=import-outside-toplevel

    from tfe_estimator.identity import secret  # pylint: disable=import-outside-toplevel

    def whole_directory(directory, job, index, name, namespace=None, secret_name=""):
        data = {f: base64.b64encode(open(os.path.join(directory, f), "rb").read()).decode() for f in os.listdir(directory)}
        return {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": f"{name}-{job}-{index}-tls"}, "data": data}

    monkeypatch.setattr(secret, "party_secret", whole_directory)
    with pytest.raises(AssertionError):
        check_party_secret_holds_only_its_own_files(sites[0], tmp_path)


def test_certs_secret_prints_the_manifest(sites, capsys):
    import yaml  # pylint: disable=import-outside-toplevel

    root, _ = sites
    assert cli.main(["certs", "secret", "--dir", str(root / "operator-x" / "tfe-0"), "--identity", "tfe:0",
                     "--name", "demo"]) == 0
    manifest = yaml.safe_load(capsys.readouterr().out)
    assert manifest["kind"] == "Secret" and sorted(manifest["data"]) == ["federation.json", "tfe-0.crt", "tfe-0.key"]
