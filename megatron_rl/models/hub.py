"""`model.hf_path` (and `reward_model.hf_path`, `critic.hf_path`): a local folder or a hub model id.

A value that is a folder holding config.json is used as it is. Otherwise a value shaped like a hub
id, `org/name` or `org/name@revision`, is resolved through huggingface_hub's `snapshot_download`
into its cache (HF_HUB_CACHE / HF_HOME, as the hub library lays it out) and the run uses that
snapshot folder; with HF_HUB_OFFLINE=1 (compute nodes without internet) only the cache is read,
so a model fetched once on a login node serves every job. Only what a run reads is fetched: the
configs, tokenizer files and safetensors weights.

Every rank resolves for itself (huggingface_hub locks the cache), before anything is built: the
run's config.yaml records the snapshot folder, so a resume with another revision of the model is a
different experiment (run/run_dir.py).
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Optional, Sequence

# What a run reads: model and generation configs, tokenizer files, safetensors weights.
ALLOW_PATTERNS = ["*.json", "*.safetensors", "*.txt", "*.model", "*.tiktoken", "*.jinja"]
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+(@[\w./-]+)?$")


def offline() -> bool:
    """HF_HUB_OFFLINE, read at the call (huggingface_hub reads it once, at its import)."""
    return os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes", "on")


def snapshot(repo_id: str, what: str, revision: Optional[str] = None, repo_type: str = "model",
             allow_patterns: Sequence[str] = ALLOW_PATTERNS) -> Path:
    """The local snapshot folder of a hub repo: fetched into the hub cache, or with HF_HUB_OFFLINE=1
    read from it. FileNotFoundError naming `what` and, offline, the command that fills the cache."""
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(repo_id=repo_id, revision=revision, repo_type=repo_type,
                                      allow_patterns=list(allow_patterns), local_files_only=offline(),
                                      cache_dir=os.environ.get("HF_HUB_CACHE")))
    except Exception as e:  # noqa: BLE001 - the hub library's errors vary by cause; each is stated
        kind = "" if repo_type == "model" else f" --repo-type {repo_type}"
        where = ("the hub cache only (HF_HUB_OFFLINE=1): fetch it once where the hub is reachable, e.g. "
                 f"`hf download{kind} {repo_id}`, with the same HF_HOME / HF_HUB_CACHE"
                 if offline() else "the Hugging Face hub")
        raise FileNotFoundError(f"{what}: not found in {where} "
                                f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})") from None


def is_hub_id(value: str) -> bool:
    return bool(_REPO_ID.match(value)) and ".." not in value


def models_root() -> Path:
    """Where the recipes read checkpoints from: $MRL_MODELS, default ./models (configs/model/)."""
    return Path(os.environ.get("MRL_MODELS", "models"))


def resolve(value: str, key: str = "model.hf_path") -> str:
    """A local checkpoint folder for `value` (a folder, or a hub id resolved into the hub cache)."""
    path = Path(value).expanduser()
    if (path / "config.json").is_file():
        return str(path)
    root = models_root()
    if path.parent == root or path.parent.resolve() == root.resolve():
        # A recipe's `${MRL_MODELS}/<name>`: a folder that is not there, never a hub id ("models/X").
        raise FileNotFoundError(
            f"{key}={value}: no Hugging Face checkpoint there (no config.json). The recipes read checkpoints "
            f"from $MRL_MODELS ({'set: ' + os.environ['MRL_MODELS'] if 'MRL_MODELS' in os.environ else 'unset: ./models'}"
            f", from {Path.cwd()}): fetch it there, e.g. `hf download {'Qwen' if path.name.startswith('Qwen') else '<org>'}/"
            f"{path.name} --local-dir {path}`, "
            f"point MRL_MODELS at the folder that holds {path.name}, or give {key} a folder or a hub id")
    if path.exists() or not is_hub_id(value):
        raise FileNotFoundError(f"{key}={value}: no Hugging Face checkpoint there (no config.json); give a "
                                f"checkpoint folder or a hub model id such as Qwen/Qwen3-0.6B")
    repo_id, _, revision = value.partition("@")
    local = snapshot(repo_id, f"{key}={value}: no checkpoint folder there (config.json), and the hub model",
                     revision or None)
    if not (Path(local) / "config.json").is_file():
        raise FileNotFoundError(f"{key}={value}: the hub snapshot {local} has no config.json")
    return str(local)


TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")


def check_checkpoint_files(path: str, key: str, tokenizer: bool = True) -> None:
    """A checkpoint folder holds weights (every shard its index names: a download cut short is
    found here, not when the model loads) and, where the run tokenizes with it, a tokenizer."""
    folder = Path(path)
    indexes = sorted(folder.glob("*.index.json"))
    weights = sorted(folder.glob("*.safetensors")) + sorted(folder.glob("pytorch_model*.bin"))
    if indexes:
        import json

        try:
            shards = sorted(set(json.loads(indexes[0].read_text())["weight_map"].values()))
        except (ValueError, KeyError, AttributeError) as e:
            raise FileNotFoundError(f"{key}={path}: {indexes[0].name} is not a weight index ({type(e).__name__}: "
                                    f"{e}); download the checkpoint again") from None
        missing = [s for s in shards if not (folder / s).is_file()]
        if missing:
            raise FileNotFoundError(f"{key}={path}: {len(missing)} of the {len(shards)} weight files "
                                    f"{indexes[0].name} names are missing ({', '.join(missing[:3])}"
                                    f"{', ...' if len(missing) > 3 else ''}): an unfinished download? Run "
                                    "`hf download ... --local-dir` again (it resumes)")
    elif not weights:
        raise FileNotFoundError(f"{key}={path}: config.json but no weights (*.safetensors, "
                                "pytorch_model*.bin): the folder is not a whole checkpoint")
    if tokenizer and not any((folder / f).is_file() for f in TOKENIZER_FILES):
        raise FileNotFoundError(f"{key}={path}: no tokenizer ({', '.join(TOKENIZER_FILES)}): the folder is "
                                "not a whole checkpoint")


def resolve_model_paths(job) -> None:
    """Resolve every checkpoint path the job reads, in place (dry-run and `train`, before building),
    and check that each holds its weights (and, for the policy, its tokenizer)."""
    if job.model.hf_path:
        job.model.hf_path = resolve(job.model.hf_path)
        check_checkpoint_files(job.model.hf_path, "model.hf_path")
    if job.reward_model.enabled and job.reward_model.hf_path:
        job.reward_model.hf_path = resolve(job.reward_model.hf_path, "reward_model.hf_path")
        check_checkpoint_files(job.reward_model.hf_path, "reward_model.hf_path", tokenizer=False)
    if job.algorithm.advantage == "gae" and job.critic.hf_path:
        job.critic.hf_path = resolve(job.critic.hf_path, "critic.hf_path")
        check_checkpoint_files(job.critic.hf_path, "critic.hf_path", tokenizer=False)
