# Two entry points, both idempotent from a fresh clone:
#   make demo   install (once) and run the main job on the embedded default
#   make test   install (once) and run the test suite
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: setup demo test bench clean

setup: $(STAMP)

$(STAMP): pyproject.toml requirements/cpu-lock.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -r requirements/cpu-lock.txt
	$(PY) -m pip install -q --no-deps --no-build-isolation -e .
	touch $@

demo: $(STAMP)
	$(PY) -m megatron_rl.cli demo

test: $(STAMP)
	$(PY) -m pytest tests -q

clean:
	rm -rf $(VENV)
