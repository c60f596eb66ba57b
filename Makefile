# Two commands on a fresh machine: `make demo` and `make test`. Each builds the virtualenv it needs.
# torch is pinned to the CPU build of 2.13.0 before anything else asks for torch: an unpinned install would pull
# a CUDA build of several GB.
#
# CI (.ci/run) runs four legs, each a target here; each checks the versions it runs and, file by file, the passes
# and skips that .ci/minimums.toml allows it (.ci/leg.py):
#   make test          torch 2.13.0 (CPU) + the newest Lightning 2.6.x: ruff, mypy and the whole suite (*)
#   make test-lowest   torch 2.13.0 (CPU) + Lightning 2.5.0: the whole suite but LOWEST_LEAVES_OUT (*)
#   make test-torch21  torch 2.1.2 + Lightning 2.5.0 + numpy<2: the core (CORE_TESTS), with the ten-run exit loop
#   make test-newest   the newest torch CI's pip allows + the newest Lightning 2.6.x: the core but its examples and
#                      fault injection (*)
# (*) without the ten-run exit-code loop (WITHOUT_EXIT_LOOP).
# The last three build their environment once, in ~/.cache/lightning-ddp-amp (.ci/venv): the index's torch builds
# other than 2.13.0's are CUDA builds of several GB. .ci/run resolves "newest" at every run and passes it on
# (make test-newest NEWEST_TORCH=torch==X NEWEST_LIGHTNING="lightning==Y pytorch-lightning==Y").

PYTHON ?= python3
VENV ?= .venv
TORCH := torch==2.13.0
# The newest releases, as last resolved; .ci/run passes the ones pip resolves at each run.
NEWEST_TORCH := torch==2.14.1
NEWEST_LIGHTNING := lightning==2.6.6 pytorch-lightning==2.6.6
# The lowest Lightning release pyproject.toml declares, in both namespaces.
LOWEST_LIGHTNING := lightning==2.5.0 pytorch-lightning==2.5.0
# The lowest torch pyproject.toml declares; its wheels are built against numpy 1.
OLDEST_TORCH := torch==2.1.2 'numpy<2'
# The core the other torch releases run: real ranks under torchrun (training, equivalence with the recipe, launchers
# through the examples), AMP in one process and on ranks, the apex and native AMP references with the apex double
# they run on, what DDP gets under each precision, the native backend without the apex one, fault injection, the
# CLI examples, and the torch feature probes. Tests that need what an older torch lacks (CPU float16 before 2.3)
# skip and say why. The two Lightning namespaces (test_namespaces.py) do not depend on torch: legs a and b run them
# on both Lightning releases.
CORE_TESTS := tests/test_multiprocess.py tests/test_amp_multiprocess.py tests/test_faults.py tests/test_examples.py \
	tests/test_precision.py tests/test_torch_features.py tests/test_apex_reference.py \
	tests/test_apex_double.py tests/test_ddp_under_amp.py tests/test_backends.py
# What the lowest-Lightning leg leaves out, each pair of versions still met: fault injection and the real-rank
# equivalence with the recipe depend on torch and on Lightning, and run with torch 2.13 on leg a and with Lightning
# 2.5.0 on leg c (torch 2.1.2, where they run whole); the wheel's packaging depends on neither, and runs on leg a.
# So do compare's two runs of torchrun's example and restarts (what they add to the rest of test_compare.py is
# torch's agent). The examples and the README's blocks (scripts of the public API) run with Lightning 2.5.0 on leg c,
# those in CPU float16 only on leg a (their AMP on Lightning 2.5.0 is test_precision.py's, here); the environment
# report (test_doctor.py) reads Lightning's version but not its API, and runs on leg a. About 16 minutes of CI.
LOWEST_LEAVES_OUT := --ignore=tests/test_faults.py --ignore=tests/test_multiprocess.py --ignore=tests/test_packaging.py \
	--ignore=tests/test_examples.py --ignore=tests/test_readme.py --ignore=tests/test_doctor.py
LOWEST_TESTS := -k "not exit_zero_every_time and not close_on_the_example_under_torchrun \
	and not torchrun_restarts_records_each_step_once" $(LOWEST_LEAVES_OUT)
# What the newest-torch leg leaves out of the core, to keep CI within its hour: the examples (scripts of the
# package's public API, which the core's real-rank tests meet on this torch) and fault injection; legs a (torch
# 2.13, the newest Lightning) and c (torch 2.1.2, Lightning 2.5.0) run both.
NEWEST_CORE := $(filter-out tests/test_examples.py tests/test_faults.py,$(CORE_TESTS))
# The ten-run exit-code loop runs on torch 2.1 only (test-torch21), where a finished run could hang at exit (torch's
# process group destructor held the GIL while joining gloo's workers, pytorch/pytorch#154976; launch/process_group.py):
# 80 s that every other leg, where each test's own runs exit too, leaves out to keep `make test` near 12 minutes.
WITHOUT_EXIT_LOOP := -k "not exit_zero_every_time"
REPORTS := build/test-reports
# The small virtualenvs of the other legs (.ci/venv); build/ is git-ignored, so ruff and git leave them alone.
LEG_VENVS := build/venvs

.PHONY: demo test test-lowest test-torch21 test-newest lint bench envs env-lowest env-torch21 env-newest

# $(call leg,VENV,PINS,NAME,PYTEST ARGUMENTS): the versions, the tests, then the passes and skips of each test file
# against the leg's table [NAME] in .ci/minimums.toml.
define leg
	$(1)/bin/python .ci/leg.py versions $(2)
	$(1)/bin/python -m pytest --durations=25 --junitxml=$(REPORTS)/$(3).xml $(4)
	$(1)/bin/python .ci/leg.py passed $(REPORTS)/$(3).xml $(3)
endef

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install -q --upgrade pip
	$(VENV)/bin/pip install -q $(TORCH) $(NEWEST_LIGHTNING)
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
