"""Router replay (R3 / R2) against HF transformers with forced routing, at several layouts.

Setup: model A is a tiny Qwen3-MoE; model B is A with its router weights perturbed, so B's
natural routing differs from A's. The learner loads B. Replaying A's routing must give exactly
the log-probs of HF-B forced to A's routing (the independent reference: HF's own experts with
the router probabilities re-gathered from B's scores at the forced ids); without replay the
learner follows B's natural routing. R2: recording gives B's natural routing. One training step
under replay matches HF-B forced + a clipped Adam step, router included (it keeps its gradient).
`torch_ep2` runs `model.spec=torch` (SDPA attention, grouped experts through `torch._grouped_mm`,
which torch also runs on CPU, in place of the CPU default loop) at EP2: the same checks against HF,
and against the local spec's EP2 run. The layouts of one world size run one after the other in one spawned process group (Megatron's
parallel state rebuilt for each).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from megatron_rl.distributed.spawn import run_distributed
from megatron_rl.models.tiny import make_tiny_checkpoint

B, S, LR, ADAM_EPS = 4, 12, 1e-3, 1e-3


def make_batch():
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 99, (B, S), generator=g)
    lengths = torch.tensor([12, 9, 7, 11])
    valid = torch.arange(S)[None] < lengths[:, None]
    ids = torch.where(valid, ids, torch.zeros_like(ids))
    loss_mask = (valid & torch.roll(valid, -1, 1)).float()
    loss_mask[:, -1] = 0
    return dict(input_ids=ids, labels=torch.roll(ids, -1, 1), loss_mask=loss_mask), valid


def hf_model(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)


def routers(model):
    return [layer.mlp.gate for layer in model.model.layers]


def natural_routes(model, ids) -> torch.Tensor:
    """[B, S, L, k] top-k expert ids HF's routers pick."""
    out = []
    hooks = [g.register_forward_hook(lambda m, i, o: out.append(o[2].view(B, S, -1)))
             for g in routers(model)]
    with torch.no_grad():
        model(ids)
    for h in hooks:
        h.remove()
    return torch.stack(out, dim=2)


def forced_forward(model, ids, routes):
    """Logits of `model` with every router forced to `routes` [B, S, L, k] (-1 -> 0..k-1)."""
    k = routes.shape[-1]
    routes = torch.where(routes < 0, torch.arange(k).expand_as(routes), routes)
    originals = []
    for l, gate in enumerate(routers(model)):
        forced = routes[:, :, l].reshape(-1, k)

        def forward(hidden, gate=gate, forced=forced):
            logits = torch.nn.functional.linear(hidden.reshape(-1, gate.hidden_dim), gate.weight)
            probs = torch.softmax(logits, dim=-1, dtype=torch.float)
            top = probs.gather(1, forced)
            if gate.norm_topk_prob:
                top = top / top.sum(-1, keepdim=True)
            return logits, top.to(logits.dtype), forced

        originals.append(gate.forward)
        gate.forward = forward
    try:
        return model(ids).logits
    finally:
        for gate, f in zip(routers(model), originals):
            gate.forward = f


def token_logp(logits, labels):
    return torch.log_softmax(logits.double(), -1).gather(-1, labels[..., None])[..., 0]


