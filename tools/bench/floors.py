"""Service mode's floors on this machine: per-byte costs measured here, each role's floor, the owner's and the step's.

What a reader needs to tell "not yet fast enough" from "below this machine's floor". Every floor is built from
CPU costs per byte measured on this machine in the same run (`measure_costs`), at two levels:

- the **cipher floor** (AES alone): AES-128-GCM for every TLS byte and AES-128-CTR for every mask and key
  expansion (`cryptography`, cache-resident 1 MiB blocks, like ``openssl speed``), plus NumPy's ring sums:
  no TCP, no record layer, no copy; no TLS implementation can go below it;
- the **transport floor** (TLS on TCP as measured): the same bytes through the data plane's own TLS (Python's
  `ssl`, the servers' and owners' contexts) on a loopback TCP connection (`tls_costs`: OpenSSL's record path
  and the kernel's socket copies included), plus the same AES-CTR and ring sums.

Per parameter (`role_floors`), with N owners and w bytes per ring word (8 at the 64-bit ring, 4 at 32), and
``out``/``in`` the cost per byte sent/received (GCM/GCM for the cipher floor, TLS send/receive for transport)::

    server0 = w ((N + 1) (ctr + add) + out)    expands N owners' keys and its blind key, sums them, sends its part
    server1 = w ((N + 1) (in + add) + N out)   receives N shares and server0's part, sums them, sends each owner w
    client  = w (out + in)                     an owner's client: its share up, the masked sum down

For a case of the bench (`case_floors`, P parameters, the owner's client's measured bytes U up and D down per
step, the MWMS owners' measured CPU per step ``m_o``, the MWMS step ``T`` and C cores)::

    owner security = 2 w P ctr + U out + D in     masking and unmasking (AES-CTR over its ring words), its bytes
    owner floor    = mean(m_o) + owner security   (ratio to mean(m_o): the best owner-CPU ratio this machine allows)
    step CPU       = sum_o m_o + N owner security + P (server0 + server1)
    step floor     = max(step CPU / C, T)         (ratio to T: ``step_ratio``, the best step ratio allowed here)
    CPU floor      = step CPU / sum_o m_o         (``cpu_ratio``: the best ratio of a step's CPU to MWMS's)

The step floor is a lower bound: a step's processes cannot spend more CPU than C cores give in its wall time
(every process of a loopback case shares this machine's C cores), and a secure step does the MWMS step's model
work and a sum that moves at least MWMS's bytes (8 + 8 or 4 + 4 B/param against all-reduce's 4 + 4), so its
ratio to MWMS is at least 1. It is tight on an idle machine; on a loaded one other processes take cores, the
MWMS step keeps fewer than C busy and this floor falls towards 1x. The CPU floor depends on the load only
through the per-byte costs (CPU seconds, not wall time): it bounds the ratio of every process's CPU per step
(owners and servers) to the MWMS owners'. The two meet: the step ratio is at least the CPU ratio times the share
of the C cores the MWMS step kept busy (``sum_o m_o / (T C)``, 0.7-0.9 on this machine when it is quiet).

One simplification errs high: the MWMS owner's CPU keeps its own all-reduce ("less nothing"), which a secure
owner does not run; under the cipher floor that still holds (the secure owner moves at least those bytes
through TCP, which the cipher floor does not count), under the transport floor it counts the plain TCP of
all-reduce's 4 + 4 B/param twice (about 2 ns/param per owner here, at 0.25-0.32 ns/B).

Example::

    costs = measure_costs(certs_dir)                     # in the same run as the case
    figures = case_floors(costs, params=100_001, owners=2, word_bytes=8, up_bytes=800_158,
                          down_bytes=800_098, mwms_owner_cpu_ms=[8.9, 9.0], mwms_ms=9.8, cores=2)
    figures["transport"]["step_ratio"]                   # the best service / MWMS step ratio this machine allows
"""
import dataclasses
import os
import threading
import time
from typing import Callable, Dict, List, Optional, Sequence

import numpy as np

__all__ = ["ByteCosts", "measure_costs", "least", "tls_costs", "role_floors", "case_floors", "below_floor",
           "machine_cores"]

#: The two floors, in the order reported.
KINDS = ("cipher", "transport")


@dataclasses.dataclass(frozen=True)
class ByteCosts:
    """CPU nanoseconds per byte on this machine (`measure_costs`).

    Attributes:
      gcm: AES-128-GCM (a TLS record's cipher), `cryptography`.
      ctr: AES-128-CTR (a mask's or key expansion's keystream), `cryptography`.
      add: NumPy's uint64 ring addition, per byte of one operand.
      tls_send: the data plane's TLS on loopback TCP, sending (encrypt, TCP send); None if not measured.
      tls_recv: the same, receiving (TCP receive, decrypt, OpenSSL's copy into our buffer); None if not measured.
    """

    gcm: float
    ctr: float
    add: float
    tls_send: Optional[float] = None
    tls_recv: Optional[float] = None

    def per_byte(self, kind: str) -> Dict[str, float]:
        """The cost of a byte sent (``out``) and received (``in``) under floor `kind` ("cipher" or "transport")."""
        if kind == "cipher":
            return {"out": self.gcm, "in": self.gcm}
        if kind == "transport":
            if self.tls_send is None or self.tls_recv is None:
                raise ValueError("The transport floor needs the TLS costs: measure them with "
                                 "measure_costs(certs_dir) (a certificate directory, e.g. from make_cluster_certs).")
            return {"out": self.tls_send, "in": self.tls_recv}
        raise ValueError(f"Unknown floor kind {kind!r}: use one of {KINDS}.")


