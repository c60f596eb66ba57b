# Two commands on a fresh machine: `make demo` and `make test`. Each builds the virtualenv it needs.
# torch is pinned to the CPU build of 2.13.0 before anything else asks for torch: an unpinned install would pull
# a CUDA build of several GB.

PYTHON ?= python3
VENV ?= .venv
TORCH := torch==2.13.0
# The lowest Lightning release pyproject.toml declares, in both namespaces; `make test-lowest` runs the suite
# against it.
LOWEST_LIGHTNING := lightning==2.5.0 pytorch-lightning==2.5.0

.PHONY: demo test test-lowest lint bench

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install -q --upgrade pip
	$(VENV)/bin/pip install -q $(TORCH)
	$(VENV)/bin/pip install -q -e ".[dev]"
	touch $@

demo: $(VENV)/.installed
	$(VENV)/bin/torchrun --nproc-per-node=2 examples/train_mlp.py

lint: $(VENV)/.installed
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy

test: lint
	$(VENV)/bin/python -m pytest

# Not a test: CPU benchmarks against the plain recipe, Lightning's ddp and Accelerate (benchmarks/README.md).
bench: $(VENV)/.installed
	$(VENV)/bin/pip install -q -e ".[bench]"
	$(VENV)/bin/python benchmarks/run.py

.venv-lowest/.installed: pyproject.toml
	$(PYTHON) -m venv .venv-lowest
	.venv-lowest/bin/pip install -q --upgrade pip
	.venv-lowest/bin/pip install -q $(TORCH) $(LOWEST_LIGHTNING)
	.venv-lowest/bin/pip install -q -e ".[dev]" $(LOWEST_LIGHTNING)
	touch $@

# Everything but the ten-run exit-code loop, against the lowest declared Lightning.
test-lowest: .venv-lowest/.installed
	.venv-lowest/bin/python -m pytest -k "not exit_zero_every_time"
