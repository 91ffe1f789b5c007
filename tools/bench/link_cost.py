"""The owner's data-plane link alone: CPU per byte of one call, Python's `ssl` link beside the C link.

One loopback TLS server thread (Python's `ssl`, the servers' own context)
reads each request frame and answers with a message of the same size; the
caller's thread runs ``link.call`` with the payload from an array and the
answer read into a reused buffer, and its CPU (``time.thread_time``: the
kernel's send and receive included, the server's thread not) is divided by
the bytes moved both ways. The links alternate; each figure is the best of
`--repeats` calls (a floor: the least this machine's load let it cost).
`tools.bench.service_alone --link python c` measures the same links inside
whole steps.

Run::

    PYTHONPATH=. python -m tools.bench.link_cost --megabytes 8 --repeats 5
"""
import argparse
import socket
import sys
import tempfile
import threading
import time
from typing import Dict, Optional, Sequence

import numpy as np

__all__ = ["link_costs", "main"]


def _answer(raw: socket.socket, context) -> None:
    """Answers each request on one connection with a message of its payload's size."""
    import grpc  # pylint: disable=import-outside-toplevel

    from tfe_estimator.service import frames  # pylint: disable=import-outside-toplevel

    with context.wrap_socket(raw, server_side=True) as conn:
        buffer = bytearray(0)
        while True:
            header = frames.read_exact(conn, frames.REQUEST.size)
            if header is None:
                return
            _, head, meta, payload = frames.parse_request(header)
            frames.read_exact(conn, head + meta)
            if len(buffer) < payload:
                buffer = bytearray(payload)
            frames.read_into(conn, memoryview(buffer)[:payload])
            conn.sendall(frames.reply_header(grpc.StatusCode.OK, payload))
            conn.sendall(memoryview(buffer)[:payload])


def _serve(listener: socket.socket, context, stop: threading.Event) -> None:
    """Each connection on a thread of its own (the two links each hold one)."""
    while not stop.is_set():
        try:
            raw, _ = listener.accept()
        except OSError:
            return
        threading.Thread(target=_answer, args=(raw, context), daemon=True).start()


def link_costs(certs_dir: str, nbytes: int = 8 << 20, repeats: int = 5) -> Dict[str, float]:
    """``{"python": ns/B, "c": ns/B}``: the calling thread's CPU per byte moved (up and down) of one call of
    `nbytes` each way, the best of `repeats` calls of each link, alternated. `certs_dir` holds the certificates
    of tasks ``tfe:1`` and ``chief:0``."""
    from tfe_estimator.service.data_link import DataLink  # pylint: disable=import-outside-toplevel
    from tfe_estimator.service.native_link import NativeLink  # pylint: disable=import-outside-toplevel
    from tfe_estimator.service.tls import TlsFiles, server_name  # pylint: disable=import-outside-toplevel

    server_tls, tls = TlsFiles.from_dir(certs_dir, "tfe", 1), TlsFiles.from_dir(certs_dir, "chief", 0)
    listener, stop = socket.create_server(("127.0.0.1", 0)), threading.Event()
    thread = threading.Thread(target=_serve, args=(listener, server_tls.ssl_server_context(), stop), daemon=True)
    thread.start()
    port, name = listener.getsockname()[1], server_name(tls, 1)
    links = {"python": DataLink("127.0.0.1", port, tls.ssl_client_context(1), name),
             "c": NativeLink("127.0.0.1", port, tls, 1, name)}
    payload, into = np.ones(nbytes // 8, np.int64), bytearray(nbytes)
    best: Dict[str, float] = {}
    try:
        for counted in [False] + [True] * repeats:  # the first call of each link connects: not counted
            for kind, link in links.items():
                start = time.thread_time()
                link.call("Contribute", b"h", b"", payload, 60.0, into=into)
                spent = (time.thread_time() - start) / (2 * nbytes) * 1e9
                if counted:
                    best[kind] = min(spent, best.get(kind, spent))
    finally:
        for link in links.values():
            link.close()
        stop.set()
        listener.shutdown(socket.SHUT_RDWR)
        listener.close()
        thread.join(30)
    return best


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.bench.link_cost", description=__doc__.split("\n")[0])
    parser.add_argument("--megabytes", type=int, default=8, help="bytes each way per call, in MiB (default 8)")
    parser.add_argument("--repeats", type=int, default=5, help="calls of each link counted (default 5)")
    args = parser.parse_args(argv)
    from tfe_estimator.cluster import certs  # pylint: disable=import-outside-toplevel

    with tempfile.TemporaryDirectory(prefix="tfe-link-cost-") as certs_dir:
        certs.make_cluster_certs(certs_dir, [("chief", 0), ("tfe", 1)], cluster="bench")
        costs = link_costs(certs_dir, args.megabytes << 20, args.repeats)
    print(f"[link-cost] {args.megabytes} MiB each way per call, caller's CPU per byte moved (best of "
          f"{args.repeats}): python link {costs['python']:.3f} ns/B, c link {costs['c']:.3f} ns/B, "
          f"c/python {costs['c'] / costs['python']:.2f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
