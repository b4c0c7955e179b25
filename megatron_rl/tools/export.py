"""`megatron-rl export RUN_DIR OUT_DIR [--step N]`: a run's checkpoint as a Hugging Face folder.

A checkpoint (`RUN_DIR/checkpoints/step_<N>`, run/checkpoint.py) holds the model as
megatron-core sharded tensors written at the training's layout. Export builds the model at *this*
process's layout — one process by default (`parallel.*` reset to 1), or under torchrun with
`parallel.tp=...` overrides for a model too large for one device — loads only the model part
(`load_model_weights`: no optimizer state is read), and writes it through mbridge as the HF
checkpoint it started from: safetensors under the original names (and the original shard index),
config.json, the tokenizer files and generation_config.json. megatron-core reshards across TP, PP,
VPP and EP on load (layers and experts are stored under their global numbers), and a vocabulary
padded for another TP size loads its real rows (the embedding and output layer are stored with
`allow_shape_mismatch`). The weights keep the dtype the checkpoint stores them in (`model.dtype`
"auto" follows the checkpoint, so a GPU run's bfloat16 weights stay bfloat16 on a CPU machine).

The model comes from the run's `config.yaml` (written by `train` and `train-lm`), with Hydra
overrides on top; its HF source (`model.hf_path`, or the run's `tiny_model/`) gives the
architecture mapping, the tokenizer and the file layout. OUT_DIR also gets megatron_rl_export.json
(run, checkpoint, step, the export's layout, the config file below) and megatron_rl_run_config.yaml,
the configuration that wrote the checkpoint (its own config.yaml, else the run's): `megatron-rl eval
OUT_DIR` evaluates on that run's data, reward and eval settings (tools/evaluate.py), wherever the
folder is copied. OUT_DIR is written as OUT_DIR.tmp and renamed when complete, and an existing
OUT_DIR is refused.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
import time
from pathlib import Path
from typing import Optional, Sequence

import torch
import torch.distributed as dist
from omegaconf import OmegaConf

from megatron_rl.config.schema import JobConfig
from megatron_rl.run.checkpoint import PREFIX, checkpoints_root, latest_checkpoint

CONFIG_FILE = "config.yaml"
PROVENANCE_FILE = "megatron_rl_export.json"
RUN_CONFIG_FILE = "megatron_rl_run_config.yaml"  # in an export: the config that wrote its checkpoint


def save_run_config(cfg: JobConfig, run_dir: str | Path) -> None:
    """RUN_DIR/config.yaml, as the RL trainer writes it (rank 0)."""
    Path(run_dir).mkdir(parents=True, exist_ok=True)
    (Path(run_dir) / CONFIG_FILE).write_text(OmegaConf.to_yaml(OmegaConf.structured(cfg)))


def load_run_config(run_dir: str | Path, overrides: Sequence[str] = (), *, drop: Sequence[str] = ()) -> JobConfig:
    """The run's config.yaml, validated against the schema, with Hydra `overrides` applied.
    `drop`: top-level groups reset to their defaults first (export: `parallel`)."""
    path = Path(run_dir) / CONFIG_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{run_dir} is not a run directory: no {CONFIG_FILE} (written by "
                                "`megatron-rl train` and `train-lm` into their out_dir)")
    return load_config_file(path, overrides, drop=drop)


def load_config_file(path: str | Path, overrides: Sequence[str] = (), *, drop: Sequence[str] = ()) -> JobConfig:
    """A saved job config (a run's config.yaml, an export's megatron_rl_run_config.yaml), validated
    against the schema, with Hydra `overrides` applied; `drop` as in load_run_config."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    from megatron_rl.config.load import CONFIGS_DIR, _explain, register_schemas, to_object

    path = Path(path)
    saved = OmegaConf.load(path)
    for group in drop:
        saved.pop(group, None)
    register_schemas()
    GlobalHydra.instance().clear()
    # The saved config as a primary config on the schema, so overrides mean what they mean on a
    # recipe (same syntax, same errors naming the valid keys).
    with tempfile.TemporaryDirectory() as tmp:
        primary = OmegaConf.merge({"defaults": ["job_schema", "_self_"]}, saved)
        (Path(tmp) / "run.yaml").write_text(OmegaConf.to_yaml(primary))
        try:
            with initialize_config_dir(config_dir=tmp, version_base="1.3"):
                cfg = compose(config_name="run",
                              overrides=[f"hydra.searchpath=[file://{CONFIGS_DIR}]", *overrides])
            OmegaConf.resolve(cfg)
        except (HydraException, OmegaConfBaseException) as exc:
            explained = _explain(exc, str(path))
            if explained is None:
                raise
            raise explained from exc
        finally:
            GlobalHydra.instance().clear()
    return to_object(cfg)


def step_of(checkpoint: Path) -> int:
    m = re.fullmatch(rf"{PREFIX}(\d+)", checkpoint.name)
    if not m:
        raise ValueError(f"{checkpoint} is not named {PREFIX}<N>")
    return int(m.group(1))


