"""FP8 rollouts (ALGORITHMS.md §11): the learner's weights quantized for the rollout servers.

The format is the block-scaled e4m3 of the Qwen3-FP8 and DeepSeek-V3 checkpoints: each 2-D linear
weight W [out, in] is cut into 128 x 128 blocks (the last row and column of blocks may be ragged);
block b gets the dequantization scale s_b = amax_b / 448 (448 = e4m3's largest finite value), and
its elements are stored as e4m3(W / s_b), rounded to nearest even. The checkpoint names the weight
`<name>.weight` (float8_e4m3fn) and the scale `<name>.weight_scale_inv` (float32, one per block,
[ceil(out/128), ceil(in/128)]); dequantized, W ≈ e4m3 * s_b. A block of zeros keeps scale 1.

Which tensors: the projections of attention and the MLP / experts (`*_proj.weight`, 2-D) -- what
SGLang's FP8 linear methods serve and what the FP8 Qwen3 checkpoints quantize. Embeddings, the LM
head, norms and the MoE router (`mlp.gate.weight`) stay in the learner's precision.

Two modes (`ServedWeights`):
- "serve" (CUDA servers, SGLang's FP8 kernels): every push sends `.weight` in e4m3 and its
  `.weight_scale_inv`, the names and shapes SGLang's loader takes for a block-scaled checkpoint.
  The servers must start from such a checkpoint (`write_fp8_checkpoint`), so that their layers are
  FP8 layers.
- "round" (CPU servers: no FP8 kernels): every push sends W rounded through the same e4m3 blocks
  and dequantized, in the learner's dtype. This reproduces the weights' quantization error only --
  not FP8 activations, FP8 GEMM accumulation or an FP8 KV cache.

The quantization runs on rank 0 over the full tensors that mbridge's export gathers, so a tensor
sharded over TP or EP ranks is quantized exactly as the whole tensor would be (block boundaries
are the full tensor's, whatever the shard sizes).
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Iterable, Iterator

import torch

E4M3_MAX = 448.0
BLOCK = (128, 128)
QUANTIZATIONS = ("none", "fp8")
MODES = ("serve", "round")
SCALE_SUFFIX = "_scale_inv"

_QUANTIZED = re.compile(r"\.(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)\.weight$")


def is_quantized(name: str, tensor: torch.Tensor) -> bool:
    """Whether the HF weight `name` is served in FP8 (a 2-D attention / MLP / expert projection)."""
    return tensor.dim() == 2 and bool(_QUANTIZED.search(name))


def _blocks(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, int, int]:
    """W [m, n] in float32, zero-padded to whole blocks, as [rows, bm, cols, bn]."""
    m, n = w.shape
    bm, bn = block
    rows, cols = -(-m // bm), -(-n // bn)
    padded = torch.zeros(rows * bm, cols * bn, dtype=torch.float32, device=w.device)
    padded[:m, :n] = w
    return padded.view(rows, bm, cols, bn), rows, cols


def quantize_blockwise(w: torch.Tensor, block: tuple[int, int] = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """W [m, n] -> (e4m3 [m, n], scale_inv float32 [ceil(m/bm), ceil(n/bn)]) with W ≈ q * scale_inv
    blockwise. Non-finite weights are an error (an FP8 block would saturate or turn NaN silently)."""
    if w.dim() != 2:
        raise ValueError(f"block FP8 quantizes 2-D weights; got shape {tuple(w.shape)}")
    if not torch.isfinite(w).all():
        raise ValueError("block FP8 quantization of a weight with NaN or inf values")
    m, n = w.shape
    x, rows, cols = _blocks(w.float(), block)
    amax = x.abs().amax(dim=(1, 3))                                  # [rows, cols]
    scale = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))
    q = (x / scale[:, None, :, None]).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return q.view(rows * block[0], cols * block[1])[:m, :n].contiguous(), scale


def dequantize_blockwise(q: torch.Tensor, scale_inv: torch.Tensor, dtype: torch.dtype = torch.float32,
                         block: tuple[int, int] = BLOCK) -> torch.Tensor:
    """The inverse map: q * scale_inv per block, in `dtype` (computed in float32)."""
    m, n = q.shape
    x, rows, cols = _blocks(q.float(), block)
    if tuple(scale_inv.shape) != (rows, cols):
        raise ValueError(f"scale_inv has shape {tuple(scale_inv.shape)}; {(rows, cols)} blocks expected")
    w = (x * scale_inv.float()[:, None, :, None]).view(rows * block[0], cols * block[1])[:m, :n]
    return w.to(dtype).contiguous()


def round_through_fp8(w: torch.Tensor, block: tuple[int, int] = BLOCK) -> torch.Tensor:
    """W as an FP8 server holds it: quantized blockwise and dequantized, in W's dtype."""
    return dequantize_blockwise(*quantize_blockwise(w, block), dtype=w.dtype, block=block)


class ServedWeights:
    """The weights as the servers take them: `apply` maps the learner's (HF name, tensor) stream."""

    def __init__(self, quantization: str = "none", mode: str = "round"):
        if quantization not in QUANTIZATIONS:
            raise ValueError(f"rollout.quantization={quantization!r}; valid: {', '.join(QUANTIZATIONS)}")
        if mode not in MODES:
            raise ValueError(f"FP8 mode {mode!r}; valid: {', '.join(MODES)}")
        self.quantization, self.mode = quantization, mode

    def apply(self, named: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        if self.quantization == "none":
            yield from named
            return
        for name, t in named:
            if not is_quantized(name, t):
                yield name, t
            elif self.mode == "round":
                yield name, round_through_fp8(t)
            else:
                q, scale = quantize_blockwise(t)
                yield name, q
                yield name + SCALE_SUFFIX, scale


def fp8_quantization_config() -> dict:
    """config.json's `quantization_config` of a block-scaled e4m3 checkpoint (as Qwen3-FP8's)."""
    return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
            "weight_block_size": list(BLOCK)}


def write_fp8_checkpoint(src: str | Path, dst: str | Path) -> Path:
    """A block-scaled FP8 copy of the HF checkpoint `src` at `dst` (what FP8 servers start from):
    the projections quantized, everything else as it is, tokenizer and config copied, config.json
    given `quantization_config`. Reads and writes one safetensors file at a time."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    src, dst = Path(src), Path(dst)
    files = sorted(src.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{src} has no *.safetensors files to quantize")
    tmp = dst.with_name(dst.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    served = ServedWeights("fp8", "serve")
    weight_map = {}
    for f in files:
        with safe_open(str(f), framework="pt") as fh:
            tensors = dict(served.apply((k, fh.get_tensor(k)) for k in fh.keys()))
        save_file(tensors, str(tmp / f.name), metadata={"format": "pt"})
        weight_map.update({k: f.name for k in tensors})
    for p in src.iterdir():
        if p.is_file() and p.suffix != ".safetensors" and p.name != "model.safetensors.index.json":
            shutil.copy(p, tmp / p.name)
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = fp8_quantization_config()
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    if len(files) > 1 or (src / "model.safetensors.index.json").exists():
        (tmp / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}, indent=2))
    shutil.rmtree(dst, ignore_errors=True)
    tmp.rename(dst)
    return dst
