# Two commands on a fresh machine: `make demo` and `make test`. Each builds the virtualenv it needs; torch is pinned
# to the CPU build of 2.13.0 before anything else asks for torch (an unpinned install pulls a CUDA build of GBs).
# CI (.ci/run) runs the four legs below; docs/maintainers.md says what each runs, leaves out, and why.

PYTHON ?= python3
VENV ?= .venv
TORCH := torch==2.13.0
# Where pip finds torch: empty for the configured index (this project's machines and CI hold the CPU build of 2.13.0);
# on a machine whose index serves CUDA builds (PyPI's torch for Linux is one, about 2.5 GB),
# `make demo TORCH_INDEX=https://download.pytorch.org/whl/cpu` takes the CPU build.
TORCH_INDEX ?=
# The newest releases, as last resolved; .ci/run passes the ones pip resolves at each run.
NEWEST_TORCH := torch==2.14.1
NEWEST_LIGHTNING := lightning==2.6.6 pytorch-lightning==2.6.6
# The lowest Lightning release pyproject.toml declares, in both namespaces.
LOWEST_LIGHTNING := lightning==2.5.0 pytorch-lightning==2.5.0
# The lowest torch pyproject.toml declares; its wheels are built against numpy 1.
OLDEST_TORCH := torch==2.1.2 'numpy<2'
# The core every torch runs (docs/maintainers.md, "Supported versions and the CI legs").
CORE_TESTS := tests/test_multiprocess.py tests/test_amp_multiprocess.py tests/test_faults.py tests/test_examples.py \
	tests/test_precision.py tests/test_torch_features.py tests/test_apex_reference.py \
	tests/test_apex_double.py tests/test_ddp_under_amp.py tests/test_backends.py tests/test_migrate.py \
	tests/test_overflow.py tests/test_fabric.py tests/test_loss_optimizers.py
# What the lowest-Lightning leg leaves out: each is met with Lightning 2.5.0 on leg c or needs no Lightning API.
LOWEST_LEAVES_OUT := --ignore=tests/test_faults.py --ignore=tests/test_multiprocess.py --ignore=tests/test_packaging.py \
	--ignore=tests/test_examples.py --ignore=tests/test_readme.py --ignore=tests/test_env_report.py
LOWEST_TESTS := -k "not exit_zero_every_time and not close_on_the_example_under_torchrun" $(LOWEST_LEAVES_OUT)
# What the newest-torch leg leaves out of the core: legs a and c run it.
NEWEST_CORE := $(filter-out tests/test_faults.py,$(CORE_TESTS))
# The ten-run exit-code loop runs on torch 2.1 only, where a finished run could hang at exit (pytorch/pytorch#154976).
WITHOUT_EXIT_LOOP := -k "not exit_zero_every_time"
REPORTS := build/test-reports
# Two pytest workers, a test file each at a time (module-scoped runs stay in one worker); every leg lists its 25
# slowest tests.
PYTEST := -m pytest -n 2 --dist loadfile --durations=25
# The small virtualenvs of the other legs (.ci/venv); build/ is git-ignored, so ruff and git leave them alone.
LEG_VENVS := build/venvs

.PHONY: demo test test-lowest test-torch21 test-newest lint bench envs env-lowest env-torch21 env-newest

# $(call leg,VENV,PINS,NAME,PYTEST ARGUMENTS): the versions, the tests, then the passes and skips of each test file
# against the leg's table [NAME] in .ci/minimums.toml.
define leg
	$(1)/bin/python .ci/leg.py versions $(2)
	$(1)/bin/python $(PYTEST) --junitxml=$(REPORTS)/$(3).xml $(4)
	$(1)/bin/python .ci/leg.py passed $(REPORTS)/$(3).xml $(3)
endef

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install -q --upgrade pip
	$(VENV)/bin/pip install -q $(TORCH) $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX))
	$(VENV)/bin/pip install -q $(NEWEST_LIGHTNING)
	# [compare]: matplotlib, so that this leg also checks compare.png; the other legs check the report without it.
	$(VENV)/bin/pip install -q -e ".[dev,compare]" $(NEWEST_LIGHTNING)
	touch $@

demo: $(VENV)/.installed
	$(VENV)/bin/torchrun --nproc-per-node=2 examples/train_mlp.py

lint: $(VENV)/.installed
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy

test: lint
	$(call leg,$(VENV),$(TORCH) $(NEWEST_LIGHTNING),test,$(WITHOUT_EXIT_LOOP))

# Not a test: CPU benchmarks against the plain recipe, Lightning's ddp and Accelerate (benchmarks/README.md).
bench: $(VENV)/.installed
	$(VENV)/bin/pip install -q -e ".[bench]"
	$(VENV)/bin/python benchmarks/run.py

# The other legs rebuild their small virtualenv at every run (seconds once the cached environment exists), so it
# always holds the pins on the command line: CI passes the newest releases it resolved.

# Every leg's environment, built side by side (`make -j4 envs`): .ci/run builds them before the first leg, so that
# downloading and unpacking the CUDA builds of torch overlaps, instead of coming one leg after another.
envs: $(VENV)/.installed env-lowest env-torch21 env-newest

env-lowest:
	.ci/venv $(LEG_VENVS)/lowest $(TORCH) $(LOWEST_LIGHTNING)

env-torch21:
	.ci/venv $(LEG_VENVS)/torch21 $(OLDEST_TORCH) $(LOWEST_LIGHTNING)

env-newest:
	.ci/venv $(LEG_VENVS)/newest $(NEWEST_TORCH) $(NEWEST_LIGHTNING)

# The whole suite but LOWEST_LEAVES_OUT against the lowest declared Lightning.
test-lowest: env-lowest
	$(call leg,$(LEG_VENVS)/lowest,$(TORCH) $(LOWEST_LIGHTNING),test-lowest,$(LOWEST_TESTS))

test-torch21: env-torch21
	$(call leg,$(LEG_VENVS)/torch21,$(OLDEST_TORCH) $(LOWEST_LIGHTNING),test-torch21,$(CORE_TESTS))

test-newest: env-newest
	$(call leg,$(LEG_VENVS)/newest,$(NEWEST_TORCH) $(NEWEST_LIGHTNING),test-newest,$(WITHOUT_EXIT_LOOP) $(NEWEST_CORE))
