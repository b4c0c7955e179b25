"""Hub model ids for model.hf_path, resolved offline through a hub cache laid out as huggingface_hub
lays it out (models--org--name/refs/main -> snapshots/<commit>/...), with HF_HUB_OFFLINE=1: the
way a compute node without internet reads a model fetched once on a login node."""

from __future__ import annotations

import pytest

from megatron_rl import cli
from megatron_rl.config.load import load_config, to_object
from megatron_rl.models.hub import is_hub_id, resolve, resolve_model_paths
from megatron_rl.models.tiny import make_tiny_checkpoint

COMMIT = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture(scope="module")
def hub_cache(tmp_path_factory):
    cache = tmp_path_factory.mktemp("hub")
    repo = cache / "models--TinyOrg--Tiny-Qwen3"
    make_tiny_checkpoint(repo / "snapshots" / COMMIT, vocab_size=128)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    return cache


@pytest.fixture
def offline(hub_cache, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(hub_cache))
    return hub_cache


def test_hub_ids_resolve_to_the_cached_snapshot(offline, tmp_path):
    snapshot = offline / "models--TinyOrg--Tiny-Qwen3" / "snapshots" / COMMIT
    assert resolve("TinyOrg/Tiny-Qwen3") == str(snapshot)
    assert resolve(f"TinyOrg/Tiny-Qwen3@{COMMIT}") == str(snapshot)
    assert resolve(str(snapshot)) == str(snapshot)  # a folder is used as it is
    with pytest.raises(FileNotFoundError, match=r"model.hf_path=TinyOrg/Missing: .*hub cache only \(HF_HUB_OFFLINE=1\)"
                                                r".*hf download TinyOrg/Missing"):
        resolve("TinyOrg/Missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="no Hugging Face checkpoint there"):
        resolve(str(tmp_path / "empty"))  # an existing folder is never taken for a hub id
    assert is_hub_id("Qwen/Qwen3-0.6B") and is_hub_id("Qwen/Qwen3-0.6B@main")
    assert not is_hub_id("/abs/path") and not is_hub_id("a/b/c") and not is_hub_id("../x")


def test_train_and_dry_run_take_a_hub_id(offline, capsys):
    job = to_object(load_config("tiny_cpu", ["model.hf_path=TinyOrg/Tiny-Qwen3"]))
    resolve_model_paths(job)  # what `train` does before building anything
    assert job.model.hf_path.endswith(f"snapshots/{COMMIT}")
    assert cli.main(["dry-run", "tiny_cpu", "model.hf_path=TinyOrg/Tiny-Qwen3"]) == 0
    assert cli.main(["dry-run", "tiny_cpu", "model.hf_path=TinyOrg/Nope"]) == 2
    assert "TinyOrg/Nope" in capsys.readouterr().err


def test_a_recipes_missing_model_names_mrl_models(tmp_path, monkeypatch, capsys):
    """`models/Qwen3-30B-A3B-Base` (a recipe's ${MRL_MODELS}/name) is a folder that is not there, not a
    hub id: the error says where the recipes read models from and how to fetch one there."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MRL_MODELS", raising=False)
    with pytest.raises(FileNotFoundError) as e:
        resolve("models/Qwen3-30B-A3B-Base")
    msg = str(e.value)
    assert "$MRL_MODELS (unset: ./models" in msg and "hf download Qwen/Qwen3-30B-A3B-Base --local-dir models/" in msg
    monkeypatch.setenv("MRL_MODELS", str(tmp_path / "ckpts"))
    with pytest.raises(FileNotFoundError, match=r"\$MRL_MODELS \(set: .*ckpts"):
        resolve(str(tmp_path / "ckpts" / "Llama-3"))
