"""The bench's distance tools: the delaying relay (`tools.bench.relay`) and the step prediction (`distance`)."""
import doctest
import os
import socket
import threading
import time

import pytest

from tools.bench import distance, service_case
from tools.bench.relay import DelayRelay


class _EchoServer:
    """A loopback TCP server that echoes every byte back, until closed."""

    def __init__(self):
        self.sock = socket.create_server(("localhost", 0))
        self.address = f"localhost:{self.sock.getsockname()[1]}"
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self):
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._echo, args=(conn,), daemon=True).start()

    @staticmethod
    def _echo(conn):
        with conn:
            while True:
                data = conn.recv(1 << 16)
                if not data:
                    return
                conn.sendall(data)

    def close(self):
        self.sock.shutdown(socket.SHUT_RDWR)  # wakes the accept()
        self.sock.close()
        self._thread.join(timeout=5)


@pytest.fixture
def echo():
    server = _EchoServer()
    yield server
    server.close()


def _round_trip(conn: socket.socket, payload: bytes) -> bytes:
    conn.sendall(payload)
    received = bytearray()
    while len(received) < len(payload):
        chunk = conn.recv(1 << 16)
        assert chunk, "the relay closed the connection early"
        received += chunk
    return bytes(received)


def _relay_threads():
    return [t for t in threading.enumerate() if t.name.startswith("delay-relay-")]


def test_the_relay_delays_each_round_trip_by_its_rtt_and_passes_bytes_unchanged(echo):
    payload = os.urandom(1 << 20)  # 1 MiB: many chunks each way
    with DelayRelay(echo.address, rtt_ms=100) as relay:
        with socket.create_connection(("localhost", relay.port)) as conn:
            assert _round_trip(conn, b"warm") == b"warm"
            start = time.perf_counter()
            assert _round_trip(conn, b"x" * 100) == b"x" * 100
            small = time.perf_counter() - start
            assert _round_trip(conn, payload) == payload  # unchanged, in order
        assert relay.bytes_up == relay.bytes_down == 4 + 100 + len(payload)
    # One round trip through the relay: ~100 ms (a loaded machine may add some; never less).
    assert 0.095 <= small < 0.6, small


def test_the_relay_limits_bandwidth(echo):
    payload = os.urandom(200_000)
    with DelayRelay(echo.address, rtt_ms=0, bandwidth_bytes_per_s=2e6) as relay:
        with socket.create_connection(("localhost", relay.port)) as conn:
            start = time.perf_counter()
            assert _round_trip(conn, payload) == payload
            elapsed = time.perf_counter() - start
    # 200 kB up and back at 2 MB/s per direction: ~0.1 s each way, pipelined by chunk (>= 0.1 s in all).
    assert 0.1 <= elapsed < 1.0, elapsed


def test_the_relay_closes_cleanly_with_connections_open(echo):
    relay = DelayRelay(echo.address, rtt_ms=20).start()
    port = relay.port
    conn = socket.create_connection(("localhost", port))
    assert _round_trip(conn, b"hello") == b"hello"
    relay.close()
    # Nothing left running: the thread ended, the port no longer listens, the open connection was closed.
    assert not _relay_threads()
    conn.settimeout(5)
    assert conn.recv(10) == b""
    conn.close()
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("localhost", port), timeout=2).close()
    relay.close()  # idempotent


def test_the_relay_refuses_bad_settings_by_name():
    with pytest.raises(ValueError, match="target='nohost'"):
        DelayRelay("nohost", rtt_ms=1)
    with pytest.raises(ValueError, match="rtt_ms=-1"):
        DelayRelay("localhost:1", rtt_ms=-1)
    with pytest.raises(ValueError, match="bandwidth_bytes_per_s=0"):
        DelayRelay("localhost:1", rtt_ms=1, bandwidth_bytes_per_s=0)


