"""The service-mode case: each owner in its own process, secure vs MultiWorkerMirroredStrategy.

In service mode every data owner is its own process with its own graph and
session, so the two twins cannot take turns inside one process as the local
cases do (`tools.bench.timing`). Instead the case launches the same loopback
cluster (`tfe-estimator launch --cluster-mode service`: the owners and the two
aggregation servers) once per twin and round, alternating the order per round:

- ``service``: `TfeRunConfig` on the cluster (service mode: the owners sum
  through the aggregation servers with mutual TLS);
- ``mwms``: the plaintext anchor a TensorFlow user would pick for
  independent workers: Estimator with ``MultiWorkerMirroredStrategy``
  (collective ring all-reduce between the owners on their TF_CONFIG ports; the
  ``tfe`` job is removed from its TF_CONFIG, which that strategy does not
  accept, and the aggregation servers idle).

Every owner runs ``train_and_evaluate`` for the warm-up plus the timed
steps; a hook times each step (``session.run`` plus Estimator's hooks). The
step time of a launch is the chief's median over its timed steps (the owners
move in lockstep: each step's sum waits for both). The ratio is the median
over rounds of (service / mwms) of the same round. Bytes per parameter per
owner per step are what the owner's client sent and received; the ring
all-reduce's are ``2 (N - 1) / N x 4`` bytes each way (float32), its
algorithm's volume.

Example::

    row = run_service_case(Workload("svc-linear-1e5", "linear", 100_000, service=True),
                           {"batch_size": 32, "rounds": 2, "steps": 10, "warmup": 5,
                            "protocol": "pond"}, "/tmp/svc")
"""
import dataclasses
import json
import os
import statistics
import sys
import time
from typing import Dict, List, Optional

import tensorflow as tf

from tools.bench import traffic
from tools.bench.workloads import Workload, estimator_settings, input_fn, make_estimator

__all__ = ["run_service_case", "run_owner_task", "process_cpu_seconds", "TWINS"]

#: Service mode: owners through the aggregation service (mTLS) and the MultiWorkerMirroredStrategy anchor,
#: in the order of even rounds.
TWINS = ("service", "mwms")
#: The service twin with each owner's links to the servers through `tools.bench.relay` (``--relay-rtt-ms``).
RELAYED = "service-relayed"
#: Environment of a service-mode owner task: the aggregation servers' pids (comma-separated), for their CPU.
SERVER_PIDS_ENV = "TFE_BENCH_SERVER_PIDS"
#: Parameters from which a case runs once, short (a 1e7-parameter step moves ~160 MB per owner).
_SHORT_PARAMS = 10**7
#: Bytes of one float32 value.
_FLOAT_BYTES = 4
#: The distance at which the service cases' step is predicted (`tools.bench.distance.predict_step_ms`):
#: owners and servers 20 ms apart, on 1 Gbit/s links.
DISTANCE_RTT_MS, DISTANCE_MBPS = 20.0, 1000.0


