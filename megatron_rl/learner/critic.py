"""The PPO critic (value model), and the learner of any model that ends in a scalar head.

Shapes: B = sequences in the global batch, S = positions (right-padded), b = micro-batch.

`ScalarHeadLearner` is a `Learner` whose GPTModel ends in `models/heads.py`'s `ScalarHead`: the
same mbridge loading, parallel layout (TP/SP, PP, VPP, DP), Megatron schedules and optimizer, but
the forward gives [b, s, 1] fp32 instead of vocab logits. `Critic` (trainable) and
`reward_model.RewardModel` (forward-only) are its two uses.

Value alignment: `values_BS[:, t]` = V(input_ids[:, :t+1]), the value of the state in which the
token at position t+1 (`labels[:, t]`) is generated — the position at which
`Learner.forward_logprobs` reads that token's log-prob. A response mask, per-token rewards,
advantages and returns in the policy's [B, S] layout therefore index the critic's values
unchanged (a response starting at position P has its first token's value at P−1).

Critic loss (ALGORITHMS.md §5; `algorithms/value_loss.py`): per token over the valid positions of
`batch["response_mask"]`, "clipped" ½·max((V − R)², (V_old + clip(V − V_old, −ε, ε) − R)²) or
"mse" ½·(V − R)², with R = `batch["returns"]` (GAE advantages + V_old, unwhitened) and V_old =
`batch["old_values"]` (the critic's values when the returns were made; needed for clipping).
Aggregated by `algorithms/aggregation.py` with the normaliser of the whole global batch, so loss
and gradients do not depend on the layout.

Metrics of `Critic.train_step` (over the valid tokens of the global batch, V = this step's values
before the update): value_loss; value_clip_frac (fraction where the clipped term won);
explained_variance = 1 − Var(R − V)/Var(R) (NaN if Var(R) = 0); value_mse = mean (V − R)²;
values_mean; returns_mean; grad_norm; lr; update_skipped.
"""

from __future__ import annotations

import math
from functools import partial
from typing import Callable, Optional

import torch
import torch.distributed as dist

from megatron_rl.algorithms.aggregation import AGG_MODES, aggregate, local_count
from megatron_rl.algorithms.registry import get
from megatron_rl.config.schema import JobConfig
from megatron_rl.distributed.context import ParallelContext
from megatron_rl.learner.learner import Learner
from megatron_rl.models.heads import build_scalar_head_chunks
from megatron_rl.batch import RolloutBatch


