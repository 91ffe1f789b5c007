"""The `tfe-estimator` command: `server`, `launch`, `demo`, `bench`, `k8s`.

Example::

    $ tfe-estimator demo                      # secure vs plaintext on one machine
    $ tfe-estimator demo --cluster            # the same on a loopback cluster
    $ tfe-estimator launch --workers 1 --evaluator -- python train.py
    $ TF_CONFIG=... tfe-estimator server      # one TFE party of a real cluster (service mode: --data-port 2223)
    $ TF_CONFIG=... tfe-estimator health      # in a server's environment: exit 0 when its server is SERVING
    $ tfe-estimator status --federation federation.json --tls-dir hospital-a/chief-0   # both servers, as you
    $ tfe-estimator bench                     # secure vs plaintext step time (from a checkout: tools/bench)
    $ tfe-estimator build-kernels             # compile the AES-CTR kernels ahead of time
    $ tfe-estimator k8s --name demo --image my/train:1 --workers 2 -- python train.py
    $ tfe-estimator certs --dir certs --workers 2 --cluster demo   # one lab: a CA and every task's key and cert
    $ tfe-estimator certs ca --org hospital-a --cluster demo --dir ca   # per organisation (docs/deployment.md)
"""
import argparse
import gc
import importlib
import logging
import pathlib
import sys
from typing import Optional, Sequence

from tfe_estimator._version import __version__
from tfe_estimator.cluster.probe import HEALTH_SUBCOMMAND, STATUS_SUBCOMMAND
from tfe_estimator.cluster.server import SERVER_SUBCOMMAND
from tfe_estimator.tools import certs_cli

__all__ = ["parse_args", "main"]


