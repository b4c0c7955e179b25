"""Router replay in bf16: SGLang (CPU, bfloat16) rollouts of a tiny Qwen3-MoE vs the Megatron
learner in bfloat16 (and, for reference, float32) on the same weights.

Reports, over the response tokens of the rollouts:
- routing agreement per MoE layer between the learner's natural top-k and SGLang's, over every
  position SGLang routed (prompt and response): `same set` = fraction of positions whose k
  experts are exactly SGLang's; `overlap` = mean fraction of SGLang's k experts the learner also
  picks. Two forwards: `natural` (the learner routes every
  layer itself, so a flip upstream changes the inputs downstream) and `under R3` (the learner's
  own top-k while SGLang's routes are replayed, i.e. each layer with the same routing upstream —
  the `router_agreement/layer*` metric a training step logs);
- |learner log-prob − rollout log-prob| (max, mean, 99th percentile) without and with R3, over
  all response tokens and split by whether the natural forward routed the token's own input
  position differently from SGLang in some layer (earlier positions' differences still reach
  an "agreeing" token through attention).

    .venv/bin/python -W ignore benchmarks/bench_router_replay_bf16.py [--layers 4 --experts 16 --topk 4]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def rollout_batch(records) -> dict[str, torch.Tensor]:
    """[B, S] right-padded prompt+response; SGLang's routes [B, S, L, k] (-1: none) and its
    log-prob of each response token at the position that predicts it (`loss_mask` = 1 there)."""
    seqs = [r.prompt_ids.tolist() + r.response_ids.tolist() for r in records]
    B, S = len(seqs), max(map(len, seqs))
    _, L, k = records[0].routed_experts.shape
    ids = torch.zeros(B, S, dtype=torch.long)
    routes = torch.full((B, S, L, k), -1, dtype=torch.long)
    rollout_logp, mask = torch.zeros(B, S), torch.zeros(B, S)
    for i, (r, s) in enumerate(zip(records, seqs)):
        P, T = len(r.prompt_ids), len(r.response_ids)
        ids[i, : len(s)] = torch.tensor(s)
        routes[i, : P + T - 1] = r.sequence_routed_experts()
        rollout_logp[i, P - 1: P - 1 + T] = r.rollout_logp
        mask[i, P - 1: P - 1 + T] = 1.0
    return dict(input_ids=ids, labels=torch.roll(ids, -1, 1), loss_mask=mask, routed_experts=routes,
                rollout_logp=rollout_logp)


def generate(ckpt: Path, args, log_dir: Path):
    from megatron_rl.rollout.client import RolloutClient, SamplingParams
    from megatron_rl.rollout.server import EngineManager, ServerConfig

    g = torch.Generator().manual_seed(args.seed)
    prompts = [torch.randint(3, 99, (int(torch.randint(6, 20, (1,), generator=g)),), generator=g).tolist()
               for _ in range(args.prompts)]
    cfg = ServerConfig(model_path=str(ckpt), dtype="bfloat16", max_total_tokens=8192,
                       enable_return_routed_experts=True)

    async def run(url):
        async with RolloutClient([url], moe_topk=args.topk, num_experts=args.experts) as client:
            return await client.generate(prompts, SamplingParams(temperature=1.0, max_new_tokens=args.max_new),
                                         n=args.n, return_routed_experts=True)

    t0 = time.monotonic()
    with EngineManager(cfg, 1, log_dir=log_dir) as mgr:  # stopped before the learner runs
        t1 = time.monotonic()
        records = [r for group in asyncio.run(run(mgr.urls()[0])) for r in group]
        t2 = time.monotonic()
    print(f"SGLang bf16 server up in {t1 - t0:.0f}s; {len(records)} rollouts, "
          f"{sum(r.num_response_tokens for r in records)} response tokens in {t2 - t1:.1f}s", flush=True)
    return records


def measure(ckpt: Path, batch: dict, dtype: str, run_dir: str) -> dict:
    from megatron_rl.config.schema import JobConfig
    from megatron_rl.distributed.context import init_distributed
    from megatron_rl.learner.learner import Learner

    cfg = JobConfig()
    cfg.model.hf_path = str(ckpt)
    cfg.model.dtype = dtype
    cfg.learner.micro_batch_size = 8
    learner = Learner(cfg, init_distributed(cfg.parallel), run_dir=run_dir)
    natural, recorded = learner.forward_logprobs(batch, routing="record")
    replayed = learner.forward_logprobs(batch, routing="replay")
    # The replay phase leaves its agreement counts in the controller (reset when a phase starts).
    under_r3 = [v for _, v in sorted(learner._agreement_metrics().items(),
                                     key=lambda kv: int(kv[0].rsplit("layer", 1)[1]))]
    # A training step under R3 in this dtype (Megatron's bf16 optimizer on CPU): it must run.
    step = learner.train_step(batch, routing="replay")
    return dict(natural=natural, recorded=recorded, replayed=replayed, under_r3=under_r3, step=step)


def stats(gap: torch.Tensor) -> str:
    if gap.numel() == 0:
        return "— | — | —"
    return f"{gap.max().item():.3g} | {gap.mean().item():.3g} | {gap.quantile(0.99).item():.3g}"


def report(batch: dict, res: dict, dtype: str) -> None:
    mask = batch["loss_mask"] > 0  # positions predicting a response token
    routes = batch["routed_experts"]
    valid = routes[..., 0, 0] >= 0  # every position SGLang routed (prompt and response)
    rec = res["recorded"]
    same_set = (rec.sort(-1).values == routes.sort(-1).values).all(-1)  # [B, S, L]
    overlap = (rec[..., :, None] == routes[..., None, :]).any(-1).float().mean(-1)
    L = routes.shape[2]
    print(f"\n### learner {dtype} vs SGLang bf16\n")
    print("| MoE layer | same set, natural | overlap, natural | overlap, under R3 |")
    print("|---|---|---|---|")
    for l in range(L):
        print(f"| {l} | {same_set[..., l][valid].float().mean().item():.4f} | "
              f"{overlap[..., l][valid].mean().item():.4f} | {res['under_r3'][l]:.4f} |")
    print(f"| all | {same_set[valid].float().mean().item():.4f} | {overlap[valid].mean().item():.4f} | "
          f"{sum(res['under_r3']) / L:.4f} |")
    target = batch["rollout_logp"].double()
    flipped = ~same_set.all(-1)  # [B, S]: some layer routed this input position differently
    print(f"\nAgreement over {int(valid.sum())} routed positions.\n|learner − rollout| log-prob over "
          f"{int(mask.sum())} response tokens ({int((flipped & mask).sum())} whose position was "
          f"routed differently in some layer):\n")
    print("| tokens | R3 | max | mean | p99 |")
    print("|---|---|---|---|---|")
    for name, sel in (("all", mask), ("routing differs", mask & flipped), ("routing agrees", mask & ~flipped)):
        for r3, key in (("no", "natural"), ("yes", "replayed")):
            print(f"| {name} | {r3} | {stats((res[key].double() - target)[sel].abs())} |")
    step = res["step"]
    print(f"\ntrain_step(routing='replay') in {dtype}: NLL {step['loss']:.4f} per response token, "
          f"grad norm {step['grad_norm']:.4g}, update skipped {bool(step['update_skipped'])}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--topk", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--init-std", type=float, default=0.1)
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--n", type=int, default=2)
    ap.add_argument("--max-new", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--learner-dtypes", default="bfloat16,float32")
    args = ap.parse_args()

    from megatron_rl.distributed.spawn import free_port
    from megatron_rl.models.tiny import make_tiny_checkpoint

    with tempfile.TemporaryDirectory() as tmp:
        ckpt = make_tiny_checkpoint(Path(tmp) / "m", moe=True, num_layers=args.layers,
                                    num_experts=args.experts, topk=args.topk, hidden=args.hidden,
                                    init_std=args.init_std, seed=args.seed)
        batch = rollout_batch(generate(ckpt, args, Path(tmp) / "logs"))
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1")
        print(f"tiny Qwen3-MoE: {args.layers} layers, {args.experts} experts, top-{args.topk}, "
              f"hidden {args.hidden}, init std {args.init_std}; T = 1.0")
        for dtype in args.learner_dtypes.split(","):
            report(batch, measure(ckpt, batch, dtype, tmp), dtype)


if __name__ == "__main__":
    main()
