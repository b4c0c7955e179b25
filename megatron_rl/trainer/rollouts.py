"""The trainer's rollout side: SGLang servers, sampling, rewards and weight sync.

Rank 0 drives generation (`RolloutClient` over the servers: retries, dead-server replacement, no
sample lost or duplicated) and scores responses; the batch then goes to every learner rank.
Servers come from `rollout.server_urls` (disaggregated: started by the launcher, e.g. on other
nodes) or are started here by rank 0 on its own machine (local: `EngineManager`, which restarts
dead ones; on GPUs only on `rollout.gpu_ids`). rollout/placement.py checks the placement before
anything starts, and each server's own /server_info before the weight-update group is formed.
Weight sync is a collective of all learner ranks (mbridge's export gathers the shards); rank 0
sends the full tensors with the configured transport.
"""

from __future__ import annotations

import asyncio
import os
import socket
import time
import uuid
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist

from megatron_rl.algorithms.dapo import dynamic_sampling_keep
from megatron_rl.config.schema import JobConfig
from megatron_rl.distributed.context import ParallelContext
from megatron_rl.rewards import get_reward
from megatron_rl.rollout import placement
from megatron_rl.rollout.client import RolloutClient, SamplingParams
from megatron_rl.rollout.placement import server_device
from megatron_rl.rollout.records import RolloutRecord
from megatron_rl.trainer.prompts import Prompt
from megatron_rl.weights.push import push_weights


def server_dtype(cfg: JobConfig) -> str:
    if cfg.rollout.dtype != "auto":
        return cfg.rollout.dtype
    from megatron_rl.models.bridge import resolve_dtype

    return {torch.float32: "float32", torch.bfloat16: "bfloat16"}[resolve_dtype(cfg.model.dtype)]


def server_extra_args(cfg: JobConfig) -> tuple[str, ...]:
    """SGLang arguments of servers started for this config: rollout.extra_server_args, plus the
    deterministic mode that seeded sampling needs (SGLang ignores the seeds without it)."""
    r = cfg.rollout
    flag = "--enable-deterministic-inference"
    return tuple(r.extra_server_args) + ((flag,) if r.seeded and flag not in r.extra_server_args else ())


