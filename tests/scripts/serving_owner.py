"""A task that only serves its TensorFlow server (from TF_CONFIG) until ./stop exists, then exits 0.

Stands in for a data owner in tests/test_isolation.py: the attacks need every task's server up
for as long as they run, whatever the training does meanwhile.
"""
import json
import os
import time

import tensorflow as tf

config = json.loads(os.environ["TF_CONFIG"])
cluster = {job: addresses for job, addresses in config["cluster"].items()}
server = tf.distribute.Server(tf.train.ClusterSpec(cluster), job_name=config["task"]["type"],
                              task_index=config["task"]["index"], protocol="grpc", start=True)
print("serving", flush=True)
while not os.path.exists("stop"):
    time.sleep(0.2)
