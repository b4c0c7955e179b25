"""The GPU smoke suite (tests/gpu, docs/gpu.md), everything of it that runs without a GPU.

- the wheel list: versions equal requirements/cpu-lock.txt, every wheel requirement resolves
  within the wheel set + the GPU image's packages, nothing shadows an image package; and the
  checkers themselves report a missing package (they can fail);
- `tests/gpu/suite.sh prepare` for real, into a temporary folder: the wheels downloaded and checked
  against their recorded sha256, the loop's rollouts saved by SGLang (rollout_only, dense and MoE
  with R3 routes), what travels to the GPU machine < 64 MiB;
- `tests/gpu/suite.sh dry-run`: every test of tests/gpu passes on CPU (tiny shapes, gloo, the same
  code paths), none skipped, and the figures file holds every section; among those tests, the
  train_only import trace resolves against the wheels + the image (test_gpu_loop.py).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SUITE = REPO / "tests" / "gpu"


def _load(name: str):
    sys.path.insert(0, str(SUITE))
    try:
        spec = importlib.util.spec_from_file_location(name, SUITE / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(str(SUITE))


@pytest.mark.slow
def test_wheel_list_is_complete_and_pinned():
    out = subprocess.run([sys.executable, str(SUITE / "prepare.py"), "wheels", "--check-only"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "megatron-core==0.16.1" in out.stdout and "problem" not in out.stdout


def test_the_checkers_report_what_is_missing():
    prepare = _load("prepare")
    pins = prepare.read_pins()
    reqs = json.loads((SUITE / "wheel-requirements.json").read_text())
    assert prepare.check_set(pins, reqs) == []
    without = [p for p in pins if p.name != "omegaconf"]
    problems = prepare.check_set(without, {k: v for k, v in reqs.items() if k != "omegaconf"})
    assert any("hydra-core requires omegaconf" in p for p in problems), problems
    # sglang is installed here but neither travels nor is on the GPU image
    trace = {"edges": [["megatron_rl", "sglang"], ["megatron_rl", "torch"], ["transformers", "regex"]],
             "loaded": ["sglang", "torch", "regex", "transformers"]}
    problems, where = prepare.check_imports(trace, pins)
    assert len(problems) == 1 and problems[0].startswith("sglang"), problems
    assert where == {"image": ["torch"]}  # regex: imported by an image package, the image's business


@pytest.mark.slow
def test_prepare_then_dry_run_the_whole_suite_on_cpu(tmp_path):
    env = {**os.environ, "MRL_GPU_DIR": str(tmp_path / "gpu"), "OUT": str(tmp_path / "out"), "PY": sys.executable}
    env.pop("MRL_GPU_FIGURES", None)
    prep = subprocess.run(["bash", str(SUITE / "suite.sh"), "prepare"], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=900)
    assert prep.returncode == 0, prep.stdout[-4000:] + prep.stderr[-4000:]
    assert "travels:" in prep.stdout and len(list((tmp_path / "gpu" / "wheels").glob("*.whl"))) == 5
    print(prep.stdout)
    run = subprocess.run(["bash", str(SUITE / "suite.sh"), "dry-run", "-p", "no:logging"], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=900)
    summary = (tmp_path / "out" / "summary.txt").read_text().strip()
    print(summary)
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-3000:]
    root = ET.parse(tmp_path / "out" / "junit.xml").getroot()
    suite = root if root.tag == "testsuite" else root[0]
    n = int(suite.get("tests"))
    assert n >= 20 and summary == f"{n} passed, 0 failed", summary
    assert int(suite.get("skipped")) == 0
    figures = json.loads((tmp_path / "out" / "gpu_figures.json").read_text())
    assert {"environment", "a_learner", "b_loop", "c_vocab_parallel", "d_throughput"} <= figures.keys()
    assert {"dense_1p7b", "moe_small", "moe_30b_layer"} <= figures["d_throughput"].keys()
    assert {"torch", "local"} <= figures["d_throughput"]["dense_1p7b"].keys()
    assert all("profile" in figures["d_throughput"][m]["torch"] for m in ("dense_1p7b", "moe_small", "moe_30b_layer"))
    assert figures["run"]["commit"] and figures["run"]["result"] == summary
    assert "torch_spec_logsoftmax_error_vs_hf_fp32" in figures["a_learner"]
    assert figures["c_vocab_parallel"]["benchmark"]["rows"][0]["variants"]["e"]["fwd_bwd_ms"] > 0
