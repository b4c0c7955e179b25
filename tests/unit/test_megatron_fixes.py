"""patches/megatron_fixes.py in a fresh interpreter: MoE routing without Transformer Engine with only
these fixes applied (not the CPU layer), as a GPU without TE runs it; then, with every patch this
machine needs, a synchronous checkpoint that spawns no Manager process and reads back equal."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from patches import megatron_fixes
from patches._guard import UnsupportedVersionError

REPO = Path(__file__).resolve().parents[2]


def test_refuses_unexpected_megatron_core():
    with pytest.raises(UnsupportedVersionError, match="megatron_fixes.*0.16.1.*0.99"):
        megatron_fixes.apply(version="0.99")


@pytest.mark.slow
def test_moe_router_without_te_and_a_checkpoint_without_a_manager(tmp_path):
    code = textwrap.dedent(f"""
        import os, time, torch, torch.distributed as dist
        from megatron.core.transformer.moe import moe_utils
        assert not hasattr(moe_utils, "te_general_gemm")  # TE is absent: upstream leaves it undefined
        w, x = torch.randn(8, 16, dtype=torch.float64), torch.randn(5, 16, dtype=torch.float64)
        try:
            moe_utils.router_gating_linear(x.float(), w.float(), None, torch.float32)
            raise SystemExit("expected upstream's NameError")
        except NameError as e:
            assert "te_general_gemm" in str(e)
        from patches import megatron_fixes
        megatron_fixes.apply(); megatron_fixes.apply()  # idempotent
        x32 = x.float().requires_grad_()
        out = moe_utils.router_gating_linear(x32, w.float(), None, torch.float32)
        assert torch.allclose(out.double(), x @ w.T, atol=1e-5), (out, x @ w.T)
        out.sum().backward()
        assert torch.allclose(x32.grad.double(), w.sum(0).expand(5, 16), atol=1e-5)

        import patches
        patches.apply_all()  # on this CPU the checkpoint path also needs the CPU layer (torch.cuda.*)
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="{_port()}")
        dist.init_process_group("gloo", rank=0, world_size=1)
        from megatron.core import dist_checkpointing, parallel_state as mpu
        from megatron.core.dist_checkpointing import ShardedTensor
        from megatron.core.dist_checkpointing.strategies import filesystem_async
        import multiprocessing
        mpu.initialize_model_parallel()
        t = torch.randn(64, 64)
        start = time.monotonic()
        dist_checkpointing.save({{"w": ShardedTensor.from_rank_offsets("w", t)}}, r"{tmp_path}")
        first = time.monotonic() - start
        assert filesystem_async._results_queue is None  # upstream's Manager queue was never made
        assert not [p for p in multiprocessing.active_children() if "Manager" in type(p).__name__ or "SyncManager" in p.name]
        loaded = dist_checkpointing.load({{"w": ShardedTensor.from_rank_offsets("w", torch.empty(64, 64))}}, r"{tmp_path}")
        assert torch.equal(loaded["w"], t)
        print("OK first save", round(first, 2))
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=300)
    assert out.returncode == 0 and "OK" in out.stdout, out.stdout[-2000:] + out.stderr[-4000:]
    print(out.stdout.strip())


def _port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _no_host_wait(monkeypatch):
    """Any device-to-host read inside the block fails the test (on a GPU each is a wait)."""
    import torch

    def refuse(*a, **k):
        raise AssertionError("host read of a tensor value")

    for name in ("item", "tolist", "__float__", "__bool__", "cpu", "numpy"):
        monkeypatch.setattr(torch.Tensor, name, refuse)


