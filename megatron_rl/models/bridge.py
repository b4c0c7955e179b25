"""HF <-> Megatron-Core through mbridge: build GPTModel chunks from a HF checkpoint, export back.

The Megatron TransformerConfig comes from mbridge's mapping of the HF config plus the overrides
in `megatron_overrides` (the one adapter from our config to Megatron's). The layer spec is
`model.spec` (`resolve_spec`): Transformer Engine's (`te`, the default on CUDA when TE imports),
megatron-core's local torch modules with torch's fused attention and grouped expert GEMMs
(`torch`, models/torch_spec.py; the default on CUDA without TE), or megatron-core's local torch
modules as they are (`local`, the CPU default: unfused attention, one expert at a time). `torch`
and `local` run with every TE/apex fusion off. The choice is never silent: rank 0 and the dry-run
print it with its reason (`choose_spec(...).line()`); with `auto` a Transformer Engine that is
installed but fails to import is a warning quoting the error, and asking for `te` where Transformer
Engine cannot run is an error quoting it.
`export_hf_weights` is a collective: every rank of the model-parallel group must iterate it.
"""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path
from typing import Iterator

import torch
import torch.distributed as dist

from megatron_rl.config.schema import ModelConfig
from megatron_rl.distributed.context import ParallelContext

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                    "chat_template.jinja", "vocab.json", "merges.txt", "generation_config.json")


def resolve_dtype(name: str) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if torch.cuda.is_available() else torch.float32
    try:
        return {"float32": torch.float32, "bfloat16": torch.bfloat16}[name]
    except KeyError:
        raise ValueError(f"model.dtype={name!r}; valid: auto, float32, bfloat16") from None


def resolve_hf_path(model_cfg: ModelConfig, run_dir: str | Path) -> Path:
    """The HF checkpoint to load: `model.hf_path`, or a tiny random model made in the run dir.

    Collective when a tiny model is made: rank 0 writes it, every rank waits for it.
    """
    if model_cfg.hf_path:
        path = Path(model_cfg.hf_path)
        if not (path / "config.json").exists():
            raise FileNotFoundError(f"model.hf_path={path} has no config.json (a HF checkpoint folder "
                                    "is required; there is no model hub on these machines)")
        return path
    from megatron_rl.models.tiny import make_tiny_checkpoint

    path = Path(run_dir) / "tiny_model"
    if not dist.is_initialized() or dist.get_rank() == 0:
        make_tiny_checkpoint(path, **vars(model_cfg.tiny))
    if dist.is_initialized():
        dist.barrier()
    return path


SPECS = ("auto", "te", "torch", "local")


def _te_import_error() -> Exception | None:
    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception as e:  # ImportError, or TE's own errors about a CUDA/cuDNN mismatch
        return e
    return None


def _te_installed() -> str | None:
    """The installed Transformer Engine's version (its distribution or its package), or None."""
    import importlib.metadata
    import importlib.util

    for dist_name in ("transformer-engine", "transformer-engine-torch"):
        try:
            return importlib.metadata.version(dist_name)
        except importlib.metadata.PackageNotFoundError:
            pass
    return "(version unknown)" if importlib.util.find_spec("transformer_engine") is not None else None


@dataclasses.dataclass(frozen=True)
class SpecChoice:
    """`model.spec` resolved on this machine, and why (`line()`: what rank 0 and the dry-run print).
    `warning`: a Transformer Engine that is installed but does not import, which `auto` passed over."""

    asked: str
    spec: str
    why: str
    warning: str | None = None

    def line(self) -> str:
        text = f"layer spec: model.spec={self.asked} -> {self.spec}: {self.why}"
        return text + (f"\nwarning: {self.warning}" if self.warning else "")


