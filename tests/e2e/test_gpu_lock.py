"""requirements/gpu-lock.txt is what requirements/gpu.in resolves to (.ci/check_gpu_lock.py, uv 0.13.9,
metadata only, no wheel downloaded: ~7-9 s a run), and the check can fail: a lock with one pin
changed is refused with a message naming the package.

Needs https://pypi.org. Without it these tests fail, saying so; they never skip (an unchecked lock
would pass unnoticed).
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
LOCK = REPO / "requirements" / "gpu-lock.txt"


def check(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(REPO / ".ci" / "check_gpu_lock.py"), *args],
                          cwd=REPO, capture_output=True, text=True, timeout=300)


def test_gpu_lock_matches_its_resolution():
    run = check()
    assert run.returncode == 0, run.stdout + run.stderr
    assert "matches the resolution" in run.stdout


def test_altered_lock_fails_naming_the_package(tmp_path):
    lock = LOCK.read_text()
    assert re.search(r"^orjson==(?!3\.9\.0 )", lock, re.M), "the lock pins orjson"
    altered = tmp_path / "gpu-lock.txt"
    altered.write_text(re.sub(r"^orjson==\S+", "orjson==3.9.0", lock, count=1, flags=re.M))
    run = check("--lock", str(altered))
    assert run.returncode != 0, run.stdout + run.stderr
    assert "orjson: the lock has 3.9.0, the resolution gives" in run.stderr, run.stderr
