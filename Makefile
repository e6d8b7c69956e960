# The two commands users need: `make bench` (the main job) and `make test` (the CPU suite).
# Both create or reuse a virtual environment in .venv and install what they need.
# On a machine that already has the packages (the GPU test box), skip the install with
#   make bench PYTHON=python3 DEPS=

VENV    ?= .venv
PYTHON  ?= $(VENV)/bin/python
DEPS    ?= install
# torch is installed first, by itself, from TORCH_INDEX: PyTorch's CPU wheel index by default, so that a CPU
# machine gets the CPU build (no CUDA libraries); its dependencies then come from the default index. On a GPU
# box pick a CUDA index (e.g. TORCH_INDEX=https://download.pytorch.org/whl/cu130) or TORCH_INDEX= (the
# default index: its Linux torch is the CUDA build). Nothing is installed where `import torch` already works.
TORCH   ?= torch==2.13.0
TORCH_INDEX ?= https://download.pytorch.org/whl/cpu
STAMP   := $(VENV)/.installed
export PYTHONPATH := $(CURDIR)$(if $(PYTHONPATH),:$(PYTHONPATH))

.PHONY: install test gpu-test bench profile lint clean

install: $(STAMP)

$(STAMP): pyproject.toml Makefile
	@test -x $(VENV)/bin/python || python3 -m venv $(VENV)
	$(VENV)/bin/python -m pip install -q --upgrade pip
	$(VENV)/bin/python -c "import torch" 2>/dev/null || { \
	  $(VENV)/bin/python -m pip install -q --no-deps "$(TORCH)" $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX)) && \
	  $(VENV)/bin/python -m pip install -q "$(TORCH)"; }
	$(VENV)/bin/python -m pip install -q -e ".[test,bench,lint]"
	@# DeepSeek's torch references for its TileLang mHC kernels, an oracle for tests/test_reference_oracle.py (the
	@# wheel only, read as data, never installed: its package imports tilelang, and it asks for Python 3.12)
	$(VENV)/bin/python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 -d $(VENV)/oracles \
	  tile-kernels==2.1.0
	@touch $@

# The CPU suite on every core (pytest-xdist, where installed: the test extra has it); GPU tests stay on one worker.
XDIST = $(shell $(PYTHON) -c "import xdist" 2>/dev/null && echo "-n auto --dist loadgroup")

test: $(DEPS)
	$(PYTHON) -m pytest -q $(XDIST)

# Without a CUDA GPU every GPU test would skip, which reads as a pass: refuse instead, saying so.
gpu-test: $(DEPS)
	@$(PYTHON) -c "import sys, torch; torch.cuda.is_available() or sys.exit('make gpu-test: no CUDA GPU here, so no GPU test ran (make test runs the CPU suite)')"
	$(PYTHON) -m pytest -q -m gpu -rs

# A few representative shapes of every part by default; FULL=1 (python -m bench --full) the whole sweep.
# TILELANG=DIR (or $$MHC_TILELANG_PATH): a folder holding tile_kernels (the pack-tilelang bundle, unpacked): the step
# and V4 tables then gain DeepSeek's TileLang kernels, measured in a process of their own.
bench: $(DEPS)
	$(PYTHON) -m bench $(if $(FULL),--full) $(if $(TILELANG),--tilelang-path $(TILELANG))

# Nsight Compute on every shipped kernel (profiles/profile_all.py; needs ncu and a CUDA GPU), at H=7168 and rows
# 16 and 512 unless given, e.g. make profile H=5120 ROWS="1 64" ONLY="boundary final" (kernel-name prefixes);
# `$(PYTHON) profiles/profile_all.py --list` shows the plan.
profile: $(DEPS)
	$(PYTHON) profiles/profile_all.py $(if $(H),--hidden $(H)) $(if $(ROWS),--rows $(ROWS)) $(if $(ONLY),--only $(ONLY))

lint: $(DEPS)
	$(PYTHON) -m ruff check boundary cute_kernels tests bench profiles
	$(PYTHON) -m ruff format --check boundary cute_kernels tests bench profiles

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache build *.egg-info
	find . -name __pycache__ -prune -exec rm -rf {} +
