"""The benchmark's outputs: machine description, JSON, PNG plot, Markdown table."""
import datetime
import importlib.metadata
import json
import os
import platform
from typing import Dict, Optional

__all__ = ["machine", "write_json", "write_plot", "markdown", "target_of", "moonshot_of", "target_text",
           "floors_text"]

#: Step-time ratio targets (secure / plaintext) per model kind, the cluster's,
#: the upload per parameter, and the secure sum's extra ns per parameter per replica.
TARGET_LINEAR, TARGET_DNN, TARGET_CLUSTER, TARGET_UPLOAD, TARGET_EXTRA_NS = 1.15, 1.60, 1.30, 8.0, 3.0


def machine() -> Dict:
    """CPU model, cores, date and versions of the machine the benchmark runs on."""
    import tensorflow as tf  # pylint: disable=import-outside-toplevel

    cpu = "unknown"
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    versions = {"python": platform.python_version(), "tensorflow": tf.__version__}
    for module, dist in (("tensorflow_estimator", "tensorflow-estimator"), ("tf_encrypted", "tf-encrypted"),
                         ("tfe_estimator", "tfe-estimator")):
        try:
            versions[module] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            versions[module] = "?"
    return {"cpu": cpu, "cores": os.cpu_count(), "platform": platform.platform(),
            "date": datetime.datetime.now().isoformat(timespec="seconds"), "versions": versions}


def write_json(path: str, results: Dict) -> None:
    with open(path, "w") as f:
        json.dump(results, f, indent=2, sort_keys=False)


#: Service mode (mTLS) vs MultiWorkerMirroredStrategy, step ratios (issue 42's acceptance): LinearRegressor at
#: 1e5 and 1e6 parameters with 2 owners (and 3, and the 32-bit ring), its moonshot, DNNRegressor[512, 256, 128],
#: 4 and 8 owners, 1e7 parameters; and each owner's CPU per step against an MWMS owner's.
TARGET_SERVICE_LINEAR, TARGET_SERVICE_MOONSHOT, TARGET_SERVICE_DNN = 1.5, 1.3, 1.8
TARGET_SERVICE_OWNERS, TARGET_SERVICE_LARGE, TARGET_SERVICE_OWNER_CPU = 1.4, 2.0, 1.25


def target_of(case: Dict) -> float:
    """The case's step-ratio target (secure / plaintext)."""
    if case.get("service"):
        return (TARGET_SERVICE_DNN if case["model"] == "dnn" else
                TARGET_SERVICE_LARGE if case["features"] >= 10_000_000 else
                TARGET_SERVICE_OWNERS if case["replicas"] >= 4 else TARGET_SERVICE_LINEAR)
    if case["cluster"]:
        return TARGET_CLUSTER
    return TARGET_DNN if case["model"] == "dnn" else TARGET_LINEAR


def moonshot_of(case: Dict) -> Optional[float]:
    """The case's moonshot step ratio, beyond its target (service mode, 2 owners, LinearRegressor to 1e6), or None."""
    if case.get("service") and case["replicas"] == 2 and target_of(case) == TARGET_SERVICE_LINEAR:
        return TARGET_SERVICE_MOONSHOT
    return None


def target_text(case: Dict) -> str:
    """The case's printed goal: its target, and its moonshot where it has one."""
    moonshot = moonshot_of(case)
    return f"target <= {target_of(case):.2f}" + (f", moonshot {moonshot:.2f}" if moonshot is not None else "")


def _goal(targets: Dict) -> str:
    """A service case's step target, and its moonshot where it has one."""
    moonshot = targets.get("step_moonshot")
    return f"{targets['step']:.2f}" + (f", moonshot {moonshot:.2f}" if moonshot is not None else "")


def _ratio(value: Optional[float]) -> str:
    return "-" if value is None else f"{value:.2f}"


def _pair(floors: Dict, pick) -> str:
    """``cipher / transport`` of one figure of a case's floors (``-`` for a floor not measured)."""
    return " / ".join(f"{pick(floors[kind]):.{2 if pick(floors[kind]) < 10 else 1}f}" if kind in floors else "-"
                      for kind in ("cipher", "transport"))


