"""Rollouts from a real SGLang server against the Megatron learner holding the same weights.

Dense: every generated token's rollout log-prob, and every entry of its top-K list, equals the
learner's recomputed log-prob (logits / temperature, fp32) at T = 1.0 and 0.7.
MoE: the experts SGLang routed each position to equal the learner's own routing (R2 record), and
replaying SGLang's routes in the learner (R3) reproduces the rollout log-probs.
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from megatron_rl.distributed.spawn import run_distributed
from megatron_rl.models.tiny import make_tiny_checkpoint

PROMPTS = [[1, 40, 41, 18, 20, 2, 5, 1, 13], [1, 33, 31, 17, 30, 98, 2, 5, 1, 13, 40], [1, 50, 2, 1, 13]]
N, K, MAX_NEW = 2, 5, 8


def generate(url, temperature, moe_topk=None, num_experts=None):
    from megatron_rl.rollout.client import RolloutClient, SamplingParams

    async def run():
        async with RolloutClient([url], moe_topk=moe_topk, num_experts=num_experts) as client:
            return await client.generate(PROMPTS, SamplingParams(temperature=temperature, max_new_tokens=MAX_NEW),
                                         n=N, top_k_logprobs=K, return_routed_experts=moe_topk is not None)

    return [r for group in asyncio.run(run()) for r in group]


def as_batch(records, routes=False):
    """Right-padded [B, S] batch of prompt+response; labels are the next tokens."""
    seqs = [r.prompt_ids.tolist() + r.response_ids.tolist() for r in records]
    S = max(map(len, seqs))
    ids = torch.zeros(len(seqs), S, dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = torch.tensor(s)
    batch = dict(input_ids=ids, labels=torch.roll(ids, -1, 1), loss_mask=torch.zeros(len(seqs), S))
    if routes:
        rs = [r.sequence_routed_experts() for r in records]
        out = torch.full((len(seqs), S, *rs[0].shape[1:]), -1, dtype=torch.long)
        for i, r in enumerate(rs):
            out[i, : r.shape[0]] = r
        batch["routed_experts"] = out
    return batch


def learner_worker(rank, world_size, hf_path, batch, topk_ids, temperature, moe):
    from megatron_rl.config.schema import JobConfig
    from megatron_rl.distributed.context import init_distributed
    from megatron_rl.learner.learner import Learner
    from megatron_rl.vocab_parallel import vocab_parallel_log_probs

    cfg = JobConfig()
    cfg.model.hf_path = hf_path
    cfg.learner.micro_batch_size = batch["input_ids"].shape[0]
    ctx = init_distributed(cfg.parallel)
    learner = Learner(cfg, ctx, run_dir="/nonexistent")
    mb_batch = {**batch, "topk_ids": topk_ids}

    def closure(logits_BSV, mb, tp_group, vocab_size):
        ids = torch.cat([mb["labels"][..., None], mb["topk_ids"].clamp(min=0)], dim=-1)
        logp = vocab_parallel_log_probs(logits_BSV.detach(), ids, tp_group, temperature=temperature,
                                        vocab_size=vocab_size)
        return logits_BSV.new_zeros(()), {"logp": logp}

    for m in learner.model:
        m.eval()
    with torch.no_grad():
        out = {"logp": learner.run_micro_batches(mb_batch, closure, forward_only=True)[0]["logp"]}
    if moe:
        _, out["recorded"] = learner.forward_logprobs(batch, routing="record")
        out["replayed"] = learner.forward_logprobs(batch, routing="replay")
        out["natural"] = learner.forward_logprobs(batch)
    return out


def compare(hf_path, records, temperature, moe=False):
    batch = as_batch(records, routes=moe)
    B, S = batch["input_ids"].shape
    topk = torch.full((B, S, K), -1, dtype=torch.long)
    for i, r in enumerate(records):
        P, T = len(r.prompt_ids), len(r.response_ids)
        topk[i, P - 1: P - 1 + T] = r.topk_ids
    out = run_distributed(learner_worker, 1, str(hf_path), batch, topk, temperature, moe)[0]
    worst_logp = worst_topk = 0.0
    for i, r in enumerate(records):
        P, T = len(r.prompt_ids), len(r.response_ids)
        rows = out["logp"][i, P - 1: P - 1 + T].double()  # [T, 1 + K]
        worst_logp = max(worst_logp, (rows[:, 0] - r.rollout_logp.double()).abs().max().item())
        worst_topk = max(worst_topk, (rows[:, 1:] - r.topk_logp.double()).abs().max().item())
    return out, batch, worst_logp, worst_topk


@pytest.mark.slow
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_dense_rollout_logprobs_equal_learner(dense_server, temperature):
    hf_path, url = dense_server
    records = generate(url, temperature)
    assert len(records) == len(PROMPTS) * N and all(len(r.response_ids) > 0 for r in records)
    _, _, worst_logp, worst_topk = compare(hf_path, records, temperature)
    print(f"T={temperature}: max |rollout - learner| log-prob {worst_logp:.2e}, top-K {worst_topk:.2e}")
    assert worst_logp <= 1e-4 and worst_topk <= 1e-4


@pytest.mark.slow
def test_moe_routes_and_replay_equal_learner(moe_server):
    hf_path, url = moe_server
    records = generate(url, 1.0, moe_topk=2, num_experts=4)  # make_tiny_checkpoint's defaults
    out, batch, worst_logp, _ = compare(hf_path, records, 1.0, moe=True)
    assert worst_logp <= 1e-4
    routes, recorded = batch["routed_experts"], out["recorded"]
    valid = routes[..., 0, 0] >= 0
    assert torch.equal(recorded[valid].sort(-1).values, routes[valid].sort(-1).values)
    for i, r in enumerate(records):  # R3: replaying SGLang's routes gives SGLang's log-probs
        P, T = len(r.prompt_ids), len(r.response_ids)
        gap = (out["replayed"][i, P - 1: P - 1 + T].double() - r.rollout_logp.double()).abs().max().item()
        assert gap <= 1e-5, gap


def _server(tmp_path_factory, shared_server, name, **tiny):
    """The session's shared server of this architecture in SGLang's default (not deterministic)
    mode, serving a fresh checkpoint (tests/e2e/conftest.py)."""
    ckpt = make_tiny_checkpoint(tmp_path_factory.mktemp(name) / "model", **tiny)
    return ckpt, shared_server(ckpt, routed=bool(tiny.get("moe")), deterministic=False).urls()[0]


@pytest.fixture(scope="module")
def dense_server(tmp_path_factory, shared_server):
    return _server(tmp_path_factory, shared_server, "dense", init_std=0.2)


@pytest.fixture(scope="module")
def moe_server(tmp_path_factory, shared_server):
    return _server(tmp_path_factory, shared_server, "moe", moe=True, init_std=0.2)
