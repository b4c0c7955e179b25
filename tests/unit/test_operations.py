"""The loop's operations (run/operations.py): the job's end, and the decision between two steps.

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
from megatron_rl.run.operations import JobClock, Operations, parse_end_time


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


@pytest.mark.parametrize("moe", [False, True])
def test_parameter_count_matches_transformers(tmp_path, moe):
    import transformers

    from megatron_rl.models.layout import parameter_count
    from megatron_rl.models.tiny import make_tiny_checkpoint

    path = make_tiny_checkpoint(tmp_path / "m", moe=moe, num_layers=3)
    config = transformers.AutoConfig.from_pretrained(path)
    import torch

    with torch.device("meta"):  # shapes only
        model = transformers.AutoModelForCausalLM.from_config(config)
    expected = sum(p.numel() for p in model.parameters())
    assert parameter_count(types.SimpleNamespace(hf_path=str(path))) == expected


def test_storage_check_refuses_what_does_not_fit(tmp_path):
    import json

    from megatron_rl.config.load import load_config, to_object
    from megatron_rl.run.checkpoint import storage_check

    (tmp_path / "q3").mkdir()
    (tmp_path / "q3" / "config.json").write_text(json.dumps(dict(  # Qwen3-30B-A3B's shape
        hidden_size=2048, num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
        intermediate_size=6144, moe_intermediate_size=768, num_experts=128, vocab_size=151936,
        tie_word_embeddings=False)))
    job = to_object(load_config("tiny_cpu", [f"model.hf_path={tmp_path / 'q3'}", f"trainer.out_dir={tmp_path / 'run'}",
                                             "hardware=4 nodes x 8 H100"]))
    tb = 1e12
    line, problems = storage_check(job, free_bytes=lambda p: int(2 * tb), home="/nonexistent-home")
    assert "427.4 GB each (30,532.1M params x 14 bytes)" in line and "1,282.3 GB" in line and not problems
    line, problems = storage_check(job, free_bytes=lambda p: int(1 * tb), home="/nonexistent-home")
    assert len(problems) == 1 and "need 1,282.3 GB (keep_checkpoints=2 + 1 being written)" in problems[0]
    _, problems = storage_check(job, free_bytes=lambda p: int(2 * tb), home=str(tmp_path))
    assert len(problems) == 1 and "is under $HOME" in problems[0] and "427 GB" in problems[0]
    job.hardware = "cpu: 2 cores"  # a CPU run: fp32 (12 bytes), and $HOME is fine
    line, problems = storage_check(job, free_bytes=lambda p: int(2 * tb), home=str(tmp_path))
    assert "x 12 bytes" in line and not problems
