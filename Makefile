# Every target bootstraps its own virtualenv in .venv (Python 3.11+; override with PYTHON=...).
# Database: DATABASE_URL when set, otherwise an embedded PostgreSQL 18 started on demand.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

# Django 6 needs Python 3.12+: `make test-django6 DJANGO6_PYTHON=python3.12 DJANGO6_SPEC='Django>=6.1,<6.2'`.
DJANGO6_PYTHON ?= python3.12
DJANGO6_SPEC ?= Django>=6.1,<6.2
DJANGO6_VENV ?= .venvs/django6

.PHONY: venv test test-all test-soak test-pooler test-server-version test-django6 lint type migrations-check check demo bench clean tox

venv: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e ".[test,lint]"
	touch $(STAMP)

# Parallel workers (pytest-xdist), each with a test database of its own (test_<name>_gw0, ...) on
# the same server; tests that must not overlap share an xdist_group. TEST_WORKERS=0: one process.
# The suite mostly waits (TTLs, polls, server start-up), so more workers than cores pays.
TEST_WORKERS ?= 4
XDIST_ARGS := -n $(TEST_WORKERS) --dist loadgroup

# pytest keeps the modules it rewrites (assertions) in __pycache__ unless bytecode writing is off
# (PYTHONDONTWRITEBYTECODE): each worker then rewrites ~260 modules again, 3-4 s of CPU per process.
unexport PYTHONDONTWRITEBYTECODE

# Which tests by marker (pyproject.toml, tests/tiers.py): make test leaves out the long, soak,
# cluster and browser tiers (its last line counts them); make test-all runs every test (CI runs it).
MARKERS ?= not (slow or soak or cluster or browser)
# CI's pooled leg and server-version matrix: the tests whose behaviour depends on what they vary.
POOLER_MARKERS := pooler and not (slow or soak or cluster or chaos or browser or acceptance)
SERVER_VERSION_MARKERS := server_version and not (soak or cluster or chaos or browser or acceptance)

PYTEST := $(BIN)/python -m pytest $(XDIST_ARGS)

## make test: what a contributor needs for any change, on a real PostgreSQL, in TEST_WORKERS parallel workers (0: one process); its last line counts the tests it left out.
test: venv
	PG_LEASE_TEST_LEFT_OUT="make test-all" $(PYTEST) -m "$(MARKERS)" $(PYTEST_ARGS)

## make test-all: every test, the long, soak, cluster and browser tiers included (CI runs it on PostgreSQL 15 and the embedded 18); MARKERS_ALL selects among them.
test-all: venv
	$(PYTEST) $(if $(MARKERS_ALL),-m "$(MARKERS_ALL)") $(PYTEST_ARGS)

## make test-soak: the long history-checked runs under faults (stress, faults, failovers under load).
test-soak: venv
	$(PYTEST) -m soak $(PYTEST_ARGS)

## make test-pooler: the tests whose behaviour depends on a pooler (CI: behind PgBouncer, .ci/with-pgbouncer).
test-pooler: venv
	$(PYTEST) -m "$(POOLER_MARKERS)" $(PYTEST_ARGS)

## make test-server-version: the tests whose behaviour depends on the PostgreSQL major (CI: .ci/matrix).
test-server-version: venv
	$(PYTEST) -m "$(SERVER_VERSION_MARKERS)" $(PYTEST_ARGS)