def choose_spec(name: str) -> SpecChoice:
    """`model.spec` -> the spec this machine runs, with the reason. auto: te on CUDA with Transformer
    Engine importable, torch on CUDA without it (a TE that is installed but fails to import is a
    warning quoting the error), local without CUDA. te where TE cannot run is an error quoting why."""
    if name not in SPECS:
        raise ValueError(f"model.spec={name!r}; valid: {', '.join(SPECS)}")
    cuda = torch.cuda.is_available()
    if name in ("torch", "local"):
        return SpecChoice(name, name, "asked for")
    if name == "auto" and not cuda:
        return SpecChoice(name, "local", "no CUDA device on this machine")
    if name == "te" and not cuda:
        raise ValueError(f"model.spec={name} selects Transformer Engine's layer spec, which needs "
                         "CUDA; this machine has none (model.spec=local runs on CPU)")
    version = _te_installed()
    error = _te_import_error() if version is not None else None
    if version is not None and error is None:
        return SpecChoice(name, "te", f"transformer_engine {version}" if name == "auto" else
                          f"asked for, transformer_engine {version}")
    if name == "te":
        why = ("transformer_engine is not installed" if version is None else
               f"transformer_engine {version} is installed but does not import ({type(error).__name__}: {error})")
        raise ValueError(f"model.spec={name} selects Transformer Engine's layer spec, but {why}; "
                         "install it (docs/cluster.md: the image's `te` target) or set "
                         "model.spec=torch (torch's fused attention and grouped expert GEMMs, the "
                         "measured GPU path) or model.spec=local (megatron-core's torch modules, no "
                         "fused kernels)") from None
    if version is None:
        return SpecChoice(name, "torch", "transformer_engine is not installed")
    return SpecChoice(name, "torch", f"transformer_engine {version} does not import",
                      warning=f"transformer_engine {version} is installed but `import transformer_engine."
                              f"pytorch` fails ({type(error).__name__}: {error}); running the torch spec. "
                              "Fix the install, or set model.spec=torch to choose it.")


def resolve_spec(name: str) -> str:
    """`model.spec` -> "te", "torch" or "local" on this machine (`choose_spec` has the reason)."""
    return choose_spec(name).spec


