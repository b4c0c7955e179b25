"""A server's environment: the starting process's, minus the launcher's rank variables.

The reference for torchrun is torchrun itself: a real worker's environment, compared with the
environment torchrun was started with, names every variable torchrun adds.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_rl.rollout.server import (
    SGLangServer, ServerConfig, is_launcher_variable, server_environment,
)

# Variables torchrun adds that tune rather than name a rank: a server may keep them.
TORCHRUN_TUNING = {"OMP_NUM_THREADS", "TORCH_NCCL_ASYNC_ERROR_HANDLING"}


def torchrun_worker_env(tmp_path: Path, parent: dict[str, str]) -> dict[str, str]:
    """The environment of rank 1 of a real 2-process torchrun started with `parent`."""
    torchrun = Path(sys.executable).with_name("torchrun")
    dump = "import json, os; json.dump(dict(os.environ), open(os.environ['OUT'] + os.environ['RANK'], 'w'))"
    subprocess.run([str(torchrun), "--nproc-per-node", "2", "--standalone", "--no-python",
                    sys.executable, "-c", dump], env={**parent, "OUT": str(tmp_path / "env")},
                   check=True, timeout=120, capture_output=True)
    return json.loads((tmp_path / "env1").read_text())


@pytest.mark.slow
def test_torchrun_worker_variables_do_not_reach_a_server(tmp_path):
    parent = {k: v for k, v in os.environ.items() if not is_launcher_variable(k)}
    parent.pop("OMP_NUM_THREADS", None)  # torchrun sets it for 2 processes only if unset
    parent |= {"CUDA_VISIBLE_DEVICES": "3,5", "MY_SETTING": "kept", "NCCL_DEBUG": "WARN"}
    worker = torchrun_worker_env(tmp_path, parent)
    added = set(worker) - set(parent) - {"OUT"}
    # What made the server hang, and the rendezvous variables torch and SGLang read.
    assert {"TORCHELASTIC_USE_AGENT_STORE", "RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
            "MASTER_PORT", "GROUP_RANK", "ROLE_RANK", "LOCAL_WORLD_SIZE"} <= added, added

    env = server_environment(worker, device="cpu")
    assert sorted(added & env.keys()) == sorted(TORCHRUN_TUNING & added)
    for k in ("CUDA_VISIBLE_DEVICES", "MY_SETTING", "NCCL_DEBUG", "PATH"):
        assert env.get(k) == parent.get(k), k
    assert env["SGLANG_USE_CPU_ENGINE"] == "1"


def test_slurm_and_mpi_rank_variables_dropped_job_variables_kept():
    launched = {
        # srun task identity
        "SLURM_PROCID": "3", "SLURM_LOCALID": "1", "SLURM_NODEID": "1", "SLURM_NTASKS": "8",
        "SLURM_NPROCS": "8", "SLURM_STEP_NUM_TASKS": "8", "SLURM_GTIDS": "2,3",
        "SLURM_TASKS_PER_NODE": "4(x2)", "SLURM_TASK_PID": "4242",
        # PMI / PMIx / Open MPI / MPICH / MVAPICH rank identity
        "PMI_RANK": "3", "PMI_SIZE": "8", "PMI_FD": "7", "PMIX_RANK": "3", "PMIX_NAMESPACE": "slurm.1",
        "OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "8", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
        "OMPI_MCA_ess_base_vpid": "3", "OMPI_MCA_orte_hnp_uri": "x", "MPI_LOCALRANKID": "1",
        "MV2_COMM_WORLD_RANK": "3",
        # the learner's own CUDA setting (the sbatch sets it for learner ranks only)
        "CUDA_DEVICE_MAX_CONNECTIONS": "1",
    }
    job = {"SLURM_JOB_ID": "77", "SLURM_JOB_NODELIST": "n[1-2]", "SLURM_CPUS_PER_TASK": "16",
           "OMPI_MCA_btl": "^openib", "CUDA_VISIBLE_DEVICES": "0,1,2,3", "PATH": "/usr/bin"}
    env = server_environment(launched | job, device="cuda")
    assert env == job  # on cuda without gpu_ids the inherited CUDA_VISIBLE_DEVICES stands


def test_explicit_env_and_gpu_ids_win_over_the_rule(monkeypatch):
    for k, v in {"RANK": "1", "WORLD_SIZE": "2", "TORCHELASTIC_USE_AGENT_STORE": "True",
                 "CUDA_VISIBLE_DEVICES": "0,1", "MY_SETTING": "kept"}.items():
        monkeypatch.setenv(k, v)
    server = SGLangServer(0, ServerConfig(model_path="m", device="cuda", env={"MASTER_ADDR": "10.0.0.9"}),
                          port=1, log_path=Path("unused.log"), gpu_ids=[6, 7])
    env = server.environment()
    assert "RANK" not in env and "WORLD_SIZE" not in env and "TORCHELASTIC_USE_AGENT_STORE" not in env
    assert env["MASTER_ADDR"] == "10.0.0.9"  # named in ServerConfig.env on purpose
    assert env["CUDA_VISIBLE_DEVICES"] == "6,7" and env["MY_SETTING"] == "kept"
    assert "SGLANG_USE_CPU_ENGINE" not in env


def test_a_cpu_server_s_openmp_threads_sleep_unless_chosen():
    """A CPU server's OpenMP threads sleep when idle (OMP_WAIT_POLICY=PASSIVE: its scheduler shares
    the cores with its own processes and the trainer's push), unless the environment or the server's
    config chose; a GPU server's environment is not touched."""
    assert server_environment({}, device="cpu")["OMP_WAIT_POLICY"] == "PASSIVE"
    assert server_environment({"OMP_WAIT_POLICY": "ACTIVE"}, device="cpu")["OMP_WAIT_POLICY"] == "ACTIVE"
    assert server_environment({}, {"OMP_WAIT_POLICY": "ACTIVE"}, device="cpu")["OMP_WAIT_POLICY"] == "ACTIVE"
    assert "OMP_WAIT_POLICY" not in server_environment({}, device="cuda")


def test_a_servers_port_is_drawn_under_the_ephemeral_range():
    """`free_port`: a server's HTTP port comes from LISTEN_PORTS, under the kernel's ephemeral range
    (which bind(0) and outgoing connections draw from) and under SGLang's own draw for its NCCL
    port (22000-29999), free when drawn, at random (servers started together rarely draw alike)."""
    import socket

    from megatron_rl.rollout.server import LISTEN_PORTS, free_port

    ranges = Path("/proc/sys/net/ipv4/ip_local_port_range")
    ephemeral = int(ranges.read_text().split()[0]) if ranges.exists() else 32768  # Linux's default
    ports = [free_port() for _ in range(50)]
    high = min(LISTEN_PORTS[1], ephemeral - 1)
    assert all(LISTEN_PORTS[0] <= p <= high < 22000 for p in ports), ports
    assert len(set(ports)) >= 45
    for p in ports[:5]:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", p))
