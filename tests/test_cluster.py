"""TF_CONFIG validation: every bad cluster is refused with a clear error."""
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tfe_estimator.cluster.spec import TfeCluster, cluster_jobs, cluster_tasks, tf_config_json

GOOD = {
    "chief": ["h0:2222"],
    "worker": ["h1:2222", "h2:2222"],
    "evaluator": ["h3:2222"],
    "tfe": ["s0:2222", "s1:2222", "s2:2222"],
}


def _tf_config(cluster, task_type="chief", index=0):
    return json.dumps({"cluster": cluster, "task": {"type": task_type, "index": index}})


def test_good_cluster_gives_devices_in_owner_order():
    cluster = TfeCluster.from_json(_tf_config(GOOD, "worker", 1))
    assert (cluster.task_type, cluster.task_index) == ("worker", 1)
    assert cluster.replica_devices() == (
        "/job:chief/replica:0/task:0/device:CPU:0",
        "/job:worker/replica:0/task:0/device:CPU:0",
        "/job:worker/replica:0/task:1/device:CPU:0",
    )
    assert cluster.server_devices() == tuple(f"/job:tfe/replica:0/task:{i}/device:CPU:0" for i in range(3))
    cluster.check_protocol("pond")
    cluster.check_protocol("aby3")


def test_no_cluster_means_local():
    assert TfeCluster.from_environment({}) is None
    assert TfeCluster.from_json('{"task": {"type": "chief", "index": 0}}') is None


@pytest.mark.parametrize("blank", ["", "  "])
def test_blank_tf_config_is_a_clear_error_not_a_json_decode_error(blank):
    # Estimator's RunConfig would json.loads("") and fail with a bare JSONDecodeError.
    with pytest.raises(ValueError, match=r"TF_CONFIG is set but empty.*unset TF_CONFIG"):
        TfeCluster.from_environment({"TF_CONFIG": blank})


def test_the_one_layout_gives_every_task_in_tf_config_order():
    tasks = cluster_tasks(2, evaluator=True)
    assert tasks == [("chief", 0), ("worker", 0), ("worker", 1), ("evaluator", 0), ("tfe", 0), ("tfe", 1), ("tfe", 2)]
    jobs = cluster_jobs(tasks, lambda job, i: f"{job}{i}:1")
    assert jobs == {"chief": ("chief0:1",), "worker": ("worker0:1", "worker1:1"), "evaluator": ("evaluator0:1",),
                    "tfe": ("tfe0:1", "tfe1:1", "tfe2:1")}
    assert TfeCluster.from_json(tf_config_json(jobs, "worker", 1)).replica_devices()[2].startswith("/job:worker/")
    with pytest.raises(ValueError, match="workers=-1 must be an integer >= 0"):
        cluster_tasks(-1, evaluator=False)


def _without(job):
    return {k: v for k, v in GOOD.items() if k != job}


@pytest.mark.parametrize(
    "text, match",
    [
        ("{not json", "TF_CONFIG is not valid JSON"),
        ("[1, 2]", "TF_CONFIG must be a JSON object"),
        (_tf_config(_without("tfe")), "TF_CONFIG has no 'tfe' job.*`tfe-estimator server`"),
        (_tf_config(_without("chief"), "worker", 0), "TF_CONFIG has no 'chief' job"),
        (_tf_config({**GOOD, "ps": ["p0:1"]}), "job 'ps' that secure aggregation cannot serve"),
        (_tf_config({**GOOD, "worker": ["h0:2222"]}), "address 'h0:2222' to both chief:0 and worker:0"),
        (_tf_config({**GOOD, "chief": ["a:1", "b:1"]}), "exactly one 'chief' task"),
        (_tf_config(GOOD, "worker", 5), "task index 5 is out of range for job 'worker'"),
        (_tf_config(GOOD, "master", 0), "task type 'master' is not a job of the cluster"),
        (_tf_config({**GOOD, "worker": "h1:2222"}), 'job \'worker\' must list "host:port" strings'),
        (json.dumps({"cluster": GOOD}), 'TF_CONFIG has a cluster but no "task"'),
    ],
)
def test_bad_tf_config_is_refused(text, match):
    with pytest.raises(ValueError, match=match) as info:
        TfeCluster.from_json(text)
    assert "TF_CONFIG" in str(info.value)


@pytest.mark.parametrize("protocol", ["pond", "aby3"])
def test_too_few_tfe_tasks_for_the_protocol(protocol):
    cluster = TfeCluster.from_json(_tf_config({**GOOD, "tfe": ["s0:1", "s1:1"]}))
    with pytest.raises(ValueError, match=f"protocol='{protocol}' needs exactly 3 'tfe' tasks.*lists 2"):
        cluster.check_protocol(protocol)


def test_sparse_job_form_is_accepted():
    cluster = TfeCluster.from_json(_tf_config({**GOOD, "worker": {"1": "h2:2222", "0": "h1:2222"}}, "worker", 0))
    assert cluster.jobs["worker"] == ("h1:2222", "h2:2222")


_json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=8),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=12,
)
_jobs = st.dictionaries(
    st.sampled_from(["chief", "worker", "evaluator", "tfe", "ps", "master"]),
    st.lists(st.sampled_from(["a:1", "b:2", "c:3", "d:4", "e:5", "", 3]), max_size=4) | _json_values,
    max_size=5,
)


@settings(max_examples=300, deadline=None)
@given(
    cluster=_jobs | _json_values,
    task=st.fixed_dictionaries({"type": st.sampled_from(["chief", "worker", "tfe", "ps"]) | st.text(max_size=5),
                                "index": st.integers(-2, 5) | _json_values}) | _json_values,
)
def test_fuzzed_tf_config_is_accepted_or_refused_with_value_error(cluster, task):
    text = json.dumps({"cluster": cluster, "task": task})
    try:
        parsed = TfeCluster.from_json(text)
    except ValueError as e:
        assert "TF_CONFIG" in str(e)
        return
    if parsed is not None:  # anything accepted is a usable secure-aggregation cluster
        assert len(parsed.jobs["chief"]) == 1 and "tfe" in parsed.jobs
        assert 0 <= parsed.task_index < len(parsed.jobs[parsed.task_type])
        addresses = [a for job in parsed.jobs.values() for a in job]
        assert len(addresses) == len(set(addresses))


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=40))
def test_fuzzed_tf_config_text_never_crashes_otherwise(text):
    try:
        TfeCluster.from_json(text)
    except ValueError as e:
        assert "TF_CONFIG" in str(e)