def megatron_overrides(model_cfg: ModelConfig, ctx: ParallelContext) -> dict:
    """TransformerConfig fields megatron-rl sets on top of mbridge's HF mapping."""
    over = dict(
        sequence_parallel=ctx.sequence_parallel,
        # Loss closures return losses already normalised by global (DP x micro-batch) counts;
        # this keeps Megatron from dividing by the micro-batch count or the DP size again.
        calculate_per_token_loss=True,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        # Recorded routing replays only through the unfused router; the fused one ignores it.
        moe_router_fusion=False,
        # Every MoE router gets a RouterReplay (idle unless a replay/record phase is active).
        moe_enable_routing_replay=True,
        variable_seq_lengths=True,
    )
    if model_cfg.recompute == "full":
        over.update(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    elif model_cfg.recompute != "none":
        raise ValueError(f"model.recompute={model_cfg.recompute!r}; valid: none, full")
    if resolve_spec(model_cfg.spec) in ("local", "torch"):
        # The local (torch) modules implement none of the fused paths (they need TE or apex);
        # the torch spec is the local one with two submodules swapped (models/torch_spec.py).
        over.update(persist_layer_norm=False, moe_grouped_gemm=False, bias_activation_fusion=False,
                    bias_dropout_fusion=False, masked_softmax_fusion=False,
                    gradient_accumulation_fusion=False, apply_rope_fusion=False,
                    moe_permute_fusion=False, cross_entropy_loss_fusion=False)
    return over


def make_bridge(hf_path: str | Path, model_cfg: ModelConfig, ctx: ParallelContext):
    """An mbridge Bridge for the checkpoint, bound to this process's parallel groups."""
    from mbridge import AutoBridge
    from mbridge.core.parallel_states import ParallelStates

    mpu = ParallelStates(
        tp_size=ctx.tp, tp_rank=ctx.tp_rank, pp_size=ctx.pp, pp_rank=ctx.pp_rank,
        vpp_size=ctx.vpp, cp_size=1, cp_rank=0, ep_size=ctx.ep, ep_rank=ctx.ep_rank,
        etp_size=ctx.etp, etp_rank=ctx.etp_rank, tp_group=ctx.tp_group, pp_group=ctx.pp_group,
        cp_group=None, ep_group=ctx.ep_group, etp_group=ctx.etp_group,
    )
    bridge = AutoBridge.from_pretrained(
        str(hf_path), dtype=resolve_dtype(model_cfg.dtype), parallel_states=mpu,
        make_vocab_size_divisible_by=model_cfg.make_vocab_size_divisible_by * ctx.tp,
    )
    bridge.set_extra_args(**megatron_overrides(model_cfg, ctx))
    bridge.layer_spec = resolve_spec(model_cfg.spec)  # read by patches/mbridge_fixes.py
    return bridge


def build_model_chunks(bridge, ctx: ParallelContext) -> list[torch.nn.Module]:
    """GPTModel chunks of this pipeline rank (one, or `vpp` for the interleaved schedule)."""
    from megatron.core.enums import ModelType
    from megatron.core.tensor_parallel import set_defaults_if_not_set_tensor_model_parallel_attributes

    provider = bridge._model_provider([])
    n_chunks = ctx.vpp or 1
    chunks = []
    for i in range(n_chunks):
        pre = ctx.pp_rank == 0 and i == 0
        post = ctx.pp_rank == ctx.pp - 1 and i == n_chunks - 1
        model = provider(pre_process=pre, post_process=post, vp_stage=i if ctx.vpp else None)
        model.model_type = ModelType.encoder_or_decoder
        if ctx.vpp:
            model.vp_stage = i
        for name, p in model.named_parameters():
            set_defaults_if_not_set_tensor_model_parallel_attributes(p)
            if ".mlp.experts." in name:
                # megatron-core marks expert weights for the expert-data-parallel reduction only
                # when EP > 1; with EP = 1 and expert-TP < TP (e.g. TP2, ETP1) each TP rank routes
                # its own sequence-parallel chunk, so its expert grads are partial and must be
                # summed over the expert-DP group too. With ETP = TP that group equals the dense
                # DP group, so marking experts always is right in every layout.
                p.allreduce = False
        if ctx.device.type == "cuda":
            model.cuda(torch.cuda.current_device())
        chunks.append(model)
    return chunks


def load_hf_weights(bridge, chunks, hf_path: str | Path) -> None:
    """Copy HF weights into the (unwrapped) chunks; collective over TP / expert-TP groups."""
    with torch.no_grad():
        bridge.load_weights(chunks, str(hf_path))


def export_hf_weights(bridge, chunks, bucket_bytes: int | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (HF name, full tensor) for every weight; every model-parallel rank must iterate.
    Gathered bucket by bucket (`bucket_bytes` of HF bytes each, models/weight_export.py's default
    if None), a fixed number of collectives per bucket: models/weight_export.py, installed as
    mbridge's `export_weights` by patches/mbridge_fixes.py."""
    if bucket_bytes is None:
        return bridge.export_weights(chunks)
    return bridge.export_weights(chunks, bucket_bytes=bucket_bytes)


def save_hf_checkpoint(bridge, chunks, out_dir: str | Path, tokenizer_src: str | Path | None) -> None:
    """Write a HF checkpoint (safetensors + config [+ tokenizer]); collective, rank 0 writes."""
    from mbridge.core.safetensor_io import SafeTensorIO

    out_dir = Path(out_dir)
    if bridge.safetensor_io is None and tokenizer_src is not None:
        bridge.safetensor_io = SafeTensorIO(str(tokenizer_src))
    bridge.save_weights(chunks, str(out_dir))
    if (not dist.is_initialized() or dist.get_rank() == 0) and tokenizer_src is not None:
        for name in _TOKENIZER_FILES:
            src = Path(tokenizer_src) / name
            if src.exists():
                shutil.copy(src, out_dir / name)
    if dist.is_initialized():
        dist.barrier()
