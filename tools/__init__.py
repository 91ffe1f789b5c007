"""Developer tools, run from a checkout (not in the installed package):

- `tools.bench`: secure vs plaintext step time and bytes (``python -m tools.bench``, ``make bench``);
  `tools.bench.sampler_compare` compares two versions of the DP noise kernel; `tools.bench.service_alone`
  measures the aggregation service's CPU per parameter without TensorFlow; `tools.bench.floors` gives each
  service case's floors on this machine (AES alone, TLS on TCP); `tools.bench.distance` predicts its
  step at a round-trip time and bandwidth and checks it through `tools.bench.relay` (a delaying TCP relay).
- `tools.attack`: tries what ``launch --isolate --tls`` must stop (``python -m tools.attack``);
  `tools.attack_service` what a service-mode cluster (``launch --cluster-mode service``) must stop;
  `tools.portscan` the TCP scan of every port it runs on an isolated service cluster.

`tfe-estimator bench` and `tfe-estimator attack` run these when the checkout is at hand.
"""
import os
import pathlib

__all__ = ["CHECKOUT", "checkout_on_pythonpath"]

#: The checkout's root (the parent of this directory).
CHECKOUT = pathlib.Path(__file__).resolve().parents[1]


def checkout_on_pythonpath() -> None:
    """Puts the checkout on PYTHONPATH, so child processes (launched in other directories) import `tools`."""
    paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    if str(CHECKOUT) not in paths:
        os.environ["PYTHONPATH"] = os.pathsep.join([str(CHECKOUT), *paths])
