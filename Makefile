# The two front-door commands: `make demo` and `make test`. Both create or
# reuse .venv (scripts/venv.sh) before they run.
VENV_PY := .venv/bin/python

.PHONY: demo demo-cluster test test-fast bench venv clean

venv:
	bash scripts/venv.sh test

demo: venv
	$(VENV_PY) -m tfe_estimator.cli demo

demo-cluster: venv
	$(VENV_PY) -m tfe_estimator.cli demo --cluster

test: venv
	$(VENV_PY) -m pytest tests

bench: venv
	$(VENV_PY) -m tfe_estimator.bench

test-fast: venv
	$(VENV_PY) -m pytest tests -m "not slow and not multiprocess"

clean:
	rm -rf .venv .pytest_cache build *.egg-info
