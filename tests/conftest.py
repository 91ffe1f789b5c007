"""Shared fixtures: quiet TensorFlow logs, a fresh graph per test, small data."""
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402

tf.compat.v1.logging.set_verbosity(tf.compat.v1.logging.ERROR)

# The in-process files that take longest (CI's "slowest durations"; each 50-250 s of a 2-worker run). `make test`
# hands whole files to its pytest-xdist workers in collection order (scripts/test.sh: --dist loadfile
# --no-loadscope-reorder), so these go first and the short files fill the end: otherwise xdist's default order
# (files with most tests first) leaves these few-test, long files for last, with the other worker idle.
LONG_FILES_FIRST = ("test_dp.py", "test_eval_batches.py", "test_bench.py", "test_tutorials.py", "test_keras.py",
                    "test_keras_dp.py", "test_model_fns.py", "test_examples.py", "test_estimator_training.py")


#: The cluster tests' marker. `make test` runs them in a phase of their own: `pytest <tests> -m multiprocess`
#: (scripts/test.sh).
MULTIPROCESS = "multiprocess"


def pytest_ignore_collect(collection_path, config):
    """In the cluster phase (``-m multiprocess``), a test file found in a directory that never names the marker
    is not imported: importing every in-process file (Keras, tensorflow-privacy, scikit-learn, ...) only to
    deselect its tests cost ~8 of that phase's ~23 CPU-s of collection. A file named on the command line is
    always collected; `_assert_cluster_tests_name_their_marker` keeps the rule sound."""
    if (config.getoption("markexpr") == MULTIPROCESS and collection_path.suffix == ".py"
            and collection_path.name.startswith("test_")
            and MULTIPROCESS not in collection_path.read_text(encoding="utf-8")):
        return True
    return None


def _assert_cluster_tests_name_their_marker(items):
    """Every test marked `multiprocess` is in a file whose text names the marker (the decorator or
    ``pytestmark``), or `pytest_ignore_collect` would leave it out of the cluster phase unseen."""
    for item in items:
        if item.get_closest_marker(MULTIPROCESS) is not None and MULTIPROCESS not in item.path.read_text(
                encoding="utf-8"):
            raise pytest.UsageError(f"{item.nodeid} is marked {MULTIPROCESS} but {item.path.name} never names the "
                                    f"marker: write @pytest.mark.{MULTIPROCESS} (or pytestmark) in that file, or "
                                    "`make test`'s cluster phase skips the file (tests/conftest.py).")


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects: the check sees every collected test
def pytest_collection_modifyitems(items):
    """Puts `LONG_FILES_FIRST`'s tests first, in that order; every other file keeps its place after them."""
    _assert_cluster_tests_name_their_marker(items)
    rank = {name: i for i, name in enumerate(LONG_FILES_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))


@pytest.fixture(autouse=True)
def _fresh_default_graph():
    tf.compat.v1.reset_default_graph()
    yield


@pytest.fixture(scope="session")
def mutant_kernel_cache(tmp_path_factory):
    """The kernel cache (`TFE_ESTIMATOR_KERNEL_CACHE`) of every planted-mutation library this run builds
    (test_dp.py, test_sum_check.py, test_wire.py): one directory for every pytest-xdist worker of the run (a
    worker's base temporary directory is inside the run's), so a library or object file that tests on two
    workers need compiles once; `_build`'s file lock makes the other worker wait for it. Its entries are keyed by
    their sources' contents and flags, and the directory is new in each run."""
    base = tmp_path_factory.getbasetemp()
    return (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "mutant-kernel-cache"


@pytest.fixture
def linear_data():
    """A small noiseless linear regression problem: y = x . w + b."""
    rng = np.random.RandomState(0)
    x = rng.randn(512, 3).astype(np.float32)
    w = np.array([1.5, -2.0, 0.5], np.float32)
    y = (x @ w + 0.3).astype(np.float32)
    return x, y, w
