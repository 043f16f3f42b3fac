# The two commands of the README: `make run` (a local swarm) and `make test`.
# Both create .venv and install what they need on first use.
PYTHON ?= python3
# torch from PyTorch's CPU index (pip's own index gives Linux the CUDA build, several GB). A CUDA
# build: TORCH_INDEX=https://download.pytorch.org/whl/cu128; pip's own index: TORCH_INDEX= ; another
# torch: TORCH=...
TORCH ?= torch==2.13.0
TORCH_INDEX ?= https://download.pytorch.org/whl/cpu
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: run test lint proto install clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX)) "$(TORCH)"
	$(BIN)/pip install -q -e '.[dev,hf,hf-trainer,lightning]'
	touch $(STAMP)

install: $(STAMP)

run: $(STAMP)
	$(BIN)/python scripts/local_swarm.py

lint: $(STAMP)
	$(BIN)/ruff check neuronode tests scripts
	$(BIN)/mypy neuronode

test: lint
	$(BIN)/python -m pytest -q -n 2 --dist loadfile --durations=15

proto: $(STAMP)
	$(BIN)/python scripts/gen_proto.py

clean:
	rm -rf $(VENV) neuronode-data .pytest_cache .mypy_cache .ruff_cache