#: Subcommands whose arguments are parsed by the module that runs them.
_PASS_THROUGH = ("bench", "k8s")


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    """Parses the command line (without the program name)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] and argv[0] in _PASS_THROUGH:
        return argparse.Namespace(command=argv[0], args=argv[1:])
    parser = argparse.ArgumentParser(prog="tfe-estimator", description="Secure aggregation for TensorFlow Estimator.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    server = sub.add_parser(SERVER_SUBCOMMAND, help="run this task's TFE party server from TF_CONFIG and block")
    server.add_argument("--step-timeout-secs", type=float, default=None,
                        help="service mode: how long a put waits for the other owners (default 300)")
    server.add_argument("--max-elements", type=int, default=None,
                        help="service mode: the largest sum a channel may have, in parameters (default 2**27)")
    server.add_argument("--max-channels", type=int, default=None,
                        help="service mode: how many sums the server keeps (default 4096)")
    server.add_argument("--memory-budget-bytes", type=int, default=None,
                        help="service mode: bytes of steps the server may hold for all owners (default 4 GiB)")
    server.add_argument("--owner-memory-budget-bytes", type=int, default=None,
                        help="service mode: bytes one owner's puts may make the server hold, ring words and key "
                             "expansion counted (default 768 MiB)")
    server.add_argument("--max-waiting-puts", type=int, default=None,
                        help="service mode: calls one owner may keep waiting at once (default 8)")
    server.add_argument("--replay-window-steps", type=int, default=None,
                        help="service mode: released steps per sum whose answers are kept for owners restored from "
                             "an earlier checkpoint (default 64)")
    server.add_argument("--replay-window-bytes", type=int, default=None,
                        help="service mode: bytes of kept answers in all (default 1 GiB)")
    server.add_argument("--data-port", type=int, default=None,
                        help="service mode: also open the data plane (the large calls on mutual TLS without gRPC's "
                             "copies) on this port of the service port's host; 0 picks a free port. Default: none "
                             "(owners then send everything over gRPC); open it in the firewall like the service port")
    server.add_argument("--metrics-port", type=int, default=None,
                        help="service mode: serve Prometheus metrics at http://<bind host>:PORT/metrics (plain "
                             "HTTP, counts only: open it to the site's monitoring only); 0 picks a free port. "
                             "Default: none")
    server.add_argument("--tf-warnings", action="store_true",
                        help="in-graph mode: show TensorFlow's INFO lines (hidden by default)")

    health = sub.add_parser(HEALTH_SUBCOMMAND, help="in an aggregation server's environment (TF_CONFIG, "
                            "TFE_ESTIMATOR_TLS_DIR): ask its own server's gRPC health service; exit 0 when SERVING, "
                            "1 otherwise (Kubernetes probes run it)")
    health.add_argument("--target", default=None,
                        help="HOST:PORT to call instead of this host's port from TF_CONFIG")
    health.add_argument("--timeout", type=float, default=5.0, help="seconds to wait for the answer (default 5)")
    status = sub.add_parser(STATUS_SUBCOMMAND, help="ask both aggregation servers of a federation for their health, "
                            "as you (your certificate); exit 0 when both are SERVING")
    status.add_argument("--federation", default=None,
                        help="the federation file (default: the one in --tls-dir); its servers' addresses are "
                             "called (TF_CONFIG's when it has none)")
    status.add_argument("--tls-dir", default=None,
                        help="your certificate directory (default: $TFE_ESTIMATOR_TLS_DIR)")
    status.add_argument("--identity", default=None,
                        help="job:index of your certificate there (default: the only one)")
    status.add_argument("--timeout", type=float, default=5.0, help="seconds to wait per server (default 5)")

    launch = sub.add_parser("launch", help="run a whole cluster on loopback ports as local processes")
    launch.add_argument("--workers", type=int, default=1, help="workers besides the chief (default 1)")
    launch.add_argument("--evaluator", action="store_true", help="also run an evaluator task")
    launch.add_argument("--protocol", default="pond", help="tf-encrypted protocol: pond or aby3")
    launch.add_argument("--task-cwd", default=None,
                        help="working directory per task, with {job} and {index}, e.g. 'owners/{job}-{index}'")
    launch.add_argument("--max-restarts", type=int, default=0,
                        help="restart a dying worker or tfe task this often at the same address")
    launch.add_argument("--restart-delay", type=float, default=0.0, help="seconds to wait before a restart")
    launch.add_argument("--evaluator-restarts", type=int, default=2,
                        help="restart a dying evaluator this often; it never stops training (default 2)")
    launch.add_argument("--down-timeout", type=float, default=300.0,
                        help="stop the cluster when a worker or tfe task is down this many seconds (default 300)")
    launch.add_argument("--final-eval-timeout", type=float, default=600.0,
                        help="seconds the evaluator may take after the chief finished (default 600)")
    launch.add_argument("--log-dir", default=None,
                        help="write each task's output to LOG_DIR/<job>-<index>.log instead of the terminal")
    launch.add_argument("--tf-warnings", action="store_true",
                        help="show TensorFlow's deprecation warnings in the terminal (hidden by default; log files "
                             "keep them)")
    launch.add_argument("--cluster-mode", default="service",
                        help="service (the default, across organisations: every owner trains alone and only "
                             "connects out to two aggregation servers with mutual TLS) or in-graph (the chief "
                             "runs every task's graph; one organisation on a trusted network). The retired "
                             "between-graph mode is refused")
    launch.add_argument("--isolate", action="store_true",
                        help="run every task in its own network namespace on a private bridge (root), as "
                             "separate hosts")
    launch.add_argument("--tls", action="store_true",
                        help="with --isolate, in the TensorFlow-runtime modes: mutual TLS sidecars (stunnel) on "
                             "every link, certificates for the run, and a firewall that closes TensorFlow's ports to "
                             "everything but their own namespace (service mode has its own mutual TLS)")
    launch.add_argument("--link-rate", default=None,
                        help="with --isolate: limit every task's link to this rate (tc notation, e.g. 1gbit)")
    launch.add_argument("--network-file", default=None,
                        help="with --isolate: write the namespaces, addresses and ports to this JSON file; with "
                             "--cluster-mode service: the addresses and the run's certificate directory, and "
                             "with --isolate too the namespaces (for `tfe-estimator attack`)")
    launch.add_argument("cmd", nargs=argparse.REMAINDER, help="-- the training command")
    attack = sub.add_parser("attack", help="from outside the private network (and from each owner), try what "
                                           "--isolate --tls must stop; exit 1 if anything got through")
    attack.add_argument("--network", required=True, help="the file `launch --isolate --network-file` (or `launch "
                        "--cluster-mode service --network-file`) wrote")
    attack.add_argument("--read-file", default="/etc/hostname", help="the file the readfile attack tries to read")

    demo = sub.add_parser("demo", help="LinearRegressor on real data, secure vs plaintext")
    demo.add_argument("--cluster", action="store_true", help="on a loopback cluster (chief + workers + tfe)")
    demo.add_argument("--steps", type=int, default=None, help="training steps (default 400 local, 300 cluster)")
    demo.add_argument("--workers", type=int, default=1, help="with --cluster: workers besides the chief")
    demo.add_argument("--num-replicas", type=int, default=2, help="without --cluster: local replicas")
    demo.add_argument("--protocol", default="pond")

    build = sub.add_parser("build-kernels", help="compile the AES-CTR kernel library now (e.g. in an image)")
    build.add_argument("--force", action="store_true", help="recompile even if a cached build exists")

    certs_cli.add_parser(sub)  # certs, certs ca/request/sign/federation/verify

    sub.add_parser("bench", help="secure vs plaintext step time, side by side (see bench --help; from a checkout)")
    sub.add_parser("k8s", help="print Kubernetes manifests for a cluster (see k8s --help)")
    return parser.parse_args(argv)


def _run(args: argparse.Namespace) -> int:
    if args.command == SERVER_SUBCOMMAND:
        from tfe_estimator.cluster.quiet import quiet_this_process  # pylint: disable=import-outside-toplevel
        from tfe_estimator.cluster.server import run_server  # pylint: disable=import-outside-toplevel

        quiet_this_process(args.tf_warnings)  # before TensorFlow loads (in-graph mode's TensorFlow server)
        limits = {name: getattr(args, name) for name in (
            "step_timeout_secs", "max_elements", "max_channels", "memory_budget_bytes", "owner_memory_budget_bytes",
            "max_waiting_puts", "replay_window_steps", "replay_window_bytes") if getattr(args, name) is not None}
        return run_server(limits=limits, data_port=args.data_port, metrics_port=args.metrics_port)
    if args.command in (HEALTH_SUBCOMMAND, STATUS_SUBCOMMAND):
        from tfe_estimator.cluster import probe  # pylint: disable=import-outside-toplevel

        if args.command == HEALTH_SUBCOMMAND:
            return probe.run_health(target=args.target, timeout=args.timeout)
        return probe.run_status(federation=args.federation, tls_dir=args.tls_dir, identity=args.identity,
                                timeout=args.timeout)
    if args.command == "launch":
        from tfe_estimator.cluster.launcher import Launcher  # pylint: disable=import-outside-toplevel

        cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
        return Launcher(cmd, workers=args.workers, evaluator=args.evaluator, protocol=args.protocol,
                        task_cwd=args.task_cwd, max_restarts=args.max_restarts,
                        restart_delay=args.restart_delay, evaluator_restarts=args.evaluator_restarts,
                        down_timeout=args.down_timeout, final_eval_timeout=args.final_eval_timeout,
                        log_dir=args.log_dir, cluster_mode=args.cluster_mode, isolate=args.isolate,
                        tf_warnings=args.tf_warnings,
                        tls=args.tls, network_file=args.network_file, link_rate=args.link_rate).run()
    if args.command == "attack":
        attack = _checkout_tool("attack")
        return attack.main(["--network", args.network, "--read-file", args.read_file])
    if args.command == "demo":
        return _demo(args)
    if args.command == "build-kernels":
        from tfe_estimator.secure import kernels  # pylint: disable=import-outside-toplevel

        kernels.build(force=args.force)
        kernels.load()  # and prove it: load it and run the known-answer test
        print(kernels.library_path())
        return 0
    if args.command == "certs":
        return certs_cli.run(args)
    if args.command == "bench":
        return _checkout_tool("bench").main(args.args)
    if args.command == "k8s":
        from tfe_estimator.cluster import kubernetes  # pylint: disable=import-outside-toplevel

        return kubernetes.main(args.args)
    raise AssertionError(args.command)  # argparse allows only the commands above


def _checkout_tool(name: str):
    """`tools.<name>` of the source checkout: developer tools are not part of the installed package.

    Found when the checkout is on sys.path (``python -m tfe_estimator.tools.cli`` from its root) or when
    this package is the checkout's own (an editable install).

    Raises:
      ValueError: naming the tool, where it lives and how to run it.
    """
    checkout = pathlib.Path(__file__).resolve().parents[2]
    if (checkout / "tools" / "__init__.py").is_file() and str(checkout) not in sys.path:
        sys.path.append(str(checkout))
    try:
        return importlib.import_module(f"tools.{name}")
    except ImportError as e:
        if not (e.name or "").startswith("tools"):
            raise
        raise ValueError(
            f"`tfe-estimator {name}` is a developer tool that lives in the source checkout (tools/{name}), not "
            f"in the installed package. Run it from a checkout of tfe_estimator: `python -m tools.{name} ...` "
            "(with the package installed, e.g. `pip install -e .`)."
        ) from None


def _demo(args: argparse.Namespace) -> int:
    import tensorflow as tf  # pylint: disable=import-outside-toplevel

    from tfe_estimator.tools.demo import format_comparison, run_local_demo  # pylint: disable=import-outside-toplevel

    tf.compat.v1.logging.set_verbosity(tf.compat.v1.logging.ERROR)
    if args.cluster:
        from tfe_estimator.tools.demo_cluster import run_cluster_demo  # pylint: disable=import-outside-toplevel

        from tfe_estimator.cluster.isolation import IsolatedCluster  # pylint: disable=import-outside-toplevel

        missing = IsolatedCluster.missing(tls=True)
        print("cluster demo: every task in its own network namespace, every link mutual TLS (--isolate --tls)"
              if missing is None else f"cluster demo: on loopback ports, without --isolate --tls (it needs {missing})",
              flush=True)
        results = run_cluster_demo(steps=args.steps or 300, workers=args.workers, protocol=args.protocol,
                                   isolate_tls=missing is None)
        where = "namespaces with mutual TLS" if missing is None else "loopback"
        title = (f"LinearRegressor on the diabetes data, cluster ({where}): chief + {args.workers} worker(s), "
                 f"each reading only its own share, + 3 tfe servers ({args.protocol})")
    else:
        results = run_local_demo(steps=args.steps or 400, num_replicas=args.num_replicas, protocol=args.protocol)
        title = f"LinearRegressor on the diabetes data, {args.num_replicas} local replicas ({args.protocol})"
    print(format_comparison(results, title))
    # The plaintext twin's MirroredStrategy owns a thread pool; collecting it
    # now, not at interpreter exit, avoids a spurious "Pool.__del__" traceback.
    gc.collect()
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of the `tfe-estimator` console script."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    try:
        return _run(parse_args(argv))
    except ValueError as e:  # bad input: one clear line, not a traceback
        print(f"tfe-estimator: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