def floors_text(case: Dict) -> str:
    """A service case's floors, printed: each role's CPU ns/param beside its AES / TLS-on-TCP floors, the owner's
    CPU and the step against MWMS beside their floors and targets, and the targets below a floor."""
    f = case["floors"]
    costs, measured, targets = f["ns_per_byte"], f["measured_ns_per_param"], f["targets"]
    tls = (f"TLS send {costs['tls_send']:.2f} / recv {costs['tls_recv']:.2f}" if costs["tls_send"] is not None
           else "TLS not measured")
    servers = ", ".join(f"server{k} {ns:.1f} ({_pair(f, lambda d, k=k: d['ns_per_param'][f'server{k}'])})"
                        for k, ns in enumerate(measured["servers"]) if ns is not None)
    text = (f"; ns/param beside AES / TLS-on-TCP floors (ns/B here: GCM {costs['gcm']:.2f}, CTR {costs['ctr']:.2f}, "
            f"{tls}; {f['cores']} cores): {servers + ', ' if servers else ''}owners "
            f"{', '.join(f'{v:.1f}' for v in measured['owners'].values())} (MWMS "
            f"{', '.join(f'{v:.1f}' for v in measured['mwms_owners'].values())}, + security "
            f"{_pair(f, lambda d: d['ns_per_param']['owner_security'])}); owner CPU {f['owner_cpu_ratio']:.2f}x "
            f"MWMS (floor {_pair(f, lambda d: d['owner_ratio'])}, target {targets['owner_cpu']:.2f}); step floor "
            f"{_pair(f, lambda d: d['step_ratio'])}x MWMS on {f['cores']} cores (target {_goal(targets)}); step CPU "
            f"{_ratio(f['cpu_ratio'])}x MWMS's (floor {_pair(f, lambda d: d['cpu_ratio'])})")
    return text + ("; " + "; ".join(f["below_floor"]) if f["below_floor"] else "")


