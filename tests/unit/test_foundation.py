"""Patches (version guards, that they still apply), config errors, launch environment, tiny models."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from megatron_rl.config.load import ConfigError, available_recipes, load_config, to_object
from megatron_rl.config.schema import ParallelConfig
from megatron_rl.distributed.context import layout_sizes, read_launch_env
from patches import mbridge_fixes, megatron_cpu
from patches._guard import UnsupportedVersionError

REPO = Path(__file__).resolve().parents[2]


# ---------------------------------------------------------------------------------------------
# patches
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "patch,dist,supported",
    [(megatron_cpu, "megatron-core", "0.16.1"), (mbridge_fixes, "mbridge", "0.15.1")],
)
def test_patch_refuses_unexpected_version(patch, dist, supported):
    with pytest.raises(UnsupportedVersionError) as err:
        patch.apply(version="99.0.0")
    msg = str(err.value)
    assert dist in msg and supported in msg and "99.0.0" in msg


def test_pins_agree_with_pyproject_and_lock():
    """pyproject.toml pins exactly the releases the guards accept, and so does the CPU lock file:
    pip can install no release that a patch would then refuse at start-up."""
    import tomllib

    from packaging.requirements import Requirement

    from patches._guard import PINS

    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    reqs = [Requirement(r) for r in project["dependencies"]]
    reqs += [Requirement(r) for extra in project["optional-dependencies"].values() for r in extra]
    declared = {r.name: str(r.specifier) for r in reqs if r.name in PINS}
    assert declared == {name: f"=={v}" for name, v in PINS.items()}
    lock = {}
    for f in ("cpu-lock.txt", "sglang-nodeps.txt"):
        for line in (REPO / "requirements" / f).read_text().splitlines():
            if "==" in line and not line.startswith("#"):
                name, v = line.split("#")[0].strip().split("==")
                lock[name] = v
    assert {name: lock[name] for name in PINS} == PINS


def test_layer_spec_is_chosen_never_guessed(monkeypatch):
    """model.spec: auto is local on CPU, te on CUDA with Transformer Engine, torch on CUDA without;
    te without CUDA/Transformer Engine is an error naming the way out, never a quiet switch. The
    choice is printed with its reason; a TE that is installed but does not import is, with auto, a
    warning quoting the import error and, with te, an error quoting it."""
    from megatron_rl.models import bridge
    from megatron_rl.models.bridge import choose_spec, resolve_spec

    assert resolve_spec("auto") == "local"
    assert choose_spec("auto").line() == "layer spec: model.spec=auto -> local: no CUDA device on this machine"
    assert resolve_spec("local") == "local"
    assert choose_spec("torch").line() == "layer spec: model.spec=torch -> torch: asked for"
    with pytest.raises(ValueError, match="model.spec=local"):
        resolve_spec("te")
    with pytest.raises(ValueError, match="valid: auto, te, torch, local"):
        resolve_spec("tee")
    # A CUDA machine: TE absent, TE importable, TE installed but broken.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    imported = []
    monkeypatch.setattr(bridge, "_te_import_error", lambda: imported.append(1))  # never called without TE
    monkeypatch.setattr(bridge, "_te_installed", lambda: None)
    assert choose_spec("auto").line() == "layer spec: model.spec=auto -> torch: transformer_engine is not installed"
    assert choose_spec("auto").warning is None and not imported
    with pytest.raises(ValueError, match="transformer_engine is not installed; install it .* model.spec=torch"):
        resolve_spec("te")
    monkeypatch.setattr(bridge, "_te_installed", lambda: "2.11.0")
    monkeypatch.setattr(bridge, "_te_import_error", lambda: None)
    assert choose_spec("auto").line() == "layer spec: model.spec=auto -> te: transformer_engine 2.11.0"
    assert resolve_spec("te") == "te"
    broken = OSError("libcudnn_graph.so.9: cannot open shared object file")
    monkeypatch.setattr(bridge, "_te_import_error", lambda: broken)
    choice = choose_spec("auto")
    assert choice.spec == "torch" and choice.line().splitlines() == [
        "layer spec: model.spec=auto -> torch: transformer_engine 2.11.0 does not import",
        "warning: transformer_engine 2.11.0 is installed but `import transformer_engine.pytorch` fails "
        "(OSError: libcudnn_graph.so.9: cannot open shared object file); running the torch spec. Fix the "
        "install, or set model.spec=torch to choose it."]
    with pytest.raises(ValueError, match=r"transformer_engine 2.11.0 is installed but does not import \(OSError: "
                                         r"libcudnn_graph.so.9: cannot open shared object file\)"):
        resolve_spec("te")


@pytest.mark.slow
def test_patches_apply_to_installed_versions():
    """In a fresh interpreter: every patch applies and its targets behave as patched."""
    code = textwrap.dedent(
        """
        import torch
        import patches
        patches.apply_all()
        # megatron_cpu: CUDA literals become CPU, including inside autograd backward.
        assert torch.ones(2, device="cuda").device.type == "cpu"
        assert torch.zeros(1).cuda().device.type == "cpu"
        assert torch.zeros(1).to("cuda").device.type == "cpu"
        assert torch.zeros(1).type() == "torch.cuda.FloatTensor"
        # `with torch.device(...)` still places the wrapped factories (transformers builds its
        # models under the meta device; its rotary buffers were uninitialised memory otherwise).
        with torch.device("meta"):
            assert torch.tensor([1.0]).is_meta and torch.arange(3).is_meta and torch.empty(2).is_meta
        class F(torch.autograd.Function):
            @staticmethod
            def forward(ctx, x): return x * 2
            @staticmethod
            def backward(ctx, g): return g * torch.ones(1, device="cuda")
        x = torch.ones(3, requires_grad=True); F.apply(x).sum().backward()
        assert torch.equal(x.grad, torch.ones(3))
        from megatron.core.transformer.moe import moe_utils
        assert moe_utils.te_general_gemm is None
        # the "CUDA" RNG is the CPU generator: seeding it makes CPU draws reproducible
        torch.cuda.manual_seed(7); a = torch.rand(3)
        torch.cuda.manual_seed(7); b = torch.rand(3)
        assert torch.equal(a, b)
        # mbridge: routing follows norm_topk_prob; local-spec names translate to TE names
        from mbridge.models.qwen3moe import Qwen3MoEBridge
        from mbridge.core.bridge import Bridge
        assert Bridge.load_weights.__module__ == "patches.mbridge_fixes"
        assert Qwen3MoEBridge._build_config.__name__ == "qwen3moe_build_config"
        print("ok")
        """
    )
    out = subprocess.run([sys.executable, "-W", "ignore", "-c", code], cwd=REPO,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-3000:]


@pytest.mark.parametrize(
    "local,kept,expected",
    [
        ("decoder.layers.3.input_layernorm.weight", False,
         "decoder.layers.3.self_attention.linear_qkv.layer_norm_weight"),
        ("decoder.layers.0.pre_mlp_layernorm.weight", False,
         "decoder.layers.0.mlp.linear_fc1.layer_norm_weight"),
        ("decoder.layers.0.pre_mlp_layernorm.weight", True, "decoder.layers.0.pre_mlp_layernorm.weight"),
        ("decoder.layers.1.mlp.experts.local_experts.12.linear_fc2.weight", True,
         "decoder.layers.1.mlp.experts.linear_fc2.weight12"),
        ("decoder.layers.1.mlp.router.weight", True, "decoder.layers.1.mlp.router.weight"),
    ],
)
def test_local_spec_names_translate_to_te_names(local, kept, expected):
    assert mbridge_fixes.te_style_name(local, kept) == expected


# ---------------------------------------------------------------------------------------------
# config
# ---------------------------------------------------------------------------------------------
def test_unknown_override_key_lists_valid_keys():
    with pytest.raises(ConfigError) as err:
        load_config("tiny_lm_cpu", ["parallel.tpp=2"])
    msg = str(err.value)
    assert "parallel.tpp" in msg and "did you mean 'tp'" in msg
    for key in ("tp", "pp", "vpp", "ep", "etp", "sequence_parallel"):
        assert key in msg


def test_unknown_nested_key_and_bad_value():
    with pytest.raises(ConfigError, match=r"model\.tiny\.hiden.*valid keys of model\.tiny:.*hidden"):
        load_config("tiny_lm_cpu", ["model.tiny.hiden=3"])
    with pytest.raises(ConfigError, match=r"bad value for config key 'parallel\.tp'"):
        load_config("tiny_lm_cpu", ["parallel.tp=two"])


def test_unknown_recipe_and_group_option():
    with pytest.raises(ConfigError, match="unknown recipe 'nope'; available recipes: .*tiny_lm_cpu"):
        load_config("nope")
    with pytest.raises(ConfigError, match="tiny_qwen3_moe"):
        load_config("tiny_lm_cpu", ["model=nope"])


def test_typo_inside_a_yaml_file_is_reported(tmp_path, monkeypatch):
    from megatron_rl.config import load as load_mod

    recipes = tmp_path / "recipes"
    recipes.mkdir()
    (recipes / "bad.yaml").write_text("defaults:\n  - job_schema\n  - _self_\noptim:\n  lrr: 1.0\n")
    monkeypatch.setattr(load_mod, "RECIPES_DIR", recipes)
    with pytest.raises(ConfigError, match=r"optim\.lrr.*did you mean 'lr'"):
        load_config("bad")


@pytest.mark.parametrize("recipe", available_recipes())
def test_every_recipe_composes(recipe):
    job = to_object(load_config(recipe))
    assert job.name


def test_overrides_apply_and_groups_select():
    job = to_object(load_config("tiny_lm_cpu", ["parallel=tp2", "model=tiny_qwen3_moe", "optim.lr=0.5"]))
    assert job.parallel.tp == 2 and job.model.tiny.moe and job.optim.lr == 0.5


def test_dry_run_cli_prints_layout(capsys):
    from megatron_rl.cli import main

    assert main(["dry-run", "tiny_lm_cpu", "parallel.tp=2", "--world-size", "4"]) == 0
    out = capsys.readouterr().out
    assert "tp=2 pp=1 vpp=None ep=1 etp=1 dp=2 sequence_parallel=True" in out
    assert "layer spec: model.spec=auto -> local: no CUDA device on this machine" in out
    assert main(["dry-run", "tiny_lm_cpu", "parallel.tq=2"]) == 2
    assert "valid keys of parallel" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------
# launch environment and layouts
# ---------------------------------------------------------------------------------------------
def test_launch_env_torchrun():
    env = read_launch_env({"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "1",
                           "MASTER_ADDR": "n0", "MASTER_PORT": "1234"})
    assert (env.rank, env.world_size, env.local_rank, env.master_addr, env.master_port) == (3, 8, 1, "n0", 1234)


@pytest.mark.slow
def test_launch_env_slurm(monkeypatch):
    # No scontrol on the PATH: the node list is parsed directly.
    monkeypatch.setenv("PATH", "/nonexistent")
    job = {"SLURM_PROCID": "0", "SLURM_NTASKS": "16", "SLURM_LOCALID": "0",
           "SLURM_JOB_NODELIST": "gpu[017-018,020]", "SLURM_JOB_ID": "4242"}
    # the batch script (an `export` or `eval` run there): no step, so no peers to wait for
    assert (read_launch_env(job).rank, read_launch_env(job).world_size) == (0, 1)
    env = read_launch_env(job | {"SLURM_STEP_ID": "0", "SLURM_PROCID": "5", "SLURM_LOCALID": "5"})
    assert (env.rank, env.world_size, env.local_rank, env.master_addr) == (5, 16, 5, "gpu017")
    assert env.master_port == 20000 + 4 * 4242
    # a requeued attempt rendezvous on a port of its own (its predecessor's may still be held)
    assert read_launch_env(job | {"SLURM_STEP_ID": "0", "SLURM_RESTART_COUNT": "1"}).master_port == 20000 + 4 * 4242 + 1


def test_local_device():
    from megatron_rl.distributed.context import local_device

    assert local_device(5, 8) == 5  # the node's GPUs all visible to each task
    assert local_device(5, 1) == 0  # one GPU bound per task: its own is device 0
    with pytest.raises(RuntimeError, match="local rank 5 but only 2 CUDA devices"):
        local_device(5, 2)


def test_launch_env_single_process():
    env = read_launch_env({})
    assert (env.rank, env.world_size) == (0, 1)


def test_layout_sizes_validate():
    assert layout_sizes(ParallelConfig(tp=2, pp=2), 8)["dp"] == 2
    assert layout_sizes(ParallelConfig(tp=2), 2)["sequence_parallel"] is True
    assert layout_sizes(ParallelConfig(tp=2, sequence_parallel=False), 2)["sequence_parallel"] is False
    with pytest.raises(ValueError, match="not divisible by tp\\*pp"):
        layout_sizes(ParallelConfig(tp=3), 4)
    with pytest.raises(ValueError, match="vpp needs"):
        layout_sizes(ParallelConfig(vpp=2), 2)
    with pytest.raises(ValueError, match="etp\\*ep\\*pp"):
        layout_sizes(ParallelConfig(ep=3), 4)


# ---------------------------------------------------------------------------------------------
# tiny models
# ---------------------------------------------------------------------------------------------
def test_tiny_checkpoint_loads_in_transformers(tmp_path):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from megatron_rl.models.tiny import make_tiny_checkpoint

    path = make_tiny_checkpoint(tmp_path / "m", moe=True, num_layers=1)
    tok = AutoTokenizer.from_pretrained(path)
    text = "12+7=19"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert len(ids) == len(text) and tok.decode(ids) == text
    chat = tok.apply_chat_template([{"role": "user", "content": "1+1="}], add_generation_prompt=True,
                                   tokenize=False)
    assert chat == "<|im_start|>user\n1+1=<|im_end|>\n<|im_start|>assistant\n"
    model = AutoModelForCausalLM.from_pretrained(path)
    assert model.config.num_experts == 4
    logits = model(torch.tensor([ids])).logits
    assert logits.shape == (1, len(ids), 256) and torch.isfinite(logits).all()
    # No all-zero embedding row (HF zeroes the pad token's): a sampled pad token would otherwise
    # meet RMSNorm at |x| = 0, whose gradient is 1/sqrt(eps) times larger.
    embed = model.get_input_embeddings().weight
    assert embed.norm(dim=1).min() > 0.1 * embed.norm(dim=1).mean(), embed.norm(dim=1)[:4]
    # Reuse: same arguments -> nothing rewritten.
    mtime = (path / "model.safetensors").stat().st_mtime_ns
    make_tiny_checkpoint(tmp_path / "m", moe=True, num_layers=1)
    assert (path / "model.safetensors").stat().st_mtime_ns == mtime


def test_dry_run_refuses_a_driver_older_than_torchs_cuda(tmp_path, monkeypatch, capsys):
    """A GPU recipe on a node whose driver (R535) is older than torch's CUDA 13 needs: the dry-run
    names both versions and the way out, instead of 'no GPU visible' blaming the Python. With CUDA
    working anyway (the forward-compatibility package), or R580, it passes."""
    from megatron_rl.cli import main
    from megatron_rl.distributed import context

    old = tmp_path / "version"
    old.write_text("NVRM version: NVIDIA UNIX x86_64 Kernel Module  535.129.03  Thu Oct 19 18:56:32 UTC 2023\n"
                   "GCC version:  gcc version 12.2.0 (Debian 12.2.0-14)\n")
    assert context.driver_version(str(old)) == (535, 129, 3)
    monkeypatch.setattr(context, "DRIVER_FILE", str(old))
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.delenv("MRL_ALLOW_CPU", raising=False)
    argv = ["dry-run", "tiny_cpu", "hardware=8xH100", f"trainer.out_dir={tmp_path / 'run'}"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert ("the NVIDIA driver on this node is 535.129.03; torch " + torch.__version__ + " is a CUDA 13.0 build, "
            "which needs driver 580.65.06 or newer (R580)") in err, err
    assert "cuda-compat-13-0" in err and "The driver" in err, err
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # the compat libraries make CUDA work
    context.check_driver(to_object(load_config("tiny_cpu", ["hardware=8xH100"])))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    new = tmp_path / "version580"
    new.write_text("NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  580.95.05  Release Build\n")
    assert context.driver_version(str(new)) == (580, 95, 5)
    context.check_driver(to_object(load_config("tiny_cpu", ["hardware=8xH100"])), path=str(new))
    context.check_driver(to_object(load_config("tiny_cpu")), path=str(old))  # a CPU recipe: no driver needed