def test_the_prediction_adds_round_trips_and_transfer_time():
    # Execute: 10 ms on loopback, 2 round trips, 1 MB up and 1 MB down per owner.
    at_20ms = distance.predict_step_ms(10.0, 2, 1e6, 1e6, rtt_ms=20)
    at_20ms_100mbps = distance.predict_step_ms(10.0, 2, 1e6, 1e6, rtt_ms=20, bandwidth_bytes_per_s=12.5e6)
    # Assert: loopback + 2 x 20 ms; then + 2 MB at 12.5 MB/s = 160 ms.
    assert at_20ms == pytest.approx(50.0)
    assert at_20ms_100mbps == pytest.approx(210.0)
    assert distance.predict_step_ms(10.0, 2, 1e6, 1e6, rtt_ms=0) == pytest.approx(10.0)
    assert distance.SERVICE_HOPS == 1.5
    assert doctest.testmod(distance, verbose=False).failed == 0
    with pytest.raises(ValueError, match="rtt_ms=-5"):
        distance.predict_step_ms(10.0, 2, 1e6, 1e6, rtt_ms=-5)
    # The key put when the step starts travels during the model's compute (the bench takes the plaintext step):
    # half a round trip of compute or more leaves one round trip per call, less leaves the rest of the half.
    assert distance.service_hops(20.0, compute_ms=12.0, key_early=True) == 1.0
    assert distance.service_hops(20.0, compute_ms=4.0, key_early=True) == pytest.approx(1.3)
    assert distance.service_hops(20.0, compute_ms=12.0) == 1.5
    row = {"sequential_calls_per_step": 1, "plaintext_ms_per_step": 4.0, "secure_ms_per_step": 10.0,
           "upload_bytes_per_step": 0, "download_bytes_per_step": 0}
    figures = service_case._distance_figures(row)  # pylint: disable=protected-access
    assert figures["round_trips_per_step"] == pytest.approx(1.0 + 0.5 - 4.0 / service_case.DISTANCE_RTT_MS)
    with pytest.raises(ValueError, match="bandwidth_bytes_per_s=0"):
        distance.predict_step_ms(10.0, 2, 1e6, 1e6, rtt_ms=5, bandwidth_bytes_per_s=0)


def test_the_relay_process_prints_its_ports_relays_and_ends_when_its_stdin_closes(echo):
    import subprocess
    import sys

    from tools.bench import relay as relay_module

    process = subprocess.Popen([sys.executable, relay_module.__file__, "--rtt-ms", "10", "--target", echo.address],
                               stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        port = int(process.stdout.readline().split()[-1])
        with socket.create_connection(("localhost", port)) as conn:
            assert _round_trip(conn, b"ping") == b"ping"
        process.stdin.close()
        assert process.wait(timeout=10) == 0
        assert process.stdout.read().strip() == "relay bytes up 4 down 4"
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def test_the_service_through_the_relay_pays_one_and_a_half_round_trips_per_contribution(tmp_path):
    import subprocess

    from tfe_estimator.cluster import certs
    from tools.bench.service_alone import measure

    certs.make_cluster_certs(str(tmp_path), [("chief", 0), ("worker", 0), ("tfe", 0), ("tfe", 1)], cluster="bench")
    # Execute: 2 owners, 1,000 elements, every link 100 ms away (TLS end to end through the relay).
    relayed = measure(1000, 3, 2, str(tmp_path), rtt_ms=100)
    # Assert: one Contribute per step, 8 B per element each way (and the sealed blind keys), the owner's round trip
    # plus server0's forward to server1 per step (the prediction's SERVICE_HOPS), and not server1's release
    # travelling back to server0 before the owners are answered (2 round trips: 200 ms and more).
    assert distance.SERVICE_HOPS == 1.5 and relayed["calls_per_step"] == 1
    assert 8000 < relayed["up_bytes"] < 8200 and 8000 < relayed["down_bytes"] < 8200
    assert 1.5 * 100 * 0.95 <= relayed["ms_per_step"] < 1.9 * 100, relayed
    pids = ",".join(str(p) for p in relayed["server_pids"])
    assert subprocess.run(["ps", "-p", pids], capture_output=True, check=False).returncode == 1


def test_a_key_put_before_the_owners_compute_hides_server0s_forward(tmp_path):
    from tfe_estimator.cluster import certs
    from tools.bench.service_alone import measure

    certs.make_cluster_certs(str(tmp_path), [("chief", 0), ("worker", 0), ("tfe", 0), ("tfe", 1)], cluster="bench")
    # Execute: every link 100 ms away, 60 ms of compute per step, the key put on server0 before it.
    early = measure(1000, 3, 2, str(tmp_path), rtt_ms=100, compute_ms=60, key_early=True)
    # Assert: the compute plus the owner's own round trip (server0's forward, 50 ms, travelled during the
    # compute), not the 1.5 round trips of a key put with its share (210 ms and more).
    assert distance.service_hops(100, 60, key_early=True) == 1.0 and distance.service_hops(100, 60) == 1.5
    assert 60 + 100 * 0.95 <= early["ms_per_step"] < 60 + 1.25 * 100, early
    assert early["calls_per_step"] == 1
