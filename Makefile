# The two commands of the README: `make run` (a local swarm) and `make test`.
# Both create .venv and install what they need on first use.
PYTHON ?= python3
# The CPU build of torch; pick another build by overriding TORCH (e.g. TORCH=torch).
TORCH ?= torch==2.13.0
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: run test lint proto install clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q "$(TORCH)"
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
