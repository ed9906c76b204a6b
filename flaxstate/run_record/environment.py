"""The run's environment, stored with every checkpoint: what a resumed run that diverges is first asked.

Which flaxstate, jax, jaxlib, flax, optax and orbax-checkpoint; which Python;
which backend, devices and processes; which mesh; which command; which git
commit of the working directory (where there is one); which XLA preset, XLA
flags and JAX options were in force (`flaxstate.xla_settings.in_force`). The writers store it
as JSON in each checkpoint's `meta` (beside the user's `metadata`),
`flaxstate show` prints it, `flaxstate diff` compares it, and a resumed run's
writer logs each entry that changed.
"""

from __future__ import annotations

import functools
import importlib.metadata
import os
import platform
import re
import subprocess
import sys
from collections.abc import Mapping
from typing import Any

import jax

from flaxstate import tree_paths, xla_settings
from flaxstate.records import Session

PACKAGES = ("flaxstate", "jax", "jaxlib", "flax", "optax", "orbax-checkpoint")


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


@functools.cache
def git_commit(directory: str | None = None) -> str | None:
    """The commit checked out in `directory` (the working directory by default), `+dirty` if changed; else `None`."""
    where = directory or os.getcwd()
    try:
        head = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=where, capture_output=True, text=True, timeout=5, check=True
        ).stdout.strip()
        status = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=where,
            capture_output=True,
            text=True,
            timeout=5,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return f"{head}+dirty" if status else head or None


def describe(session: Session | None = None) -> dict[str, Any]:
    """This process's environment, as JSON (the devices and mesh from the loop's `session` where given)."""
    devices = jax.devices()
    return {
        "versions": {package: _version(package) for package in PACKAGES},
        "python": platform.python_version(),
        "backend": jax.default_backend(),
        "device_kind": session.device_kind if session is not None and session.device_kind else devices[0].device_kind,
        "devices": session.n_devices if session is not None else len(devices),
        "processes": jax.process_count(),
        "mesh": dict(session.mesh) if session is not None and session.mesh else None,
        "microbatches": session.n_microbatches if session is not None else None,
        "command": [sys.executable, *sys.argv],
        "commit": git_commit(),
        "xla": xla_settings.in_force(),
    }


def _differing(old: Any, new: Any) -> list[tuple[str, Any, Any]]:
    """`(path, old, new)` for each entry of two JSON trees that differs (`"(absent)"` where one has none)."""
    old_flat = tree_paths.flatten(old) if isinstance(old, Mapping) else {"": old}
    new_flat = tree_paths.flatten(new) if isinstance(new, Mapping) else {"": new}
    missing = object()
    return [
        (key, old_flat.get(key, "(absent)"), new_flat.get(key, "(absent)"))
        for key in sorted(old_flat.keys() | new_flat.keys())
        if old_flat.get(key, missing) != new_flat.get(key, missing)
    ]


def changes(old: Any, new: Any, root: str = "value", besides: list[str] | None = None) -> list[str]:
    """One line per entry of two JSON trees that differs: `path: old -> new` (`root` names a bare value).

    Args:
        besides: changes already said (`going_on`'s): a command-line argument that only carries one of them
            (`--steps 600` -> `--steps 1000`, or `--steps=...`) is left out.
    """
    said = [_numbers(line) for line in besides or ()]
    return [
        f"{key or root}: {before!r} -> {after!r}"
        for key, before, after in _differing(old, new)
        if not (key.startswith("command/") and _numbers(f"{before} {after}") in said)
    ]


STEP_COUNTS = re.compile(r"(^|[_/.])((n|num|max|total|train)_)?steps$")
"""The names of a run's step count in its metadata (`steps`, `n_steps`, `num_steps`, `max_steps`, ...)."""


def going_on(old: Any, new: Any, root: str = "value") -> tuple[list[str], list[str]]:
    """Splits two metadata trees' differences into a changed step count (how a run is meant to go on: more
    steps) and the rest, each one line `path: old -> new`."""
    steps: list[str] = []
    rest: list[str] = []
    for key, before, after in _differing(old, new):
        line = f"{key or root}: {before!r} -> {after!r}"
        counts = all(isinstance(value, int) and not isinstance(value, bool) for value in (before, after))
        (steps if counts and STEP_COUNTS.search(key) else rest).append(line)
    return steps, rest


def _numbers(text: str) -> list[str]:
    """The numbers a line holds, in order."""
    return re.findall(r"\d+", text.split(": ", 1)[-1])
