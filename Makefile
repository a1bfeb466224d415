# Quick start: `make demo` runs the main job, `make test` runs the tests.
# Both create .venv and install what they need on first use.
#
# TORCH pins the CPU build of PyTorch: a bare `torch` requirement can pull a
# multi-GB CUDA build. On a GPU machine: make TORCH="torch==2.13.0 --index-url <your CUDA wheel index>"
PYTHON ?= python3
TORCH ?= torch==2.13.0
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test fuzz bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q $(TORCH)
	$(BIN)/python -m pip install -q -e ".[dev,plots]"
	$(BIN)/python -m pip install -q --no-deps "torchtitan==0.3.0"  # its own pins conflict (datasets<4.8); tests use its dataloader and DCP
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/tokenloom demo

# Two test processes (or up to 4 on bigger machines): many tests also start loader workers.
test: $(STAMP)
	$(BIN)/python -m pytest -q -n auto --maxprocesses 4

# The token-level oracle over random scenarios (tests/oracle_fuzz.py): MINUTES of them, or N from START.
MINUTES ?= 30
fuzz: $(STAMP)
	$(BIN)/python -m tests.oracle_fuzz $(if $(N),--n $(N) --start $(or $(START),10000),--minutes $(MINUTES))

clean:
	rm -rf $(VENV) out .pytest_cache
