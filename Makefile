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

.PHONY: demo test fuzz bench peers remote-peers clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q $(TORCH)
	$(BIN)/python -m pip install -q -e ".[dev,plots]"
	$(BIN)/python -m pip install -q --no-deps "torchtitan==0.3.0"  # its own pins conflict (datasets<4.8); tests use its dataloader and DCP
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/tokenloom demo

# One test process more than the cores, at most 4: many tests spend part of their time waiting on loader
# workers, local servers or subprocesses (2 cores: 3 processes, 355 s against 379 s with 2, back to back).
TEST_PROCS := $(shell n=$$(nproc 2>/dev/null || echo 1); echo $$(( n + 1 < 4 ? n + 1 : 4 )))
test: $(STAMP)
	$(BIN)/python -m pytest -q -n $(TEST_PROCS)

# The long runs `make test` leaves out (tests marked soak: stress loops, more random scenarios), then
# the token-level oracle over random scenarios (tests/oracle_fuzz.py): MINUTES of them, or N from START.
MINUTES ?= 30
fuzz: $(STAMP)
	$(BIN)/python -m pytest -q -n auto --maxprocesses 4 -m soak
	$(BIN)/python -m tests.oracle_fuzz $(if $(N),--n $(N) --start $(or $(START),10000),--minutes $(MINUTES))

# tokenloom beside the loaders users pick instead (benchmarks/peers.py), in a venv of its own so that
# the peers' dependencies never reach .venv or CI. The peers are installed with torch pinned to the
# version already there, so none of them can replace it (the install fails instead). LitData and Mosaic
# Streaming pull torchvision, whose PyPI wheels are CUDA builds that cannot load beside a CPU torch: where
# it does not import it is removed (peers.py stands in for the two names Mosaic's image datasets import).
# torchtitan goes in without its dependencies (it pins an older datasets), with the one its loss module
# imports (spmd_types). QUICK=1: one short round.
PEERS_VENV := .venv-peers
PEERS_BIN := $(PEERS_VENV)/bin
PEERS_STAMP := $(PEERS_VENV)/.installed

$(PEERS_STAMP): pyproject.toml
	$(PYTHON) -m venv $(PEERS_VENV)
	$(PEERS_BIN)/python -m pip install -q $(TORCH)
	$(PEERS_BIN)/python -m pip install -q -e ".[peers]" "torch==$$($(PEERS_BIN)/python -c 'from importlib.metadata import version; print(version("torch"))')"
	$(PEERS_BIN)/python -c "import torchvision" 2>/dev/null || $(PEERS_BIN)/python -m pip uninstall -q -y torchvision
	$(PEERS_BIN)/python -m pip install -q --no-deps "torchtitan==0.3.0" "spmd_types==0.2.3"
	touch $(PEERS_STAMP)

peers: $(PEERS_STAMP)
	$(PEERS_BIN)/python benchmarks/peers.py $(if $(QUICK),--quick)

remote-peers: $(PEERS_STAMP)
	$(PEERS_BIN)/python benchmarks/remote_peers.py $(if $(QUICK),--quick)

clean:
	rm -rf $(VENV) $(PEERS_VENV) out .pytest_cache
