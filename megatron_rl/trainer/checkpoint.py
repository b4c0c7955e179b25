"""Checkpoints with exact resume, on megatron-core's dist_checkpointing.

A checkpoint is a folder `<out_dir>/checkpoints/step_<N>` holding
- the model chunks and the optimizer (Adam moments, fp32 master weights, step counts) as sharded
  tensors (`dist_checkpointing.save`, torch_dist format: every rank writes its own shards, and a
  checkpoint written at one parallel layout loads at another),
- the LR scheduler and the trainer state (step, prompt-stream position, weight version) as common
  state written once,
- every rank's RNG states (python, torch, Megatron's model-parallel tracker) in `rng/rank<r>.pt`,
  so dropout and sampling continue bit for bit;
- other trained models of the run (the PPO critic) in a sub-folder each, `<name>/`, with their
  own model, optimizer and LR scheduler state.
It is written to `step_<N>.tmp` and renamed only when every rank has finished; the file `latest`
is then replaced atomically. A crash mid-write therefore leaves the previous checkpoint intact, and
`latest_checkpoint` never returns a partial one. Older checkpoints beyond `keep` are removed.
"""

from __future__ import annotations

import os
import random
import shutil
from pathlib import Path
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

PREFIX = "step_"


def checkpoints_root(out_dir: str | Path) -> Path:
    return Path(out_dir) / "checkpoints"


def latest_checkpoint(out_dir: str | Path) -> Optional[Path]:
    """The newest complete checkpoint under out_dir, or None."""
    root = checkpoints_root(out_dir)
    marker = root / "latest"
    if not marker.exists():
        return None
    path = root / marker.read_text().strip()
    if not path.is_dir():
        raise FileNotFoundError(f"{marker} names {path.name}, which does not exist")
    return path


def _rng_state() -> dict[str, Any]:
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    state = {"python": random.getstate(), "torch": torch.get_rng_state(),
             "tracker": get_cuda_rng_tracker().get_states()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    get_cuda_rng_tracker().set_states(state["tracker"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def model_sharded_state(chunks: list[torch.nn.Module]) -> dict[str, Any]:
    """The model part of a checkpoint: {"model<i>": sharded state dict of this rank's chunk i}.

    The `model<i>` names only nest the request; what is stored are megatron-core's sharded keys,
    which name layers by their global number (transformer_block.py) and experts by their global
    index, and record each tensor's global shape. So the model part of a checkpoint written at one
    TP / PP / VPP / EP layout loads into the chunks of any other (`load_model_weights`).
    `chunks`: GPTModels (or the Float16Module around one), one per virtual pipeline stage.
    """
    from megatron.core import parallel_state as mpu

    state: dict[str, Any] = {}
    for i, chunk in enumerate(chunks):
        if len(chunks) > 1:
            mpu.set_virtual_pipeline_model_parallel_rank(i)
        state[f"model{i}"] = chunk.sharded_state_dict()
    if len(chunks) > 1:
        mpu.set_virtual_pipeline_model_parallel_rank(0)
    return state


def _sharded_state(learner, is_loading: bool) -> dict[str, Any]:
    state = model_sharded_state([chunk.module for chunk in learner.model])
    model_state = {k: v for k, v in state.items()}
    state["optimizer"] = learner.optimizer.sharded_state_dict(model_state, is_loading=is_loading)
    return state


def _save_learner(learner, folder: Path, extra_state: Optional[dict[str, Any]] = None) -> None:
    from megatron.core import dist_checkpointing

    state = _sharded_state(learner, is_loading=False)
    state["scheduler"] = learner.scheduler.state_dict()
    if extra_state is not None:
        state["trainer"] = dict(extra_state)
    dist_checkpointing.save(state, str(folder))


def _load_learner(learner, folder: Path, with_trainer_state: bool = False) -> Optional[dict[str, Any]]:
    from megatron.core import dist_checkpointing

    if not folder.is_dir():
        raise FileNotFoundError(f"checkpoint {folder.parent} has no {folder.name}/ (was it written by a "
                                f"run without that model?)")
    state = _sharded_state(learner, is_loading=True)
    state["scheduler"] = None
    if with_trainer_state:
        state["trainer"] = None
    loaded = dist_checkpointing.load(state, str(folder))
    for i, chunk in enumerate(learner.model):
        chunk.module.load_state_dict(loaded[f"model{i}"])
    learner.optimizer.load_state_dict(loaded["optimizer"])
    learner.scheduler.load_state_dict(loaded["scheduler"])
    return loaded.get("trainer")


def load_model_weights(chunks: list[torch.nn.Module], path: str | Path) -> None:
    """Collective: only the model weights of checkpoint `path` (no optimizer, scheduler or RNG
    state) into `chunks`, at this process's layout, whatever layout wrote it."""
    from megatron.core import dist_checkpointing

    path = Path(path)
    if not (path / "metadata.json").exists():
        raise FileNotFoundError(f"{path} is not a megatron-rl checkpoint (no metadata.json; checkpoints are "
                                f"<run>/checkpoints/{PREFIX}<N>)")
    loaded = dist_checkpointing.load(model_sharded_state(chunks), str(path))
    for i, chunk in enumerate(chunks):
        chunk.load_state_dict(loaded[f"model{i}"])


def save_checkpoint(learner, out_dir: str | Path, step: int, trainer_state: dict[str, Any],
                    keep: int = 2, others: Optional[dict[str, Any]] = None,
                    extra: Optional[Callable[[Path], None]] = None) -> Path:
    """Collective: every learner rank calls it. `others`: {name: learner} saved in `<name>/`.
    `extra(folder)`: each rank writes its own files into the checkpoint before it is made final
    (e.g. the rollout producer's queued shares). Returns the checkpoint folder."""
    root = checkpoints_root(out_dir)
    final = root / f"{PREFIX}{step:08d}"
    tmp = root / f"{PREFIX}{step:08d}.tmp"
    rank = dist.get_rank()
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    dist.barrier()
    _save_learner(learner, tmp, trainer_state)
    for name, other in (others or {}).items():
        # Made after the policy's save: dist_checkpointing warns about a non-empty folder.
        if rank == 0:
            (tmp / name).mkdir()
        dist.barrier()
        _save_learner(other, tmp / name)
    (tmp / "rng").mkdir(exist_ok=True)
    torch.save(_rng_state(), tmp / "rng" / f"rank{rank}.pt")
    if extra is not None:
        extra(tmp)
    dist.barrier()
    if rank == 0:
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        marker = root / "latest.tmp"
        marker.write_text(final.name)
        os.replace(marker, root / "latest")
        done = sorted(p for p in root.glob(f"{PREFIX}*") if p.is_dir() and not p.name.endswith(".tmp"))
        for old in done[:-keep] if keep > 0 else []:
            shutil.rmtree(old, ignore_errors=True)
    dist.barrier()
    return final


def load_checkpoint(learner, path: str | Path, others: Optional[dict[str, Any]] = None) -> dict[str, Any]:
    """Collective: restore model, optimizer, scheduler (and those of `others`, as saved) and this
    rank's RNG; return the trainer state."""
    path = Path(path)
    trainer_state = _load_learner(learner, path, with_trainer_state=True)
    for name, other in (others or {}).items():
        _load_learner(other, path / name)
    rng = path / "rng" / f"rank{dist.get_rank()}.pt"
    if rng.exists():
        _set_rng_state(torch.load(rng, weights_only=False))
    return trainer_state
