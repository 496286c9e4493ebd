# The two commands a fresh machine needs: `make serve` and `make test`.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
MODEL ?= smollm2
SERVE_ARGS ?=
PYTEST_ARGS ?=
STAMP := $(VENV)/.installed

.PHONY: serve test venv proto bench bench-online bench-overheads clean

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
	$(BIN)/python -m pytest -q $(PYTEST_ARGS)

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

clean:
	rm -rf $(VENV) build *.egg-info
