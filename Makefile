# The two commands a fresh machine needs: `make serve` and `make test`.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
MODEL ?= smollm2
SERVE_ARGS ?=
PYTEST_ARGS ?=
# the suite in two processes, each test file in one of them (its module-scoped servers shared as before)
PYTEST_WORKERS ?= 2
STAMP := $(VENV)/.installed

.PHONY: serve test venv proto bench bench-online bench-overheads bench-guidellm bench-limits perf-tables clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet torch==2.13.0
	$(BIN)/python -m pip install --quiet -e '.[test,bench]'
	touch $(STAMP)

venv: $(STAMP)

serve: $(STAMP)
	$(BIN)/pagedserve serve --model $(MODEL) $(SERVE_ARGS)

test: $(STAMP)
	$(BIN)/python -m pytest -q -n $(PYTEST_WORKERS) --dist loadfile $(PYTEST_ARGS)

proto: $(STAMP)
	$(BIN)/python -m pagedserve.protogen

# Benchmarks (docs/performance.md): offline comparison with Hugging Face, online latency, overheads.
BENCH_ARGS ?=
bench: $(STAMP)
	$(BIN)/python bench/offline_throughput.py $(BENCH_ARGS)

bench-online: $(STAMP)
	$(BIN)/python bench/online_serving.py $(BENCH_ARGS)

bench-overheads: $(STAMP)
	$(BIN)/python bench/overheads.py $(BENCH_ARGS)

# guidellm (its own venv, docs/performance.md#guidellm-against-llamacpp) against serve and llama-server.
bench-guidellm: $(STAMP)
	$(BIN)/python bench/guidellm_chat.py $(BENCH_ARGS)

# This CPU's read bandwidth and GEMM peaks (kept in bench/results/kept/), and the tables made from
# every kept result (docs/performance-tables.md).
bench-limits: $(STAMP)
	$(BIN)/python bench/roofline.py $(BENCH_ARGS)

perf-tables: $(STAMP)
	$(BIN)/python bench/perf_tables.py

clean:
	rm -rf $(VENV) build *.egg-info
