"""Version guard shared by every patch: a patch written against one upstream release refuses others.

A patch reaches into a package's internals; applied to a release it was not written for it can
silently do the wrong thing. So each patch names the exact versions it supports and fails loudly,
naming them, on anything else.

`PINS` is the one list of those versions: the patches read their `SUPPORTED` from it, and
pyproject.toml pins exactly these releases (tests/unit/test_foundation.py checks that the two and
requirements/cpu-lock.txt agree), so pip never installs a release a guard would refuse.
"""

from __future__ import annotations

from importlib import metadata


PINS = {
    "megatron-core": "0.16.1",  # megatron_cpu, and the learner's use of RouterReplay / finalize_model_grads
    "mbridge": "0.15.1",  # mbridge_fixes
    "sglang": "0.5.23",  # sglang_cpu, sglang_fixes
}


def pinned(dist: str) -> tuple[str, ...]:
    return (PINS[dist],)


class UnsupportedVersionError(RuntimeError):
    pass


def installed_version(dist: str) -> str:
    return metadata.version(dist)


def require_version(dist: str, supported: tuple[str, ...], patch: str, version: str | None = None) -> str:
    """Raise UnsupportedVersionError unless `dist` is at one of the `supported` versions.

    `version` overrides the installed version (tests use it to fake an unexpected release).
    """
    found = version if version is not None else installed_version(dist)
    if found not in supported:
        raise UnsupportedVersionError(
            f"patch {patch!r} supports {dist} {' or '.join(supported)}, but {dist} {found} is installed; "
            f"install a supported version (requirements/cpu-lock.txt) or update the patch and its test"
        )
    return found
