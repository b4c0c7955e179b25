"""A learned reward model on Megatron-Core, forward-only, with its own parallel layout.

Shapes: B = sequences in the global batch, S = positions (right-padded).

The model is a HF `*ForSequenceClassification` checkpoint with one label (a Bradley–Terry reward
model): the decoder through mbridge, its `score.weight` [1, h] as `models/heads.py`'s `ScalarHead`.
The reward of a sequence is the head's output at its last real token — the position transformers
pools (its rightmost non-pad token) when the pad token appears only as padding. Built with
`trainable=False`: no DDP grad buffers and no optimizer state.
"""

from __future__ import annotations

import torch

from megatron_rl.config.schema import JobConfig
from megatron_rl.distributed.context import ParallelContext
from megatron_rl.learner.critic import ScalarHeadLearner
from megatron_rl.batch import RolloutBatch


def last_token_index(attention_mask_BS: torch.Tensor) -> torch.Tensor:
    """Index of each row's last real token, [B] int64; rows must be right-padded and non-empty."""
    mask = attention_mask_BS.bool()
    lengths = mask.sum(dim=-1)
    if not bool((lengths > 0).all()):
        raise ValueError(f"reward batch rows {torch.nonzero(lengths == 0).flatten().tolist()} "
                         "have no token (attention_mask all 0)")
    right_padded = torch.arange(mask.shape[1], device=mask.device)[None, :] < lengths[:, None]
    if not torch.equal(mask, right_padded):
        bad = torch.nonzero((mask != right_padded).any(dim=-1)).flatten().tolist()
        raise ValueError(f"reward batch rows {bad} are not right-padded (attention_mask must be "
                         "1 on a prefix, 0 after it)")
    return lengths - 1


class RewardModel(ScalarHeadLearner):
    """Forward-only scalar reward model; `cfg.model.hf_path` is the sequence-classification
    checkpoint, `ctx` its layout, `cfg.learner.micro_batch_size` its micro-batch."""

    def __init__(self, cfg: JobConfig, ctx: ParallelContext, run_dir: str):
        super().__init__(cfg, ctx, run_dir, trainable=False, head_init="checkpoint")

    def score(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """Rewards [B] fp32 on every rank. Keys: `input_ids` and `attention_mask` ([B, S],
        right-padded; 1 on real tokens). Every rank passes the same global batch — or its own
        sequences as a `RolloutBatch` (then its own rewards come back)."""
        if isinstance(batch, RolloutBatch):
            seqs = RolloutBatch({"seq_len": batch.seq_lens, "prompt_len": batch.seq["prompt_len"],
                                 "last_index": batch.seq_lens - 1},
                                {"input_ids": batch.tok["input_ids"]}, batch.pad_id,
                                {"input_ids": batch.spec["input_ids"]})

            def pick_last(out_bS, mb):
                return out_bS[torch.arange(out_bS.shape[0], device=out_bS.device), mb["last_index"]]

            return self._forward_rows(seqs, pick_last, ())
        last_index_B = last_token_index(batch["attention_mask"])

        def pick(out_bS, mb):
            idx = mb["last_index"]
            return out_bS[torch.arange(out_bS.shape[0], device=out_bS.device), idx]

        return self._forward_rows({"input_ids": batch["input_ids"], "last_index": last_index_B},
                                  pick, ())
