"""Device discipline: the CPU suite fails where CUDA and NCCL would fail the first GPU step.

`patches/device_check.py` (MRL_DEVICE_CHECK=1) tracks where each tensor would live on a GPU node
and enforces CUDA's rules: collectives on device groups take device tensors only, and no op
mixes a device tensor with a host tensor of one or more dims. Here:
- the instrument itself over real gloo: a host tensor into an all-reduce raises, the same tensor
  moved with `.to(device)` passes, a gloo-backed group takes host tensors, mixing raises;
- the whole RL loop under it, on two gloo ranks (train_only mode: every collective of the loop
  without a rollout server): dense TP2 with π_old recompute, TIS, the reference model, the critic
  and GAE, a checkpoint; Qwen3-MoE EP2 with R3 replay (the router-agreement metric). The
  stop-signal flag, the loss normaliser and the diagnostics reductions run every step.
"""

from __future__ import annotations

import pytest
import torch

from megatron_rl.distributed.spawn import run_distributed

pytestmark = pytest.mark.slow

SMALL = ["rollout.prompts_per_step=4", "rollout.n_samples=2", "algorithm.mini_batches=2",
         "learner.micro_batch_size=2", "eval.num_prompts=0", "trainer.progress=false",
         "trainer.plot=false", "trainer.mode=train_only", "trainer.steps=2", "trainer.save_every=1"]


def instrument_worker(rank, world_size):
    import torch.distributed as dist

    import patches
    from patches.device_check import DeviceDisciplineError

    patches.apply_all()
    out = {}
    host = torch.tensor([float(rank)])
    try:
        dist.all_reduce(host)
        out["host_all_reduce"] = "passed"
    except DeviceDisciplineError as e:
        out["host_all_reduce"] = str(e)
    moved = host.to(torch.device("cuda"))  # `.to(ctx.device)`: under the check ctx.device is cuda
    dist.all_reduce(moved)
    out["moved"] = float(moved)
    gloo = dist.new_group(list(range(world_size)), backend="gloo")
    cpu_side = torch.tensor([1.0])
    dist.all_reduce(cpu_side, group=gloo)  # a host-side (gloo) group is allowed host tensors
    out["gloo"] = float(cpu_side)
    device = torch.zeros(3, device="cuda")  # Megatron's spelling; the CPU layer maps it
    try:
        torch.where(torch.ones(3) > 0, device, device)
        out["mix"] = "passed"
    except DeviceDisciplineError as e:
        out["mix"] = str(e)
    out["scalar_mix"] = float((device + torch.tensor(2.0)).sum())  # 0-dim host: a scalar to CUDA
    try:
        dist.broadcast(host * 2, src=0)  # an op on host tensors stays on the host
        out["derived"] = "passed"
    except DeviceDisciplineError as e:
        out["derived"] = str(e)
    from megatron_rl.algorithms.adapter import global_normalizer

    masks = [torch.ones(2, 3, device="cuda"), torch.ones(1, 3, device="cuda")]  # micro-batches on the device
    out["normalizer"] = int(global_normalizer(masks, "token-mean", dp_group=dist.group.WORLD))
    return out


def test_instrument_catches_what_nccl_and_cuda_reject(monkeypatch):
    monkeypatch.setenv("MRL_DEVICE_CHECK", "1")
    for r in run_distributed(instrument_worker, 2):
        assert "all_reduce got a host tensor" in r["host_all_reduce"]
        assert r["moved"] == 1.0 and r["gloo"] == 2.0 and r["scalar_mix"] == 6.0
        assert r["normalizer"] == 2 * 9
        assert "mixes tensors that would be on different devices" in r["mix"]
        assert "broadcast got a host tensor" in r["derived"]


def trainer_worker(rank, world_size, recipe, overrides):
    from megatron_rl.config.load import load_config, to_object
    from megatron_rl.distributed.context import init_distributed
    from megatron_rl.trainer.loop import Trainer

    cfg = to_object(load_config(recipe, overrides))
    ctx = init_distributed(cfg.parallel)
    return Trainer(cfg, ctx).fit()


def save_rollouts(path, cfg, steps: int) -> None:
    """Rollout batches shaped as SGLang's (random tokens; μ of a uniform policy; random routes)."""
    from megatron_rl.rollout.records import RolloutRecord
    from megatron_rl.batch import RolloutBatch

    g = torch.Generator().manual_seed(0)
    r, tiny = cfg.rollout, cfg.model.tiny
    path.mkdir(parents=True)
    for step in range(steps):
        records, rewards = [], []
        for p in range(r.prompts_per_step):
            prompt = torch.randint(3, 99, (int(torch.randint(3, 7, (1,), generator=g)),), generator=g)
            for s in range(r.n_samples):
                T = int(torch.randint(1, 4, (1,), generator=g))
                routes = torch.randint(0, tiny.num_experts, (len(prompt) + T - 1, tiny.num_layers, tiny.topk),
                                       generator=g, dtype=torch.uint8) if tiny.moe else None
                records.append(RolloutRecord(
                    prompt_index=p, sample_index=s, prompt_ids=prompt,
                    response_ids=torch.randint(3, 99, (T,), generator=g),
                    rollout_logp=torch.full((T,), -4.85), topk_ids=None, topk_logp=None,
                    routes=routes,
                    finish_reason="length", weight_version="0", temperature=1.0))
                rewards.append(float(s % 2))
        groups = [rec.prompt_index for rec in records]
        batch = RolloutBatch.from_records(
            records, rewards, group_ids=groups, pad_id=0, with_routes=tiny.moe, num_experts=tiny.num_experts,
            mini_batch=[g * cfg.algorithm.mini_batches // r.prompts_per_step for g in groups])
        batch.save(path / f"step_{step:08d}.dp0.pt")


@pytest.mark.parametrize("recipe,overrides", [
    ("tiny_cpu", ["parallel.tp=2", "algorithm.recompute_old_logp=true", "algorithm.correction=tis",
                  "algorithm.kl_coef=0.01", "algorithm.advantage=gae"]),
    ("tiny_moe_cpu_r3", ["parallel.ep=2"]),
], ids=["dense_tp2_ppo", "moe_ep2_r3"])
def test_rl_loop_keeps_device_discipline(tmp_path, monkeypatch, recipe, overrides):
    from megatron_rl.config.load import load_config, to_object

    overrides = SMALL + overrides + [f"trainer.out_dir={tmp_path / 'run'}",
                                     f"trainer.rollouts_dir={tmp_path / 'rollouts'}"]
    save_rollouts(tmp_path / "rollouts", to_object(load_config(recipe, overrides)), steps=2)
    monkeypatch.setenv("MRL_DEVICE_CHECK", "1")
    history = run_distributed(trainer_worker, 2, recipe, overrides)[0]
    assert [h["step"] for h in history] == [0, 1]
    assert all(torch.isfinite(torch.tensor(h["loss/total"])) for h in history)
    assert (tmp_path / "run" / "checkpoints" / "latest").read_text().strip() == "step_00000002"
