# The two front-door commands: `make demo` and `make test`. Both create or
# reuse the stack's virtualenv (scripts/venv.sh) before they run.
#
# STACK selects the supported stack (README, "Versions"):
#   tf215 (default)  .venv       Python 3.11, TensorFlow 2.15.1, estimator 2.15.0
#   tf29             .venv-tf29  Python 3.10, TensorFlow 2.9.1,  estimator 2.9.0
#   tf221            .venv-tf221 Python 3.11, TensorFlow 2.21.0, Keras 3, no Estimator (Keras only)
# e.g. `make test STACK=tf29`. On tf29 and tf221, `make test` runs TESTS_<stack>.
STACK ?= tf215
VENV_tf215 := .venv
VENV_tf29 := .venv-tf29
VENV_tf221 := .venv-tf221
EXTRAS_tf215 := estimator,test,bench,dp
EXTRAS_tf29 := estimator,test,bench
EXTRAS_tf221 := test
# What must hold on the old stack: versions, tfe_backend, kernels (C++14 on TF 2.9), secure aggregation, routing,
# Estimator training (both protocols; checkpoints moving between secure and plain configs), run config, security,
# and clusters launched on TF 2.9's runtime: in-graph train_and_evaluate against its plaintext twin, a killed
# aggregation server restarted at once (the TF 2.9 session recovering a lost remote device from the last
# checkpoint), and service mode. On the default stack only, as they re-test Python on top of what is here:
#  - the launcher's own process handling;
#  - the ABY3 launch: ABY3 on TF 2.9 is test_estimator_training's aby3 cases (canned Estimators equal their
#    plaintext twins); the launch differs from the Pond one only by the launcher starting a third server;
#  - the restart of a data owner after a delay: the same session recovery as the server's restart, plus the
#    launcher's restart delay (Python); test_faults' restart test does it (every role, 2 s each).
# The whole suite on the default stack but one case: test_launch's killed aggregation server restarted at once
# ([tfe-0.0]) is there for the old stack's subset; here test_faults' restart test kills tfe:0 and tfe:2 (and
# every other role) in one launch and asserts the same restart and a converged model.
TESTS_tf215 := tests --deselect "tests/test_launch.py::test_a_dead_task_is_restarted_and_training_resumes[tfe-0.0]"
TESTS_tf29 := tests/test_compat.py tests/test_tfe_backend.py tests/test_kernels.py tests/test_aggregation.py tests/test_strategy_routing.py \
	tests/test_estimator_training.py tests/test_run_config.py \
	tests/test_security.py tests/test_precision.py tests/test_cluster.py tests/test_service_data_plane.py tests/test_sum_check.py \
	tests/test_launch.py::test_train_and_evaluate_on_loopback_cluster_matches_plaintext_and_keeps_data_local \
	"tests/test_launch.py::test_a_dead_task_is_restarted_and_training_resumes[tfe-0.0]" \
	tests/test_launch.py::test_a_launched_service_cluster_serves_a_data_plane_health_and_metrics
# Keras 3 on current TensorFlow (no Estimator): versions, kernels, secure aggregation, Keras on one machine and
# across owners (service mode; its DP part skips without tensorflow-privacy).
TESTS_tf221 := tests/test_compat.py tests/test_kernels.py tests/test_keras_build.py tests/test_keras_service.py tests/test_keras_progress.py \
	tests/test_aggregation.py::test_an_only_first_replica_update_is_refused_with_the_fix \
	tests/test_aggregation.py::test_only_a_value_every_replica_already_has_is_broadcast_from_replica_0 \
	tests/test_keras.py::test_rfc_example_with_tfe_strategy_trains_like_mirrored_strategy \
	tests/test_keras.py::test_custom_training_loop_sums_securely_and_trains_like_mirrored_strategy \
	tests/test_keras.py::test_num_replicas_picks_the_local_replicas_and_the_parties_after_them \
	tests/test_keras.py::test_without_a_cluster_in_tf_config_the_strategy_is_local

VENV := $(VENV_$(STACK))
VENV_PY := $(VENV)/bin/python
TESTS := $(TESTS_$(STACK))
ifeq ($(VENV),)
$(error unknown STACK=$(STACK): use tf215 (default), tf29 or tf221)
endif

.PHONY: demo demo-cluster test test-fast bench bench-flower venv clean

# SYSTEM_DEPS=: leaves the system tools out (.ci/run sets the three venvs up at once, after it ran them once).
SYSTEM_DEPS ?= bash scripts/system-deps.sh

venv:
	$(SYSTEM_DEPS)
	STACK=$(STACK) bash scripts/venv.sh $(EXTRAS_$(STACK))

# TF_CPP_MIN_LOG_LEVEL=1: TensorFlow's INFO lines (e.g. "Local rendezvous recv item
# cancelled" at the end of an evaluation on 2.15) would bury the demo's table.
demo: venv
	TF_CPP_MIN_LOG_LEVEL=$${TF_CPP_MIN_LOG_LEVEL:-1} $(VENV_PY) -m tfe_estimator.tools.cli demo

demo-cluster: venv
	$(VENV_PY) -m tfe_estimator.tools.cli demo --cluster

# Two phases, one exit status (scripts/test.sh): the in-process tests on TEST_WORKERS pytest-xdist
# workers (default 2; TEST_WORKERS=1 runs them serially), then the `multiprocess` cluster tests one at a time.
test: venv
	bash scripts/test.sh $(VENV_PY) $(TESTS)

bench: venv
	$(VENV_PY) -m tools.bench

# Our service's CPU per secure sum beside Flower's SecAgg+ (its own virtualenv, .venv-flower).
bench-flower: venv
	bash scripts/flower-venv.sh
	PYTHONPATH=. $(VENV_PY) -m tools.bench.flower_compare

test-fast: venv
	$(VENV_PY) -m pytest $(TESTS) -m "not slow and not multiprocess" -n $${TEST_WORKERS:-2} --dist loadfile

clean:
	rm -rf .venv .venv-tf29 .venv-tf221 .venv-flower .pytest_cache build *.egg-info
