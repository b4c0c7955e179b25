"""The GPU environment is installed one way: docker/install_lock.sh holds the only pip commands, and the
image's two targets (docker/Dockerfile.gpu), `make gpu-env` and `make gpu-env-check`
(.ci/gpu_env_check.sh) call it with the parts they are documented to install, then run
docker/verify_env.py. Its split of requirements/gpu-lock.txt puts every pin in exactly one part.

Pure file reading (the unit tier starts no process): the files are parsed, nothing is run.
"""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DOCKERFILE = REPO / "docker" / "Dockerfile.gpu"
INSTALL = REPO / "docker" / "install_lock.sh"
CHECK = REPO / ".ci" / "gpu_env_check.sh"
LOCK = REPO / "requirements" / "gpu-lock.txt"

CALL = re.compile(r"docker/install_lock\.sh\s+(\S+)((?:\s+(?:base|te|project)\b)+)")
VERIFY = re.compile(r"python3?\"?\s+docker/verify_env\.py")
PIP_INSTALL = re.compile(r"pip3?\s+install|-m\s+pip\s+install")

# What each place installs (docs/cluster.md, "The GPU environment").
PARTS = {
    "image, te target": ["base", "te", "project"],
    "image, default target": ["base", "project"],
    "make gpu-env": ["base", "te", "project"],
    "make gpu-env-check": ["base", "project"],  # what the default image installs
}


def calls(text: str) -> tuple[set[str], list[str]]:
    """(the venvs named, the parts in order) of every install_lock.sh call in `text`."""
    found = CALL.findall(text)
    return {venv for venv, _ in found}, [part for _, parts in found for part in parts.split()]


def code(text: str) -> str:
    """`text` without its comment lines, continuation lines joined."""
    lines = [line for line in text.splitlines() if not line.lstrip().startswith("#")]
    return re.sub(r"\\\n", " ", "\n".join(lines))


def dockerfile_stages() -> dict[str, str]:
    """stage name -> its instructions."""
    text = code(DOCKERFILE.read_text())
    stages = re.split(r"^FROM\s+\S+\s+AS\s+(\S+)\s*$", text, flags=re.M | re.I)
    return dict(zip(stages[1::2], stages[2::2]))


def make_recipe(target: str) -> str:
    text = (REPO / "Makefile").read_text()
    m = re.search(rf"^{re.escape(target)}:.*\n((?:\t.*\n?)+)", text, re.M)
    assert m, f"the Makefile has no {target} target"
    return code(m.group(1))


def places() -> dict[str, str]:
    stages = dockerfile_stages()
    return {
        "image, te target": stages["te"],
        "image, default target": stages["default"],
        "make gpu-env": make_recipe("gpu-env"),
        "make gpu-env-check": code(CHECK.read_text()),
    }


def test_the_plain_build_is_the_image_without_transformer_engine():
    stages = dockerfile_stages()
    assert list(stages)[-1] == "default", "the last stage is what `docker build` without --target gives"
    assert not re.search(r"\bte\b", " ".join(calls(stages["default"])[1]))


def test_every_place_installs_through_install_lock_sh_with_its_parts():
    for place, text in places().items():
        venvs, parts = calls(text)
        assert parts == PARTS[place], f"{place}: install_lock.sh parts {parts}, expected {PARTS[place]}"
        assert len(venvs) == 1, f"{place}: install_lock.sh installs into several venvs: {venvs}"
        (venv,) = venvs
        assert re.search(rf"-m\s+venv\s+{re.escape(venv)}", text), f"{place}: {venv} is not made with -m venv"
        assert not PIP_INSTALL.search(text), f"{place} runs pip install itself; docker/install_lock.sh does"
        verify = VERIFY.search(text)
        assert verify, f"{place} does not run docker/verify_env.py"
        assert verify.start() > text.rindex("install_lock.sh"), f"{place}: verify_env.py runs before the install"


def test_make_gpu_env_check_runs_the_check_script():
    assert ".ci/gpu_env_check.sh" in make_recipe("gpu-env-check")


def pin_lines() -> list[str]:
    """The lines install_lock.sh's awk treats as pins (`name==version \\`)."""
    return [line for line in LOCK.read_text().splitlines() if re.match(r"^[^ #]", line)]


def test_the_lock_split_puts_every_pin_in_exactly_one_part():
    script = INSTALL.read_text()
    regex = dict(re.findall(r"^([A-Z_]+)='([^']+)'$", script, re.M))
    case = dict(re.findall(r"^\s+([a-z-]+)\)\n(.*?);;", script, re.M | re.S))
    picks = {part: re.findall(r'pick "\$([A-Z_]+)" ([01]) ([a-z-]+)', body) for part, body in case.items()}
    assert set(picks) == {"base", "te", "project"}, picks

    def files(part: str) -> dict[str, set[str]]:
        out = {}
        for var, keep, name in picks[part]:
            hit = {line.split("==")[0] for line in pin_lines() if bool(re.search(regex[var], line)) == (keep == "1")}
            out[name] = hit
        return out

    base, te = files("base"), files("te")
    assert base["build"] == {"setuptools", "wheel"}
    assert te["te-core"] == {"transformer-engine", "transformer-engine-cu13"}
    assert te["te-torch"] == {"transformer-engine-torch"}
    parts = [base["build"], base["main"], te["te-core"], te["te-torch"]]
    every = {line.split("==")[0] for line in pin_lines()}
    assert set().union(*parts) == every, f"pins in no part: {every - set().union(*parts)}"
    assert sum(map(len, parts)) == len(every), "a pin is in two parts"
    assert not any(name.startswith("transformer-engine") for name in base["main"])
