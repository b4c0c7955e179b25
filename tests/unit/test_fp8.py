"""FP8 rollouts (megatron_rl/weights/fp8.py): the block quantizer against a float64 reference of e4m3
rounding (itself checked against torch's float8_e4m3fn cast), scales, saturation, ragged blocks,
which tensors are quantized, the two serving modes, the FP8 checkpoint, the config and the flags."""

from __future__ import annotations

import json
import math

import pytest
import torch

from megatron_rl.weights import fp8
from megatron_rl.weights.fp8 import (BLOCK, E4M3_MAX, ServedWeights, dequantize_blockwise, is_quantized,
                                     quantize_blockwise, round_through_fp8, write_fp8_checkpoint)

F64 = torch.float64


def e4m3_round(v: float) -> float:
    """Round-to-nearest-even onto e4m3fn's grid in float64: 3 mantissa bits, exponents -6..8,
    subnormals in steps of 2^-9, largest finite 448 (values beyond saturate here)."""
    a = abs(v)
    if a == 0:
        return 0.0
    e = max(math.floor(math.log2(a)), -6)
    quantum = 2.0 ** (e - 3)
    n = a / quantum
    k = math.floor(n)
    frac = n - k
    if frac > 0.5 or (frac == 0.5 and k % 2 == 1):
        k += 1
    return math.copysign(min(k * quantum, E4M3_MAX), v)


def test_reference_rounding_is_torchs_e4m3_cast():
    # Every representable value, the midpoints between neighbours (ties: to even) and random values.
    grid = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).to(F64)
    grid = grid[torch.isfinite(grid)].unique()
    mids = (grid[1:] + grid[:-1]) / 2
    rand = (torch.rand(4000, generator=torch.Generator().manual_seed(0), dtype=F64) * 2 - 1) * 440
    for x in (grid, mids, rand, rand / 1000):
        ours = torch.tensor([e4m3_round(float(v)) for v in x], dtype=F64)
        torch.testing.assert_close(ours, x.to(torch.float8_e4m3fn).to(F64), rtol=0, atol=0)


