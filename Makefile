# Every target sets itself up on a fresh machine: a virtual environment in .venv with the
# CPU build of torch pinned (pip would otherwise pull a multi-GB CUDA build), then ftlm.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.ftlm-installed
PIP := $(BIN)/python -m pip --disable-pip-version-check -q

.PHONY: setup demo test bench clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(PIP) install --upgrade pip
	$(PIP) install torch==2.13.0
	$(PIP) install -e '.[test]'
	touch $(STAMP)

setup: $(STAMP)

demo: setup
	$(BIN)/ftlm demo

test: setup
	$(BIN)/python -m pytest -q

bench: setup
	$(BIN)/python -m bench

clean:
	rm -rf runs .pytest_cache
