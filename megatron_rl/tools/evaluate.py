"""`megatron-rl eval MODEL [overrides]`: mean@k / pass@k of a model on served samples, no training.

MODEL is one of (the config in parentheses, the overrides always on top; which config, data and
reward it evaluates with is printed first):
- a run directory (its config.yaml; its newest checkpoint, or `--step N`, is first exported to
  RUN_DIR/export/step_<N> with `megatron-rl export`'s code at world size 1, and an existing export
  is reused);
- a folder `megatron-rl export` wrote (the config that wrote its checkpoint, which the export keeps
  as megatron_rl_run_config.yaml; an older export without it: the config.yaml of the run named in
  its megatron_rl_export.json), sampled with the seeds of the checkpoint's step; `--recipe` uses a
  recipe instead, as for any HF folder;
- any other Hugging Face folder (`--recipe`, default tiny_cpu: the demo's synthetic task).
The prompts are the config's eval set (`data.eval_files`, or the synthetic task's held-out
problems), the first `eval.num_prompts` of them (0: every row of data.eval_files); each gets
`eval.k` samples at `eval.temperature` / `eval.top_p`, up to `eval.max_new_tokens` (default
rollout.max_new_tokens), scored by `data.reward`. The samples and scores come from the trainer's
own `Fleet.evaluate`, so mean@k (the mean reward) and pass@k (the share of prompts with a correct
sample among their k: the reward's own verdict, else a reward >= data.correct_threshold) are what a
training run logs as eval/mean@k and eval/pass@k; with `rollout.seeded` the samples' seeds follow
trainer.seed and the checkpoint's step as the trainer's evaluation at that step does.

Servers: `rollout.num_servers` local SGLang servers on this machine serving MODEL (on CUDA the
`rollout.gpu_ids`, default the first num_servers x server_tp visible GPUs), stopped at the end; or
`rollout.server_urls`, running servers that are told to load MODEL from disk
(`/update_weights_from_disk`: the path must be readable on their machines, and they must serve the
same architecture). The numbers are printed and written as JSON (`--out`, default
`<MODEL>.eval.json` beside the folder). One process: the servers do the work.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import time
from pathlib import Path
from typing import Optional

import torch

from megatron_rl.config.schema import JobConfig


def _is_run_dir(path: Path) -> bool:
    from megatron_rl.tools.export import CONFIG_FILE

    return (path / CONFIG_FILE).is_file() and not (path / "config.json").is_file()


def export_record(folder: Path) -> Optional[dict]:
    """megatron_rl_export.json of a folder `megatron-rl export` wrote (run, step, config), or None."""
    from megatron_rl.tools.export import PROVENANCE_FILE

    path = folder / PROVENANCE_FILE
    return json.loads(path.read_text()) if path.is_file() else None


def export_config_file(folder: Path, record: dict) -> Path:
    """The config an export was made from: its own copy (megatron_rl_run_config.yaml), else (an
    export made before it kept one) the config.yaml of the run it names; an error when neither is
    there."""
    from megatron_rl.tools.export import CONFIG_FILE, RUN_CONFIG_FILE

    own = folder / record.get("config", RUN_CONFIG_FILE)
    run = Path(record["run_dir"]) / CONFIG_FILE if record.get("run_dir") else None
    for path in (own, run):
        if path is not None and path.is_file():
            return path
    raise FileNotFoundError(
        f"{folder} is an export of {record.get('run_dir', 'a run')} (megatron_rl_export.json), but neither its "
        f"{own.name} nor {run or 'the run config.yaml'} is there: the run's data, reward and eval settings are "
        "unknown. Give the config with --recipe RECIPE (plus data.* / eval.* overrides)")


def _with(overrides: list[str]) -> str:
    return f" + {' '.join(overrides)}" if overrides else ""


def resolve_model(model: str, recipe: Optional[str], overrides: list[str],
                  step: Optional[int]) -> tuple[JobConfig, Path, int]:
    """(config, HF folder to serve, step for the sampling seeds) for MODEL; prints which config."""
    from megatron_rl.config.load import load_config, to_object
    from megatron_rl.tools.export import (
        CONFIG_FILE, export_checkpoint, find_checkpoint, load_config_file, load_run_config, step_of,
    )

    path = Path(model)
    if _is_run_dir(path):
        if recipe is not None:
            raise ValueError(f"--recipe is the config of a HF folder; the run directory {model} has its own "
                             "(config.yaml): give overrides instead")
        cfg = load_run_config(path, overrides, drop=("parallel",))
        print(f"[megatron-rl] eval: config {path / CONFIG_FILE}{_with(overrides)}", flush=True)
        checkpoint = find_checkpoint(path, step)
        hf = path / "export" / checkpoint.name
        if hf.is_dir():  # complete: an export is renamed into place only when written
            print(f"[megatron-rl] eval: using the existing export {hf}", flush=True)
        else:
            export_checkpoint(path, hf, step_of(checkpoint), overrides)
            gc.collect()  # the export's model copy, before servers want the memory
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        return cfg, hf, step_of(checkpoint)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{model} is neither a HF folder (no config.json) nor a run directory "
                                "(no config.yaml)")
    if step is not None:
        raise ValueError("--step picks a checkpoint of a run directory; MODEL is a HF folder")
    record = export_record(path)
    if record is not None and recipe is None:
        # An export: its run's data, reward and eval settings, at the checkpoint's step (its seeds).
        source = export_config_file(path, record)
        cfg = load_config_file(source, overrides, drop=("parallel",))
        cfg.model.hf_path = str(path)
        seed_step = int(record.get("step", 0))
        print(f"[megatron-rl] eval: {path} is an export of {record.get('run_dir')} (step {seed_step}); config "
              f"{source}{_with(overrides)}", flush=True)
        return cfg, path, seed_step
    cfg = to_object(load_config(recipe or "tiny_cpu", overrides))
    cfg.model.hf_path = str(path)
    why = "--recipe" if recipe else "the default for a HF folder; --recipe RECIPE to choose"
    print(f"[megatron-rl] eval: config recipe {recipe or 'tiny_cpu'} ({why}){_with(overrides)}", flush=True)
    return cfg, path, 0


def _server_gpus(cfg: JobConfig) -> Optional[list[list[str]]]:
    """On CUDA, the GPUs of each local server: rollout.gpu_ids, else the first visible ones (this
    process trains nothing, so every GPU is the servers')."""
    from megatron_rl.rollout.placement import visible_devices

    r = cfg.rollout
    visible = visible_devices() or [str(i) for i in range(torch.cuda.device_count())]
    n = r.num_servers * r.server_tp
    ids = list(r.gpu_ids) or list(range(n))
    if len(ids) != n or len(set(ids)) != n or min(ids) < 0 or max(ids) >= len(visible):
        raise ValueError(f"rollout.gpu_ids={ids}: need {n} distinct indices (num_servers={r.num_servers} x "
                         f"server_tp={r.server_tp}) of the {len(visible)} visible GPUs")
    ids = [visible[g] for g in ids]
    return [ids[i * r.server_tp:(i + 1) * r.server_tp] for i in range(r.num_servers)]


def start_servers(cfg: JobConfig, hf: Path, log_dir: Path):
    """Local servers serving `hf`, as the trainer's rank 0 starts them; returns the manager."""
    from megatron_rl.rollout.placement import server_device
    from megatron_rl.rollout.server import EngineManager, ServerConfig
    from megatron_rl.rollout.servers import server_dtype, server_extra_args

    r = cfg.rollout
    device = server_device(cfg)
    return EngineManager(
        ServerConfig(model_path=str(hf), device=device, dtype=server_dtype(cfg), tp_size=r.server_tp,
                     max_total_tokens=r.max_total_tokens, mem_fraction_static=r.mem_fraction_static,
                     enable_return_routed_experts=cfg.algorithm.router_replay == "r3",
                     extra_args=server_extra_args(cfg)),
        r.num_servers, log_dir=log_dir, gpu_ids=_server_gpus(cfg) if device == "cuda" else None).start()


def load_on_servers(urls: list[str], hf: Path) -> None:
    """Running servers load `hf` from disk (the path as their machines see it)."""
    from megatron_rl.weights.endpoint import ServerEndpoint

    for url in urls:
        out = ServerEndpoint(url).post("/update_weights_from_disk",
                                       {"model_path": str(hf.resolve()), "weight_version": "eval"})
        if not out.get("success", False):
            raise RuntimeError(f"rollout server {url} could not load {hf.resolve()}: {out.get('message', out)} "
                               "(it must see that path and serve the same architecture)")


def eval_data(cfg: JobConfig):
    """The eval set a config names, as printed and reported: data.eval_files, or the synthetic task."""
    d = cfg.data
    if d.source == "files":
        return list(d.eval_files)
    return f"synthetic op={d.synthetic.op} (held-out seed {d.synthetic.seed + 1})"


def evaluate(cfg: JobConfig, hf: Path, step: int, log_dir: Path) -> dict:
    """mean@k / pass@k of the model in `hf` on the config's eval prompts; returns the report."""
    from transformers import AutoTokenizer

    from megatron_rl.config.schema import ParallelConfig
    from megatron_rl.distributed.context import init_distributed
    from megatron_rl.data.prompts import check_data_files, load_examples, tokenize
    from megatron_rl.rewards import correct_rule
    from megatron_rl.rollout.fleet import Fleet

    e, d, r = cfg.eval, cfg.data, cfg.rollout
    check_data_files(d)
    if d.source == "files" and not d.eval_files:
        raise ValueError("data.source=files: name the prompts to evaluate on with data.eval_files=[...]")
    if d.source == "synthetic" and e.num_prompts <= 0:
        raise ValueError(f"eval.num_prompts={e.num_prompts}: the synthetic eval set needs a number of problems > 0")
    if e.k < 1:
        raise ValueError(f"eval.k={e.k} must be >= 1")
    tokenizer = AutoTokenizer.from_pretrained(hf)
    prompts = tokenize(load_examples(d, "eval", e.num_prompts), tokenizer)
    data, rule = eval_data(cfg), correct_rule(d.reward, d.correct_threshold)
    print(f"[megatron-rl] eval: {len(prompts)} prompts of {data} x {e.k} samples; mean@{e.k}: the mean "
          f"reward, pass@{e.k}: a correct sample among {e.k}, {rule}", flush=True)
    start = time.perf_counter()
    manager = None
    if r.server_urls:
        load_on_servers(list(r.server_urls), hf)
    else:
        manager = start_servers(cfg, hf, log_dir)
        # The fleet sees them as running servers (it starts none of its own).
        r.server_urls, r.placement, r.gpu_ids = manager.urls(), "disaggregated", []
    rollouts = None
    try:
        ctx = init_distributed(ParallelConfig())
        rollouts = Fleet(cfg, ctx, hf, tokenizer, log_dir, moe_topk=None)
        metrics = rollouts.evaluate(prompts, step)
    finally:
        if rollouts is not None:
            rollouts.close()
        if manager is not None:
            manager.stop()
    return {"model": str(hf), "step": step, "metrics": metrics, "num_prompts": len(prompts), "k": e.k,
            "temperature": e.temperature, "top_p": e.top_p,
            "max_new_tokens": e.max_new_tokens or r.max_new_tokens, "seeded": r.seeded, "seed": cfg.trainer.seed,
            "data": data, "reward": d.reward, "correct": rule, "seconds": round(time.perf_counter() - start, 1)}


def _init_single_process() -> None:
    """A process group of one, whatever launcher variables this process inherited (in an sbatch
    script, SLURM_NTASKS counts the job's tasks, not this process's peers)."""
    import torch.distributed as dist

    if dist.is_initialized():
        return
    if torch.cuda.is_available():
        torch.cuda.set_device(0)
    # An in-memory store: a group of one needs no port (a probed free port can be taken before
    # the bind by any other process on the node).
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo", store=dist.HashStore(),
                            rank=0, world_size=1)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="megatron-rl eval", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", help="a HF folder, or a run directory (config.yaml, checkpoints/)")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides, e.g. eval.k=8 data.eval_files=[aime.parquet]")
    parser.add_argument("--recipe", default=None, help="base config for a HF folder (default: tiny_cpu)")
    parser.add_argument("--step", type=int, default=None, help="a run directory's checkpoint of step N (default: the newest)")
    parser.add_argument("--out", default=None, help="the JSON report (default: <MODEL>.eval.json beside the folder)")
    args = parser.parse_intermixed_args(argv)  # options may follow the overrides
    if int(os.environ.get("WORLD_SIZE", 1)) > 1:
        raise ValueError("megatron-rl eval runs in one process (the servers do the work): start it without "
                         "torchrun; export a model too large for one device first (`megatron-rl export` under "
                         "torchrun) and evaluate the folder")
    _init_single_process()
    cfg, hf, step = resolve_model(args.model, args.recipe, args.overrides, args.step)
    out = Path(args.out) if args.out else hf.with_name(hf.name + ".eval.json")
    report = evaluate(cfg, hf, step, out.with_name(out.stem + "_server_logs"))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1) + "\n")
    numbers = "  ".join(f"{k} {v:.4f}" for k, v in report["metrics"].items())
    print(f"[megatron-rl] {numbers}  ({report['num_prompts']} prompts x {report['k']} samples, "
          f"T={report['temperature']}, {hf}) -> {out}", flush=True)
    return 0
