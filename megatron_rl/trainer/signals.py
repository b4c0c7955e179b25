"""Preemption: SIGTERM / SIGUSR1 ask the run to stop at the next step boundary with a checkpoint.

The handler only sets a flag (nothing unsafe runs inside a signal handler). Ranks receive the
signal at slightly different moments, so `requested()` is a collective: the flag is max-reduced
over all ranks, and every rank stops after the same step.
"""

from __future__ import annotations

import signal

import torch
import torch.distributed as dist

SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class StopRequest:
    def __init__(self, device: torch.device | str = "cpu"):
        """`device`: where the flag lives for the all-reduce (the default group's: CUDA with NCCL)."""
        self.device = torch.device(device)
        self.signum = 0
        self._previous = {s: signal.signal(s, self._handle) for s in SIGNALS}

    def _handle(self, signum, frame) -> None:
        self.signum = signum

    def requested(self) -> bool:
        flag = torch.tensor([self.signum], dtype=torch.int64, device=self.device)
        if dist.is_initialized():
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        self.signum = int(flag)
        return self.signum != 0

    def name(self) -> str:
        return signal.Signals(self.signum).name if self.signum else ""

    def restore(self) -> None:
        for s, h in self._previous.items():
            signal.signal(s, h)
