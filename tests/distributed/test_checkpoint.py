"""Checkpoints at a 30B run's scale of trouble, on two real gloo ranks (run/checkpoint.py).

TP 2, so that each rank writes shards of its own.
- An asynchronous save: `save` returns with the shards staged and a forked writer writing them; the
  model trains on (its parameters and Adam moments change) before the save is finished; the
  checkpoint then holds the state of the step it was asked for, and a learner resumed from it
  continues exactly as the learner that never stopped (every parameter and Adam moment bit for bit).
- A save that fails on one rank ends both ranks within seconds, each naming rank 1 and the error,
  and leaves the previous checkpoint as the one `latest` names: when rank 1's shard writes raise
  EDQUOT (as a full quota does), both raise at the all-reduce that asks whether every writer is done;
  when rank 1 fails writing its own files of an asynchronous save, rank 0 has returned from `save`
  and waits in a collective that rank 1 never joins, and the failure watcher ends it.
"""

from __future__ import annotations

import re
import time

import pytest
import torch

from megatron_rl.distributed.spawn import run_distributed
from megatron_rl.models.tiny import make_tiny_checkpoint

pytestmark = pytest.mark.slow


def _learner(hf_path, tp=2, pp=1):
    """A learner on the tiny model at TP `tp` x PP `pp`. The default, TP 2: both ranks write shards of
    their own (replicas are written once). Shared with test_checkpoint_spread.py."""
    from megatron_rl.config.schema import JobConfig, ParallelConfig
    from megatron_rl.distributed.context import init_distributed
    from megatron_rl.learner.learner import Learner

    cfg = JobConfig()
    cfg.model.hf_path = hf_path
    cfg.parallel = ParallelConfig(tp=tp, pp=pp)
    cfg.optim.lr, cfg.optim.adam_eps = 1e-2, 1e-3
    ctx = init_distributed(cfg.parallel)
    return Learner(cfg, ctx, run_dir="/nonexistent"), ctx


