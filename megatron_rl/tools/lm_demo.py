"""Supervised warm-up on the synthetic task (data.synthetic): Megatron-Core training end to end on CPU.

Each step draws a fresh global batch of problems
"a+b=" + answer (or solution: a scratchpad), trains with the masked token-NLL on those tokens through the learner (any
TP/PP/DP/EP layout), and every `log_every` steps reports loss and greedy exact-match accuracy on
held-out problems (greedy decoding of the answer succeeds iff every answer token is the argmax
given the correct prefix, so one teacher-forced forward pass measures it exactly). The run dir
gets config.yaml at the start and a checkpoint at the end (the RL trainer's format), so
`megatron-rl export` makes a HF folder of the result: a warm-up an RL run can start from.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch
import torch.distributed as dist

from megatron_rl.config.schema import JobConfig
from megatron_rl.data.synthetic import Problem, make_problems, task_kwargs
from megatron_rl.distributed.context import ParallelContext
from megatron_rl.learner.learner import Learner
from megatron_rl.vocab_parallel import vocab_parallel_topk


def encode(problems: list[Problem], tokenizer, chat: bool = False) -> dict[str, torch.Tensor]:
    """Right-padded [B, S] batch; the loss covers the target (the solution, else the answer) and
    the end-of-turn token. `chat`: the prompt as the RL rollouts send it (one user message in the
    chat template, with the assistant turn opened)."""
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    seqs, masks = [], []
    for p in problems:
        if chat:
            prompt = list(tokenizer.apply_chat_template([{"role": "user", "content": p.prompt}],
                                                        add_generation_prompt=True, tokenize=True,
                                                        return_dict=False))
        else:
            prompt = tokenizer(p.prompt, add_special_tokens=False)["input_ids"]
        answer = tokenizer(p.target, add_special_tokens=False)["input_ids"] + [eos]
        seqs.append(prompt + answer)
        masks.append([0] * len(prompt) + [1] * len(answer))
    S = max(map(len, seqs))
    ids = torch.full((len(seqs), S), tokenizer.pad_token_id, dtype=torch.long)
    target_mask = torch.zeros(len(seqs), S)
    for i, (s, m) in enumerate(zip(seqs, masks)):
        ids[i, : len(s)] = torch.tensor(s)
        target_mask[i, : len(m)] = torch.tensor(m, dtype=torch.float)
    # Position t predicts token t+1: shift labels and their mask left by one.
    labels = torch.roll(ids, -1, dims=1)
    loss_mask = torch.roll(target_mask, -1, dims=1)
    loss_mask[:, -1] = 0
    return dict(input_ids=ids, labels=labels, loss_mask=loss_mask)


def greedy_accuracy(learner: Learner, batch: dict[str, torch.Tensor]) -> float:
    """Fraction of sequences whose every answer token is the model's argmax (greedy exact match)."""

    def closure(logits_BSV, mb, tp_group, vocab_size):
        _, top_ids = vocab_parallel_topk(logits_BSV.detach(), 1, tp_group, vocab_size=vocab_size)
        wrong = ((top_ids[..., 0] != mb["labels"]) & (mb["loss_mask"] > 0)).any(dim=1)
        return logits_BSV.new_zeros(()), {"correct": (~wrong).float().sum()}

    for m in learner.model:
        m.eval()
    with torch.no_grad():
        per_mb = learner.run_micro_batches(batch, closure, forward_only=True)
    return learner.reduce_metrics(per_mb)["correct"] / batch["input_ids"].shape[0]


def run(cfg: JobConfig, ctx: ParallelContext) -> list[dict]:
    from transformers import AutoTokenizer

    from megatron_rl.tools.export import save_run_config
    from megatron_rl.run.checkpoint import save_checkpoint

    out_dir = Path(cfg.train.out_dir)
    if ctx.rank == 0:
        save_run_config(cfg, out_dir)  # what `megatron-rl export` reads
    learner = Learner(cfg, ctx, run_dir=str(out_dir), total_steps=cfg.train.steps)
    tokenizer = AutoTokenizer.from_pretrained(learner.hf_path)
    t = cfg.train
    task = task_kwargs(cfg.data.synthetic)
    eval_batch = encode(make_problems(t.global_batch_size * 4, seed=10_000 + t.seed, **task), tokenizer, t.chat)
    history = []
    display = _Display(ctx.rank == 0, t.steps)
    step = 0
    for step in range(1, t.steps + 1):
        batch = encode(make_problems(t.global_batch_size, seed=t.seed * 1_000_003 + step, **task), tokenizer, t.chat)
        start = time.perf_counter()
        metrics = learner.train_step(batch)
        metrics.update(step=step, step_time=time.perf_counter() - start,
                       tokens_per_s=metrics["tokens"] / (time.perf_counter() - start))
        if step % t.log_every == 0 or step in (1, t.steps):
            metrics["eval_accuracy"] = greedy_accuracy(learner, eval_batch)
        history.append(metrics)
        display.update(metrics)
        if t.target_accuracy is not None and metrics.get("eval_accuracy", -1.0) >= t.target_accuracy:
            break  # the base stage's early stop (models/base.py)
    display.close()
    # The trainer's checkpoint format: `megatron-rl export` turns it into a HF folder, from which
    # an RL run can start (model.hf_path).
    save_checkpoint(learner, out_dir, step, {"step": step})
    if ctx.rank == 0:
        with open(out_dir / "metrics.jsonl", "w") as f:
            for m in history:
                f.write(json.dumps(m) + "\n")
    if dist.is_initialized():
        dist.barrier()
    return history


class _Display:
    """A live progress bar with the latest metrics (rank 0 only)."""

    def __init__(self, enabled: bool, total: int):
        self.progress = None
        if enabled:
            from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

            self.progress = Progress(TextColumn("step {task.completed}/{task.total}"), BarColumn(),
                                     TimeElapsedColumn(), TextColumn("{task.description}"))
            self.task = self.progress.add_task("", total=total)
            self.progress.start()

    def update(self, m: dict) -> None:
        if self.progress is None:
            return
        desc = f"loss {m['loss']:.3f}  grad_norm {m['grad_norm']:.2f}  {m['tokens_per_s']:.0f} tok/s"
        if "eval_accuracy" in m:
            self.progress.console.print(f"step {m['step']:4d}  loss {m['loss']:.4f}  "
                                        f"eval greedy accuracy {m['eval_accuracy']:.2f}")
        self.progress.update(self.task, advance=1, description=desc)

    def close(self) -> None:
        if self.progress is not None:
            self.progress.stop()
