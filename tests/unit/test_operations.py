"""The loop's operations (trainer/operations.py): the job's end, and the decision between two steps.

Independent reference: the arithmetic written out here (end − now against the longest recent step
+ the last save + the margin); the Slurm end time as squeue prints it, parsed by the standard
library. The Slurm job itself (a time limit lowered mid-run, the requeue, the resume with no step
lost or repeated) is tests/slurm/test_sbatch.py's.
"""

from __future__ import annotations

import datetime
import signal
import types

import pytest

from megatron_rl.config.schema import TrainerConfig
from megatron_rl.trainer.operations import JobClock, Operations, parse_end_time


def test_parse_end_time():
    assert parse_end_time("2026-11-26T21:34:40") == datetime.datetime(2026, 11, 26, 21, 34, 40).timestamp()
    assert parse_end_time("1800000000") == 1.8e9
    for none in ("NONE", "Unknown", "N/A", "UNLIMITED", ""):
        assert parse_end_time(none) is None


def test_job_clock_sources():
    t = [1000.0]
    now = lambda: t[0]  # noqa: E731
    assert JobClock(3600, env={"SLURM_JOB_ID": "7"}, now=now).end() == 4600.0  # explicit wins over Slurm
    assert JobClock(0, env={"SLURM_JOB_ID": "7"}, now=now).end() is None
    assert JobClock(None, env={}, now=now).end() is None  # not in a Slurm job
    with pytest.raises(ValueError, match="trainer.time_limit=-5"):
        JobClock(-5, env={})

    # Slurm: re-read every refresh_s (an administrator may change the limit mid-run)
    ends, reads = [5000.0, 3000.0], []

    def squeue(job_id):
        reads.append(job_id)
        return ends[min(len(reads), len(ends)) - 1]

    clock = JobClock(None, env={"SLURM_JOB_ID": "7"}, now=now, read_slurm=squeue, refresh_s=10)
    assert clock.end() == 5000.0 and reads == ["7"]
    t[0] += 5
    assert clock.end() == 5000.0 and len(reads) == 1  # cached
    t[0] += 6
    assert clock.end() == 3000.0 and len(reads) == 2  # lowered: seen

    # no squeue (a container): the end time the sbatch exported, said once
    lines = []

    def missing(job_id):
        raise OSError("squeue: [Errno 2] No such file or directory")

    clock = JobClock(None, env={"SLURM_JOB_ID": "7", "MRL_JOB_END_TIME": "4242"}, now=now, read_slurm=missing,
                     log=lines.append)
    assert clock.end() == 4242.0 and clock.end() == 4242.0
    assert len(lines) == 1 and "using MRL_JOB_END_TIME" in lines[0]


def _ops(tmp_path, end, margin=10.0, save_every=0):
    t = TrainerConfig(time_limit_margin=margin, save_every=save_every)
    ctx = types.SimpleNamespace(device="cpu", rank=0)
    clock = JobClock(None, env={})
    clock.end = lambda: end  # a fixed end, in epoch seconds
    clock.source = "test"
    return Operations(t, ctx, tmp_path, log=print, clock=clock)


def test_between_steps_stops_before_a_step_that_would_not_fit(tmp_path):
    import time

    ops = _ops(tmp_path, end=time.time() + 100, margin=10)
    try:
        ops._steps.extend([30.0, 50.0])  # the longest recent step counts
        d = ops.between_steps(step=3, last_step=10, save_every=0)
        assert (d.save, d.stop, d.requeue) == (False, "", False)  # 100 s left >= 50 + 0 + 10
        ops.checkpointer.last = {"total_s": 45.0}  # a save takes 45 s: 50 + 45 + 10 > 100
        d = ops.between_steps(step=4, last_step=10, save_every=0)
        assert (d.save, d.stop, d.requeue) == (True, "time limit", True)
        assert "a step takes up to 50s, a save 45s" in ops.why and "time_limit_margin=10s" in ops.why
        d = ops.between_steps(step=10, last_step=10, save_every=0)  # the last step: done, not requeued
        assert (d.save, d.stop, d.requeue) == (True, "", False)
    finally:
        ops.finish()


def test_between_steps_periodic_final_and_signals(tmp_path):
    ops = _ops(tmp_path, end=None, save_every=4)
    try:
        assert ops.between_steps(3, 10, 4).save is False
        assert ops.between_steps(4, 10, 4).save is True
        assert ops.between_steps(10, 10, 4).save is True  # the last step
        signal.raise_signal(signal.SIGUSR1)
        d = ops.between_steps(5, 10, 4)
        assert (d.save, d.stop, d.requeue) == (True, "SIGUSR1", False)  # a signal is not a requeue by the loop
    finally:
        ops.finish()
    assert signal.getsignal(signal.SIGUSR1) is not ops.stop._handle  # handlers given back


def test_step_time_excludes_saves(tmp_path):
    import time

    ops = _ops(tmp_path, end=None)
    try:
        ops.step_started()
        time.sleep(0.2)
        ops.checkpointer.blocked_total_s += 0.15  # of those 0.2 s, a save held the step up for 0.15
        ops.between_steps(1, 10, 0)
        assert 0.04 < ops._steps[-1] < 0.12
    finally:
        ops.finish()
