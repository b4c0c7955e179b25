"""megatron_rl.distributed.spawn: a port taken between the probe and rank 0's bind (another process
on the machine took it: a CI failure once) is retried on a new port, not reported as a failure; ranks
forked from the fork server see the caller as it is now (environment, working directory, stdout and
stderr), as spawned ones did."""

from __future__ import annotations

import os
import socket
import sys

import pytest
import torch
import torch.distributed as dist

from megatron_rl.distributed import spawn


def _sum_ranks(rank, world_size):
    t = torch.tensor([float(rank)])
    dist.all_reduce(t)
    return t.item()


@pytest.mark.slow
def test_a_port_taken_before_the_bind_is_retried(monkeypatch):
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        taken = held.getsockname()[1]
        ports = iter([taken])
        real = spawn.free_port
        monkeypatch.setattr(spawn, "free_port", lambda: next(ports, None) or real())
        assert spawn.run_distributed(_sum_ranks, 2, timeout=120) == [1.0, 1.0]
        assert next(ports, "used") == "used"  # the held port was tried first
        # attempts=1: the taken port is reported as such
        ports = iter([taken])
        try:
            spawn.run_distributed(_sum_ranks, 2, timeout=120, attempts=1)
        except RuntimeError as e:
            assert "ports taken before rank 0 bound them" in str(e)
        else:
            raise AssertionError("a held port did not fail the run")


def _report(rank, world_size):
    print(f"rank {rank} says hello on stdout")
    print(f"rank {rank} says hello on stderr", file=sys.stderr)
    return {"probe": os.environ.get("MRL_SPAWN_PROBE"), "cwd": os.getcwd(), "rank_env": os.environ["RANK"],
            "preloaded": "megatron.core" in sys.modules, "threads": torch.get_num_threads()}


@pytest.mark.slow
@pytest.mark.parametrize("method", ["forkserver", "spawn"])
def test_ranks_see_the_callers_environment_folder_and_output(monkeypatch, tmp_path, capfd, method):
    """forkserver: the CPU path (the server already running when the caller changes); spawn: the path
    with CUDA (the GPU suite's run_isolated), forced here."""
    if method == "spawn":
        monkeypatch.setattr(spawn, "_ctx", torch.multiprocessing.get_context("spawn"))
    assert spawn.run_distributed(_sum_ranks, 2, timeout=120) == [1.0, 1.0]  # a fork server runs now
    if method == "forkserver" and torch.cuda.is_available():
        pytest.skip("with CUDA, ranks are spawned (the spawn case)")
    assert spawn.context().get_start_method() == method
    # Changed after the fork server started: a rank must still see them.
    monkeypatch.setenv("MRL_SPAWN_PROBE", "now")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.chdir(tmp_path)
    capfd.readouterr()
    out = spawn.run_distributed(_report, 2, timeout=120)
    assert [r["rank_env"] for r in out] == ["0", "1"]
    assert all(r["probe"] == "now" and r["cwd"] == str(tmp_path) and r["threads"] == 1 for r in out), out
    if method == "forkserver":
        assert all(r["preloaded"] for r in out)  # forked from the server that imported it
    captured = capfd.readouterr()
    for rank in (0, 1):
        assert f"rank {rank} says hello on stdout" in captured.out, captured
        assert f"rank {rank} says hello on stderr" in captured.err, captured
