"""The policy-loss closure the learner runs on each micro-batch's vocab-sharded logits.

One pass over the local logit shard [b, s, V/TP] (megatron_rl.vocab_parallel) gives log π(a_t),
the entropy and the configured μ-vs-π divergence; `algorithms.adapter.compute_policy_loss` turns
them into the micro-batch's share of the step loss (normalised by the mini-batch's global token or
sequence count, so the loss does not depend on the layout) and its trust-region diagnostics.
The diagnostics of every micro-batch are kept here and reduced over data-parallel ranks after the
step (`finish`); the learner itself only sums scalar metrics.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from megatron_rl.algorithms.adapter import compute_policy_loss, global_normalizer, reduce_diagnostics
from megatron_rl.algorithms.aggregation import local_count
from megatron_rl.algorithms.policy_losses import aspo_entropy_eps
from megatron_rl.batch.packing import per_token, unpacked
from megatron_rl.config.schema import AlgorithmConfig
from megatron_rl.vocab_parallel import TOPK_DIVERGENCES, PolicyStats, vocab_parallel_policy_stats



class PolicyLoss:
    """`loss_fn(logits_BSV, mb, tp_group, vocab_size)` for one mini-batch (see learner.py)."""

    def __init__(self, algo: AlgorithmConfig, mini_batch, temperature: float,
                 max_response_length: int, *, dp_group=None, device=None, split_at_step: int | None = None,
                 record: bool = False, kernel: str = "torch"):
        """`mini_batch`: the whole mini-batch (a dict every rank holds), or this rank's part of it
        (a RolloutBatch; then `dp_group` sums the normaliser over the data-parallel ranks).
        `split_at_step`: the learner's step in asynchronous training; the trust-region diagnostics
        are then also reported apart for tokens sampled by the weights of this step (`fresh/`) and
        by older ones (`stale/`), from the batch's per-token `versions`.
        `record`: keep every loss token's log π, log μ and advantage with its sequence (`records`;
        trainer.token_log_every writes them for the testbed's token-level analysis)."""
        self.algo, self.temperature, self.max_len = algo, temperature, max_response_length
        self.kernel = kernel  # learner.loss_kernel: "torch" or "triton"
        self.split_at_step = split_at_step
        self.split_stats: dict[str, object] = {}
        mask = mini_batch["loss_mask"]
        self.normalizer = (global_normalizer(mask.to(device), algo.agg_mode, dp_group=dp_group)
                           if dp_group is not None else local_count(mask, algo.agg_mode))
        self.kwargs = dict(algo.loss_kwargs)
        if algo.policy_loss in ("dppo", "cppo"):
            self.kwargs.setdefault("divergence_type", algo.divergence or "binary_tv")
        # ASPO's per-token ε from each sequence's entropy ranking (aspo_entropy_eps arguments).
        self.entropy_eps = self.kwargs.pop("entropy_eps", None)
        if self.entropy_eps is not None and algo.policy_loss != "aspo":
            raise ValueError(f"algorithm.loss_kwargs.entropy_eps is an ASPO option; policy_loss is "
                             f"{algo.policy_loss}")
        self.stats = None
        self.records: list[dict[str, torch.Tensor]] | None = [] if record else None

    def __call__(self, logits_BSV, mb, tp_group, vocab_size):
        a = self.algo
        divs = (a.divergence,) if a.divergence else ()
        topk = a.divergence in TOPK_DIVERGENCES
        # A packed micro-batch ([1, T] logits, batch/packing.py): the per-token inputs packed alike,
        # the per-token outputs unpacked to [b, S] before anything that works per sequence.
        ps = vocab_parallel_policy_stats(
            logits_BSV, per_token(mb, "labels"), tp_group, rollout_logp=per_token(mb, "rollout_logp"),
            topk_ids=per_token(mb, "topk_ids") if topk else None,
            topk_logp=per_token(mb, "topk_logp") if topk else None,
            divergences=divs, with_entropy=True, entropy_grad=a.entropy_coef != 0,
            temperature=self.temperature, vocab_size=vocab_size,
            # The output layer's logits are read by nothing after the loss: reuse their storage as
            # the scratch buffer and then as the gradient (megatron-core's trick). The torch path
            # does it for fp32 logits without the entropy gradient; the Triton kernel for any dtype.
            inplace_logits=logits_BSV.is_contiguous() and (
                self.kernel == "triton" or (logits_BSV.dtype == torch.float32 and a.entropy_coef == 0)),
            kernel=self.kernel,
            topk_distinct=True)  # RolloutBatch.from_records checked every top-K row
        if "packing" in mb:
            ps = PolicyStats(**{f.name: unpacked(mb, getattr(ps, f.name)) for f in dataclasses.fields(ps)})
        kwargs = self.kwargs
        if self.entropy_eps is not None:
            eps = aspo_entropy_eps(ps.entropy, mb["loss_mask"] > 0, **self.entropy_eps)
            kwargs = {**kwargs, "eps_low": eps, "eps_high": eps}
        loss, stats = compute_policy_loss(
            a.policy_loss, logp=ps.logp, rollout_logp=mb["rollout_logp"],
            advantages=mb["advantages"], response_mask=mb["loss_mask"], normalizer=self.normalizer,
            agg_mode=a.agg_mode, max_response_length=self.max_len, loss_kwargs=kwargs,
            old_logp=mb.get("old_logp"), divergence=ps.divergence(a.divergence) if divs else None,
            entropy=ps.entropy, entropy_coef=a.entropy_coef,
            ref_logp=mb.get("ref_logp"), kl_estimator=a.kl_estimator,
            kl_coef=0.0 if a.kl_in_reward else a.kl_coef,  # in the rewards instead (trainer/loop.py)
            correction=a.correction, correction_kwargs=dict(a.correction_kwargs))
        self.stats = stats if self.stats is None else self.stats.merge(stats)
        if self.records is not None:
            self._record(ps, mb)
        if self.split_at_step is not None:
            self._split(ps, mb, kwargs, divs)
        return loss, {}

    @torch.no_grad()
    def _record(self, ps, mb) -> None:
        """The micro-batch's sequences that hold loss tokens, and per token (row-major over them):
        the position, log μ, log π and the advantage. Compact: int32 ids, float32 values."""
        mask = mb["loss_mask"] > 0
        rows = mask.any(dim=1)
        m = mask[rows]
        self.records.append({
            "input_ids": mb["input_ids"][rows].to("cpu", torch.int32),
            "loss_mask": m.cpu(),
            "rollout_logp": mb["rollout_logp"][rows][m].float().cpu(),
            "logp": ps.logp.detach()[rows][m].float().cpu(),
            "advantages": mb["advantages"][rows][m].float().cpu(),
        })

    @torch.no_grad()
    def _split(self, ps, mb, kwargs, divs) -> None:
        """The same loss's diagnostics over fresh and over stale tokens only (no gradient)."""
        a = self.algo
        stale = (self.split_at_step - mb["versions"].long()) > 0
        if a.policy_loss == "cppo":  # its mask scans whole responses: fresh and stale tokens alike
            kwargs = {**kwargs, "scan_mask": mb["loss_mask"] > 0}
        for name, part in (("fresh", ~stale), ("stale", stale)):
            mask = mb["loss_mask"] * part.to(mb["loss_mask"].dtype)
            _, stats = compute_policy_loss(
                a.policy_loss, logp=ps.logp.detach(), rollout_logp=mb["rollout_logp"],
                advantages=mb["advantages"], response_mask=mask, normalizer=self.normalizer,
                agg_mode=a.agg_mode, max_response_length=self.max_len, loss_kwargs=kwargs,
                old_logp=mb.get("old_logp"), divergence=ps.divergence(a.divergence).detach() if divs else None,
                entropy=ps.entropy.detach(), entropy_coef=a.entropy_coef,
                ref_logp=mb.get("ref_logp"), kl_estimator=a.kl_estimator,
                kl_coef=0.0 if a.kl_in_reward else a.kl_coef,
                correction=a.correction, correction_kwargs=dict(a.correction_kwargs))
            old = self.split_stats.get(name)
            self.split_stats[name] = stats if old is None else old.merge(stats)

    def finish(self, learner) -> dict[str, float]:
        """Diagnostics of the whole mini-batch (reduced over DP, sent from the last PP stage)."""
        ctx = learner.ctx
        out = [None]
        if ctx.is_last_stage:
            reduced = reduce_diagnostics(self.stats, dp_group=ctx.dp_group)
            out = [{k: float(v) for k, v in reduced.items()}]
            for name, stats in self.split_stats.items():
                part = reduce_diagnostics(stats, dp_group=ctx.dp_group)
                out[0] |= {f"{name}/{k}": float(v) for k, v in part.items() if not k.startswith("loss/")}
        src = dist.get_global_rank(ctx.pp_group, ctx.pp - 1)
        dist.broadcast_object_list(out, src=src, group=ctx.pp_group)
        return out[0]
