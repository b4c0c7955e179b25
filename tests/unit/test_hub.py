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


def test_a_checkpoint_folder_needs_its_weights_and_tokenizer(tmp_path, capsys):
    """A folder with config.json alone, a sharded download with a shard missing, or no tokenizer is
    refused by the dry-run, naming what is missing; the whole checkpoint passes."""
    import json
    import shutil

    whole = make_tiny_checkpoint(tmp_path / "whole", vocab_size=128)
    resolve_model_paths(to_object(load_config("tiny_cpu", [f"model.hf_path={whole}"])))

    def refused(folder, *message):
        assert cli.main(["dry-run", "tiny_cpu", f"model.hf_path={folder}",
                         f"trainer.out_dir={tmp_path / 'run'}"]) == 2
        err = capsys.readouterr().err
        assert all(m in err for m in message), err

    only_config = tmp_path / "only_config"
    only_config.mkdir()
    shutil.copy(whole / "config.json", only_config)
    refused(only_config, f"model.hf_path={only_config}: config.json but no weights")
    sharded = tmp_path / "sharded"
    shutil.copytree(whole, sharded)
    (sharded / "model.safetensors").rename(sharded / "model-00001-of-00002.safetensors")
    (sharded / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {
        "a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}))
    refused(sharded, "1 of the 2 weight files model.safetensors.index.json names are missing "
                     "(model-00002-of-00002.safetensors)", "hf download")
    no_tokenizer = tmp_path / "no_tokenizer"
    shutil.copytree(whole, no_tokenizer)
    (no_tokenizer / "tokenizer.json").unlink()
    refused(no_tokenizer, "no tokenizer (tokenizer.json, tokenizer.model, vocab.json)")
