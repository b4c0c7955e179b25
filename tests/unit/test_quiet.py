"""A quiet start: megatron-core's "not installed, falling back" warnings (real, from importing it on
this machine without Transformer Engine / Apex) collapse into one line; MRL_VERBOSE=1 shows them."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

# The modules that warn at import without TE / Apex (each its own warning), then one that does not.
SNIPPET = ("import megatron_rl.quiet as q; q.install(); import megatron.core.optimizer, "
           "megatron.core.models.gpt.gpt_layer_specs; import warnings; warnings.warn('a warning of our own')")


def run(env_extra: dict[str, str]) -> str:
    env = {k: v for k, v in os.environ.items() if k not in ("MRL_VERBOSE", "RANK", "SLURM_PROCID")}
    env.update(env_extra)
    out = subprocess.run([sys.executable, "-c", SNIPPET], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr
    return out.stderr


@pytest.mark.slow
def test_known_notices_collapse_into_one_line_and_others_still_show():
    err = run({})
    assert "not installed" not in err, err
    assert err.count("known upstream notices hidden") == 1, err
    assert "a warning of our own" in err  # unknown warnings are untouched


@pytest.mark.slow
@pytest.mark.parametrize("env", [{"MRL_VERBOSE": "1"}, {"RANK": "1"}])
def test_verbose_shows_everything_and_other_ranks_print_nothing(env):
    err = run(env)
    if env.get("MRL_VERBOSE"):
        assert err.count("Transformer Engine and Apex are not installed") >= 2, err
        assert "known upstream notices hidden" not in err
    else:  # rank 1: hidden, and no summary line (rank 0 prints it)
        assert "not installed" not in err and "known upstream notices hidden" not in err, err


@pytest.mark.slow
def test_cli_is_quiet_by_default_and_verbose_shows_all(tmp_path):
    """Through the command line (a one-step supervised run imports all of megatron-core)."""
    env = {k: v for k, v in os.environ.items() if k not in ("MRL_VERBOSE", "RANK", "SLURM_PROCID")}

    def cli(*extra: str) -> str:
        out = subprocess.run([sys.executable, "-m", "megatron_rl.cli", "train-lm", "tiny_lm_cpu", "train.steps=1",
                              f"train.out_dir={tmp_path / str(len(extra))}", *extra],
                             capture_output=True, text=True, env=env, timeout=600)
        assert out.returncode == 0, out.stderr[-3000:]
        return out.stderr

    quiet, loud = cli(), cli("--verbose")
    assert "not installed" not in quiet and quiet.count("known upstream notices hidden") == 1, quiet
    assert loud.count("not installed") >= 5 and "known upstream notices hidden" not in loud, loud