test-django6:
	$(DJANGO6_PYTHON) -m venv $(DJANGO6_VENV)
	$(DJANGO6_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(DJANGO6_VENV)/bin/python -m pip install --quiet "$(DJANGO6_SPEC)" -e ".[test]"
	$(DJANGO6_VENV)/bin/python -m pytest $(PYTEST_ARGS)

lint: venv
	$(BIN)/ruff check pg_lease_django devkit tests demo benchmarks stress
	$(BIN)/ruff format --check pg_lease_django devkit tests demo benchmarks stress

type: venv
	$(BIN)/mypy pg_lease_django devkit tests demo benchmarks stress

migrations-check: venv
	DJANGO_SETTINGS_MODULE=tests.settings $(BIN)/python -m django makemigrations --check --dry-run
	DJANGO_SETTINGS_MODULE=demo.settings $(BIN)/python -m django makemigrations --check --dry-run demo

check: lint type migrations-check test

## make sql-change NAME=heartbeat_ttl_limit: the next migration from an edit of pg_lease_django/sql/schema.sql (its delta, its reverse and the Django migration pinning the delta's SHA-256; devkit/sqlchange); nothing to do after no edit, a refusal naming what to write by hand.
.PHONY: sql-change
sql-change: venv
	@test -n "$(NAME)" || { echo 'make sql-change NAME=what_the_change_does (the migration name: lower case, digits, underscores)'; exit 2; }
	$(BIN)/python -m devkit.sqlchange $(NAME) $(SQL_CHANGE_ARGS)

## make tox: tox.ini's environments, from a virtualenv of its own (.venvs/tox); e.g. TOX_ARGS='-e type' or TOX_ARGS='-- tests/db/test_manager.py'.
# The Django 6 environments need python3.12 and python3.13 on PATH. With pyenv, its shims answer for
# several versions at once when PYENV_VERSION lists them: the current one first, then every 3.12 / 3.13.
TOX_VENV ?= .venvs/tox
PYENV_PYTHONS = $(shell command -v pyenv >/dev/null 2>&1 && { pyenv version-name; pyenv versions --bare | grep -E '^3\.1[23]\.[0-9]+$$'; } | paste -sd: -)

$(TOX_VENV)/.installed:
	$(PYTHON) -m venv $(TOX_VENV)
	$(TOX_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(TOX_VENV)/bin/python -m pip install --quiet "tox>=4"
	touch $@

tox: $(TOX_VENV)/.installed
	$(if $(PYENV_PYTHONS),PYENV_VERSION=$(PYENV_PYTHONS)) $(TOX_VENV)/bin/tox $(TOX_ARGS)

## make demo: three workers, a fenced counter, a frozen holder, a kill -9, a force release and a hand-off; writes charts.
demo: venv
	$(BIN)/python -m demo

## make bench-instructions: server instructions per acquire+release, renewal, inspect, fenced save and fenced 1,000-row update against the floor's / a plain table's, counted by callgrind (deterministic on a noisy machine; needs valgrind); e.g. BENCH_INSTRUCTIONS_ARGS='--bindir /usr/lib/postgresql/15/bin'.
.PHONY: bench-instructions
bench-instructions: venv
	$(BIN)/python benchmarks/instructions.py $(BENCH_INSTRUCTIONS_ARGS)

## make bench-instructions-check: CI's guard, on the embedded server: fails when a workload costs more than 3 % over benchmarks/instructions-baseline.json (a new baseline: benchmarks/instructions.py --record, in a commit that says why).
.PHONY: bench-instructions-check
bench-instructions-check: venv
	$(BIN)/python benchmarks/instructions.py --check

bench:
	@# A virtualenv of its own (.venvs/bench): the project plus the peer libraries, never in .venv.
	test -x .venvs/bench/bin/python || $(PYTHON) -m venv .venvs/bench
	.venvs/bench/bin/python -m pip install --quiet --upgrade pip
	.venvs/bench/bin/python -m pip install --quiet -e ".[test]"
	.venvs/bench/bin/python -m pip install --quiet -r benchmarks/requirements-peers.txt || \
	  for req in $$(sed 's/#.*//' benchmarks/requirements-peers.txt); do \
	    .venvs/bench/bin/python -m pip install --quiet "$$req" || echo "bench: $$req could not be installed"; \
	  done
	.venvs/bench/bin/python benchmarks/bench.py $(BENCH_ARGS)

.PHONY: stress-failover
## make stress-failover: the stress harness while the primary of a replicated pair is SIGKILLed and its standby promoted, 10 times a run (synchronous; asynchronous, loss measured; asynchronous + advance-epochs), every history checked; 4-5 minutes, needs pg_basebackup.
stress-failover: venv
	$(BIN)/python -m stress failover --suite $(STRESS_FAILOVER_ARGS)

## make patroni-packages: Patroni, etcd and HAProxy from Debian (the Patroni cluster's tests and `make stress-patroni`).
.PHONY: patroni-packages stress-patroni stress-switchover
patroni-packages:
	@command -v patroni >/dev/null && command -v etcd >/dev/null && command -v haproxy >/dev/null || { \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq patroni etcd-server haproxy >/dev/null; }

## make stress-patroni: the stress harness against a Patroni cluster (etcd, 2 nodes, HAProxy): asynchronous kill -9 of the leader's PostgreSQL, 10 failovers without then with the pg_lease_django.patroni hook; then every fault (kill postgres, kill Patroni, SIGSTOP, switchover, failover) per synchronous_mode strict / on / off, via the host list and via HAProxy; every history checked; about 50 minutes; exit status 1 on a violation or a cluster that did not recover (STUCK).
stress-patroni: venv patroni-packages
	$(BIN)/python -m stress patroni --suite $(STRESS_PATRONI_ARGS)

## make stress-switchover: a hold() and an elect() leader (TTL 30 s and 5 s) through 5 planned `patronictl switchover`s on the Patroni cluster, via the host list; a table per switchover of failed renewals, renewal gaps against the trust window, losses, epochs and seconds until the new leader accepts writes; about 3 minutes.
stress-switchover: venv patroni-packages
	$(BIN)/python -m stress patroni --switchovers 5 --ttls 30,5 $(STRESS_SWITCHOVER_ARGS)

## make model: the Quint model of the protocol (spec/pg_lease.qnt): the simulator, 20,000 runs of 30 steps on every invariant, each mutation caught, then the code held to the model on PostgreSQL (tests/cluster/test_model_conformance.py, 300 runs); Quint from npm (spec/package.json, pinned) in .venvs/quint.
# make model-check: the same, shorter (CI): 500 runs, each mutation at most 2,000 runs, 40 conformance runs.
QUINT_DIR ?= .venvs/quint
MODEL_ARGS ?=
.PHONY: model model-check

$(QUINT_DIR)/.installed: spec/package.json spec/package-lock.json
	mkdir -p $(QUINT_DIR)
	cp spec/package.json spec/package-lock.json $(QUINT_DIR)/
	cd $(QUINT_DIR) && npm ci --no-audit --no-fund --loglevel=error
	touch $@

model: venv $(QUINT_DIR)/.installed
	$(BIN)/python -m devkit.quint_model --samples 20000 --mutation-samples 5000 --random-too $(MODEL_ARGS)
	PG_LEASE_MODEL_EXAMPLES=300 $(BIN)/python -m pytest tests/cluster/test_model_conformance.py

model-check: model-check-quint
	$(BIN)/python -m pytest tests/cluster/test_model_conformance.py

## make model-check-quint: model-check's Quint half alone, no database (CI: the conformance test is in the suite's cluster tier, which runs on 15 and 18).
.PHONY: model-check-quint
model-check-quint: venv $(QUINT_DIR)/.installed
	$(BIN)/python -m devkit.quint_model --samples 500 --mutation-samples 2000 $(MODEL_ARGS)

clean:
	rm -rf $(VENV) .pgdata .mypy_cache .ruff_cache .pytest_cache

## make docs: the documentation site (MkDocs, Material, mkdocstrings) built strictly into site/, in .venv-docs.
DOCS_VENV ?= .venv-docs
DOCS_REQUIREMENTS := "mkdocs>=1.6,<2" "mkdocs-material>=9.5,<10" "mkdocstrings[python]>=0.26,<2" "ruff>=0.6"

.PHONY: docs docs-serve

$(DOCS_VENV)/.installed:
	$(PYTHON) -m venv $(DOCS_VENV)
	$(DOCS_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(DOCS_VENV)/bin/python -m pip install --quiet $(DOCS_REQUIREMENTS)
	touch $@

docs: $(DOCS_VENV)/.installed
	NO_MKDOCS_2_WARNING=1 $(DOCS_VENV)/bin/mkdocs build --strict --site-dir site

docs-serve: $(DOCS_VENV)/.installed
	NO_MKDOCS_2_WARNING=1 $(DOCS_VENV)/bin/mkdocs serve --strict