def _batch(step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    ids = torch.randint(3, 99, (4, 12), generator=g)
    return dict(input_ids=ids, labels=torch.roll(ids, -1, 1), loss_mask=torch.ones(4, 12))


def _state(learner) -> dict[str, torch.Tensor]:
    """This rank's parameters and Adam moments, named by parameter, with the model's global layer
    numbers (at PP > 1 a stage's layers are numbered from 0 in the module: its `layer_number` says
    which it is), so that the states of two pipeline layouts compare name by name."""
    import re

    names = {}
    for chunk in learner.model:
        layers = {n: m.layer_number - 1 for n, m in chunk.named_modules()
                  if re.search(r"decoder\.layers\.\d+$", n) and hasattr(m, "layer_number")}

        def global_name(n):
            m = re.match(r"(.*decoder\.layers\.)(\d+)(\..*)", n)
            return n if m is None else f"{m[1]}{layers[m[1] + m[2]]}{m[3]}"

        for n, p in chunk.named_parameters():
            names[p] = global_name(n)
    out = {f"param/{n}": p.detach().clone() for p, n in names.items()}
    # torch's Adam under Megatron's (fp32 on CPU: its state is keyed by the model's parameters); a
    # model with experts has two, one for the dense parameters and one for the experts' (a ChainedOptimizer)
    for opt in getattr(learner.optimizer, "chained_optimizers", [learner.optimizer]):
        for p, st in opt.optimizer.state.items():
            for k, v in st.items():
                if torch.is_tensor(v):
                    out[f"adam/{names[p]}/{k}"] = v.clone()
    return out


QUOTA = {"full": False}


def _quota_on_this_rank() -> None:
    """From here on, while QUOTA["full"], this rank's shard writes raise as a full quota does (inside
    megatron-core's writer processes, which see the flag as it was when they were forked)."""
    import errno
    import functools

    from megatron.core.dist_checkpointing.strategies import filesystem_async

    write = filesystem_async._write_item

    @functools.wraps(write)  # megatron-core inspects its signature
    def write_or_full(*args, **kwargs):
        if QUOTA["full"]:
            raise OSError(errno.EDQUOT, "Disk quota exceeded")
        return write(*args, **kwargs)

    filesystem_async._write_item = write_or_full


def worker(rank, world_size, hf_path, root):
    from pathlib import Path

    from megatron_rl.run.checkpoint import CheckpointError, Checkpointer, latest_checkpoint, load_checkpoint

    root = Path(root)
    if rank == 1:
        _quota_on_this_rank()
    learner, ctx = _learner(hf_path)
    out = {}
    for s in range(4):  # straight: 4 steps
        learner.train_step(_batch(s))
    out["straight"] = _state(learner)

    learner, ctx = _learner(hf_path)
    ckpt = Checkpointer(root / "async", async_save=True, device=ctx.device, name="async")
    for s in range(2):
        learner.train_step(_batch(s))
    ckpt.save(learner, 2, {"step": 2})
    out["writer_forked"] = ckpt.pending is not None and ckpt.pending.process is not None
    out["latest_after_save"] = latest_checkpoint(root / "async")
    learner.train_step(_batch(2))  # trains on (parameters, moments change) while the writer writes step 2
    ckpt.wait()
    out["latest_after_wait"] = latest_checkpoint(root / "async").name
    out["timings"] = dict(ckpt.last)

    resumed, ctx = _learner(hf_path)
    out["trainer_state"] = load_checkpoint(resumed, root / "async" / "checkpoints" / "step_00000002")
    for s in range(2, 4):
        resumed.train_step(_batch(s))
    out["resumed"] = _state(resumed)

    # A synchronous save that fails on rank 1: both ranks raise, naming rank 1.
    sync = Checkpointer(root / "sync", device=ctx.device, name="sync")
    sync.save(resumed, 1, {"step": 1})
    QUOTA["full"] = rank == 1
    start = time.monotonic()
    try:
        sync.save(resumed, 2, {"step": 2})
        out["sync_error"] = None
    except CheckpointError as e:
        out["sync_error"] = str(e)
    out["sync_s"] = time.monotonic() - start
    out["sync_latest"] = latest_checkpoint(root / "sync").name
    torch.save(out, root / f"rank{rank}.pt")

    # Asynchronous, and rank 1 fails writing its own files (the queued rollouts) after the planning's
    # collectives: rank 0 returns from `save`, trains on and waits in the next all-reduce, which
    # rank 1 never joins. The failure watcher ends rank 0.
    QUOTA["full"] = False
    bad = Checkpointer(root / "bad", async_save=True, device=ctx.device, name="bad", grace_s=2)
    bad.save(resumed, 1, {"step": 1})
    bad.wait()

    def queue_files(folder):
        if rank == 1:
            raise OSError(122, "Disk quota exceeded", str(folder / "queue"))

    (root / f"async-start{rank}").write_text(str(time.time()))
    try:
        bad.save(resumed, 2, {"step": 2}, extra=queue_files)
        resumed.train_step(_batch(4))
        bad.poll()
    except CheckpointError as e:
        (root / f"async-error{rank}").write_text(str(e))
        if rank == 1:  # stays for a while, as a real rank's teardown does (the test's harness would
            time.sleep(15)  # kill rank 0 a few seconds after this rank's error)
        raise
    return None


def test_async_save_resumes_exactly_and_a_failed_save_ends_every_rank(tmp_path, capfd):
    hf = make_tiny_checkpoint(tmp_path / "model", num_layers=2)
    with pytest.raises(RuntimeError) as info:
        run_distributed(worker, 2, str(hf), str(tmp_path), timeout=600)
    ended = time.time()
    assert (tmp_path / "rank0.pt").exists(), str(info.value)[-4000:]
    r0, r1 = torch.load(tmp_path / "rank0.pt", weights_only=False), torch.load(tmp_path / "rank1.pt", weights_only=False)

    # Asynchronous save: returned with a forked writer, published only when finished, and exact.
    for r in (r0, r1):
        assert r["writer_forked"] and r["latest_after_save"] is None
        assert r["latest_after_wait"] == "step_00000002" and r["trainer_state"] == {"step": 2}
        assert r["timings"]["written_s"] <= r["timings"]["total_s"]
        assert r["straight"].keys() == r["resumed"].keys() and len(r["straight"]) > 10
        diff = [k for k in r["straight"] if not torch.equal(r["straight"][k], r["resumed"][k])]
        assert not diff, diff

    # Synchronous failure on rank 1: both ranks raised within seconds, naming rank 1; step 1 intact.
    assert re.search(r"failed on rank 1: OSError: .*Disk quota exceeded", r1["sync_error"]), r1["sync_error"]
    assert re.search(r"step 2 failed on rank 1: OSError: .*Disk quota exceeded", r0["sync_error"]), r0["sync_error"]
    assert max(r0["sync_s"], r1["sync_s"]) < 60
    assert r0["sync_latest"] == r1["sync_latest"] == "step_00000001"

    # Asynchronous failure: rank 1 raised; rank 0, waiting in a collective, was ended by the watcher.
    assert "failed on rank 1: OSError" in (tmp_path / "async-error1").read_text()
    assert not (tmp_path / "async-error0").exists()
    captured = capfd.readouterr()
    out = captured.out + captured.err + str(info.value)
    assert re.search(r"rank 0: checkpoint of step 2 failed on rank 1: OSError: .*Disk quota exceeded.*queue.; "
                     r"ending this rank too", out), out[-3000:]
    # Rank 0 ended (exit 1) while rank 1 still lingered in its 15 s after raising: within seconds.
    assert "ranks [0] died without a report (exit codes [1])" in str(info.value), str(info.value)[-3000:]
    started = max(float((tmp_path / f"async-start{r}").read_text()) for r in (0, 1))
    assert ended - started < 60
    assert (tmp_path / "bad" / "checkpoints" / "latest").read_text() == "step_00000001"
