# Two entry points, both idempotent from a fresh clone:
#   make demo   install (once) and run the main job on the embedded default
#   make test   install (once) and run the test suite (what CI runs; docs/testing.md)
#   make test-fast  the unit tier only: no server, no spawned process (the edit-run loop, < 3 min)
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: setup demo test test-fast bench clean gpu-prepare gpu-dry-run gpu-env gpu-env-check

setup: $(STAMP)

LOCKS := requirements/cpu-lock.txt requirements/cpu-constraints.txt requirements/sglang-nodeps.txt \
	requirements/sglang-cpu-extras.txt

# The constraints file keeps the CPU build of torch. SGLang (and xgrammar) go in with --no-deps:
# SGLang's wheel hard-requires torch 2.14.1 and CUDA-only packages; what they need on CPU is in
# cpu-lock.txt. triton and torchvision go to a folder outside site-packages that only SGLang
# server processes on CPU put on sys.path (see the requirements files and patches/sglang_cpu.py).
$(STAMP): pyproject.toml $(LOCKS)
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -c requirements/cpu-constraints.txt -r requirements/cpu-lock.txt
	$(PY) -m pip install -q --no-deps -c requirements/cpu-constraints.txt -r requirements/sglang-nodeps.txt
	$(PY) -m pip install -q --no-deps --upgrade --target $(VENV)/sglang-cpu-extras \
		-r requirements/sglang-cpu-extras.txt
	$(PY) -m pip install -q --no-deps --no-build-isolation -e .
	touch $@

demo: $(STAMP)
	$(PY) -m megatron_rl.cli demo

# Two pytest-xdist workers: most of the suite waits on one core (imports, server start-up, Python
# overhead of tiny models), so two side by side fill the machine's two cores. Tests that share a
# module's fixtures stay on one worker; the longest go first (tests/conftest.py). TEST_WORKERS=0
# runs it in this process, serially.
TEST_WORKERS ?= 2
XDIST = $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadscope --no-loadscope-reorder)

# Two workers' trainers and CPU servers share the cores: OpenMP threads that wait sleep instead of
# spinning (measured on 2 cores: 5 trainer tests on two workers, 149-153 s -> 141 s).
test: $(STAMP)
	OMP_WAIT_POLICY=$${OMP_WAIT_POLICY:-PASSIVE} $(PY) -m pytest tests -q $(XDIST) $(PYTEST_ARGS)

# The unit tier on the same two workers (pure tests: no process of their own to share the cores with).
test-fast: $(STAMP)
	$(PY) -m pytest tests -q -m "not slow" $(XDIST) $(PYTEST_ARGS)

# The GPU smoke suite (docs/gpu.md): prepare its wheels and saved rollouts here, dry-run it on CPU;
# on the GPU machine: tests/gpu/suite.sh run. `make test` never collects tests/gpu (pyproject addopts).
gpu-prepare: $(STAMP)
	PY=$(abspath $(PY)) bash tests/gpu/suite.sh prepare

gpu-dry-run: $(STAMP)
	PY=$(abspath $(PY)) bash tests/gpu/suite.sh dry-run

# The GPU environment (docs/cluster.md) as a plain venv on a cluster node with a CUDA 13 toolkit (nvcc
# on PATH, e.g. after `module load cuda/13.0`): exactly requirements/gpu-lock.txt, hash-checked, by
# docker/install_lock.sh, the install script of docker/Dockerfile.gpu: every pin, Transformer Engine's
# torch extension built from its sdist against the torch just installed (with g++ and the toolkit's
# CUDA and cuDNN headers), the project; then the image's verify step. MAX_JOBS=N: parallel compiles.
GPU_VENV ?= .venv-gpu
GPU_PYTHON ?= python3.12
gpu-env:
	@command -v nvcc >/dev/null && nvcc --version | grep -q 'release 13\.' || \
		{ echo "gpu-env: needs a CUDA 13 toolkit's nvcc on PATH (found: $$(command -v nvcc || echo none))"; exit 1; }
	$(GPU_PYTHON) -m venv $(GPU_VENV)
	docker/install_lock.sh $(GPU_VENV) base te project
	$(GPU_VENV)/bin/python docker/verify_env.py

# The lock installed for real on this x86_64 host, no GPU needed (.ci/gpu_env_check.sh): what the
# default image installs (no Transformer Engine), into a fresh venv GPU_CHECK_VENV; verify_env.py; a
# tiny Megatron model trained 3 steps on CPU. ~11 GB of disk; docs/cluster.md has a run's figures.
GPU_CHECK_VENV ?= /tmp/megatron-rl-gpu-check
gpu-env-check:
	GPU_PYTHON='$(GPU_PYTHON)' GPU_CHECK_VENV='$(GPU_CHECK_VENV)' .ci/gpu_env_check.sh

clean:
	rm -rf $(VENV)