def find_checkpoint(run_dir: str | Path, step: Optional[int] = None) -> Path:
    """RUN_DIR's checkpoint of `step`, or its newest; errors list the steps there are."""
    root = checkpoints_root(run_dir)
    have = sorted(step_of(p) for p in root.glob(f"{PREFIX}*") if p.is_dir() and re.fullmatch(rf"{PREFIX}\d+", p.name))
    if step is None:
        found = latest_checkpoint(run_dir)
        if found is None:
            raise FileNotFoundError(f"{run_dir} has no checkpoint ({root}/latest is missing; a run writes one at "
                                    "its end, every trainer.save_every steps and on SIGTERM)")
        return found
    path = root / f"{PREFIX}{step:08d}"
    if not path.is_dir():
        raise FileNotFoundError(f"{run_dir} has no checkpoint of step {step}; steps there: "
                                f"{', '.join(map(str, have)) or 'none'}")
    return path


def checkpoint_config_file(run_dir: str | Path, checkpoint: Path) -> Path:
    """The config that wrote `checkpoint`: its own config.yaml (run/run_dir.py), else the run's."""
    own = checkpoint / CONFIG_FILE
    return own if own.is_file() else Path(run_dir) / CONFIG_FILE


def hf_source(cfg: JobConfig, run_dir: Path) -> Path:
    """The HF checkpoint the run started from: model.hf_path, or the tiny model in the run dir
    (read as it is: never remade, so an override of model.tiny.* cannot overwrite it)."""
    path = Path(cfg.model.hf_path) if cfg.model.hf_path else run_dir / "tiny_model"
    if not (path / "config.json").is_file():
        what = f"model.hf_path={path}" if cfg.model.hf_path else f"the run's tiny model {path}"
        raise FileNotFoundError(f"{what} has no config.json: the export takes the architecture, tokenizer and "
                                "file layout from the HF checkpoint the run started from (override "
                                "model.hf_path=... if it moved)")
    return path


def _stored_dtype(checkpoint: Path) -> torch.dtype:
    """The dtype the checkpoint stores the word embedding in (the model's parameter dtype)."""
    from megatron.core import dist_checkpointing

    meta = dist_checkpointing.load_tensors_metadata(str(checkpoint))
    return meta["embedding.word_embeddings.weight"].dtype


def _dtype_name(dtype: torch.dtype) -> str:
    names = {torch.float32: "float32", torch.bfloat16: "bfloat16"}
    if dtype not in names:
        raise ValueError(f"the checkpoint stores {dtype} weights; model.dtype supports float32 and bfloat16 "
                         "(set model.dtype=... to convert)")
    return names[dtype]


def export_checkpoint(run_dir: str | Path, out_dir: str | Path, step: Optional[int] = None,
                      overrides: Sequence[str] = ()) -> Path:
    """Every rank of the export calls it (one process by default). Writes OUT_DIR; returns it."""
    run_dir, out_dir = Path(run_dir), Path(out_dir)
    cfg = load_run_config(run_dir, overrides, drop=("parallel",))
    checkpoint = find_checkpoint(run_dir, step)
    if out_dir.exists():
        raise FileExistsError(f"{out_dir} exists; remove it or export to another folder")
    hf_path = hf_source(cfg, run_dir)

    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from megatron_rl.distributed.context import init_distributed
    from megatron_rl.models.bridge import build_model_chunks, make_bridge, resolve_dtype, save_hf_checkpoint
    from megatron_rl.run.checkpoint import load_model_weights

    start = time.perf_counter()
    ctx = init_distributed(cfg.parallel)
    if cfg.model.dtype == "auto":
        cfg.model.dtype = _dtype_name(_stored_dtype(checkpoint))
    model_parallel_cuda_manual_seed(cfg.model.seed)
    bridge = make_bridge(hf_path, cfg.model, ctx)
    chunks = build_model_chunks(bridge, ctx)
    dtype = resolve_dtype(cfg.model.dtype)
    if dtype != torch.float32:
        # As the learner holds them (learner.py): every parameter in bfloat16, norms included
        # (the provider builds those in float32).
        from megatron.core.transformer.module import Float16Module

        chunks = [Float16Module(c.config, c) for c in chunks]
    load_model_weights(chunks, checkpoint)
    bridge.hf_config.dtype = dtype  # config.json names the dtype of the weights beside it

    tmp = out_dir.with_name(out_dir.name + ".tmp")
    if ctx.rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.parent.mkdir(parents=True, exist_ok=True)
    if dist.is_initialized():
        dist.barrier()
    save_hf_checkpoint(bridge, chunks, tmp, tokenizer_src=hf_path)
    if ctx.rank == 0:
        # What `megatron-rl eval OUT_DIR` evaluates with: the run's data, reward and eval settings.
        config = checkpoint_config_file(run_dir, checkpoint)
        shutil.copyfile(config, tmp / RUN_CONFIG_FILE)
        (tmp / PROVENANCE_FILE).write_text(json.dumps(
            {"run_dir": str(run_dir.resolve()), "checkpoint": checkpoint.name, "step": step_of(checkpoint),
             "hf_source": str(Path(hf_path).resolve()), "export_layout": ctx.describe(),
             "config": RUN_CONFIG_FILE, "config_source": str(config.resolve()),
             "export_overrides": list(overrides)}, indent=1) + "\n")
        os.replace(tmp, out_dir)
        print(f"[megatron-rl] exported {checkpoint} -> {out_dir} ({ctx.describe()}, "
              f"{time.perf_counter() - start:.1f}s)", flush=True)
    if dist.is_initialized():
        dist.barrier()
    return out_dir
