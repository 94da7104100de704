# megatron_sparseloco — developer entry points. Every target bootstraps .venv on a fresh machine.
#   make test    the test suite (what CI runs)
#   make lint    ruff over the repo, mypy over megatron_sparseloco/ (CI runs it before the tests)
#   make demo    the main job: real Megatron pretraining on CPU with SparseLoCo, 4 ranks
#   make bench   every benchmark behind docs/results.md, then the page (hours; see docs/benchmarks.md)
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

# bench: every results file docs/results.md shows (benchmarks/render_results.py PLAN, in order; `--list` gives
# each one's command and cost: about 4 h for the headline, 7.5 h more for the second model size on a quiet
# 2-core machine;
# the network cases need root), then the page, the README table and the plots. One file:
# `$(PY) benchmarks/render_results.py --run --only quality_w2`.
bench: venv
	$(PY) benchmarks/render_results.py --run

# bench-smoke (seconds): the results files against the schema, the page / README table against the files,
# the renderer on synthetic files. The benchmarks' own plumbing: tests/test_benchmarks_smoke.py (minutes).
bench-smoke: venv
	$(PY) benchmarks/render_results.py --check
	$(PY) -m pytest -q tests/test_results_page.py tests/test_benchmark_defaults.py

clean-venv:
	rm -rf $(VENV)
