"""The GPU smoke suite runs only when asked for by path (`pytest tests/gpu`, `tests/gpu/suite.sh`):
pyproject's addopts ignore tests/gpu in every other run, so CI's `make test` never counts a test
of it as passed on CPU. Asked for on a machine without CUDA, it refuses to start unless
MRL_GPU_SUITE_DEVICE=cpu selects the dry run (gpu_common.py).
"""

from __future__ import annotations

import pytest

import gpu_common


def pytest_configure(config):
    import torch

    name = gpu_common.device()
    if name == "cuda" and not torch.cuda.is_available():
        raise pytest.UsageError(
            "tests/gpu needs a CUDA device (torch sees none). For the CPU dry run of the suite's code "
            "paths set MRL_GPU_SUITE_DEVICE=cpu; on the GPU machine use `tests/gpu/suite.sh run`.")
    if name == "cpu" and torch.cuda.is_available():
        raise pytest.UsageError("MRL_GPU_SUITE_DEVICE=cpu on a machine with CUDA: hide it for the dry run "
                                "(CUDA_VISIBLE_DEVICES=) so the package takes its CPU paths")


def pytest_report_header(config):
    return f"megatron-rl GPU smoke suite: device={gpu_common.device()}, data={gpu_common.data_dir()}, " \
           f"figures={gpu_common.figures_path()}"


def pytest_runtest_logreport(report):
    """Each test's wall time (set-up + call + tear-down: module fixtures run whole trainers in
    set-up) into the figures file, so every run says what the 10-minute command is spent on."""
    if report.duration >= 0.05:
        import json

        name = report.nodeid.split("::", 1)[-1]
        path = gpu_common.figures_path()
        before = json.loads(path.read_text()).get("durations_s", {}) if path.exists() else {}
        gpu_common.record("durations_s", {name: round(before.get(name, 0.0) + report.duration, 1)})