class Rollouts:
    def __init__(self, cfg: JobConfig, ctx: ParallelContext, hf_path: Path, tokenizer,
                 out_dir: Path, moe_topk: Optional[int]):
        self.cfg, self.ctx, self.tokenizer = cfg, ctx, tokenizer
        self.driver = ctx.rank == 0
        self.manager = None
        self.transport = None
        self.moe_topk = moe_topk
        self.reward_fn = get_reward(cfg.data.reward)
        self._restarts_seen = 0
        r = cfg.rollout
        device = server_device(cfg)
        where = placement.check_placement(cfg, device)
        # Collective (every rank reports its GPU) before the non-drivers leave.
        gpu_ids = self._local_server_gpus() if where == "local" and device == "cuda" else None
        if not self.driver:
            return
        urls = list(r.server_urls)
        if not urls:
            from megatron_rl.rollout.server import EngineManager, ServerConfig

            self.manager = EngineManager(
                ServerConfig(model_path=str(hf_path), device=device, dtype=server_dtype(cfg),
                             tp_size=r.server_tp, max_total_tokens=r.max_total_tokens,
                             mem_fraction_static=r.mem_fraction_static,
                             enable_return_routed_experts=cfg.algorithm.router_replay == "r3",
                             extra_args=server_extra_args(cfg)),
                r.num_servers, log_dir=out_dir / "server_logs", gpu_ids=gpu_ids).start()
        # Each server's own layout (TP, dp 1, seeded / R3 flags) against the config, before the
        # first request: a mismatch is one clear error here, not a rendezvous hang later.
        placement.checked_endpoints(self.urls(), cfg)
        self.client = RolloutClient(self.manager if self.manager else urls,
                                    request_timeout=r.request_timeout, moe_topk=moe_topk)
        self._loop = asyncio.new_event_loop()

    def _local_server_gpus(self) -> Optional[list[list[str]]]:
        """Collective: the GPUs of rank 0's servers (rollout.gpu_ids), checked against the GPUs
        the learner ranks on rank 0's node use (every rank reports host and device); None on the
        other ranks."""
        visible = placement.visible_devices()
        index = torch.cuda.current_device()
        mine = (socket.gethostname(), visible[index] if visible else str(index))
        everyone = [mine]
        if dist.is_initialized() and dist.get_world_size() > 1:
            everyone = [None] * dist.get_world_size()
            dist.all_gather_object(everyone, mine)
        if not self.driver:
            return None
        host = socket.gethostname()
        learner_gpus = {gpu for h, gpu in everyone if h == host}
        return placement.local_server_gpus(
            self.cfg, learner_gpus, visible or [str(i) for i in range(torch.cuda.device_count())])

    # ------------------------------------------------------------------------------------------
    def urls(self) -> list[str]:
        return self.manager.urls() if self.manager else list(self.cfg.rollout.server_urls)

    def _run(self, coro):
        return self._loop.run_until_complete(coro)

    def sampling(self, step: int, temperature: float, max_new_tokens: int, top_p: float,
                 salt: int = 0) -> SamplingParams:
        seed = None
        if self.cfg.rollout.seeded:
            seed = (self.cfg.trainer.seed * 1_000_003 + step * 7_919 + salt * 104_729) % (2 ** 31)
        return SamplingParams(temperature=temperature, top_p=top_p, max_new_tokens=max_new_tokens,
                              seed=seed)

    def sample(self, prompts: list[Prompt], n: int, sampling: SamplingParams, top_k: int = 0,
               routes: bool = False) -> list[list[RolloutRecord]]:
        return self._run(self.client.generate([p.ids for p in prompts], sampling, n=n,
                                              top_k_logprobs=top_k, return_routed_experts=routes))

    def score(self, prompts: list[Prompt], groups: list[list[RolloutRecord]]) -> list[list[float]]:
        out = []
        for p, group in zip(prompts, groups):
            texts = self.tokenizer.batch_decode([r.response_ids.tolist() for r in group],
                                                skip_special_tokens=False)
            out.append([float(self.reward_fn(t, p.answer)) for t in texts])
        return out

    def generate(self, take, step: int) -> tuple[list[RolloutRecord], list[float], dict]:
        """Rank 0: one step's groups (`take(n)` draws prompts). DAPO dynamic sampling keeps
        generating (at most rollout.max_generation_rounds rounds) until the batch holds
        prompts_per_step groups whose rewards are not all equal; short of that, equal-reward
        groups fill the rest (their advantages are zero)."""
        r, a = self.cfg.rollout, self.cfg.algorithm
        want = r.prompts_per_step
        kept: list[tuple[list[RolloutRecord], list[float]]] = []
        spare: list[tuple[list[RolloutRecord], list[float]]] = []
        rounds = 0
        start = time.perf_counter()
        while len(kept) < want and rounds < (r.max_generation_rounds if r.dynamic_sampling else 1):
            prompts = take(want - len(kept) if rounds else want)
            groups = self.sample(prompts, r.n_samples,
                                 self.sampling(step, r.temperature, r.max_new_tokens, r.top_p, salt=rounds),
                                 top_k=r.top_k_logprobs, routes=a.router_replay == "r3")
            rewards = self.score(prompts, groups)
            for g, rw in zip(groups, rewards):
                informative = len(set(rw)) > 1
                (kept if informative or not r.dynamic_sampling else spare).append((g, rw))
            rounds += 1
        kept = (kept + spare)[:want]
        records = [rec for g, _ in kept for rec in g]
        rewards = [x for _, rw in kept for x in rw]
        # Group ids must follow the batch order (prompt_index is per generate call).
        for gi, (g, _) in enumerate(kept):
            for rec in g:
                rec.prompt_index = gi
        rw = torch.tensor(rewards)
        gids = torch.tensor([rec.prompt_index for rec in records])
        lengths = torch.tensor([rec.num_response_tokens for rec in records], dtype=torch.float)
        metrics = {
            "rollout/reward_mean": float(rw.mean()),
            "rollout/accuracy": float((rw > 0).float().mean()),
            "rollout/informative_groups": float(dynamic_sampling_keep(rw, gids).float().mean()),
            "rollout/response_len_mean": float(lengths.mean()),
            "rollout/truncated_frac": float(sum(rec.finish_reason == "length" for rec in records) / len(records)),
            "rollout/generation_rounds": float(rounds),
            "rollout/retries": float(len(self.client.retry_events)),
            "time/generate_only": time.perf_counter() - start,
        }
        return records, rewards, metrics

    def evaluate(self, prompts: list[Prompt], step: int) -> dict[str, float]:
        """Rank 0: mean@k and pass@k on held-out prompts."""
        e = self.cfg.eval
        groups = self.sample(prompts, e.k, self.sampling(step, e.temperature,
                                                         e.max_new_tokens or self.cfg.rollout.max_new_tokens,
                                                         e.top_p, salt=999))
        rewards = torch.tensor(self.score(prompts, groups))
        return {f"eval/mean@{e.k}": float(rewards.mean()),
                f"eval/pass@{e.k}": float((rewards > 0).any(dim=1).float().mean())}

    # ------------------------------------------------------------------------------------------
    def _make_transport(self, learner):
        r = self.cfg.rollout
        # The update group's size comes from the servers' own tp_size (checked against
        # rollout.server_tp); a restarted server is asked again.
        servers = placement.checked_endpoints(self.urls(), self.cfg)
        if r.weight_sync == "distributed":
            from megatron_rl.rollout.server import free_port
            from megatron_rl.weights.sync_distributed import DistributedWeightSync

            # Local servers reach rank 0 on loopback; remote ones on this host's address.
            addr = "127.0.0.1" if self.manager else os.environ.get("MASTER_ADDR") or socket.gethostbyname(socket.gethostname())
            # A fresh group name per connection: a server may still hold the group of a killed run.
            t = DistributedWeightSync(servers, master_addr=addr, master_port=free_port(),
                                      group_name=f"megatron_rl_{uuid.uuid4().hex[:8]}")
            t.connect()
            return t
        if r.weight_sync == "tensor":
            from megatron_rl.weights.sync_tensor import TensorWeightSync

            return TensorWeightSync(servers)
        if r.weight_sync == "disk":
            from megatron_rl.weights.sync_disk import DiskWeightSync

            return DiskWeightSync(servers, Path(self.cfg.trainer.out_dir) / "weights_for_servers")
        raise ValueError(f"rollout.weight_sync={r.weight_sync!r}; valid: distributed, tensor, disk")

    def sync_weights(self, learner, version: str) -> dict[str, float]:
        """Collective over the learner ranks: send the learner's weights to every server."""
        restarted = [0]
        if self.driver and self.manager is not None:
            restarted = [len(self.manager.restart_events) - self._restarts_seen]
            self._restarts_seen += restarted[0]
        if self.driver and (self.transport is None or restarted[0]):
            # A restarted server lost the update group (and its weights): form it again.
            if self.transport is not None and hasattr(self.transport, "close"):
                self.transport.close()
            self.transport = self._make_transport(learner)
        if not self.driver and self.transport is None and self.cfg.rollout.weight_sync == "disk":
            from megatron_rl.weights.sync_disk import DiskWeightSync

            # Writing the HF checkpoint is a collective; only rank 0 talks to the servers.
            self.transport = DiskWeightSync([], Path(self.cfg.trainer.out_dir) / "weights_for_servers")
        start = time.perf_counter()
        stats = push_weights(learner, self.transport, weight_version=version)
        if dist.is_initialized():
            dist.barrier()
        out = {"time/weight_sync": time.perf_counter() - start}
        if stats:
            out["weight_sync/bytes"] = float(stats.get("bytes", 0))
        return out

    def close(self) -> None:
        if not self.driver:
            return
        try:
            self._run(self.client.close())
            if self.transport is not None and hasattr(self.transport, "close"):
                self.transport.close()
        finally:
            self._loop.close()
            if self.manager is not None:
                self.manager.stop()
