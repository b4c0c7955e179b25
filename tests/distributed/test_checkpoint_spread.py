"""A checkpoint's writes spread over the ranks that hold replicas (run/checkpoint.py, "Who writes what").

Two real gloo ranks at DP 2 with a tiny MoE model (its experts replicated over expert-DP 2, inside
the data-parallel group) and the plain (replicated) optimizer, so that every tensor of the checkpoint
has a replica on both ranks. Independent reference: the bytes of each rank's own shard files
(`__<rank>_<n>.distcp`, torch_dist's name for what rank <rank> wrote), and the same state saved by
megatron-core's default strategy into another folder, where data-parallel rank 0 writes everything.
- Spread: each rank writes between a third and two thirds of the shard bytes (unspread: rank 1
  writes under 5 %), asynchronously (a forked writer), and the two checkpoints hold the same bytes
  in all.
- It loads back bit for bit: at DP 2 (every parameter and Adam moment equal to the saved learner's)
  and at DP 1 (one process, in a second spawn; the same tensors, a data-parallel layout other than
  the one that wrote it).
- The spread group: the data-parallel group at DP 2; at TP 2 with expert TP 1, where the
  expert-data-parallel peers (both ranks) are not inside the data-parallel group (the rank itself),
  the whole world for a model with experts and the data-parallel group for one without.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from megatron_rl.distributed.spawn import run_distributed
from megatron_rl.models.tiny import make_tiny_checkpoint

pytestmark = pytest.mark.slow


def _learner(hf_path, tp=1):
    from megatron_rl.config.schema import JobConfig, ParallelConfig
    from megatron_rl.distributed.context import init_distributed
    from megatron_rl.learner.learner import Learner

    cfg = JobConfig()
    cfg.model.hf_path = hf_path
    cfg.parallel = ParallelConfig(tp=tp)
    cfg.optim.lr, cfg.optim.adam_eps = 1e-2, 1e-3
    ctx = init_distributed(cfg.parallel)
    return Learner(cfg, ctx, run_dir="/nonexistent"), ctx


def _batch(step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    ids = torch.randint(3, 99, (4, 12), generator=g)
    return dict(input_ids=ids, labels=torch.roll(ids, -1, 1), loss_mask=torch.ones(4, 12))


def _state(learner) -> dict[str, torch.Tensor]:
    out = {f"param/{n}": p.detach().clone() for m in learner.model for n, p in m.named_parameters()}
    # torch's Adam under Megatron's: one for the dense parameters, one for the experts' (a ChainedOptimizer)
    for j, opt in enumerate(getattr(learner.optimizer, "chained_optimizers", [learner.optimizer])):
        for i, st in enumerate(opt.optimizer.state.values()):
            for k, v in st.items():
                if torch.is_tensor(v):
                    out[f"adam{j}/{i}/{k}"] = v.clone()
    return out


def shard_bytes(folder: Path, rank: int) -> int:
    """Bytes of the shard files rank `rank` wrote into one checkpoint folder."""
    return sum(f.stat().st_size for f in folder.glob(f"__{rank}_*.distcp"))


def worker(rank, world_size, hf_path, root):
    import torch.distributed as dist
    from megatron.core import dist_checkpointing

    from megatron_rl.run.checkpoint import Checkpointer, _sharded_state, load_checkpoint, spread_group

    root = Path(root)
    learner, ctx = _learner(hf_path)
    out = {"dp": ctx.dp, "group_is_dp": spread_group(ctx, experts=True) is ctx.dp_group}
    for s in range(2):
        learner.train_step(_batch(s))
    ckpt = Checkpointer(root / "spread", async_save=True, device=ctx.device, name="spread")
    ckpt.save(learner, 2, {"step": 2})
    out["forked"] = ckpt.pending is not None and ckpt.pending.process is not None
    ckpt.wait()
    out["last"] = dict(ckpt.last)
    saved = _state(learner)
    if rank == 0:
        torch.save(saved, root / "saved.pt")

    # Today's default (no spread) into another folder: the reference for who writes what.
    plain = root / "plain"
    if rank == 0:
        plain.mkdir()
    dist.barrier()
    state = _sharded_state(learner, is_loading=False)
    dist_checkpointing.save(state, str(plain))

    resumed, ctx = _learner(hf_path)
    out["trainer_state"] = load_checkpoint(resumed, root / "spread" / "checkpoints" / "step_00000002")
    back = _state(resumed)
    out["keys"] = sorted(saved)
    out["differ"] = [k for k in saved if not torch.equal(saved[k], back[k])]

    _, ctx = _learner(hf_path, tp=2)  # expert TP 1: the expert-DP peers span both TP ranks
    out["tp2_group_is_world"] = spread_group(ctx, experts=True) is dist.group.WORLD
    out["tp2_dense_group_is_dp"] = spread_group(ctx, experts=False) is ctx.dp_group
    return out


def load_at_dp1(rank, world_size, hf_path, root):
    from megatron_rl.run.checkpoint import load_checkpoint

    learner, ctx = _learner(hf_path)
    load_checkpoint(learner, Path(root) / "spread" / "checkpoints" / "step_00000002")
    saved = torch.load(Path(root) / "saved.pt", weights_only=False)
    back = _state(learner)
    return {"dp": ctx.dp, "keys": sorted(back), "differ": [k for k in saved if not torch.equal(saved[k], back[k])]}


def test_the_save_is_spread_over_the_replicas_and_loads_back_exactly(tmp_path):
    hf = make_tiny_checkpoint(tmp_path / "model", moe=True, num_layers=2)
    r0, r1 = run_distributed(worker, 2, str(hf), str(tmp_path), timeout=600)

    assert r0["dp"] == 2 and r0["group_is_dp"] and r1["group_is_dp"]
    assert r0["forked"] and 0 < r0["last"]["writer_s"] <= r0["last"]["written_s"]
    folder = tmp_path / "spread" / "checkpoints" / "step_00000002"
    spread = [shard_bytes(folder, r) for r in (0, 1)]
    plain = [shard_bytes(tmp_path / "plain", r) for r in (0, 1)]
    assert sum(spread) == sum(plain) > 100_000, (spread, plain)
    assert plain[1] < 0.05 * sum(plain), plain  # unspread: data-parallel rank 0 writes (and stages) it all
    assert all(sum(spread) / 3 <= b <= 2 * sum(spread) / 3 for b in spread), spread

    for r in (r0, r1):
        assert r["trainer_state"] == {"step": 2}
        assert len(r["keys"]) > 10 and not r["differ"], r["differ"]
        assert r["tp2_group_is_world"] and r["tp2_dense_group_is_dp"]

    (dp1,) = run_distributed(load_at_dp1, 1, str(hf), str(tmp_path), timeout=300)
    assert dp1["dp"] == 1 and dp1["keys"] == r0["keys"] and not dp1["differ"], dp1["differ"]
