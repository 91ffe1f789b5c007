"""The launch tests' failure message: the first traceback of an interleaved launch log, then its tail."""
from launch_log import first_error, report

_LOG = "\n".join([
    "[tfe:0] aggregation server0 serving",
    "[worker:0] Traceback (most recent call last):",
    "[chief:0] tfe_estimator: step 3, loss 0.5",
    '[worker:0]   File "train.py", line 7, in <module>',
    "[worker:0]     main()",
    "[worker:0] ServiceError: Contribute on aggregation server localhost:7001 failed with UNAVAILABLE",
    "[worker:0] restarting worker-0",
    "[chief:0] Traceback (most recent call last):",
    '[chief:0]   File "train.py", line 9, in main',
    "[chief:0] RuntimeError: a consequence",
])


def test_the_first_traceback_is_its_own_tasks_lines_up_to_the_exception():
    assert first_error(_LOG) == "\n".join([
        "[worker:0] Traceback (most recent call last):",
        '[worker:0]   File "train.py", line 7, in <module>',
        "[worker:0]     main()",
        "[worker:0] ServiceError: Contribute on aggregation server localhost:7001 failed with UNAVAILABLE",
    ]) + "\n...\n"


def test_the_report_is_the_first_traceback_then_the_tail():
    assert report(_LOG, tail=30) == first_error(_LOG) + _LOG[-30:]
    assert report("no error here") == "no error here"
