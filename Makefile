# Two entry points, both idempotent from a fresh clone:
#   make demo   install (once) and run the main job on the embedded default
#   make test   install (once) and run the test suite
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: setup demo test bench clean gpu-prepare gpu-dry-run

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

test: $(STAMP)
	$(PY) -m pytest tests -q

# The GPU smoke suite (docs/gpu.md): prepare its wheels and saved rollouts here, dry-run it on CPU;
# on the GPU machine: tests/gpu/suite.sh run. `make test` never collects tests/gpu (pyproject addopts).
gpu-prepare: $(STAMP)
	PY=$(abspath $(PY)) bash tests/gpu/suite.sh prepare

gpu-dry-run: $(STAMP)
	PY=$(abspath $(PY)) bash tests/gpu/suite.sh dry-run

clean:
	rm -rf $(VENV)
