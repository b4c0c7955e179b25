"""One RL step of the embedded default: where the time goes, and what the learner costs on top of
bare megatron-core.

(1) Time split of a run's steps (median over steps, from its metrics.jsonl): generation (SGLang,
    incl. reward), advantages, old log-probs, train (all mini-batches), weight sync, evaluation.
(2) The learner's train step (policy loss with the vocab-parallel divergences, diagnostics, metric
    reduction) against a bare megatron-core forward+backward+optimizer step on the same model, the
    same micro-batches and the same optimizer: `get_forward_backward_func` with a masked-mean
    `vocab_parallel_cross_entropy` loss. Runs alternate A/B for --reps rounds; the ratio of the
    medians and the median of the per-round ratios are reported (target <= 1.10).

    .venv/bin/python benchmarks/bench_trainer_step.py --run runs/tiny_cpu [--reps 40]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

STAGES = ("time/generate", "time/advantages", "time/old_logp", "time/ref_logp", "time/train", "time/weight_sync",
          "time/step")


def time_split(run: Path) -> None:
    from megatron_rl.run.metrics import read_metrics

    rows = [r for r in read_metrics(run) if r["step"] >= 0]
    no_eval = [r for r in rows if not any(k.startswith("eval/") for k in r)]
    print(f"(1) time split of {run} ({len(rows)} steps; median over the {len(no_eval)} steps without evaluation)")
    total = statistics.median(r["time/step"] for r in no_eval)
    for k in STAGES:
        vals = [r[k] for r in no_eval if k in r]
        if vals:
            med = statistics.median(vals)
            print(f"    {k:22s} {med:7.3f} s  {100 * med / total:5.1f} %")
    evals = [r["time/step"] - r.get("time/generate", 0) - r.get("time/train", 0) - r.get("time/weight_sync", 0)
             for r in rows if any(k.startswith("eval/") for k in r)]
    if evals:
        print(f"    evaluation (steps with eval, extra)  {statistics.median(evals):7.3f} s")


def rollout_like_batch(B: int, P: int, T: int, vocab: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """B sequences of P prompt + T response tokens, shaped like batch/rollout_batch.py's batches."""
    g = torch.Generator().manual_seed(seed)
    S = P + T
    ids = torch.randint(3, vocab, (B, S), generator=g)
    labels = torch.roll(ids, -1, 1)
    mask = torch.zeros(B, S)
    mask[:, P - 1:P - 1 + T] = 1.0
    adv = (torch.rand(B, generator=g) - 0.5)[:, None] * mask
    return dict(input_ids=ids, labels=labels, loss_mask=mask,
                rollout_logp=-torch.rand(B, S, generator=g) * 5 * mask, advantages=adv)


def learner_vs_bare(reps: int, micro_batch: int, B: int, P: int, T: int) -> None:
    from functools import partial

    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    from megatron_rl.config.load import load_config, to_object
    from megatron_rl.distributed.context import init_distributed
    from megatron_rl.learner.learner import Learner
    from megatron_rl.trainer.policy import PolicyLoss

    torch.set_num_threads(2)
    cfg = to_object(load_config("tiny_cpu", [f"learner.micro_batch_size={micro_batch}"]))
    ctx = init_distributed(cfg.parallel)
    learner = Learner(cfg, ctx, run_dir=tempfile.mkdtemp(prefix="bench_trainer_"))
    batch = rollout_like_batch(B, P, T, vocab=99)
    denom = float(batch["loss_mask"].sum())

    def a_learner_step():
        loss_fn = PolicyLoss(cfg.algorithm, batch, cfg.rollout.temperature, cfg.rollout.max_new_tokens)
        learner.train_step(batch, loss_fn)
        loss_fn.finish(learner)

    micro_batches, S_pad, mbs = learner._local_micro_batches(batch)

    def bare_loss(mb, logits_BSV):
        nll = vocab_parallel_cross_entropy(logits_BSV.float(), mb["labels"])
        return (nll * mb["loss_mask"]).sum() / denom, torch.ones((), dtype=torch.int), {}

    def forward_step(data_iterator, model):
        mb = next(data_iterator)
        return model(mb["input_ids"], mb["position_ids"], None), partial(bare_loss, mb)

    def b_bare_step():
        for m in learner.model:
            m.train()
            m.zero_grad_buffer()
        learner.optimizer.zero_grad()
        get_forward_backward_func()(forward_step_func=forward_step, data_iterator=iter(micro_batches),
                                    model=learner.model, num_microbatches=len(micro_batches),
                                    seq_length=S_pad, micro_batch_size=mbs, forward_only=False)
        learner.optimizer.step()

    times = {"learner": [], "bare": []}
    for i in range(reps + 2):
        for name, fn in (("learner", a_learner_step), ("bare", b_bare_step)) if i % 2 else \
                (("bare", b_bare_step), ("learner", a_learner_step)):
            start = time.perf_counter()
            fn()
            if i >= 2:  # warm-up rounds
                times[name].append(time.perf_counter() - start)
    a, b = statistics.median(times["learner"]), statistics.median(times["bare"])
    # Each round runs both back to back: the per-round ratio cancels drifts in machine load.
    ratios = sorted(x / y for x, y in zip(times["learner"], times["bare"]))
    q1, q3 = ratios[len(ratios) // 4], ratios[(3 * len(ratios)) // 4]
    print(f"(2) learner train step vs bare megatron-core fwd+bwd+optimizer step, tiny_cpu model, "
          f"{B} sequences x {P + T} tokens, micro-batch {mbs}, {reps} alternating rounds")
    print(f"    learner (DPPO binary-TV, vocab-parallel stats, diagnostics)  {a * 1e3:8.1f} ms")
    print(f"    bare (vocab_parallel_cross_entropy, masked mean)             {b * 1e3:8.1f} ms")
    print(f"    ratio of the medians learner / bare                          {a / b:8.3f}")
    print(f"    median per-round ratio (quartiles)                           {statistics.median(ratios):8.3f}"
          f"  ({q1:.3f} - {q3:.3f})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run", default="runs/tiny_cpu", help="run directory for the time split (skipped if absent)")
    ap.add_argument("--reps", type=int, default=40)
    ap.add_argument("--micro-batch", type=int, default=64)
    ap.add_argument("--batch", type=int, default=256, help="sequences (the demo's mini-batch: 64 x 16 / 4)")
    ap.add_argument("--prompt-len", type=int, default=24)
    ap.add_argument("--response-len", type=int, default=1)
    args = ap.parse_args()
    if (Path(args.run) / "metrics.jsonl").exists():
        time_split(Path(args.run))
    learner_vs_bare(args.reps, args.micro_batch, args.batch, args.prompt_len, args.response_len)


if __name__ == "__main__":
    main()
