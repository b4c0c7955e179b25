"""patches/sglang_cpu.py and patches/sglang_fixes.py: refuse unexpected versions; apply to the
installed sglang 0.5.23. (The score-head fix is shown at work in tests/e2e/test_served_reward_model.py.)"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from patches import sglang_cpu, sglang_fixes
from patches._guard import UnsupportedVersionError

REPO = Path(__file__).resolve().parents[2]


def test_refuses_unexpected_sglang():
    with pytest.raises(UnsupportedVersionError) as err:
        sglang_cpu.apply(version="0.5.99")
    msg = str(err.value)
    assert "sglang" in msg and "0.5.23" in msg and "0.5.99" in msg


def test_fixes_refuse_unexpected_sglang():
    with pytest.raises(UnsupportedVersionError, match="sglang_fixes.*0.5.23.*0.5.99"):
        sglang_fixes.apply(version="0.5.99")


def test_refuses_unexpected_torchvision():
    with pytest.raises(UnsupportedVersionError) as err:
        sglang_cpu.apply(torchvision_version="0.99.0")
    msg = str(err.value)
    assert "torchvision" in msg and "0.28.0" in msg and "0.99.0" in msg


@pytest.mark.slow
def test_torchvision_stays_out_of_site_packages():
    """The learner's interpreter must not see PyPI's CUDA torchvision (it breaks transformers)."""
    code = "import importlib.util; print(importlib.util.find_spec('torchvision'))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "None"
    assert (Path(sys.prefix) / "sglang-cpu-extras" / "torchvision").is_dir()


def run_parts(parts: dict[str, str], timeout: float) -> None:
    """Run each part's code, in order, in one fresh interpreter (importing SGLang there is most of
    the time: one interpreter for several checks), each part in a namespace of its own; a failure
    names the part it happened in."""
    script = textwrap.dedent("""
        import sys
        for name, src in PARTS:
            print("part:", name, flush=True)
            exec(compile(src, "<part " + name + ">", "exec"), {"__name__": "__part__"})
        print("OK")
    """).replace("PARTS", repr(list(parts.items())))
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=REPO, timeout=timeout)
    started = [line[len("part: "):] for line in out.stdout.splitlines() if line.startswith("part: ")]
    assert out.returncode == 0 and out.stdout.rstrip().endswith("OK"), \
        f"part {started[-1] if started else None!r} failed:\n" + out.stdout[-2000:] + out.stderr[-4000:]


@pytest.mark.slow
def test_applies_to_installed_sglang():
    """In a fresh interpreter: every piece applies and behaves as documented (part "patches"); then,
    in the same interpreter, tests/unit/test_compact_records.py's check of the patched detokenizer and
    SGLang's flat top-K (part "compact records")."""
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
        # seeded sampling allowed with the CPU attention backend; the CPU batch-invariant mode
        # (fixed-tile GEMMs) instead of upstream's CUDA kernels
        from sglang.srt.arg_groups.choices import DETERMINISTIC_ATTENTION_BACKEND_CHOICES
        assert "intel_amx" in DETERMINISTIC_ATTENTION_BACKEND_CHOICES
        from sglang.srt.model_executor.model_runner import ModelRunner
        assert ModelRunner.maybe_enable_batch_invariant_mode is sglang_cpu._maybe_enable_cpu_batch_invariant_mode
        # seeded sampling on CPU: the hash op exists, the sampler runs eagerly, AMX stays off
        from sglang.srt.layers import sampler
        assert not hasattr(sampler.multinomial_with_seed, "_torchdynamo_orig_callable")
        assert not hasattr(torch.ops.sgl_kernel, "convert_weight_packed")
        logp = torch.log_softmax(torch.randn(3, 11, dtype=torch.float64), -1)
        seed, pos = torch.tensor([5, 5, 6], dtype=torch.int64), torch.tensor([2, 2, 2])
        a = sampler.multinomial_with_seed(logp, seed, pos)
        assert torch.equal(a, sampler.multinomial_with_seed(logp, seed, pos))  # same seed, same draw
        # reward-model score heads built without a bias (as transformers'), applied once
        from patches import sglang_fixes
        from sglang.srt.models import qwen2_classification, qwen3_classification
        sglang_fixes.apply(); sglang_fixes.apply()
        for cls in (qwen2_classification.Qwen2ForSequenceClassification,
                    qwen3_classification.Qwen3ForSequenceClassification):
            assert cls.__init__._megatron_rl_fixed and cls.__init__.__closure__[0].cell_contents.__name__ == "__init__"
            assert not hasattr(cls.__init__.__closure__[0].cell_contents, "_megatron_rl_fixed")
        # the SIGTERM watchdog wraps SGLang's own, once
        from sglang.srt.managers.tokenizer_manager import TokenizerManager
        inner = TokenizerManager.sigterm_watchdog.__closure__[0].cell_contents
        assert TokenizerManager.sigterm_watchdog._megatron_rl_fixed and inner.__name__ == "sigterm_watchdog"
        assert not hasattr(inner, "_megatron_rl_fixed")
        """
    )
    # Imported here, not at the module's top: other tests import this module as `tests.unit.…` in a
    # fresh interpreter, where tests/unit is not on the path.
    from test_compact_records import INSTALLED_SGLANG_CHECK

    run_parts({"patches": code, "compact records": INSTALLED_SGLANG_CHECK}, timeout=300)


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


def _rows_invariant(linear, x, W) -> bool:
    """Whether each row's result is the same whatever the rows around it and their number."""
    import torch

    for row in (0, 5, 70):
        ref = linear(x[row:row + 1], W)
        for M in (2, 3, 7, 16, 17, 64, 65, 100, 300):
            for pos in (0, M // 2, M - 1):
                xx = x[:M].clone()
                xx[pos] = x[row]
                if not torch.equal(linear(xx, W)[pos:pos + 1], ref):
                    return False
    return True


def test_fixed_tile_matmul_is_batch_invariant_and_exact():
    """The CPU batch-invariant GEMM: equal to float64 math to fp32 rounding, and a row's result
    does not depend on its batch-mates — which plain torch.mm (MKL) does not guarantee."""
    import torch

    g = torch.Generator().manual_seed(0)
    W = torch.randn(96, 64, generator=g)
    x = torch.randn(300, 64, generator=g)
    bias = torch.randn(96, generator=g)
    tiled = lambda a, w: sglang_cpu._mm_fixed_tiles(a, w.t())
    plain = lambda a, w: torch.mm(a, w.t())
    assert _rows_invariant(tiled, x, W)
    assert not _rows_invariant(plain, x, W)  # why the patch exists (MKL, this build of torch)
    for M in (1, 63, 64, 65, 300):
        ref = x[:M].double() @ W.t().double()
        torch.testing.assert_close(tiled(x[:M], W).double(), ref, rtol=0, atol=1e-4)
        out = sglang_cpu._addmm_fixed_tiles(bias, x[:M], W.t(), beta=0.5, alpha=2.0)
        torch.testing.assert_close(out.double(), 0.5 * bias.double() + 2 * ref, rtol=0, atol=2e-4)


def test_deterministic_cpu_server_prefills_each_prompt_whole():
    """Deterministic inference on CPU turns chunked prefill off (an explicit chunk size is refused),
    because CPU attention rounds a prefix's rows by the length of the call that computes them: the
    first part of a split prompt would be rounded otherwise than the same prompt unsplit."""
    argv = ["--model-path", "m", "--device", "cpu"]
    det = argv + ["--enable-deterministic-inference"]
    assert sglang_cpu.deterministic_server_argv(argv) == argv
    budget = str(sglang_cpu.deterministic_prefill_tokens())
    assert sglang_cpu.deterministic_prefill_tokens(8 * 2**30) == 2048  # SGLang's own chunk there
    assert sglang_cpu.deterministic_prefill_tokens(24 * 2**30) == 4096
    off = ["--chunked-prefill-size", "-1", "--max-prefill-tokens", budget]
    assert sglang_cpu.deterministic_server_argv(det) == det + off
    assert sglang_cpu.deterministic_server_argv(argv + ["--rl-on-policy-target", "fsdp"])[-4:] == off
    for given in (["--chunked-prefill-size", "-1"], ["--chunked-prefill-size=-1"]):
        assert sglang_cpu.deterministic_server_argv(det + given) == det + given + off[2:]
    mine = det + ["--max-prefill-tokens=1024"]
    assert sglang_cpu.deterministic_server_argv(mine) == mine + off[:2]
    for on in (["--chunked-prefill-size", "4096"], ["--chunked-prefill-size=8"], ["--chunked-prefill-size"]):
        with pytest.raises(ValueError, match="leave --chunked-prefill-size out"):
            sglang_cpu.deterministic_server_argv(det + on)



def test_cpu_attention_rounds_a_split_prompt_otherwise():
    """Why chunked prefill is off: the same causal attention of a prompt's first p rows, computed in
    a call of p rows (the first chunk) and within the call of the whole prompt, is not bit-identical
    on CPU (equal to fp32 noise)."""
    import torch
    import torch.nn.functional as F

    g = torch.Generator().manual_seed(0)
    split_differs = 0
    for n in (27, 40, 70):
        q, k, v = (torch.randn(1, 4, n, 16, generator=g) for _ in range(3))
        whole = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        for p in range(1, n, 3):
            part = F.scaled_dot_product_attention(q[:, :, :p], k[:, :, :p], v[:, :, :p], is_causal=True)
            torch.testing.assert_close(part, whole[:, :, :p], rtol=0, atol=1e-5)
            split_differs += not torch.equal(part, whole[:, :, :p])
    if not split_differs:  # a property of this CPU's kernels, not of the patch
        pytest.skip("this CPU's attention rounds a split prompt as the whole one: nothing to show")


@pytest.mark.slow
def test_batch_invariant_mode_routes_linear_and_matmul():
    """Once enabled (what the scheduler does under --enable-deterministic-inference on CPU),
    F.linear with and without bias and 3-D matmul go through the fixed tiles."""
    code = textwrap.dedent("""
        import torch, torch.nn.functional as F
        from patches import sglang_cpu
        from tests.unit.test_sglang_patches import _rows_invariant
        g = torch.Generator().manual_seed(0)
        W, x, b = torch.randn(96, 64, generator=g), torch.randn(300, 64, generator=g), torch.randn(96, generator=g)
        assert not _rows_invariant(F.linear, x, W)
        sglang_cpu.enable_cpu_batch_invariant_mode()
        assert _rows_invariant(F.linear, x, W)
        assert _rows_invariant(lambda a, w: F.linear(a, w, b), x, W)
        assert _rows_invariant(lambda a, w: torch.matmul(a[None], w.t())[0], x, W)
        torch.testing.assert_close(F.linear(x, W, b).double(), x.double() @ W.t().double() + b.double(), rtol=0, atol=1e-4)
        print("ok")
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=Path(__file__).resolve().parents[2], timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]


def test_sigterm_watchdog_starts_the_drain_at_once_and_keeps_sglangs_own():
    import asyncio
    import time

    calls = []

    async def upstream(self):  # stands for SGLang's drain + shutdown; it runs once the flag is seen
        calls.append((self.gracefully_exit, time.monotonic()))

    class Manager:
        gracefully_exit = False
        sigterm_watchdog = sglang_fixes._prompt_sigterm_watchdog(upstream)

    async def main(manager):
        task = asyncio.create_task(manager.sigterm_watchdog())
        await asyncio.sleep(0.3)
        assert not calls  # no flag, no shutdown
        manager.gracefully_exit = True
        flagged = time.monotonic()
        await asyncio.wait_for(task, timeout=2)
        return flagged

    flagged = asyncio.run(main(Manager()))
    assert len(calls) == 1 and calls[0][0] is True
    assert calls[0][1] - flagged < 5 * sglang_fixes.SIGTERM_POLL_S + 0.2  # upstream looked every 5 s
    assert Manager.sigterm_watchdog._megatron_rl_fixed
