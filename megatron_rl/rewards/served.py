"""A reward model served by SGLang (`reward_model.backend = sglang`): for reward models too large to
sit beside the policy, on their own GPUs (or this machine's CPU).

Rank 0 launches `reward_model.num_servers` servers of the sequence-classification checkpoint
(`--is-embedding`; device and dtype as the rollout servers') unless `reward_model.server_urls`
names running ones, and sends each prompt+response (token ids, no padding) to `/classify`
(`RolloutClient.classify`: chunks retried on another server, none lost); every rank gets the
scores. Same interface as the Megatron `RewardModel`: `score(batch) -> [B]` on every rank.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist

from megatron_rl.config.schema import JobConfig
from megatron_rl.distributed.context import ParallelContext


class ServedRewardModel:
    def __init__(self, cfg: JobConfig, ctx: ParallelContext, out_dir: Path, hf_path: Optional[Path]):
        from megatron_rl.rollout.client import RolloutClient

        rm, r = cfg.reward_model, cfg.rollout
        self.ctx, self.hf_path = ctx, hf_path
        self.vocab_size = (json.loads((hf_path / "config.json").read_text())["vocab_size"]
                           if hf_path is not None else None)
        self.manager = self.client = None
        urls = list(rm.server_urls)
        if ctx.rank == 0 and not urls:
            from megatron_rl.rollout import auth
            from megatron_rl.rollout.server import EngineManager, ServerConfig
            from megatron_rl.rollout.servers import server_device, server_dtype

            self.manager = EngineManager(
                ServerConfig(model_path=str(hf_path), device=server_device(cfg), dtype=server_dtype(cfg),
                             tp_size=rm.server_tp, max_total_tokens=rm.max_total_tokens,
                             mem_fraction_static=rm.mem_fraction_static, extra_args=("--is-embedding",),
                             env=auth.server_env()),  # the job's key (rollout/auth.py)
                rm.num_servers, log_dir=out_dir / "reward_server_logs").start()
        # Every model-parallel leader scores its own data-parallel rank's sequences.
        shared = [self.manager.urls() if self.manager else urls]
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.broadcast_object_list(shared, src=0)
        urls = shared[0]
        self.leader = dist.get_rank(ctx.mp_group) == 0 if dist.is_initialized() else True
        if not self.leader:
            return
        self.client = RolloutClient(self.manager if self.manager else urls, request_timeout=r.request_timeout)
        self._loop = asyncio.new_event_loop()

    def score(self, batch) -> torch.Tensor:
        """Rewards [b] of this rank's sequences (a `RolloutBatch`; collective over its
        model-parallel group, whose leader asks the servers), or of a global batch dict (below)."""
        if isinstance(batch, dict):
            return self._score_global(batch)
        out = torch.zeros(len(batch), dtype=torch.float32)
        if self.leader and len(batch):
            seqs = [t.tolist() for t in batch.tok["input_ids"]]
            out = torch.tensor(self._loop.run_until_complete(self.client.classify(seqs)), dtype=torch.float32)
        if dist.is_initialized() and dist.get_world_size(self.ctx.mp_group) > 1:
            out = out.to(self.ctx.device)
            dist.broadcast(out, src=dist.get_global_rank(self.ctx.mp_group, 0), group=self.ctx.mp_group)
        return out.cpu()

    def _score_global(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """Rewards [B] fp32 on every rank. Keys: `input_ids`, `attention_mask` ([B, S],
        right-padded); every rank passes the same batch, rank 0 asks the servers."""
        ids, mask = batch["input_ids"], batch["attention_mask"].bool()
        out = torch.zeros(ids.shape[0], dtype=torch.float32)
        if self.ctx.rank == 0:
            seqs = [row[m].tolist() for row, m in zip(ids, mask)]
            out = torch.tensor(self._loop.run_until_complete(self.client.classify(seqs)), dtype=torch.float32)
        if dist.is_initialized() and dist.get_world_size() > 1:
            out = out.to(self.ctx.device)
            dist.broadcast(out, src=0)
        return out.cpu()

    def close(self) -> None:
        if self.client is not None:
            self._loop.run_until_complete(self.client.close())
            self._loop.close()
        if self.manager is not None:
            self.manager.stop()
