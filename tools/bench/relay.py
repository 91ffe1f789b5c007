"""A latency-adding TCP relay on loopback: the distance between owners and servers, without ``netem``.

`DelayRelay` listens on a loopback port and copies every connection to a
target ``host:port``, holding each chunk for ``rtt_ms / 2`` in each direction
(so a request and its answer pay one round-trip time) and, with
``bandwidth_bytes_per_s``, also for the time its bytes take on a link of that
rate (per connection and direction: one owner's link to one server). The bytes
pass unchanged: the TLS session is end to end between the owner and the
server, and the owners' channels pin the server's certificate name by
``grpc.ssl_target_name_override``, so an owner pointed at the relay's port
still verifies the real server. The relay buffers what it holds (no back
pressure), like a long link full of data; it does not model TCP's congestion
window over a real distance (its own sockets are on loopback).

It runs an asyncio loop in a thread of this process (`start`/`close`, or a
``with`` block), or, for the benchmark, in its own process (run as a script: it
imports nothing of the checkout, so not TensorFlow either)::

    python tools/bench/relay.py --rtt-ms 20 --target localhost:7000 --target localhost:7001

which prints ``relay ports <p0>,<p1>`` (one per target, in order) and relays
until its stdin closes or it is terminated.

Example::

    with DelayRelay("localhost:7001", rtt_ms=20) as relay:
        client = OwnerClient(("localhost:7000", relay.address), tls)  # server1 20 ms away
"""
import argparse
import asyncio
import logging
import signal
import socket
import sys
import threading
from typing import Dict, List, Optional, Sequence, Set

__all__ = ["DelayRelay", "main"]

_LOG = logging.getLogger("tfe_estimator")
#: Bytes read per chunk from either side.
_CHUNK = 1 << 16


