"""Compose a job config from a recipe plus overrides, with errors a user can act on.

Recipes (recipes/*.yaml) are the primary configs; the groups in configs/ (model/, parallel/,
optim/, ...) are on Hydra's search path. Every YAML is validated against the structured schema
(schema.py), so a typo fails here with the valid keys listed, before anything is launched.
"""

from __future__ import annotations

import dataclasses
import difflib
import re
from pathlib import Path
from typing import Sequence

from hydra import compose, initialize_config_dir
from hydra.core.config_store import ConfigStore
from hydra.core.global_hydra import GlobalHydra
from hydra.errors import HydraException, MissingConfigException
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from megatron_rl.config import schema

REPO_ROOT = Path(__file__).resolve().parents[2]
CONFIGS_DIR = REPO_ROOT / "configs"
RECIPES_DIR = REPO_ROOT / "recipes"


class ConfigError(ValueError):
    """A config problem, stated in one actionable line."""


def register_schemas() -> None:
    """Register the structured configs: `job_schema` is the base every recipe starts from."""
    cs = ConfigStore.instance()
    cs.store(name="job_schema", node=schema.JobConfig)


def available_recipes() -> list[str]:
    return sorted(p.stem for p in RECIPES_DIR.glob("*.yaml"))


def valid_keys_at(path: str) -> tuple[str, list[str]]:
    """For a dotted key path, return (the parent path, the valid field names of that parent)."""
    node = schema.JobConfig
    parts = path.split(".")
    parent: list[str] = []
    for part in parts[:-1]:
        fields = {f.name: f for f in dataclasses.fields(node)}
        if part not in fields:
            break
        ftype = _field_dataclass(node, part)
        if ftype is None:
            break
        node = ftype
        parent.append(part)
    return ".".join(parent) or "<root>", [f.name for f in dataclasses.fields(node)]


def _field_dataclass(node, name: str):
    hints = {f.name: f for f in dataclasses.fields(node)}
    default_factory = hints[name].default_factory
    if default_factory is not dataclasses.MISSING:
        value = default_factory()
        if dataclasses.is_dataclass(value):
            return type(value)
    return None


def _explain(exc: BaseException, recipe: str) -> ConfigError | None:
    """Turn Hydra/OmegaConf exceptions into one line naming the key and the valid choices."""
    chain, e = [], exc
    while e is not None and e not in chain:
        chain.append(e)
        e = e.__cause__ or e.__context__
    for e in chain:
        if isinstance(e, OmegaConfBaseException) and getattr(e, "full_key", None):
            key = e.full_key
            msg = str(e).splitlines()[0]
            if "not in" in msg or "Key '" in msg:
                parent, valid = valid_keys_at(key)
                parts = key.split(".")
                if len(parts) >= 3 and ".".join(parts[:-2]) == parent and parts[-2] in valid:
                    # A new key inside a free-form dict field (e.g. algorithm.loss_kwargs): Hydra
                    # adds keys only with a leading '+'.
                    return ConfigError(f"'{'.'.join(parts[:-1])}' has no key '{parts[-1]}' yet; add one with a "
                                       f"leading '+': +{key}=...")
                close = difflib.get_close_matches(key.split(".")[-1], valid, n=1)
                hint = f" (did you mean '{close[0]}'?)" if close else ""
                return ConfigError(f"unknown config key '{key}'{hint}; valid keys of {parent}: "
                                   f"{', '.join(valid)}")
            return ConfigError(f"bad value for config key '{key}': {msg}")
    for e in chain:
        if isinstance(e, MissingConfigException):
            text = str(e)
            if re.search(r"primary config '([^']+)'", text):
                return ConfigError(f"unknown recipe '{recipe}'; available recipes: "
                                   f"{', '.join(available_recipes())}")
            text = text.split("Config search path")[0]
            return ConfigError(" ".join(line.strip() for line in text.splitlines() if line.strip()))
    return None


def load_config(recipe: str, overrides: Sequence[str] = ()) -> DictConfig:
    """Compose recipes/<recipe>.yaml with Hydra-style `overrides` (e.g. "parallel.tp=2").

    The result is a validated, fully resolved DictConfig typed by schema.JobConfig.
    """
    register_schemas()
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(RECIPES_DIR), version_base="1.3"):
            cfg = compose(
                config_name=recipe,
                overrides=[f"hydra.searchpath=[file://{CONFIGS_DIR}]", *overrides],
            )
        OmegaConf.resolve(cfg)
    except (HydraException, OmegaConfBaseException) as exc:
        explained = _explain(exc, recipe)
        if explained is None:
            raise
        raise explained from exc
    finally:
        GlobalHydra.instance().clear()
    return cfg


def to_object(cfg: DictConfig) -> schema.JobConfig:
    """The typed dataclass view of a composed config."""
    return OmegaConf.to_object(cfg)
