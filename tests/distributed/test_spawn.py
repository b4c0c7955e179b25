"""megatron_rl.distributed.spawn: a port taken between the probe and rank 0's bind (another process
on the machine took it: a CI failure once) is retried on a new port, not reported as a failure."""

from __future__ import annotations

import socket

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
