"""A real one-node Slurm cluster for the sbatch tests (slurm/local_cluster.sh).

The session fixture starts the cluster (two virtual nodes) unless it is already running (installing slurm-wlm and
munge with apt when they are missing, which needs root) and stops it afterwards only if it started
it. Where Slurm cannot be installed or started the tests skip with the reason -- except when
MRL_REQUIRE_SLURM=1 (set by .ci/run), where they fail instead: CI must not skip them silently.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
CLUSTER = REPO / "slurm" / "local_cluster.sh"


NODES = 2  # virtual nodes: learners on one, SGLang on the other


def _cluster(cmd: str, timeout: float = 900) -> subprocess.CompletedProcess:
    return subprocess.run([str(CLUSTER), cmd], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "MRL_SLURM_NODES": str(NODES)})


@pytest.fixture(scope="session")
def slurm_cluster():
    """SLURM_CONF of a running local cluster (exported into this process's environment)."""
    running = _cluster("status").returncode == 0
    if not running:
        if os.geteuid() != 0:
            reason = "the local Slurm cluster needs root (slurmd launches jobs as the submitting user)"
        else:
            r = _cluster("start")
            reason = None if r.returncode == 0 else (
                f"slurm/local_cluster.sh start failed (slurm-wlm/munge not installable here?):\n"
                f"{r.stdout}{r.stderr}")
        if reason:
            if os.environ.get("MRL_REQUIRE_SLURM") == "1":
                pytest.fail(reason)
            pytest.skip(reason)
    conf = _cluster("env").stdout.strip().split("=", 1)[1]
    old = os.environ.get("SLURM_CONF")
    os.environ["SLURM_CONF"] = conf
    yield conf
    if old is None:
        os.environ.pop("SLURM_CONF", None)
    else:
        os.environ["SLURM_CONF"] = old
    if not running:
        _cluster("stop")