class DelayRelay:
    """Relays TCP connections from a loopback port to `target`, each direction delayed by ``rtt_ms / 2``.

    Args:
      target: ``"host:port"`` to relay to.
      rtt_ms: the round-trip time to add (>= 0), half in each direction.
      bandwidth_bytes_per_s: optional rate of each connection's link per direction (None: unlimited).
      port: the port to listen on (0 picks a free one; `port` tells which after `start`).

    Counters (`bytes_up`: client to target, `bytes_down`: target to client) count the relayed bytes.
    """

    def __init__(self, target: str, rtt_ms: float, bandwidth_bytes_per_s: Optional[float] = None,
                 port: int = 0) -> None:
        host, _, target_port = str(target).rpartition(":")
        if not host or not target_port.isdigit():
            raise ValueError(f"target={target!r} must be 'host:port', e.g. 'localhost:7001'.")
        if isinstance(rtt_ms, bool) or not isinstance(rtt_ms, (int, float)) or not rtt_ms >= 0:
            raise ValueError(f"rtt_ms={rtt_ms!r} must be a number >= 0 (milliseconds of round trip to add).")
        if bandwidth_bytes_per_s is not None and not bandwidth_bytes_per_s > 0:
            raise ValueError(f"bandwidth_bytes_per_s={bandwidth_bytes_per_s!r} must be > 0, or None for no limit.")
        self._target = (host.strip("[]"), int(target_port))
        self._half = float(rtt_ms) / 2e3
        self._rate = None if bandwidth_bytes_per_s is None else float(bandwidth_bytes_per_s)
        self.port = int(port)
        self.bytes_up = self.bytes_down = self.connections = 0
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._thread: Optional[threading.Thread] = None
        self._server: Optional[asyncio.base_events.Server] = None
        self._tasks: Set[asyncio.Task] = set()
        self._writers: Set[asyncio.StreamWriter] = set()

    @property
    def address(self) -> str:
        """``"localhost:<port>"``: where to point a client instead of the target."""
        return f"localhost:{self.port}"

    def start(self) -> "DelayRelay":
        """Listens (in a thread running its own event loop); returns self once the port is bound."""
        if self._thread is not None:
            raise RuntimeError(f"the relay to {self._target} is already started; make another DelayRelay.")
        self._loop = asyncio.new_event_loop()
        bound = threading.Event()
        failure: List[BaseException] = []

        def run() -> None:
            asyncio.set_event_loop(self._loop)
            try:
                self._server = self._loop.run_until_complete(
                    asyncio.start_server(self._accept, "localhost", self.port, family=socket.AF_INET))
                self.port = self._server.sockets[0].getsockname()[1]
            except BaseException as e:  # pylint: disable=broad-except  # reported by start()
                failure.append(e)
                bound.set()
                return
            bound.set()
            self._loop.run_forever()
            self._loop.run_until_complete(self._shutdown())
            self._loop.close()

        self._thread = threading.Thread(target=run, name=f"delay-relay-{self._target[1]}", daemon=True)
        self._thread.start()
        bound.wait()
        if failure:
            self._thread.join()
            raise RuntimeError(f"the relay cannot listen on localhost:{self.port}: {failure[0]}") from failure[0]
        _LOG.info("relay localhost:%d -> %s:%d, rtt %.1f ms", self.port, *self._target, 2e3 * self._half)
        return self

    def close(self) -> None:
        """Stops listening, closes every relayed connection and joins the thread (nothing is left running)."""
        if self._thread is None:
            return
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        if self._thread.is_alive():
            raise RuntimeError(f"the relay to {self._target} did not stop within 10 s")
        self._thread = None

    def __enter__(self) -> "DelayRelay":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    async def _shutdown(self) -> None:
        self._server.close()
        for writer in list(self._writers):
            writer.transport.abort()
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await self._server.wait_closed()

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._tasks.add(asyncio.current_task())
        self._writers.add(writer)
        self.connections += 1
        try:
            up_reader, up_writer = await asyncio.open_connection(*self._target)
        except OSError as e:
            _LOG.warning("relay to %s:%d: %s", *self._target, e)
            writer.transport.abort()
            self._writers.discard(writer)
            self._tasks.discard(asyncio.current_task())
            return
        self._writers.add(up_writer)
        pipes = [asyncio.ensure_future(self._pipe(reader, up_writer, "up")),
                 asyncio.ensure_future(self._pipe(up_reader, writer, "down"))]
        try:  # until both sides closed, or either failed (e.g. reset): then the connection ends
            await asyncio.wait(pipes, return_when=asyncio.FIRST_EXCEPTION)
        finally:
            for pipe in pipes:
                pipe.cancel()
            await asyncio.gather(*pipes, return_exceptions=True)
            for w in (writer, up_writer):
                w.transport.abort()
                self._writers.discard(w)
            self._tasks.discard(asyncio.current_task())

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, direction: str) -> None:
        """Copies reader to writer; each chunk leaves after the link's time for its bytes plus half the RTT."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()

        async def send() -> None:
            while True:
                due, data = await queue.get()
                wait = due - loop.time()
                if wait > 0:
                    await asyncio.sleep(wait)
                if not data:
                    if writer.can_write_eof():
                        writer.write_eof()
                    return
                writer.write(data)
                await writer.drain()

        sender = asyncio.ensure_future(send())
        link_free = loop.time()
        try:
            while True:
                data = await reader.read(_CHUNK)
                now = loop.time()
                if self._rate is not None:  # the link sends one chunk after another at its rate
                    link_free = max(now, link_free) + len(data) / self._rate
                    now = link_free
                queue.put_nowait((now + self._half, data))
                if direction == "up":
                    self.bytes_up += len(data)
                else:
                    self.bytes_down += len(data)
                if not data:
                    break
            await sender
        finally:
            sender.cancel()


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Relays each ``--target`` from its own loopback port; prints ``relay ports p0,p1,...``."""
    parser = argparse.ArgumentParser(prog="python tools/bench/relay.py", description=__doc__.split("\n")[0])
    parser.add_argument("--target", action="append", required=True, help="host:port to relay to (repeatable)")
    parser.add_argument("--rtt-ms", type=float, required=True, help="round-trip time to add, ms")
    parser.add_argument("--bandwidth-mbps", type=float, default=None,
                        help="each connection's rate per direction, megabits/s (default unlimited)")
    args = parser.parse_args(argv)
    rate = None if args.bandwidth_mbps is None else args.bandwidth_mbps * 1e6 / 8
    relays = [DelayRelay(t, args.rtt_ms, rate).start() for t in args.target]
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    print("relay ports " + ",".join(str(r.port) for r in relays), flush=True)
    threading.Thread(target=lambda: (sys.stdin.read(), stop.set()), daemon=True).start()
    stop.wait()
    counts: Dict[str, int] = {"up": sum(r.bytes_up for r in relays), "down": sum(r.bytes_down for r in relays)}
    for relay in relays:
        relay.close()
    print(f"relay bytes up {counts['up']} down {counts['down']}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
