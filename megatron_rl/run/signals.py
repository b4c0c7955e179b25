"""Stopping a run: SIGTERM / SIGUSR1 (schedulers, preemption), SIGINT (Ctrl-C) and SIGHUP (the
terminal closed) ask the run to stop with a checkpoint: at once if the step in progress is still
generating (its generation is given up; run/operations.py `Operations.interrupt`), else at
the step's end.

The handler only sets a flag (nothing unsafe runs inside a signal handler). Ranks receive the
signal at slightly different moments, so `requested()` is a collective: the flag is max-reduced
over all ranks, and every rank stops after the same step.

Ctrl-C: the first one announces itself in one line (rank 0) and stops like SIGTERM; a second
one means "now": it raises KeyboardInterrupt (the CLI reports it in one line, without a checkpoint
of the step in progress). The servers a trainer starts are in process groups of their own, so a
terminal's SIGINT reaches only the trainer (rollout/server.py).
"""

from __future__ import annotations

import os
import signal

import torch
import torch.distributed as dist

SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT, signal.SIGHUP)


class StopRequest:
    def __init__(self, device: torch.device | str = "cpu", announce: bool = True):
        """`device`: where the flag lives for the all-reduce (the default group's: CUDA with NCCL).
        `announce`: this rank says so when the first Ctrl-C arrives (rank 0)."""
        self.device = torch.device(device)
        self.announce = announce
        self.signum = 0
        self._previous = {s: signal.signal(s, self._handle) for s in SIGNALS}

    def _handle(self, signum, frame) -> None:
        if signum == signal.SIGINT:
            if self.signum == signal.SIGINT:
                raise KeyboardInterrupt
            if self.announce:
                os.write(2, b"\n[megatron-rl] Ctrl-C: stopping with a checkpoint "
                            b"(Ctrl-C again: stop now, without one)\n")
        if not self.signum:
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