def _seconds_per_byte(run: Callable[[], object], nbytes: int, repeats: int = 5) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - start)
    return best / nbytes


def tls_costs(certs_dir: str, nbytes: int = 64 << 20) -> Dict[str, float]:
    """CPU seconds per byte of the data plane's transport on this machine: Python's `ssl` (the servers' and
    owners' own contexts, `TlsFiles.ssl_server_context`/``ssl_client_context``) on a loopback TCP connection,
    ``send`` (encrypt, TCP send) and ``recv`` (TCP receive, decrypt, OpenSSL's copy into our buffer), each
    measured on its own thread (``time.thread_time``: its kernel time included) over `nbytes`.

    `certs_dir` holds the certificates of tasks ``tfe:1`` and ``chief:0`` (`make_cluster_certs`)."""
    import socket  # pylint: disable=import-outside-toplevel

    from tfe_estimator.service.tls import TlsFiles, server_name  # pylint: disable=import-outside-toplevel

    server_tls, client_tls = TlsFiles.from_dir(certs_dir, "tfe", 1), TlsFiles.from_dir(certs_dir, "chief", 0)
    listener = socket.create_server(("127.0.0.1", 0))
    out: Dict[str, float] = {}

    def receive():
        raw, _ = listener.accept()
        with server_tls.ssl_server_context().wrap_socket(raw, server_side=True) as conn:
            view, got = memoryview(bytearray(8 << 20)), 0
            start = time.thread_time()
            while got < nbytes:
                got += conn.recv_into(view[got % view.nbytes:], view.nbytes - got % view.nbytes)
            out["recv"] = (time.thread_time() - start) / nbytes

    thread = threading.Thread(target=receive)
    thread.start()
    raw = socket.create_connection(listener.getsockname())
    with client_tls.ssl_client_context(1).wrap_socket(raw, server_hostname=server_name(client_tls, 1)) as conn:
        block = memoryview(bytearray(8 << 20))
        start = time.thread_time()
        for _ in range(nbytes // block.nbytes):
            conn.sendall(block)
        out["send"] = (time.thread_time() - start) / nbytes
        thread.join()
    listener.close()
    return out


def measure_costs(certs_dir: Optional[str] = None, tls_repeats: int = 3) -> ByteCosts:
    """This machine's `ByteCosts`, measured now: AES-128-GCM and AES-128-CTR (`cryptography`) into a preallocated
    buffer and NumPy's uint64 addition, each the best of 5 over 8 MiB in 1 MiB blocks (cache-resident); with
    `certs_dir`, also the data plane's TLS on loopback TCP (`tls_costs`), sending and receiving each the best of
    `tls_repeats` runs over 64 MiB (a floor: the least this machine's load let it cost)."""
    from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes  # pylint: disable=import-outside-toplevel

    block, into = bytes(1 << 20), bytearray((1 << 20) + 15)

    def speed(mode) -> float:  # seconds per byte, into a preallocated buffer (no allocation timed)
        encryptor = Cipher(algorithms.AES(bytes(16)), mode).encryptor()
        return _seconds_per_byte(lambda: [encryptor.update_into(block, into) for _ in range(8)], 8 * len(block))

    gcm_s, ctr_s = speed(modes.GCM(bytes(12))), speed(modes.CTR(bytes(16)))
    a, b = np.zeros(1 << 17, np.uint64), np.ones(1 << 17, np.uint64)
    add_s = _seconds_per_byte(lambda: [np.add(a, b, out=a) for _ in range(8)], 8 * a.nbytes)
    tls: Dict[str, float] = {}
    for _ in range(tls_repeats if certs_dir is not None else 0):  # the best of each direction, like AES's
        tls = {k: min(v, tls.get(k, v)) for k, v in tls_costs(certs_dir).items()}
    ns = 1e9
    return ByteCosts(gcm=ns * gcm_s, ctr=ns * ctr_s, add=ns * add_s,
                     tls_send=ns * tls["send"] if tls else None, tls_recv=ns * tls["recv"] if tls else None)


def least(*measured: ByteCosts) -> ByteCosts:
    """Each cost's least over several `measure_costs` of one case (e.g. before and after its launches): a floor
    is the cheapest the machine's load let a byte cost."""
    def lowest(name: str) -> Optional[float]:
        values = [getattr(m, name) for m in measured if getattr(m, name) is not None]
        return min(values) if values else None

    return ByteCosts(**{f.name: lowest(f.name) for f in dataclasses.fields(ByteCosts)})


def role_floors(costs: ByteCosts, owners: int, word_bytes: int = 8, kind: str = "cipher") -> Dict[str, float]:
    """Each role's floor in ns per parameter: ``server0``, ``server1`` and an owner's ``client`` (its transport
    alone, without masking), under floor `kind` ("cipher" or "transport"; the formulas in the module docstring)."""
    if owners < 1 or word_bytes not in (4, 8, 16):
        raise ValueError(f"role_floors(owners={owners}, word_bytes={word_bytes}): need owners >= 1 and a ring "
                         "word of 4, 8 or 16 bytes (update_ring_bits / 8).")
    byte = costs.per_byte(kind)
    w, n = word_bytes, owners
    return {"server0": w * ((n + 1) * (costs.ctr + costs.add) + byte["out"]),
            "server1": w * ((n + 1) * (byte["in"] + costs.add) + n * byte["out"]),
            "client": w * (byte["out"] + byte["in"])}


def machine_cores() -> int:
    """The cores this process may run on (its affinity), which every process of a loopback case shares."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def case_floors(costs: ByteCosts, *, params: int, owners: int, word_bytes: int, up_bytes: float,
                down_bytes: float, mwms_owner_cpu_ms: Sequence[float], mwms_ms: float,
                cores: int) -> Dict[str, Dict]:
    """A service case's floors, per kind ("cipher", "transport" when `costs` has the TLS costs).

    Args:
      params: trainable parameters (the sum's elements).
      owners: owners (one process each).
      word_bytes: the updates' ring word (8 or 4).
      up_bytes, down_bytes: what one owner's client sent and received per step (measured).
      mwms_owner_cpu_ms: each MWMS owner's CPU ms per step, measured in the same run.
      mwms_ms: the MWMS step (wall ms), measured in the same run.
      cores: the cores every process shares (`machine_cores`).

    Returns:
      Per kind: ``ns_per_param`` (``server0``, ``server1``, ``owner_security``: its masks and its client),
      ``owner_security_ms``, ``owner_cpu_ms`` (the mean MWMS owner's plus the owner's security floor),
      ``owner_ratio`` (to the mean MWMS owner's), ``step_cpu_ms`` (every process's floor CPU), ``step_ms``
      and ``step_ratio`` (to `mwms_ms`), ``cpu_ratio`` (``step_cpu_ms`` to the MWMS owners' CPU); the
      formulas in the module docstring.
    """
    if (owners < 1 or len(mwms_owner_cpu_ms) != owners or min(mwms_owner_cpu_ms) <= 0 or mwms_ms <= 0
            or cores < 1 or params < 1):
        raise ValueError(f"case_floors: need one positive MWMS owner CPU per owner ({owners}: got "
                         f"{list(mwms_owner_cpu_ms)}), a positive MWMS step (got {mwms_ms}), cores >= 1 (got "
                         f"{cores}) and params >= 1 (got {params}).")
    kinds = KINDS if costs.tls_send is not None and costs.tls_recv is not None else KINDS[:1]
    mwms_owner = sum(mwms_owner_cpu_ms) / owners
    out: Dict[str, Dict] = {}
    for kind in kinds:
        roles, byte = role_floors(costs, owners, word_bytes, kind), costs.per_byte(kind)
        security_ns = 2 * word_bytes * params * costs.ctr + up_bytes * byte["out"] + down_bytes * byte["in"]
        security_ms = security_ns / 1e6
        step_cpu_ms = (sum(mwms_owner_cpu_ms) + owners * security_ms
                       + params * (roles["server0"] + roles["server1"]) / 1e6)
        step_ms = max(step_cpu_ms / cores, mwms_ms)
        out[kind] = {"ns_per_param": {"server0": roles["server0"], "server1": roles["server1"],
                                      "owner_security": security_ns / params},
                     "owner_security_ms": security_ms, "owner_cpu_ms": mwms_owner + security_ms,
                     "owner_ratio": (mwms_owner + security_ms) / mwms_owner,
                     "step_cpu_ms": step_cpu_ms, "step_ms": step_ms, "step_ratio": step_ms / mwms_ms,
                     "cpu_ratio": step_cpu_ms / sum(mwms_owner_cpu_ms)}
    return out


def below_floor(floors: Dict[str, Dict], step_targets: Sequence[float], owner_target: float) -> List[str]:
    """The targets set below a floor of `case_floors` (step ratios, then the owner-CPU ratio), one sentence per
    target naming every floor it is below: empty when every target is at or above every floor."""
    checks = [("step", t, "step_ratio") for t in step_targets] + [("owner CPU", owner_target, "owner_ratio")]
    found = []
    for name, target, key in checks:
        under = [f"the {kind} floor {floors[kind][key]:.2f}x" for kind in KINDS
                 if kind in floors and target < floors[kind][key]]
        if under:
            found.append(f"the {name} target {target:.2f}x is below {' and '.join(under)}")
    return found