class ScalarHeadLearner(Learner):
    """A Learner whose model outputs one scalar per position ([b, s, 1] fp32) instead of logits.

    `head_init` / `head_init_std`: see `models.heads.build_scalar_head_chunks` ("auto": the
    checkpoint's `score.weight` if it has one, else a fresh head drawn from `cfg.model.seed`).
    """

    packs = False  # learner.pack_sequences: its closures read [b, s, 1] rows as they are

    def __init__(self, cfg: JobConfig, ctx: ParallelContext, run_dir: str, total_steps: int = 1, *,
                 trainable: bool = True, head_init: str = "auto",
                 head_init_std: Optional[float] = None):
        self._head_init, self._head_init_std = head_init, head_init_std
        super().__init__(cfg, ctx, run_dir, total_steps, trainable=trainable)

    def _build_chunks(self) -> list[torch.nn.Module]:
        return build_scalar_head_chunks(self.bridge, self.ctx, self.hf_path, head_init=self._head_init,
                                        init_std=self._head_init_std, seed=self.cfg.model.seed)

    @torch.no_grad()
    def _forward_rows(self, batch: dict[str, torch.Tensor],
                      pick: Callable[[torch.Tensor, dict], torch.Tensor],
                      row_shape: tuple[int, ...]) -> torch.Tensor:
        """Forward-only pass; `pick(out_bS, mb)` turns each micro-batch's head output [b, S_pad]
        into rows [b, *row_shape]. Returns [B, *row_shape] fp32 on every rank."""
        for m in self.model:
            m.eval()

        def collect(out_BS1, mb, tp_group, vocab_size):
            return out_BS1.new_zeros(()), {"rows": pick(out_BS1[..., 0].float(), mb)}

        per_mb = self.run_micro_batches(batch, collect, forward_only=True)
        if isinstance(batch, RolloutBatch):  # this rank's own sequences
            return self.local_rows(batch, per_mb, "rows", row_shape)
        B = batch["input_ids"].shape[0]
        local = torch.zeros(B // self.ctx.dp, *row_shape, dtype=torch.float32, device=self.ctx.device)
        if self.ctx.is_last_stage:
            local = torch.cat([m["rows"] for m in per_mb])
        out = self._gather_dp_rows(local)
        dist.broadcast(out, src=dist.get_global_rank(self.ctx.pp_group, self.ctx.pp - 1),
                       group=self.ctx.pp_group)
        return out.cpu()  # beside the rollout batch, which lives on the host


def value_loss_closure(values_BS1, mb, tp_group, vocab_size, *, loss_name: str, clip_eps,
                       agg_mode: str, normalizer, n_tokens: float, max_response_length=None):
    """The learner's loss closure for the critic: one micro-batch's share of the step's value loss.

    Metrics are sums (over micro-batches and DP ranks): the loss and clip fraction are already
    divided by global counts; `_n`, `_sum_*` are raw float64 sums for the explained variance.
    """
    values = values_BS1[..., 0]
    mask = mb["response_mask"].bool()
    returns = mb["returns"].float()
    old_values = mb["old_values"].float() if "old_values" in mb else None
    loss_BS, stats = get("value_loss", loss_name)(values, returns, old_values=old_values,
                                                  clip_eps=clip_eps, response_mask=mask)
    loss = aggregate(loss_BS, mask, agg_mode, normalizer=normalizer,
                     max_response_length=max_response_length)
    v, r = values.detach().double(), returns.double()
    zero = torch.zeros((), dtype=torch.float64, device=v.device)
    v, r = torch.where(mask, v, zero), torch.where(mask, r, zero)
    err = r - v
    metrics = {
        "value_loss": loss.detach(),
        "value_clip_frac": stats["clipped"].sum().double() / max(n_tokens, 1.0),
        "_n": mask.sum().double(), "_sum_v": v.sum(), "_sum_r": r.sum(), "_sum_r2": r.square().sum(),
        "_sum_e": err.sum(), "_sum_e2": err.square().sum(),
    }
    return loss, metrics


def _explained_variance(m: dict[str, float]) -> dict[str, float]:
    n = max(m.pop("_n"), 1.0)
    sum_v, sum_r, sum_r2 = m.pop("_sum_v"), m.pop("_sum_r"), m.pop("_sum_r2")
    sum_e, sum_e2 = m.pop("_sum_e"), m.pop("_sum_e2")
    var_r = sum_r2 / n - (sum_r / n) ** 2
    var_e = sum_e2 / n - (sum_e / n) ** 2
    return dict(explained_variance=1.0 - var_e / var_r if var_r > 0 else math.nan,
                value_mse=sum_e2 / n, values_mean=sum_v / n, returns_mean=sum_r / n)


class Critic(ScalarHeadLearner):
    """PPO value model: its own checkpoint (`cfg.model`), layout (`ctx`) and optimizer (`cfg.optim`).

    `value_loss`: "clipped" (needs batch["old_values"]) or "mse"; `value_clip`: ε of the clipped
    loss; `loss_agg_mode`: an `algorithms.aggregation` mode (token-mean by default);
    `max_response_length`: only for seq-mean-token-sum-norm. A policy checkpoint gets a fresh head
    (N(0, initializer_range²) unless `head_init_std`); a *ForSequenceClassification checkpoint
    (e.g. the reward model) lends its `score.weight` with `head_init="auto"`.
    """

    def __init__(self, cfg: JobConfig, ctx: ParallelContext, run_dir: str, total_steps: int = 1, *,
                 value_loss: str = "clipped", value_clip: float = 0.2,
                 loss_agg_mode: str = "token-mean", max_response_length: Optional[int] = None,
                 head_init: str = "auto", head_init_std: Optional[float] = None):
        get("value_loss", value_loss)  # an unknown name fails here, with the valid names
        if loss_agg_mode not in AGG_MODES:
            raise ValueError(f"loss_agg_mode={loss_agg_mode!r}; valid: {', '.join(AGG_MODES)}")
        self.value_loss, self.value_clip = value_loss, value_clip
        self.loss_agg_mode, self.max_response_length = loss_agg_mode, max_response_length
        super().__init__(cfg, ctx, run_dir, total_steps, trainable=True, head_init=head_init,
                         head_init_std=head_init_std)

    def forward_values(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """V for every position of the global batch, [B, S] fp32, on every rank (needs `input_ids`);
        of a `RolloutBatch`, this rank's [b, its longest] values."""
        S = int(batch.seq_lens.max()) if isinstance(batch, RolloutBatch) else batch["input_ids"].shape[1]
        return self._forward_rows(batch, lambda v, mb: v[:, :S], (S,))

    def train_step(self, batch: dict[str, torch.Tensor]) -> dict[str, float]:
        """One optimizer step of the value loss on a global batch (every rank passes the same batch).

        Keys ([B, S], right-padded, aligned as in the module docstring): `input_ids`,
        `response_mask` (positions whose value is trained), `returns`, and `old_values` for the
        clipped loss. Returns the metrics listed in the module docstring.
        """
        missing = [k for k in ("input_ids", "response_mask", "returns") if k not in batch]
        if self.value_loss == "clipped" and "old_values" not in batch:
            missing.append("old_values")
        if missing:
            raise KeyError(f"critic batch lacks {missing} (value loss {self.value_loss!r})")
        mask = batch["response_mask"]
        # A dict is the whole global batch on every rank: its counts are the global normalisers;
        # a RolloutBatch holds this rank's sequences: counts are summed over data-parallel ranks.
        counts = torch.stack([local_count(mask, self.loss_agg_mode).double(),
                              mask.bool().sum().double()]).to(self.ctx.device)
        if isinstance(batch, RolloutBatch):
            dist.all_reduce(counts, group=self.ctx.dp_group)
        loss_fn = partial(value_loss_closure, loss_name=self.value_loss, clip_eps=self.value_clip,
                          agg_mode=self.loss_agg_mode,
                          normalizer=counts[0].to(torch.int64),
                          n_tokens=float(counts[1]),
                          max_response_length=self.max_response_length)
        metrics = super().train_step(batch, loss_fn=loss_fn)
        metrics.update(_explained_variance(metrics))
        return metrics
