"""The demo's cluster task (`tfe_estimator.tools.demo_cluster`), then its TensorFlow server until ./stop exists.

tests/test_isolation.py trains through an isolated cluster and then attacks that same cluster: the chief
trains, writes ./trained and goes on serving (its server outlives the training: TensorFlow's gRPC server
cannot be stopped), the worker serves the chief's session as in any in-graph run, and the evaluator only
serves, as tests/scripts/serving_owner.py does (the attacks need every task's server up).

Usage: train_then_serve.py DEMO_CLUSTER_ARGS...
"""
import json
import os
import runpy
import sys
import time

from tfe_estimator.tools import demo_cluster

if json.loads(os.environ["TF_CONFIG"])["task"]["type"] == "evaluator":
    runpy.run_path(os.path.join(os.path.dirname(os.path.abspath(__file__)), "serving_owner.py"))
    sys.exit(0)
status = demo_cluster.main(sys.argv[1:])
with open("trained", "w", encoding="utf-8") as f:
    f.write(str(status))
while not os.path.exists("stop"):
    time.sleep(0.2)
sys.exit(status)
