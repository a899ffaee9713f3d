# The two commands of the README. Both set everything up themselves (scripts/setup.sh).
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: setup demo test lint test-all docs bench bench-cluster bench-cluster-quick
setup:
	@bash scripts/setup.sh

demo: setup
	$(PY) -m luwu demo

# The default run: unit, integration and the short system tests. pytest exits non-zero
# when a test fails and with 5 when no test ran; both fail this target.
test: setup
	$(PY) -m pytest -q --durations=25

# Formatting and lint, as CI runs them (ruff, pinned in pyproject's test extra; settings in
# pyproject's [tool.ruff]). `ruff format .` fixes the first.
lint: setup
	$(PY) -m ruff format --check .
	$(PY) -m ruff check .

# The long studies too (convergence, 100k-message fuzzing, emulated cluster head-to-head).
test-all: setup
	$(PY) -m pytest -q --runslow

# The docs site (mkdocs.yml; API pages from docstrings) into site/. --strict: any warning fails it,
# as in tests/unit/test_docs.py, which `make test` runs.
docs: setup
	$(PY) -m mkdocs build --strict

bench: setup
	$(PY) benchmarks/run_all.py

# The emulated-cluster head-to-head (issue 9; root: network namespaces + tbf): LuWu vs DDP at 1 and
# 10 Gbit/s, 2 and 4 workers, 1/2/4 nodes, then the plan validation and the heterogeneous-node study.
# Writes benchmarks/results/cluster.*, plan_validation.*, hetero.* (40-50 minutes on 2 quiet cores).
bench-cluster: setup
	$(PY) benchmarks/cluster_study.py
	$(PY) benchmarks/cluster_study.py --hetero

# Smoke run of the same (1 Gbit/s, 4 workers, 2 nodes, 16 steps; writes *.quick.*): about 6 minutes.
bench-cluster-quick: setup
	$(PY) benchmarks/cluster_study.py --quick
	$(PY) benchmarks/cluster_study.py --hetero --quick