def write_plot(path: str, results: Dict) -> None:
    """Ratio secure/plaintext vs parameters per case, and the secure sum's throughput."""
    import matplotlib  # pylint: disable=import-outside-toplevel

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel

    cases = results["cases"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    groups = {}
    for c in cases:
        key = ("service mode vs MWMS" if c.get("service") else "cluster" if c["cluster"]
               else f"{c['replicas']} local replicas") + f", {c['model']}"
        groups.setdefault(key, []).append(c)
    for key, members in groups.items():
        members = sorted(members, key=lambda c: c["params"])
        left.plot([c["params"] for c in members], [c["ratio"] for c in members], "o-", label=key)
        for c in members:
            left.annotate(c["name"], (c["params"], c["ratio"]), fontsize=7, xytext=(4, 4), textcoords="offset points")
    left.axhline(TARGET_LINEAR, color="green", ls="--", lw=1, label=f"target linear ({TARGET_LINEAR})")
    left.axhline(TARGET_DNN, color="purple", ls="--", lw=1, label=f"target DNN ({TARGET_DNN})")
    left.axhline(TARGET_CLUSTER, color="orange", ls="--", lw=1, label="target cluster (1.30)")
    left.axhline(1.0, color="gray", lw=0.5)
    left.set_xscale("log")
    left.set_xlabel("trainable parameters")
    left.set_ylabel("secure / plaintext time per step")
    left.set_title(f"Estimator training step (batch {results['settings']['batch_size']} per replica)")
    left.legend(fontsize=7)
    micro = results.get("secure_sum") or []
    if micro:
        sizes = [m["params"] for m in micro]
        right.plot(sizes, [m["extra_ns_per_param_per_replica"] for m in micro], "o-",
                   label="fused AES-CTR kernels (default)")
        right.plot(sizes, [m["reference_extra_ns_per_param_per_replica"] for m in micro], "s-",
                   label="tf-encrypted's Pond (reference)")
        right.axhline(TARGET_EXTRA_NS, color="green", ls="--", lw=1, label=f"target ({TARGET_EXTRA_NS} ns)")
        right.set_xscale("log")
        right.set_xlabel("parameters per replica")
        right.set_ylabel("extra ns per parameter per replica")
        right.set_title(f"Secure sum alone vs ReductionToOneDevice, {micro[0]['replicas']} replicas")
        right.legend(fontsize=7)
    m = results["machine"]
    fig.suptitle(f"tfe_estimator benchmark — {m['cpu']}, {m['cores']} cores, {m['date'][:10]}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _in_graph_anchor(case: Dict, cases) -> Dict:
    """The local case of this run with the same model and size on 2 replicas (in-graph `MirroredStrategy`), or {}."""
    return next((c for c in cases if not c["cluster"] and not c.get("service") and c["replicas"] == 2
                 and c["model"] == case["model"] and c["params"] == case["params"]), {})


def _service_anchors(cases) -> list:
    """The service-mode cases against both plaintext anchors a TensorFlow user would pick."""
    rows = []
    for c in cases:
        anchor = _in_graph_anchor(c, cases)
        if c.get("service") and anchor:
            mirrored = anchor["plaintext_ms_per_step"]
            rows.append(f"| {c['name']} | {c['params']:,} | {c['secure_ms_per_step']:.2f} | "
                        f"{c['plaintext_ms_per_step']:.2f} | {c['ratio']:.2f} | {mirrored:.2f} ({anchor['name']}) | "
                        f"{c['secure_ms_per_step'] / mirrored:.2f} |")
    if not rows:
        return []
    return [
        "",
        "Service-mode secure aggregation (2 owners, one process each) against both plaintext anchors of this "
        "run: `MultiWorkerMirroredStrategy` (independent workers, as above) and in-graph `MirroredStrategy` "
        "(the local case of the same model and size: 2 replicas in one process, no network hop, the floor of "
        "any multi-process anchor):",
        "",
        "| case | params | secure ms/step | MWMS ms/step | ratio | in-graph MirroredStrategy ms/step | ratio |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
        *rows,
    ]


def _service_distance(cases) -> list:
    """The service cases' round trips and bytes per step, and their step predicted at a distance."""
    rows = []
    for c in cases:
        if c.get("service") and "round_trips_per_step" in c:
            predicted = " | ".join(f"{v:.1f}" for v in c["predicted_ms_per_step"].values())
            rows.append(f"| {c['name']} | {c['round_trips_per_step']:g} | {c['bytes_per_owner_per_step']['up']:,.0f} | "
                        f"{c['bytes_per_owner_per_step']['down']:,.0f} | {c['secure_ms_per_step']:.2f} | {predicted} |")
    if not rows:
        return []
    links = next(c for c in cases if c.get("service") and "round_trips_per_step" in c)["predicted_ms_per_step"]
    relayed = [f"| {c['name']} | {r['rtt_ms']:g} | {c['sequential_calls_per_step']:g} | "
               f"{c['secure_ms_per_step']:.2f} | {r['predicted_ms_per_step']:.1f} | {r['measured_ms_per_step']:.1f} |"
               for c in cases if c.get("service") and (r := c.get("relayed_owner_links"))]
    if relayed:
        relayed = ["", "Checked (`--relay-rtt-ms`): the service twin again with each owner's links to the servers "
                   "through `tools.bench.relay` (server0 reaches server1 directly, so one round trip per call):", "",
                   "| case | RTT ms | round trips/step | loopback ms/step | predicted ms/step | measured ms/step |",
                   "| --- | ---: | ---: | ---: | ---: | ---: |", *relayed]
    return [
        "",
        "Service-mode cases at a distance: sequential round trips per step (Contribute calls that wait for "
        "each other x `distance.service_hops`: the owner's, and what is left of server0's forward to server1 "
        "once the key put when the step starts travelled during the model's compute, taken as the plaintext "
        "step; a step's sums travel together), bytes "
        "per owner and step, and the step predicted by "
        "`tools.bench.distance.predict_step_ms` (loopback step + round trips x RTT + bytes / bandwidth; "
        "`python -m tools.bench.distance` checks it through a delaying relay):",
        "",
        "| case | round trips/step | up B/owner/step | down B/owner/step | loopback ms/step | "
        + " | ".join(f"predicted ms/step, {k}" for k in links) + " |",
        "| --- | ---: | ---: | ---: | ---: | " + " | ".join("---:" for _ in links) + " |",
        *rows,
        *relayed,
    ]


def _service_floors(cases) -> list:
    """The service cases' CPU per parameter and per step beside this machine's floors (`tools.bench.floors`)."""
    rows = []
    for c in cases:
        f = c.get("floors")
        if not f:
            continue
        costs, measured, targets = f["ns_per_byte"], f["measured_ns_per_param"], f["targets"]
        tls = f"{costs['tls_send']:.2f} / {costs['tls_recv']:.2f}" if costs["tls_send"] is not None else "-"
        servers = [f"{ns:.1f} ({_pair(f, lambda d, k=k: d['ns_per_param'][f'server{k}'])})" if ns is not None
                   else "-" for k, ns in enumerate((measured["servers"] + [None, None])[:2])]
        owners = ", ".join(f"{v:.1f}" for v in measured["owners"].values())
        mwms = ", ".join(f"{v:.1f}" for v in measured["mwms_owners"].values())
        rows.append(f"| {c['name']} | {f['cores']} | {costs['gcm']:.2f}, {costs['ctr']:.2f}, {tls} | {servers[0]} | "
                    f"{servers[1]} | {owners} ({mwms}; + {_pair(f, lambda d: d['ns_per_param']['owner_security'])})"
                    f" | **{f['owner_cpu_ratio']:.2f}** ({_pair(f, lambda d: d['owner_ratio'])}; "
                    f"{targets['owner_cpu']:.2f}) | **{c['ratio']:.2f}** ({_pair(f, lambda d: d['step_ratio'])}; "
                    f"{_goal(targets)}) | **{_ratio(f['cpu_ratio'])}** ({_pair(f, lambda d: d['cpu_ratio'])}) | "
                    f"{'; '.join(f['below_floor']) or 'none'} |")
    if not rows:
        return []
    return [
        "",
        "Service-mode cases beside this machine's floors (`tools.bench.floors`), from per-byte costs measured in "
        "the same run right after each case: the cipher floor (AES alone: AES-128-GCM for every TLS byte, "
        "AES-128-CTR for masks and key expansion, the ring sums) / the transport floor (the data plane's TLS "
        "on loopback TCP as measured, plus the same AES-CTR and sums). Per parameter: each role's CPU beside "
        "its floors; an owner's CPU beside the MWMS owner's plus its security floor (masks, unmasks, its "
        "client's bytes). Ratios to MWMS: an owner's CPU (floor: (MWMS owner + security floor) / MWMS owner) "
        "and the step (floor: max(every process's floor CPU / cores, the MWMS step) / the MWMS step: it falls "
        "towards 1 when other processes load the machine); every process's CPU per step (owners and servers) "
        "over the MWMS owners' (floor: every process's floor CPU over the MWMS owners' CPU; CPU seconds, so it "
        "holds under load):",
        "",
        "| case | cores | ns/B: GCM, CTR, TLS send / recv | server0 ns/param (floors) | server1 ns/param "
        "(floors) | owners ns/param (MWMS owners; + security floors) | owner CPU x MWMS (floors; goal) | "
        "step x MWMS (floors; goal) | step CPU x MWMS (floors) | targets below a floor |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
        *rows,
    ]


def _owner_kernels(rows) -> list:
    """The service-mode owner's per-step kernels beside the AES-CTR floor (`tools.bench.owner_kernels`)."""
    if not rows:
        return []
    sizes = sorted({r["elements"] for r in rows})
    stages = list(dict.fromkeys(r["stage"] for r in rows))
    by = {(r["stage"], r["elements"]): r for r in rows}
    lines = ["", "A service-mode owner's kernels, each stage as its step runs it (64-bit ring, checked sum), in "
             "process CPU ns per parameter and in multiples of AES-128-CTR's keystream of one 8-byte word per "
             "parameter (`cryptography`, the floor of every pass that draws a mask or check coefficients), "
             "measured in the same run (`python -m tools.bench.owner_kernels`):", "",
             "| stage | " + " | ".join(f"{n:,} params: ns/param (x AES)" for n in sizes) + " |",
             "| --- | " + " | ".join("---:" for _ in sizes) + " |"]
    for stage in stages:
        cells = [by.get((stage, n)) for n in sizes]
        lines.append(f"| {stage} | " + " | ".join(f"{c['ns_per_param']:.2f} ({c['x_aes_floor']:.2f}x)" if c else "-"
                                                   for c in cells) + " |")
    return lines


def markdown(results: Dict, png_name: str = "benchmark.png") -> str:
    """BENCHMARKS.md: machine, method, the table, the secure sum alone, traffic."""
    m, s = results["machine"], results["settings"]
    v = m["versions"]
    lines = [
        f"## TensorFlow {v['tensorflow']}, Python {v['python']}",
        "",
        "Secure aggregation (`TfeRunConfig`, Pond, `precision=\"low\"`) against its plaintext twin "
        "(`MirroredStrategy` with `ReductionToOneDevice` on the same devices), measured side by side "
        "in one run by `tfe-estimator bench` (`python -m tools.bench`).",
        "",
        f"Machine: {m['cpu']}, {m['cores']} cores; {m['platform']}; {m['date']}. "
        f"Python {v['python']}, TensorFlow {v['tensorflow']}, tensorflow-estimator {v['tensorflow_estimator']}, "
        f"tf-encrypted {v['tf_encrypted']}, tfe_estimator {v['tfe_estimator']}.",
        "",
        f"Method: batch {s['batch_size']} per replica (one cached synthetic batch, repeated); each twin makes one "
        f"`train()` call in its own thread and the two take turns: {s['warmup']} warm-up steps each, then "
        f"{s['rounds']} rounds of {s['steps']} steps per twin, the order alternating per round. A hook times each "
        "step (`session.run` plus Estimator's own hooks); graph building, session creation and checkpoints are "
        "outside the timed steps. ms/step is the median over all timed steps; the ratio is the median over "
        "rounds of (secure round median / plaintext round median). Upload is counted from the training "
        "graph's edges from replica devices to TFE server devices (elements x dtype size, per distinct "
        "tensor and destination), divided by replicas and parameters.",
        "",
        "Service-mode cases (`svc-*`): one process per owner, so the twins cannot take turns in one process: "
        "the same loopback cluster is launched once per twin and round (order alternating); the plaintext "
        "anchor there is Estimator with `MultiWorkerMirroredStrategy` (collective ring all-reduce, whose "
        "volume is 2(N-1)/N x 4 bytes per parameter each way); ms/step is the chief's median over the timed "
        "steps of a launch; upload and download are per owner, what its client sent and received.",
        "",
        "| case | workload | params | secure ms/step | plaintext ms/step | ratio | target "
        "| upload B/param/replica/step | download |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for c in results["cases"]:
        target = target_of(c)
        mark = "" if c["ratio"] <= target else " (missed)"
        lines.append(
            f"| {c['name']} | {c['description']} | {c['params']:,} | {c['secure_ms_per_step']:.2f} | "
            f"{c['plaintext_ms_per_step']:.2f} | **{c['ratio']:.2f}**{mark} | {target_text(c)[len('target '):]} | "
            f"{c['upload_bytes_per_param_per_replica_per_step']:.3f} | "
            f"{c['download_bytes_per_param_per_replica_per_step']:.3f} |"
        )
    lines += _service_anchors(results["cases"])
    lines += _service_distance(results["cases"])
    lines += _service_floors(results["cases"])
    micro = results.get("secure_sum") or []
    if micro:
        lines += [
            "",
            f"The sum alone ({micro[0]['replicas']} replicas, float32 vector, plain graph session, result "
            "added into a variable on each replica), the default fused kernels and tf-encrypted's Pond "
            "(the reference implementation, with our AES-CTR generator) beside `ReductionToOneDevice`; "
            "extra = (secure - plaintext) / (params x replicas):",
            "",
            "| params | secure ms | reference ms | plaintext ms | extra ns/param/replica (target <= "
            f"{TARGET_EXTRA_NS:g}) | reference extra ns | up + down B/param/replica | 32-bit ring: extra ns, "
            "B/param/replica | plaintext B/param/replica |",
            "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
        ]
        for r in micro:
            mark = "" if r["extra_ns_per_param_per_replica"] <= TARGET_EXTRA_NS else " (missed)"
            lines.append(
                f"| {r['params']:,} | {r['secure_ms']:.2f} | {r['reference_ms']:.2f} | {r['plaintext_ms']:.2f} | "
                f"**{r['extra_ns_per_param_per_replica']:.2f}**{mark} | "
                f"{r['reference_extra_ns_per_param_per_replica']:.2f} | "
                f"{r['upload_bytes_per_param_per_replica']:.3f} + {r['download_bytes_per_param_per_replica']:.3f} | "
                f"{r['secure32_extra_ns_per_param_per_replica']:.2f}, "
                f"{r['secure32_bytes_per_param_per_replica']:.3f} | "
                f"{r['plaintext_bytes_per_param_per_replica']:.3f} |"
            )
        kinds = sorted({k for r in micro for k in r["secure_op_ms_by_kind"]})
        lines += [
            "",
            "Where the secure sum's time goes (one traced step: op time in ms summed over threads, by kind; "
            "the wall time of a step is the median above):",
            "",
            "| params | " + " | ".join(kinds) + " | wall ms |",
            "| ---: | " + " | ".join("---:" for _ in kinds) + " | ---: |",
        ]
        for r in micro:
            ops = r["secure_op_ms_by_kind"]
            lines.append(f"| {r['params']:,} | " + " | ".join(f"{ops.get(k, 0.0):.2f}" for k in kinds)
                         + f" | {r['secure_ms']:.2f} |")
    lines += _owner_kernels(results.get("owner_kernels") or [])
    lines += ["", f"![ratio vs model size]({png_name})", ""]
    return "\n".join(lines)
