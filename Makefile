# The two commands users need: `make bench` (the main job) and `make test` (the CPU suite).
# Both create or reuse a virtual environment in .venv and install what they need.
# On a machine that already has the packages (the GPU test box), skip the install with
#   make bench PYTHON=python3 DEPS=

VENV    ?= .venv
PYTHON  ?= $(VENV)/bin/python
DEPS    ?= install
# The CPU build of torch is what CI and the dev boxes keep on disk; a GPU box may use any torch >= 2.11.
TORCH   ?= torch==2.13.0
STAMP   := $(VENV)/.installed
export PYTHONPATH := $(CURDIR)$(if $(PYTHONPATH),:$(PYTHONPATH))

.PHONY: install test gpu-test bench profile lint clean

install: $(STAMP)

$(STAMP): pyproject.toml Makefile
	@test -x $(VENV)/bin/python || python3 -m venv $(VENV)
	$(VENV)/bin/python -m pip install -q --upgrade pip
	$(VENV)/bin/python -c "import torch" 2>/dev/null || $(VENV)/bin/python -m pip install -q "$(TORCH)"
	$(VENV)/bin/python -m pip install -q -e ".[test,bench,lint]"
	@touch $@

test: $(DEPS)
	$(PYTHON) -m pytest -q

gpu-test: $(DEPS)
	$(PYTHON) -m pytest -q -m gpu -rs

bench: $(DEPS)
	$(PYTHON) -m bench

profile: $(DEPS)
	PYTHON=$(PYTHON) bash profiles/ncu_boundary.sh
	PYTHON=$(PYTHON) bash profiles/ncu_coefficients.sh

lint: $(DEPS)
	$(PYTHON) -m ruff check boundary cute_kernels tests bench
	$(PYTHON) -m ruff format --check boundary cute_kernels tests bench

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache build *.egg-info
	find . -name __pycache__ -prune -exec rm -rf {} +
