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
  and at DP 1 (PP 2 on the same two ranks: the same tensors, each on the stage that holds its
  layer, in a data-parallel and pipeline layout other than the one that wrote it; between them the
  two stages hold every tensor saved). One process group for all of it.
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
from test_checkpoint import _batch, _learner, _state  # this folder's module (spawned ranks keep sys.path)

pytestmark = pytest.mark.slow


def shard_bytes(folder: Path, rank: int) -> int:
    """Bytes of the shard files rank `rank` wrote into one checkpoint folder."""
    return sum(f.stat().st_size for f in folder.glob(f"__{rank}_*.distcp"))


def worker(rank, world_size, hf_path, root):
    import torch.distributed as dist
    from megatron.core import dist_checkpointing

    from megatron_rl.run.checkpoint import Checkpointer, _sharded_state, load_checkpoint, spread_group

    root = Path(root)
    learner, ctx = _learner(hf_path, tp=1)
    out = {"dp": ctx.dp, "group_is_dp": spread_group(ctx, experts=True) is ctx.dp_group}
    for s in range(2):
        learner.train_step(_batch(s))
    ckpt = Checkpointer(root / "spread", async_save=True, device=ctx.device, name="spread")
    ckpt.save(learner, 2, {"step": 2})
    out["forked"] = ckpt.pending is not None and ckpt.pending.process is not None
    ckpt.wait()
    out["last"] = dict(ckpt.last)
    saved = _state(learner)

    # Today's default (no spread) into another folder: the reference for who writes what.
    plain = root / "plain"
    if rank == 0:
        plain.mkdir()
    dist.barrier()
    state = _sharded_state(learner, is_loading=False)
    dist_checkpointing.save(state, str(plain))

    resumed, ctx = _learner(hf_path, tp=1)
    out["trainer_state"] = load_checkpoint(resumed, root / "spread" / "checkpoints" / "step_00000002")
    back = _state(resumed)
    out["keys"] = sorted(saved)
    out["differ"] = [k for k in saved if not torch.equal(saved[k], back[k])]

    _, ctx = _learner(hf_path, tp=2)  # expert TP 1: the expert-DP peers span both TP ranks
    out["tp2_group_is_world"] = spread_group(ctx, experts=True) is dist.group.WORLD
    out["tp2_dense_group_is_dp"] = spread_group(ctx, experts=False) is ctx.dp_group

    # DP 1: PP 2 on the same two ranks, each stage loading the tensors of its own layers
    pp2, ctx = _learner(hf_path, tp=1, pp=2)
    load_checkpoint(pp2, root / "spread" / "checkpoints" / "step_00000002")
    back = _state(pp2)
    out["pp2"] = {"dp": ctx.dp, "pp": ctx.pp, "keys": sorted(back), "missing": sorted(set(back) - set(saved)),
                  "differ": [k for k in back if k in saved and not torch.equal(saved[k], back[k])]}
    return out


def test_the_save_is_spread_over_the_replicas_and_loads_back_exactly(tmp_path):
    hf = make_tiny_checkpoint(tmp_path / "model", moe=True, num_layers=2)
    r0, r1 = run_distributed(worker, 2, str(hf), str(tmp_path), timeout=600)

    assert r0["dp"] == 2 and r0["group_is_dp"] and r1["group_is_dp"]
    # writer_s is the slowest rank's writer (the same on both ranks), written_s each rank's own: the
    # writer's seconds are within the slower rank's (1 ms: writer_s travels in whole milliseconds)
    assert r0["forked"] and 0 < r0["last"]["writer_s"] <= max(r["last"]["written_s"] for r in (r0, r1)) + 1e-3, \
        (r0["last"], r1["last"])
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

    # Loaded at DP 1 (PP 2): each stage's tensors are the saved ones, and the two stages hold them all.
    for r in (r0, r1):
        p = r["pp2"]
        assert p["dp"] == 1 and p["pp"] == 2, ("DP 1 load", p["dp"], p["pp"])
        assert not p["missing"], ("DP 1 load: tensors the DP 2 learner did not have", p["missing"])
        assert not p["differ"], ("DP 1 load: tensors that differ from the saved ones", p["differ"])
    assert sorted(set(r0["pp2"]["keys"]) | set(r1["pp2"]["keys"])) == r0["keys"], \
        ("DP 1 load: the two stages do not hold every saved tensor", r0["pp2"]["keys"], r1["pp2"]["keys"])
