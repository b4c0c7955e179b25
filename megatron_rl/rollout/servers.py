"""The rollout servers of a job: what SGLang is started with for a config, where local servers run.

Servers come from `rollout.server_urls` (disaggregated: started by the launcher, e.g. on other
nodes) or are started here by rank 0 on its own machine (`start_local_servers`: an `EngineManager`,
which restarts dead ones; on GPUs only on `rollout.gpu_ids`).
Each server's slots (the fleet's admission budget) come from `fleet.slots` and rollout/admission.py.
"""

from __future__ import annotations

import socket
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist

from megatron_rl.config.schema import JobConfig
from megatron_rl.rollout import auth, placement
from megatron_rl.rollout.placement import server_device  # noqa: F401 (re-exported: the servers' device)


def server_dtype(cfg: JobConfig) -> str:
    if cfg.rollout.dtype != "auto":
        return cfg.rollout.dtype
    from megatron_rl.models.bridge import resolve_dtype

    return {torch.float32: "float32", torch.bfloat16: "bfloat16"}[resolve_dtype(cfg.model.dtype)]


def server_extra_args(cfg: JobConfig) -> tuple[str, ...]:
    """SGLang arguments of servers started for this config: rollout.extra_server_args, plus the flags
    the recipe implies (placement.implied_server_args, the launcher's rule too), but routed experts,
    which ServerConfig.enable_return_routed_experts adds."""
    extra = list(cfg.rollout.extra_server_args)
    implied = placement.implied_server_args(cfg, extra)
    return tuple(extra) + tuple(f for f in implied if f != "--enable-return-routed-experts")



def local_server_gpus(cfg: JobConfig, driver: bool) -> Optional[list[list[str]]]:
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
    if not driver:
        return None
    host = socket.gethostname()
    learner_gpus = {gpu for h, gpu in everyone if h == host}
    return placement.local_server_gpus(
        cfg, learner_gpus, visible or [str(i) for i in range(torch.cuda.device_count())])


def start_local_servers(cfg: JobConfig, model_path: Path, out_dir: Path, device: str,
                        gpu_ids: Optional[list[list[str]]]):
    """Rank 0, rollout.placement=local: rollout.num_servers SGLang servers of `model_path`, healthy
    when this returns (their logs in out_dir/server_logs)."""
    from megatron_rl.rollout.server import EngineManager, ServerConfig

    r = cfg.rollout
    return EngineManager(
        ServerConfig(model_path=str(model_path), device=device, dtype=server_dtype(cfg),
                     tp_size=r.server_tp, max_total_tokens=r.max_total_tokens,
                     mem_fraction_static=r.mem_fraction_static,
                     enable_return_routed_experts=cfg.algorithm.router_replay == "r3",
                     extra_args=server_extra_args(cfg), env=auth.server_env()),
        r.num_servers, log_dir=out_dir / "server_logs", gpu_ids=gpu_ids).start()