def reference_quantize(w: torch.Tensor):
    """Float64: per 128x128 block s = amax/448 (1 for a zero block), q = e4m3(w/s)."""
    w = w.to(F64)
    m, n = w.shape
    rows, cols = -(-m // 128), -(-n // 128)
    scale = torch.ones(rows, cols, dtype=F64)
    q = torch.zeros_like(w)
    for i in range(rows):
        for j in range(cols):
            blk = w[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128]
            amax = blk.abs().max().item()
            if amax > 0:
                scale[i, j] = amax / E4M3_MAX
            q[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128] = torch.tensor(
                [[e4m3_round(v / scale[i, j].item()) for v in row] for row in blk.tolist()], dtype=F64)
    return q, scale


@pytest.mark.parametrize("shape,dtype", [((300, 200), torch.float32), ((128, 256), torch.bfloat16), ((5, 7), torch.float32)])
def test_quantizer_equals_float64_reference(shape, dtype):
    g = torch.Generator().manual_seed(1)
    w = (torch.randn(*shape, generator=g) * torch.logspace(-3, 1, shape[1])[None, :]).to(dtype)
    w[0, 0] = 0.0
    if shape == (300, 200):
        w[256:, 128:] = 0.0          # the ragged corner block (44 x 72) is all zeros: scale 1
        w[5, 140] = 37.0              # one large value: only its own block's scale
    q, scale = quantize_blockwise(w)
    q_ref, s_ref = reference_quantize(w.float())
    assert q.dtype == torch.float8_e4m3fn and q.shape == w.shape
    assert scale.dtype == torch.float32 and scale.shape == (-(-shape[0] // 128), -(-shape[1] // 128))
    torch.testing.assert_close(scale.to(F64), s_ref, rtol=2e-7, atol=0)
    # The scale is float32 here, float64 there: compare the rounded values where both divide alike.
    torch.testing.assert_close(q.to(F64), q_ref, rtol=0, atol=0)
    if shape == (300, 200):
        assert scale[2, 1] == 1.0 and (q[256:, 128:].float() == 0).all()
        assert scale[0, 1] == pytest.approx(37.0 / 448)
        assert scale[0, 0] < 0.1 and scale[1, 1] < 0.1
    # Each block's largest magnitude lands exactly on ±448: the whole e4m3 range is used.
    deq = dequantize_blockwise(q, scale, torch.float64)
    blocks_max = q.float().abs().amax()
    assert blocks_max == E4M3_MAX
    # Error bound: half an e4m3 step (relative 2^-4) of each element, at most.
    err = (deq - w.to(F64)).abs()
    assert (err <= w.to(F64).abs() * 2.0 ** -4 + scale.max().item() * 2.0 ** -10).all()


def test_saturation_nonfinite_and_shapes():
    w = torch.tensor([[1e30, -1e30, 1.0]])
    q, s = quantize_blockwise(w)
    assert q.float().tolist() == [[448.0, -448.0, 0.0]] and torch.isfinite(q.float()).all()
    with pytest.raises(ValueError, match="NaN or inf"):
        quantize_blockwise(torch.tensor([[1.0, float("nan")]]))
    with pytest.raises(ValueError, match="2-D"):
        quantize_blockwise(torch.ones(3))
    with pytest.raises(ValueError, match="blocks expected"):
        dequantize_blockwise(q, torch.ones(2, 2))


def test_which_tensors_and_the_two_modes():
    names = {
        "model.embed_tokens.weight": False, "lm_head.weight": False, "model.norm.weight": False,
        "model.layers.0.input_layernorm.weight": False, "model.layers.0.self_attn.q_norm.weight": False,
        "model.layers.0.mlp.gate.weight": False,  # the MoE router
        "model.layers.0.self_attn.q_proj.weight": True, "model.layers.0.self_attn.o_proj.weight": True,
        "model.layers.0.mlp.gate_proj.weight": True, "model.layers.0.mlp.down_proj.weight": True,
        "model.layers.0.mlp.experts.3.up_proj.weight": True,
    }
    g = torch.Generator().manual_seed(2)
    named = [(n, torch.randn(130, 70, generator=g)) for n in names]
    named.append(("model.layers.0.self_attn.q_proj.bias", torch.randn(130, generator=g)))
    for n, t in named:
        assert is_quantized(n, t) == names.get(n, False), n
    served = dict(ServedWeights("fp8", "serve").apply(named))
    rounded = dict(ServedWeights("fp8", "round").apply(named))
    plain = dict(ServedWeights("none").apply(named))
    for n, t in named:
        assert torch.equal(plain[n], t)
        if names.get(n, False):
            assert served[n].dtype == torch.float8_e4m3fn and served[n + "_scale_inv"].shape == (2, 1)
            torch.testing.assert_close(rounded[n], dequantize_blockwise(served[n], served[n + "_scale_inv"]))
            assert not torch.equal(rounded[n], t) and rounded[n].dtype == t.dtype
        else:
            assert torch.equal(served[n], t) and torch.equal(rounded[n], t) and n + "_scale_inv" not in served
    bf = torch.randn(64, 64, generator=g).bfloat16()
    assert round_through_fp8(bf).dtype == torch.bfloat16
    with pytest.raises(ValueError, match="valid: none, fp8"):
        ServedWeights("int4")


def test_fp8_checkpoint_of_a_tiny_qwen3_moe(tmp_path):
    from safetensors import safe_open

    from megatron_rl.models.tiny import make_tiny_checkpoint

    src = make_tiny_checkpoint(tmp_path / "moe", moe=True)
    dst = write_fp8_checkpoint(src, tmp_path / "fp8")
    config = json.loads((dst / "config.json").read_text())
    assert config["quantization_config"] == {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                             "weight_block_size": [128, 128]}
    seen = 0
    for f in sorted(src.glob("*.safetensors")):
        with safe_open(str(f), "pt") as a, safe_open(str(dst / f.name), "pt") as b:
            for k in a.keys():
                t = a.get_tensor(k)
                if is_quantized(k, t):
                    seen += 1
                    torch.testing.assert_close(dequantize_blockwise(b.get_tensor(k), b.get_tensor(k + "_scale_inv"),
                                                                    t.dtype), round_through_fp8(t))
                else:
                    assert torch.equal(b.get_tensor(k), t)
    assert seen > 0 and (dst / "tokenizer.json").exists() == (src / "tokenizer.json").exists()


def test_config_and_the_flags_fp8_implies():
    from megatron_rl.config.load import load_config, to_object
    from megatron_rl.rollout import placement
    from megatron_rl.trainer.preflight import validate

    cfg = to_object(load_config("tiny_cpu", ["rollout.quantization=fp9"]))
    with pytest.raises(ValueError, match="valid: none, fp8"):
        validate(cfg)
    cfg = to_object(load_config("tiny_cpu", ["rollout.quantization=fp8"]))
    validate(cfg)
    assert "--quantization" not in placement.implied_server_args(cfg, [], "cpu")  # CPU: rounded weights
    assert placement.implied_server_args(cfg, [], "cuda")[:2] == ["--quantization", "fp8"]
    assert "--quantization" not in placement.implied_server_args(cfg, ["--quantization", "fp8"], "cuda")


def test_a_gpu_recipes_own_servers_get_fp8_serving():
    """The one-GPU recipe starts its own server (rank 0, GPU 1): with FP8 rollouts on CUDA it is
    started with SGLang's FP8 serving; on CPU servers the pushes round instead and no flag is added."""
    from megatron_rl.config.load import load_config, to_object
    from megatron_rl.rollout.servers import server_extra_args

    recipe = "dppo_binary_tv_qwen3_1p7b_base_gsm8k"
    cuda = to_object(load_config(recipe, ["rollout.quantization=fp8", "rollout.device=cuda"]))
    assert server_extra_args(cuda)[:2] == ("--quantization", "fp8")
    cpu = to_object(load_config(recipe, ["rollout.quantization=fp8", "rollout.device=cpu"]))
    assert "--quantization" not in server_extra_args(cpu)


def test_disk_push_writes_the_served_tensors_as_sharded_safetensors(tmp_path):
    """The disk transport with FP8 rollouts writes the served stream itself: shards with their index,
    the source's config and tokenizer files, the old shards gone."""
    from safetensors import safe_open

    from megatron_rl.models.tiny import make_tiny_checkpoint
    from megatron_rl.weights.sync_disk import write_safetensors

    src = make_tiny_checkpoint(tmp_path / "src")
    out = tmp_path / "weights"
    out.mkdir()
    (out / "stale.safetensors").write_bytes(b"old")
    g = torch.Generator().manual_seed(4)
    named = [("model.layers.0.self_attn.q_proj.weight", torch.randn(64, 64, generator=g)),
             ("model.norm.weight", torch.randn(64, generator=g))]
    served = list(ServedWeights("fp8", "serve").apply(named))
    write_safetensors(iter(served), out, src, shard_bytes=4100)  # q (4096 B) + scale, then the norm
    index = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    assert set(index) == {n for n, _ in served} and len(set(index.values())) == 2
    assert not (out / "stale.safetensors").exists() and (out / "config.json").exists()
    for name, t in served:
        with safe_open(str(out / index[name]), "pt") as f:
            assert torch.equal(f.get_tensor(name).view(torch.uint8), t.view(torch.uint8)), name
