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
        print("OK")
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO,
                         timeout=300)
    assert out.returncode == 0 and "OK" in out.stdout, out.stdout[-2000:] + out.stderr[-4000:]