def replay_worker(rank, world_size, path_b, routes_a, parallel, recompute, spec="local"):
    import torch.distributed as dist

    from megatron_rl.config.schema import JobConfig, ParallelConfig
    from megatron_rl.distributed.context import init_distributed
    from megatron_rl.learner.learner import Learner

    cfg = JobConfig()
    cfg.model.hf_path = path_b
    cfg.model.recompute = recompute
    cfg.model.spec = spec
    cfg.parallel = ParallelConfig(**parallel)
    cfg.optim.lr, cfg.optim.adam_eps, cfg.optim.clip_grad = LR, ADAM_EPS, 0.0
    cfg.learner.micro_batch_size = 2
    ctx = init_distributed(cfg.parallel)
    learner = Learner(cfg, ctx, run_dir="/nonexistent")
    batch, _ = make_batch()
    natural = learner.forward_logprobs(batch)
    recorded_logp, recorded = learner.forward_logprobs(batch, routing="record")
    replay_batch = {**batch, "routed_experts": routes_a}
    replayed = learner.forward_logprobs(replay_batch, routing="replay")
    metrics = learner.train_step(replay_batch, routing="replay")
    after = {k: v.clone() for k, v in learner.export_hf_weights()}

    # A replay that is never consumed (fed twice for one forward) is reported, naming the layer.
    consumption_error = None
    try:
        with learner.router_replay.phase("replay", backward=False):
            rr = learner.router_replay
            chunk = next(c for c, layers in enumerate(rr.chunks) if layers)
            mb = {**{k: v[:2] for k, v in replay_batch.items()}}
            rr.before_forward(chunk, mb)
            rr.before_forward(chunk, mb)
            rr.chunks[chunk][0].replay.replay_backward_list.append(torch.zeros(1))
    except RuntimeError as e:
        consumption_error = str(e)
    dist.barrier()
    if rank != 0:
        return None
    return dict(natural=natural, recorded=recorded, recorded_logp=recorded_logp, replayed=replayed,
                metrics=metrics, after=after, consumption_error=consumption_error,
                modules={type(m).__name__ for c in learner.model for m in c.modules()},
                main_grad_fused=[m.main_grad_fused() for c in learner.model for m in c.modules()
                                 if type(m).__name__ == "GroupedExperts"])


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from safetensors.torch import load_file, save_file

    root = tmp_path_factory.mktemp("replay")
    path_a = make_tiny_checkpoint(root / "a", moe=True, num_layers=2, num_experts=8, topk=2)
    path_b = root / "b"
    make_tiny_checkpoint(path_b, moe=True, num_layers=2, num_experts=8, topk=2)
    weights = load_file(path_b / "model.safetensors")
    g = torch.Generator().manual_seed(5)
    for name in weights:
        if name.endswith("mlp.gate.weight"):
            weights[name] = weights[name] + 0.05 * torch.randn(weights[name].shape, generator=g)
    save_file(weights, path_b / "model.safetensors", metadata={"format": "pt"})

    batch, valid = make_batch()
    model_a, model_b = hf_model(path_a), hf_model(path_b)
    routes_a = natural_routes(model_a, batch["input_ids"])
    routes_a = torch.where(valid[:, :, None, None], routes_a, torch.full_like(routes_a, -1))
    routes_b = natural_routes(model_b, batch["input_ids"])

    # HF-B forced to A's routing: log-probs, then one Adam step (no clipping) for the weights.
    logits = forced_forward(model_b, batch["input_ids"], routes_a)
    logp_forced = token_logp(logits, batch["labels"])
    loss = -(logp_forced * batch["loss_mask"]).sum() / batch["loss_mask"].sum()
    loss.backward()
    torch.optim.Adam(model_b.parameters(), lr=LR, eps=ADAM_EPS).step()
    model_b.save_pretrained(root / "b_after")
    after = load_file(root / "b_after" / "model.safetensors")
    with torch.no_grad():
        logp_natural = token_logp(hf_model(path_b)(batch["input_ids"]).logits, batch["labels"])
    return dict(path_b=path_b, before=weights, routes_a=routes_a, routes_b=routes_b, valid=valid, mask=batch["loss_mask"] > 0,
                logp_forced=logp_forced.detach(), logp_natural=logp_natural, after=after)


LAYOUTS = {
    "tp1": (1, {}, "none"),
    "pp2": (2, {"pp": 2}, "none"),
    "ep2": (2, {"ep": 2}, "none"),
    "tp2_sp": (2, {"tp": 2}, "none"),  # sequence parallel
    "pp2_recompute": (2, {"pp": 2}, "full"),  # activation recompute replays again in backward
    "torch_ep2": (2, {"ep": 2}, "none"),  # model.spec=torch
}


