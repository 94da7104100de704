# megatron_sparseloco — developer entry points. Every target bootstraps .venv on a fresh machine.
#   make test    the test suite (what CI runs)
#   make lint    ruff over the repo, mypy over megatron_sparseloco/ (CI runs it before the tests)
#   make demo    the main job: real Megatron pretraining on CPU with SparseLoCo, 4 ranks
#   make bench   benchmarks (results under docs/results/)
SHELL := /bin/bash
VENV := .venv
PY := $(VENV)/bin/python
# The stamp names the inputs' content hash, so a changed pin or setup.py reinstalls and an
# unchanged one is a no-op.
REQ_HASH := $(shell cat requirements/ci.txt setup.py pyproject.toml 2>/dev/null | sha1sum | cut -c1-12)
STAMP := $(VENV)/.installed-$(REQ_HASH)
PYTEST_ARGS ?=

.PHONY: venv test test-fast lint demo bench bench-smoke clean-venv

venv: $(STAMP)

$(STAMP):
	@set -e; PY312=$$(tools/find_python.sh); \
	if [ ! -x $(PY) ] || ! $(PY) -c 'import sys; sys.exit(0 if sys.version_info[:2]==(3,12) else 1)'; then \
	  rm -rf $(VENV); echo "creating $(VENV) with $$PY312"; $$PY312 -m venv $(VENV); fi
	$(PY) -m pip install -q --disable-pip-version-check -r requirements/ci.txt
	$(PY) -m pip install -q --disable-pip-version-check --no-deps --no-build-isolation -e .
	rm -f $(VENV)/.installed-*; touch $(STAMP)

test: venv
	$(PY) -m pytest -q --durations=30 $(PYTEST_ARGS) tests

# Settings in pyproject.toml ([tool.ruff], [tool.mypy]; mypy checks the files it names there).
lint: venv
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy

demo: venv
	$(PY) -m megatron_sparseloco.demo

bench: venv
	$(PY) benchmarks/codec.py --json docs/results/codec.json
	$(PY) benchmarks/quality.py --workers 2,4,8 --seeds 3 --sweep --sweep-each-w --long 3 --json docs/results/quality.json --plots docs/results
	$(PY) benchmarks/codec.py --llama-1b --json docs/results/codec_llama1b.json
	$(PY) benchmarks/network.py --json docs/results/network.json

bench-smoke: venv
	$(PY) benchmarks/codec.py --quick --json /tmp/sparseloco-codec-smoke.json
	$(PY) -m pytest -q tests/test_benchmarks_smoke.py

clean-venv:
	rm -rf $(VENV)
