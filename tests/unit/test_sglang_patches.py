"""patches/sglang_cpu.py: refuses unexpected versions; applies to the installed sglang 0.5.23."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from patches import sglang_cpu
from patches._guard import UnsupportedVersionError

REPO = Path(__file__).resolve().parents[2]


def test_refuses_unexpected_sglang():
    with pytest.raises(UnsupportedVersionError) as err:
        sglang_cpu.apply(version="0.5.99")
    msg = str(err.value)
    assert "sglang" in msg and "0.5.23" in msg and "0.5.99" in msg


def test_refuses_unexpected_torchvision():
    with pytest.raises(UnsupportedVersionError) as err:
        sglang_cpu.apply(torchvision_version="0.99.0")
    msg = str(err.value)
    assert "torchvision" in msg and "0.28.0" in msg and "0.99.0" in msg


def test_torchvision_stays_out_of_site_packages():
    """The learner's interpreter must not see PyPI's CUDA torchvision (it breaks transformers)."""
    code = "import importlib.util; print(importlib.util.find_spec('torchvision'))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "None"
    assert (Path(sys.prefix) / "sglang-cpu-extras" / "torchvision").is_dir()


def test_applies_to_installed_sglang():
    """In a fresh interpreter: every piece applies and behaves as documented."""
    code = textwrap.dedent(
        """
        import os, torch
        from patches import sglang_cpu
        sglang_cpu.apply()
        assert os.environ["SGLANG_USE_CPU_ENGINE"] == "1"
        # torchvision imported under the guard, its CUDA-only ops absent
        import torchvision
        assert not sglang_cpu._op_exists("torchvision::nms")
        # SGLang's server and model modules import (they import sgl_kernel names and triton)
        import sglang.srt.entrypoints.http_server, sglang.srt.models.qwen3_moe
        import sgl_kernel
        assert sgl_kernel.IS_SHIM and len(sgl_kernel.OPS) == 8
        try:
            sgl_kernel.copy_all_layer_kv_cache_cpu(1, 2)
        except sgl_kernel.SglKernelUnavailable as e:
            assert "sgl_kernel.copy_all_layer_kv_cache_cpu" in str(e)
        else:
            raise AssertionError("shim op did not raise")
        try:
            from sgl_kernel.scalar_type import ScalarType  # SGLang's fallback path must stay
        except ImportError:
            pass
        else:
            raise AssertionError("shim resolved a submodule")
        # no AMX backend: the native torch path is chosen
        from sglang.srt.utils.common import cpu_has_amx_support
        assert not cpu_has_amx_support()
        # routed-experts host buffer: plain CPU memory, no cudaHostRegister
        from sglang.srt.state_capturer.base import BaseHostCache
        cache = BaseHostCache(16, 2, 2, name="t", device="cpu")
        assert cache.buffer.device.type == "cpu" and not cache.buffer.is_pinned()
        assert cache.buffer.shape == (16, 2, 2) and int(cache.buffer.abs().sum()) == 0
        cache.destroy()
        # seeded sampling allowed with the CPU attention backend; no CUDA batch-invariant kernels
        from sglang.srt.arg_groups.choices import DETERMINISTIC_ATTENTION_BACKEND_CHOICES
        assert "intel_amx" in DETERMINISTIC_ATTENTION_BACKEND_CHOICES
        from sglang.srt.model_executor.model_runner import ModelRunner
        assert ModelRunner.maybe_enable_batch_invariant_mode(None) is None
        # seeded sampling on CPU: the hash op exists, the sampler runs eagerly, AMX stays off
        from sglang.srt.layers import sampler
        assert not hasattr(sampler.multinomial_with_seed, "_torchdynamo_orig_callable")
        assert not hasattr(torch.ops.sgl_kernel, "convert_weight_packed")
        logp = torch.log_softmax(torch.randn(3, 11, dtype=torch.float64), -1)
        seed, pos = torch.tensor([5, 5, 6], dtype=torch.int64), torch.tensor([2, 2, 2])
        a = sampler.multinomial_with_seed(logp, seed, pos)
        assert torch.equal(a, sampler.multinomial_with_seed(logp, seed, pos))  # same seed, same draw
        print("OK")
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO,
                         timeout=300)
    assert out.returncode == 0 and "OK" in out.stdout, out.stdout[-2000:] + out.stderr[-4000:]


def _murmur3_x86_32(key: bytes, seed: int = 0) -> int:
    """Textbook MurmurHash3_x86_32 over whole 4-byte blocks, in Python integers."""
    c1, c2, m = 0xCC9E2D51, 0x1B873593, 0xFFFFFFFF

    def rotl(x, r):
        return ((x << r) | (x >> (32 - r))) & m

    h = seed
    for i in range(0, len(key), 4):
        k = int.from_bytes(key[i:i + 4], "little")
        k = rotl((k * c1) & m, 15) * c2 & m
        h = (rotl(h ^ k, 13) * 5 + 0xE6546B64) & m
    h ^= len(key)
    h ^= h >> 16
    h = (h * 0x85EBCA6B) & m
    h ^= h >> 13
    h = (h * 0xC2B2AE35) & m
    return h ^ (h >> 16)


def test_seeded_sampling_hash_is_murmur3():
    """The CPU `murmur_hash32_cpu` op (seeded sampling) equals MurmurHash3 of the 16-byte key
    (seed lo, seed hi, position, column) — what SGLang's Triton kernel hashes."""
    import torch

    seeds = torch.tensor([0, 1, 2 ** 31 - 1, 2 ** 40 + 12345, 987654321987], dtype=torch.int64)
    positions = torch.tensor([0, 7, 2 ** 31 - 1, 3, 100000], dtype=torch.int64)
    cols = torch.arange(0, 300, 7, dtype=torch.int64)
    out = sglang_cpu.murmur_hash32_cpu(seeds.to(torch.uint64), positions, cols)
    assert out.dtype == torch.uint32 and out.shape == (5, cols.numel())
    for i, (s, p) in enumerate(zip(seeds.tolist(), positions.tolist())):
        for j, c in enumerate(cols.tolist()):
            key = (s & 0xFFFFFFFF).to_bytes(4, "little") + (s >> 32).to_bytes(4, "little") \
                + p.to_bytes(4, "little") + c.to_bytes(4, "little")
            assert int(out[i, j].to(torch.int64)) == _murmur3_x86_32(key), (s, p, c)