def run_service_case(workload: Workload, settings: Dict, workdir: str) -> Dict:
    """Launches each twin once per round on a loopback cluster of `workload.replicas` owners."""
    twins = TWINS + ((RELAYED,) if settings.get("relay_rtt_ms") is not None else ())
    rounds = max(1, settings["rounds"] // 3)  # a launch costs seconds: fewer, longer rounds
    timed = settings["steps"] * 3
    if workload.features >= _SHORT_PARAMS:  # "it works": one short launch per twin
        rounds, timed, settings = 1, min(timed, 6), dict(settings, warmup=min(settings["warmup"], 2))
    costs_before = _measure_costs(workdir)  # this machine's per-byte costs, before and after the launches
    launches: Dict[str, List[Dict]] = {twin: [] for twin in twins}
    for k in range(rounds):
        for twin in (twins if k % 2 == 0 else tuple(reversed(twins))):
            launches[twin].append(_launch(workload, settings, twin, timed, os.path.join(workdir, f"{twin}-{k}")))
    secure_ms = [r["chief"]["ms_per_step"] for r in launches[twins[0]]]
    plain_ms = [r["chief"]["ms_per_step"] for r in launches[twins[1]]]
    traffic = dict(launches[twins[0]][0]["chief"])
    owners, params = workload.replicas, traffic["params"]
    # What the owner's client sent and received.
    traffic.update(upload=traffic["client_sent"], download=traffic["client_received"],
                   upload_edges=traffic["contributions_per_step"])
    ring = 2 * (owners - 1) / owners * _FLOAT_BYTES
    row = dict(dataclasses.asdict(workload), description=workload.describe())
    row.update(
        secure_ms_per_step=statistics.median(secure_ms),
        plaintext_ms_per_step=statistics.median(plain_ms),
        ratio=statistics.median(s / p for s, p in zip(secure_ms, plain_ms)),
        round_ratios=[s / p for s, p in zip(secure_ms, plain_ms)],
        secure_round_ms=secure_ms, plaintext_round_ms=plain_ms,
        plaintext_anchor="MultiWorkerMirroredStrategy (collective ring all-reduce)",
        timed_steps={"secure": timed * rounds, "plaintext": timed * rounds},
        params=params,
        upload_bytes_per_step=traffic["upload"], upload_edges=traffic["upload_edges"],
        download_bytes_per_step=traffic["download"],
        upload_bytes_per_param_per_replica_per_step=traffic["upload"] / params,
        download_bytes_per_param_per_replica_per_step=traffic["download"] / params,
        plaintext_bytes_per_param_per_owner_per_step={"up": ring, "down": ring},
        owner_ms_per_step={twin: [{o: r[o]["ms_per_step"] for o in r} for r in launches[twin]] for twin in twins},
    )
    row.update(_service_figures(launches, params, rounds))
    row.update(_distance_figures(row))
    row["floors"] = _floor_figures(row, workload, costs_before, _measure_costs(workdir))
    if RELAYED in launches:  # checked: the same cluster with each owner's links through a delaying relay
        rtt = settings["relay_rtt_ms"]
        relayed = statistics.median(r["chief"]["ms_per_step"] for r in launches[RELAYED])
        from tools.bench.distance import predict_step_ms  # pylint: disable=import-outside-toplevel

        # Only the owners' links are relayed (server0 reaches server1 directly): one round trip per call.
        predicted = predict_step_ms(row["secure_ms_per_step"], row["sequential_calls_per_step"],
                                    row["upload_bytes_per_step"], row["download_bytes_per_step"], rtt)
        row["relayed_owner_links"] = {"rtt_ms": rtt, "measured_ms_per_step": relayed, "predicted_ms_per_step":
                                      predicted, "round_ms": [r["chief"]["ms_per_step"] for r in launches[RELAYED]]}
    return row


def _distance_figures(row: Dict) -> Dict:
    """Round trips and bytes per owner and step, and the step predicted at `DISTANCE_RTT_MS` (`tools.bench.distance`).

    Bytes are the chief's client's per step (each owner sends and receives the same); round trips are its
    sequential Contribute calls per step (`in_flight.Tickets.waves`: a step's sums travel together) x
    `distance.service_hops` (the owner's, and what is left of server0's forward to server1, one way, once the
    key put when the step starts travelled during the model's compute, taken as the plaintext step).
    """
    from tools.bench.distance import predict_step_ms, service_hops  # pylint: disable=import-outside-toplevel

    hops = service_hops(DISTANCE_RTT_MS, compute_ms=row["plaintext_ms_per_step"], key_early=True)
    round_trips = row["sequential_calls_per_step"] * hops
    up, down = row["upload_bytes_per_step"], row["download_bytes_per_step"]
    return {"round_trips_per_step": round_trips,
            "bytes_per_owner_per_step": {"up": up, "down": down},
            "predicted_ms_per_step": {f"rtt {DISTANCE_RTT_MS:g} ms": predict_step_ms(
                row["secure_ms_per_step"], round_trips, up, down, DISTANCE_RTT_MS),
                f"rtt {DISTANCE_RTT_MS:g} ms, {DISTANCE_MBPS:g} Mbit/s": predict_step_ms(
                row["secure_ms_per_step"], round_trips, up, down, DISTANCE_RTT_MS, DISTANCE_MBPS * 1e6 / 8)}}


def _measure_costs(workdir: str):
    """This machine's per-byte costs now (`tools.bench.floors.measure_costs`), on certificates of their own."""
    from tfe_estimator.cluster import certs  # pylint: disable=import-outside-toplevel
    from tools.bench import floors  # pylint: disable=import-outside-toplevel

    certs_dir = os.path.join(workdir, "floor-certs")
    os.makedirs(workdir, exist_ok=True)
    if not os.path.exists(certs_dir):
        certs.make_cluster_certs(certs_dir, [("chief", 0), ("tfe", 1)], cluster="bench-floors")
    return floors.measure_costs(certs_dir)


def _floor_figures(row: Dict, workload: Workload, *measured) -> Dict:
    """Each role's CPU per parameter beside its floors, and the owner's and the step's floors (`tools.bench.floors`).

    The per-byte costs are the least of those `measured` just before and just after the case's launches (each
    the best of a few runs): they move with the machine's load like the case's figures, and a transient burst of
    load on the measurement would raise a floor. Measured ns/param are CPU ms per step / params (per
    owner for the owners); ``cpu_ratio`` is every process's CPU per step (owners and servers) over the MWMS
    owners'; the targets are the case's step target (`report.target_of`) and the owner's
    (`report.TARGET_SERVICE_OWNER_CPU`), each said to be below a floor when it is.
    """
    from tools.bench import floors, report  # pylint: disable=import-outside-toplevel

    costs = floors.least(*measured)
    cpu, params, cores = row["cpu_ms_per_step"], row["params"], floors.machine_cores()
    per_param = lambda ms: None if ms is None else 1e6 * ms / params  # noqa: E731
    mwms = list(cpu["mwms_owners"].values())
    figures = floors.case_floors(costs, params=params, owners=workload.replicas,
                                 word_bytes=workload.update_ring_bits // 8,
                                 up_bytes=row["upload_bytes_per_step"], down_bytes=row["download_bytes_per_step"],
                                 mwms_owner_cpu_ms=mwms, mwms_ms=row["plaintext_ms_per_step"], cores=cores)
    service_owner = statistics.mean(cpu["service_owners"].values())
    targets = {"step": report.target_of(row), "step_moonshot": report.moonshot_of(row),
               "owner_cpu": report.TARGET_SERVICE_OWNER_CPU}
    steps = [t for t in (targets["step"], targets["step_moonshot"]) if t is not None]
    return {"ns_per_byte": dataclasses.asdict(costs), "cores": cores,
            "measured_ns_per_param": {
                "servers": [per_param(ms) for ms in cpu["servers"]],
                "owners": {o: per_param(ms) for o, ms in cpu["service_owners"].items()},
                "mwms_owners": {o: per_param(ms) for o, ms in cpu["mwms_owners"].items()}},
            "owner_cpu_ratio": service_owner / statistics.mean(mwms),
            # every process's CPU: None without both servers' (never a ratio that leaves a server out)
            "cpu_ratio": ((sum(cpu["service_owners"].values()) + sum(cpu["servers"])) / sum(mwms)
                          if len(cpu["servers"]) == 2 and None not in cpu["servers"] else None),
            **figures, "targets": targets,
            "below_floor": floors.below_floor(figures, steps, targets["owner_cpu"])}


def _service_figures(launches: Dict[str, List[Dict]], params: int, rounds: int) -> Dict:
    """Service mode: bytes each owner's client sent and received, and CPU per step of servers and owners.

    Bytes are the serialized Contribute messages of the owner's client (`OwnerClient.bytes_sent` and
    ``bytes_received``: payloads plus the few bytes of the other fields, before gRPC framing and TLS),
    per parameter and timed step; CPU is user + system time per timed step, of each owner's process
    (``getrusage``) and of each aggregation server's (``/proc/<pid>/task/*/schedstat``) over the chief's
    timed steps; the medians over rounds.
    """
    runs = launches["service"]
    owners = sorted(runs[0])
    median = lambda values: statistics.median(values) if values else None  # noqa: E731
    figures = {
        "service_bytes_per_param_per_owner_per_step": {
            "up": median([r[o]["client_sent"] / params for r in runs for o in owners]),
            "down": median([r[o]["client_received"] / params for r in runs for o in owners])},
        "cpu_ms_per_step": {
            "service_owners": {o: median([r[o]["cpu_ms_per_step"] for r in runs]) for o in owners},
            "mwms_owners": {o: median([r[o]["cpu_ms_per_step"] for r in launches["mwms"]]) for o in owners},
            "servers": [median([r["chief"]["server_cpu_ms_per_step"][k] for r in runs])
                        for k in range(len(runs[0]["chief"].get("server_cpu_ms_per_step", [])))]},
        "contributions_per_step": runs[0]["chief"]["contributions_per_step"],
        "sequential_calls_per_step": runs[0]["chief"]["sequential_calls_per_step"],
        "launches_per_twin": rounds,
    }
    return figures


class _BenchLauncher:
    """Makes a `Launcher` that tells each owner the aggregation servers' pids (started before the owners)."""

    @staticmethod
    def make(**kwargs):
        from tfe_estimator.cluster.launcher import Launcher  # pylint: disable=import-outside-toplevel
        from tfe_estimator.cluster.spec import TFE_JOB  # pylint: disable=import-outside-toplevel

        class Bench(Launcher):
            def _start(self, task):  # pylint: disable=arguments-renamed
                if task.job != TFE_JOB:
                    pids = [str(t.process.pid) for t in sorted(self.tasks, key=lambda t: t.index)
                            if t.job == TFE_JOB and t.process is not None]
                    task.env = dict(task.env, **{SERVER_PIDS_ENV: ",".join(pids)})
                super()._start(task)

        return Bench(**kwargs)


def _launch(workload: Workload, settings: Dict, twin: str, timed: int, workdir: str) -> Dict:
    """One run of `twin` on a fresh loopback cluster; every owner's result, by task."""
    os.makedirs(workdir, exist_ok=True)
    task = {"workload": dataclasses.asdict(workload), "settings": settings, "twin": twin, "timed": timed}
    command = [sys.executable, "-m", "tools.bench", "--owner-task", json.dumps(task)]
    log_path = os.path.join(workdir, "launch.log")
    with open(log_path, "w") as log:
        status = _BenchLauncher.make(command=command, workers=workload.replicas - 1, evaluator=False,
                                     protocol=settings["protocol"], task_cwd=os.path.join(workdir, "{job}-{index}"),
                                     out=log, cluster_mode="service",
                                     # the relay relays the servers' gRPC ports only: a relayed twin stays on them
                                     data_plane=twin != RELAYED).run()
    results = {}
    for entry in sorted(os.listdir(workdir)):
        path = os.path.join(workdir, entry, "result.json")
        if os.path.exists(path):
            with open(path) as f:
                results[entry.split("-")[0] if entry.startswith("chief") else entry] = json.load(f)
    if status != 0 or len(results) != workload.replicas:
        with open(log_path) as f:
            tail = "".join(f.readlines()[-40:])
        raise RuntimeError(f"the service-mode case {workload.name} ({twin}) failed with status {status}:\n{tail}")
    return results


def run_owner_task(task: Dict) -> int:
    """One owner of a `_launch`: trains its twin in the cwd and writes ``result.json``."""
    from tfe_estimator.cluster.spec import TFE_JOB, TfeCluster  # pylint: disable=import-outside-toplevel

    tf.compat.v1.logging.set_verbosity(tf.compat.v1.logging.ERROR)
    workload = Workload(**{k: tuple(v) if isinstance(v, list) else v for k, v in task["workload"].items()})
    settings, twin = task["settings"], task["twin"]
    cluster = TfeCluster.from_environment()
    kwargs = estimator_settings(os.path.abspath("model"))
    relays = []
    if twin == RELAYED:  # this owner reaches each server through its own delaying relay (TLS end to end)
        from tools.bench.relay import DelayRelay  # pylint: disable=import-outside-toplevel

        tf_config = json.loads(os.environ["TF_CONFIG"])
        relays = [DelayRelay(a, settings["relay_rtt_ms"]).start() for a in tf_config["cluster"][TFE_JOB]]
        tf_config["cluster"][TFE_JOB] = [r.address for r in relays]
        os.environ["TF_CONFIG"] = json.dumps(tf_config)
    if twin != "mwms":  # service mode
        from tfe_estimator.distribute.run_config import TfeRunConfig  # pylint: disable=import-outside-toplevel

        config = TfeRunConfig(protocol=settings["protocol"], update_ring_bits=workload.update_ring_bits,
                              clip_norm=workload.clip_norm, **kwargs)
    else:
        tf_config = json.loads(os.environ["TF_CONFIG"])
        del tf_config["cluster"][TFE_JOB]  # MultiWorkerMirroredStrategy accepts chief/worker/evaluator/ps only
        os.environ["TF_CONFIG"] = json.dumps(tf_config)
        strategy = tf.compat.v1.distribute.experimental.MultiWorkerMirroredStrategy()
        config = tf.estimator.RunConfig(train_distribute=strategy, **kwargs)
    timer = _StepTimes(settings["warmup"], timed=task["timed"], service=twin != "mwms",
                       chief=cluster.task_type == "chief")
    estimator = make_estimator(workload, config)
    data = input_fn(workload.features, settings["batch_size"])
    try:
        tf.estimator.train_and_evaluate(
            estimator, tf.estimator.TrainSpec(data, max_steps=settings["warmup"] + task["timed"], hooks=[timer]),
            tf.estimator.EvalSpec(data, steps=1))
    finally:
        for relay in relays:
            relay.close()
    result = {"ms_per_step": 1e3 * statistics.median(timer.times), "timed_steps": len(timer.times), **timer.graph,
              **timer.usage}
    with open("result.json", "w") as f:
        json.dump(result, f)
    return 0


class _StepTimes(tf.estimator.SessionRunHook):
    """Records each step's wall time after `warmup` steps, the model's size, and CPU and bytes per step."""

    def __init__(self, warmup: int, timed: int = 0, service: bool = False, chief: bool = False) -> None:
        self.times: List[float] = []
        self.graph: Dict = {}
        self.usage: Dict = {}
        self._timed, self._service, self._chief = timed, service, chief
        self._usage_start: Optional[Dict] = None
        self._warmup = warmup
        self._start = 0.0
        self._steps = 0

    def begin(self):
        graph = tf.compat.v1.get_default_graph()
        self.graph["params"] = traffic.trainable_parameters(graph)

    def before_run(self, run_context):
        self._start = time.perf_counter()

    def after_run(self, run_context, run_values):
        self._steps += 1
        if self._steps > self._warmup:
            self.times.append(time.perf_counter() - self._start)
        if self._steps == self._warmup:
            self._usage_start = _usage(self._service, self._chief)
        elif self._steps == self._warmup + self._timed and self._usage_start is not None:
            end, start, steps = _usage(self._service, self._chief), self._usage_start, self._timed
            self.usage["cpu_ms_per_step"] = 1e3 * (end["cpu"] - start["cpu"]) / steps
            if self._service:
                self.usage.update(client_sent=(end["sent"] - start["sent"]) / steps,
                                  client_received=(end["received"] - start["received"]) / steps,
                                  contributions_per_step=(end["calls"] - start["calls"]) / steps,
                                  sequential_calls_per_step=(end["waves"] - start["waves"]) / steps)
            if "servers" in end:
                self.usage["server_cpu_ms_per_step"] = [1e3 * (b - a) / steps
                                                        for a, b in zip(start["servers"], end["servers"])]


def _usage(service: bool, chief: bool) -> Dict:
    """This process's CPU seconds so far; in service mode its client's bytes, and on the chief the servers' CPU."""
    import resource  # pylint: disable=import-outside-toplevel

    rusage = resource.getrusage(resource.RUSAGE_SELF)
    usage = {"cpu": rusage.ru_utime + rusage.ru_stime}
    if service:
        from tfe_estimator.owner.in_flight import TICKETS  # pylint: disable=import-outside-toplevel
        from tfe_estimator.service.client import live_clients  # pylint: disable=import-outside-toplevel

        clients = live_clients()
        usage.update(sent=sum(c.bytes_sent for c in clients), received=sum(c.bytes_received for c in clients),
                     calls=sum(c.contributions for c in clients), waves=TICKETS.waves)
    pids = [p for p in os.environ.get(SERVER_PIDS_ENV, "").split(",") if p]
    if chief and pids:
        usage["servers"] = [process_cpu_seconds(int(pid)) for pid in pids]
    return usage


def process_cpu_seconds(pid: int) -> float:
    """CPU seconds (user + system) of process `pid`'s live threads, in nanoseconds' precision (schedstat)."""
    total = 0
    for thread in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{thread}/schedstat") as f:
                total += int(f.read().split()[0])
        except OSError:  # the thread ended
            pass
    return total / 1e9
