# The two commands of the README. Both set everything up themselves (scripts/setup.sh).
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: setup demo test test-all bench
setup:
	@bash scripts/setup.sh

demo: setup
	$(PY) -m luwu demo

# The default run: unit, integration and the short system tests. pytest exits non-zero
# when a test fails and with 5 when no test ran; both fail this target.
test: setup
	$(PY) -m pytest -q

# The long studies too (convergence, 100k-message fuzzing, emulated cluster head-to-head).
test-all: setup
	$(PY) -m pytest -q --runslow

bench: setup
	$(PY) benchmarks/run_all.py