def replays_worker(rank, world_size, path_b, routes_a, layouts):
    """replay_worker for every layout of `layouts` ({name: (parallel, recompute)}) in turn."""
    from megatron_rl.models import torch_spec

    out, on_device = {}, torch_spec.grouped_mm_supported
    for name, (parallel, recompute) in layouts.items():
        spec = "torch" if name.startswith("torch_") else "local"
        # The grouped GEMM, not the per-expert loop the CPU would choose (see the docstring).
        torch_spec.grouped_mm_supported = (lambda *tensors: True) if spec == "torch" else on_device
        try:
            out[name] = replay_worker(rank, world_size, path_b, routes_a, parallel, recompute, spec)
        finally:
            torch_spec.grouped_mm_supported = on_device
    return out


@pytest.fixture(scope="module")
def replays(models):
    """{layout: rank 0's results}: one process group per world size."""
    out = {}
    for world in (1, 2):
        mine = {name: (p, r) for name, (w, p, r) in LAYOUTS.items() if w == world}
        out.update(run_distributed(replays_worker, world, str(models["path_b"]), models["routes_a"], mine)[0])
    return out


@pytest.mark.slow
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_replay_reproduces_forced_routing(models, replays, name):
    m, out = models, replays[name]
    _, parallel, recompute = LAYOUTS[name]
    mask = m["mask"]
    replay_gap = (out["replayed"].double() - m["logp_forced"])[mask].abs().max().item()
    natural_gap = (out["natural"].double() - m["logp_forced"])[mask].abs().max().item()
    print(f"{parallel} recompute={recompute}: |replay - forced| = {replay_gap:.2e}, "
          f"|natural - forced| = {natural_gap:.2e}")
    assert replay_gap <= 1e-5
    assert natural_gap > 100 * max(replay_gap, 1e-7)  # the perturbation changed routing
    # Without replay the learner follows B's own routing (same numbers as HF-B).
    assert (out["natural"].double() - m["logp_natural"])[mask].abs().max().item() <= 1e-5
    # R2: recording returns B's natural routing on every valid position.
    valid = m["valid"]
    rec, nat = out["recorded"], m["routes_b"]
    assert torch.equal(rec[valid].sort(-1).values, nat[valid].sort(-1).values)
    assert torch.equal(out["recorded_logp"], out["natural"])
    # Agreement metric: B's router agrees with A's routes on only part of the tokens.
    agreement = [v for k, v in out["metrics"].items() if k.startswith("router_agreement/")]
    assert len(agreement) == 2 and all(0.0 < a < 1.0 for a in agreement)
    # One step under replay == HF forced + Adam, router weights included (non-zero gradient).
    worst = max((out["after"][k] - m["after"][k]).abs().max().item() for k in m["after"])
    assert worst <= 1e-6, worst
    for name, before in m["before"].items():
        if name.endswith("mlp.gate.weight"):  # the router was updated: it received a gradient
            assert (out["after"][name] - before).abs().max().item() > 1e-5, name
    assert "MoE layer" in (out["consumption_error"] or ""), out["consumption_error"]


@pytest.mark.slow
def test_torch_spec_replays_like_the_local_spec(models, replays):
    """model.spec=torch at EP2 under R3 replay and R2 recording equals the local spec's EP2 run
    (fp32 tolerance; HF is checked by test_replay_reproduces_forced_routing[torch_ep2])."""
    ours, local, mask = replays["torch_ep2"], replays["ep2"], models["mask"]
    assert {"SDPAttention", "GroupedExperts"} <= ours["modules"], ours["modules"]
    assert not {"SDPAttention", "GroupedExperts"} & local["modules"], local["modules"]
    # The expert gradients went into DDP's main_grads from the grouped GEMM's backward (one add per
    # projection), not through DDP's per-parameter hooks.
    assert ours["main_grad_fused"] and all(ours["main_grad_fused"]), ours["main_grad_fused"]
    for key in ("natural", "recorded_logp", "replayed"):
        gap = (ours[key].double() - local[key].double())[mask].abs().max().item()
        assert gap <= 1e-6, (key, gap)
    valid = models["valid"]
    assert torch.equal(ours["recorded"][valid].sort(-1).values, local["recorded"][valid].sort(-1).values)
    assert ours["metrics"]["loss"] == pytest.approx(local["metrics"]["loss"], rel=1e-6)
    worst = max((ours["after"][k] - local["after"][k]).abs().max().item() for k in local["after"])
    assert worst <= 1e-6, worst