def test_foreach_multi_tensor_ops_equal_float64_without_host_reads(monkeypatch):
    """megatron-core's optimizer gets the foreach norm and scale, which equal float64 math and read
    nothing back to the host (upstream's fallback reads every per-tensor norm)."""
    import torch
    from megatron.core import utils
    from megatron.core.optimizer import clip_grads, optimizer

    megatron_fixes.apply()
    assert clip_grads.l2_norm_impl is megatron_fixes.foreach_l2_norm
    assert clip_grads.multi_tensor_scale_impl is optimizer.multi_tensor_scale_impl is megatron_fixes.foreach_scale
    g = torch.Generator().manual_seed(0)
    grads = [torch.randn(s, generator=g) for s in ((7,), (3, 5), (64, 33), (1,))]
    ref = torch.cat([t.double().flatten() for t in grads]).norm()
    flag = torch.zeros(1, dtype=torch.int)
    with monkeypatch.context() as m:
        _no_host_wait(m)
        norm, per = megatron_fixes.foreach_l2_norm(2048, flag, [grads[:2], grads[2:]], True)
        # the clip: in place on the same tensors, by a factor < 1
        clipped = [t.clone() for t in grads]
        megatron_fixes.foreach_scale(2048, flag, [clipped, clipped], 0.25)
        # the master-weight copy: fp32 -> bf16, scale 1
        model = [torch.empty_like(t, dtype=torch.bfloat16) for t in grads]
        megatron_fixes.foreach_scale(2048, flag, [grads, model], 1.0)
        scaled = [torch.empty_like(t) for t in grads]
        megatron_fixes.foreach_scale(2048, flag, [grads, scaled], 3.0)
        empty, _ = megatron_fixes.foreach_l2_norm(2048, flag, [[]], False)
    assert norm.shape == (1,) and norm.dtype == torch.float32
    assert abs(norm.double().item() - ref.item()) < 1e-5 * ref.item()
    assert torch.allclose(per.double(), torch.stack([t.double().norm() for t in grads]), rtol=1e-6)
    for t, c, b, s in zip(grads, clipped, model, scaled):
        assert torch.equal(c, t * 0.25) and torch.equal(b, t.to(torch.bfloat16)) and torch.equal(s, t * 3.0)
    assert empty.item() == 0.0
    megatron_fixes.restore_local_multi_tensor_ops()
    assert clip_grads.l2_norm_impl is utils.local_multi_tensor_l2_norm
    assert optimizer.multi_tensor_scale_impl is utils.local_multi_tensor_scale
    megatron_fixes.use_foreach_multi_tensor_ops()
    assert optimizer.multi_tensor_scale_impl is megatron_fixes.foreach_scale


def test_linear_backward_gets_one_contiguous_output_gradient(monkeypatch):
    """A transposed (non-contiguous) output gradient reaches megatron-core's linear backward
    contiguous, once; the input and weight gradients equal float64 math."""
    import torch
    from megatron.core.tensor_parallel import layers

    megatron_fixes.apply()
    fn = layers.LinearWithGradAccumulationAndAsyncCommunication
    assert getattr(fn.backward, "_megatron_rl_fixed", False)
    seen = []
    real_contiguous = torch.Tensor.contiguous

    def spy(self, *a, **k):
        seen.append(self.is_contiguous())
        return real_contiguous(self, *a, **k)

    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 3, 4, generator=g, requires_grad=True)  # [s, b, in]
    w = torch.randn(6, 4, generator=g, requires_grad=True)
    y = fn.apply(x, w, None, False, False, False, None, 0, None)  # [s, b, out]
    up = torch.randn(3, 5, 6, generator=g)  # the loss reads [b, s, out]: its gradient comes back transposed
    with monkeypatch.context() as m:
        m.setattr(torch.Tensor, "contiguous", spy)
        (y.transpose(0, 1) * up).sum().backward()
    assert seen and not seen[0] and all(seen[1:]), seen  # the first call copies, every later one is a no-op
    ref_up = up.transpose(0, 1).double()
    torch.testing.assert_close(x.grad.double(), ref_up @ w.double(), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(w.grad.double(), torch.einsum("sbo,sbi->oi", ref_up, x.double()), rtol=1e-6, atol=1e-6)
