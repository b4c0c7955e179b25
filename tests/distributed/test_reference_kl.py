"""The reference model and the KL penalty, over real gloo processes.

A frozen forward-only copy of the initial policy (what the trainer builds for
`algorithm.kl_coef > 0`): its log-probs equal HF transformers' on the initial checkpoint; after the
policy has moved, the `loss/kl` the policy loss reports equals the estimator's definition
(k3 = exp(ref − logp) − (ref − logp) − 1, token mean) computed in float64 from the two models'
log-probs; and TP=1 and TP=2 agree on it and on the gradient norm.
"""

from __future__ import annotations

import math

import pytest
import torch

from megatron_rl.distributed.spawn import run_distributed
from megatron_rl.models.tiny import make_tiny_checkpoint

B, S, P = 8, 12, 5  # sequences, length, prompt tokens
KL_COEF = 0.5


def make_batch(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 99, (B, S), generator=g)
    labels = torch.roll(ids, -1, 1)
    mask = torch.zeros(B, S)
    mask[:, P - 1:S - 1] = 1.0
    adv = (torch.rand(B, generator=g) - 0.5)[:, None] * mask
    return dict(input_ids=ids, labels=labels, loss_mask=mask, advantages=adv,
                rollout_logp=-(torch.rand(B, S, generator=g) * 4 + 0.5) * mask)


def worker(rank, world_size, hf_path, tp):
    from megatron_rl.config.schema import JobConfig, ParallelConfig
    from megatron_rl.distributed.context import init_distributed
    from megatron_rl.learner.learner import Learner
    from megatron_rl.trainer.policy import PolicyLoss

    cfg = JobConfig()
    cfg.model.hf_path = hf_path
    cfg.parallel = ParallelConfig(tp=tp)
    cfg.optim.lr, cfg.optim.adam_eps = 1e-2, 1e-3  # ε large: no fp32 noise amplified by Adam across layouts
    cfg.learner.micro_batch_size = 4
    cfg.algorithm.kl_coef = KL_COEF
    ctx = init_distributed(cfg.parallel)
    policy = Learner(cfg, ctx, run_dir="/nonexistent")
    reference = Learner(cfg, ctx, run_dir="/nonexistent", trainable=False)
    batch = make_batch()
    ref_initial = reference.forward_logprobs(batch)
    for _ in range(3):  # move the policy away from the reference (plain NLL on other data)
        policy.train_step(make_batch(seed=1))
    logp = policy.forward_logprobs(batch)
    batch["ref_logp"] = reference.forward_logprobs(batch)
    loss_fn = PolicyLoss(cfg.algorithm, batch, temperature=1.0, max_response_length=S)
    metrics = policy.train_step(batch, loss_fn) | loss_fn.finish(policy)
    return dict(ref_initial=ref_initial, ref_after=batch["ref_logp"], logp=logp, metrics=metrics)


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    ckpt = make_tiny_checkpoint(tmp_path_factory.mktemp("ref_kl") / "ckpt", init_std=0.3, seed=3)
    return ckpt, {tp: run_distributed(worker, tp, str(ckpt), tp)[0] for tp in (1, 2)}


@pytest.mark.slow
def test_reference_is_the_frozen_initial_policy(results):
    from transformers import AutoModelForCausalLM

    ckpt, out = results
    batch = make_batch()
    hf = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = torch.log_softmax(hf(batch["input_ids"]).logits.double(), -1)
    ref = ref.gather(-1, batch["labels"][..., None])[..., 0]
    for r in out.values():
        torch.testing.assert_close(r["ref_initial"].double(), ref, atol=2e-5, rtol=0)
        assert torch.equal(r["ref_after"], r["ref_initial"])  # policy training leaves it alone


@pytest.mark.slow
def test_logged_kl_is_the_k3_estimator_and_layout_invariant(results):
    _, out = results
    mask = make_batch()["loss_mask"].bool()
    for tp, r in out.items():
        # k3 with its documented clamps (algorithms/kl.py): log ratio to ±20, value to ≤ 10.
        d = (r["ref_after"].double() - r["logp"].double())[mask].clamp(-20.0, 20.0)
        k3 = float((torch.exp(d) - d - 1).clamp(max=10.0).mean())
        assert k3 > 1e-4, k3  # the policy did move
        assert r["metrics"]["loss/kl"] == pytest.approx(k3, rel=1e-4), tp
        assert r["metrics"]["loss/total"] == pytest.approx(
            r["metrics"]["loss/pg"] + KL_COEF * r["metrics"]["loss/kl"], rel=1e-6, abs=1e-9)
    for k in ("loss/kl", "loss/total", "grad_norm"):
        assert math.isclose(out[1]["metrics"][k], out[2]["metrics"][k], rel_tol=1e-4), k
