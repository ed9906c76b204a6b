"""What a run directory holds: its checkpoints (per writer) and their state trees, for the CLI."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any

from flaxstate import tree_paths
from flaxstate.checkpoint.best import BestPolicy
from flaxstate.checkpoint.storage import CheckpointError, CheckpointStore, is_empty_or_missing

NEWEST = "newest"


@dataclasses.dataclass(frozen=True)
class CheckpointInfo:
    """One checkpoint of a run: which writer kept it, its step, time, metrics and size."""

    writer: str
    step: int
    time: float | None
    metrics: dict[str, dict[str, float]]
    bytes: int
    best: bool = False


@dataclasses.dataclass(frozen=True)
class LeafInfo:
    """One array of a stored state: its path, shape, dtype, bytes and logical axes (`None`: no names)."""

    path: str
    shape: tuple[int, ...]
    dtype: str
    bytes: int
    axes: tuple[str | None, ...] | None = None


def _writer_dirs(run_dir: Path) -> list[tuple[str, Path]]:
    """The run's own checkpoints, then every subdirectory that holds checkpoints (a best writer's)."""
    writers = [(NEWEST, run_dir)]
    writers += [
        (child.name, child) for child in sorted(run_dir.iterdir()) if child.is_dir() and not child.name.isdigit()
    ]
    return [(name, path) for name, path in writers if not is_empty_or_missing(path)]


def _check_run_dir(run_dir: Path) -> list[tuple[str, Path]]:
    if not run_dir.is_dir():
        raise CheckpointError(f"{run_dir} does not exist or is not a directory.")
    writers = _writer_dirs(run_dir)
    if not writers:
        raise CheckpointError(f"{run_dir} is not a flaxstate run: it holds no checkpoint.")
    return writers


def _size(path: Path) -> int:
    return sum(file.stat().st_size for file in path.rglob("*") if file.is_file())


def list_checkpoints(run_dir: str | Path) -> list[CheckpointInfo]:
    """Returns the run's checkpoints, newest writer first, each writer's by step.

    Raises:
        CheckpointError: no such directory, or no flaxstate checkpoint in it.
    """
    infos = []
    for writer, directory in _check_run_dir(Path(run_dir)):
        with CheckpointStore(directory, read_only=True) as store:
            metas = {step: store.read_meta(step) for step in store.steps()}
        entries = [
            CheckpointInfo(writer, step, meta.get("time"), meta.get("metrics", {}), _size(directory / str(step)))
            for step, meta in metas.items()
        ]
        # The policy the writer stored (checkpoints of format 2 and older have none: nothing is marked).
        policy = next((BestPolicy.from_json(meta.get("best")) for meta in metas.values() if meta.get("best")), None)
        if policy is not None and entries:
            best = min(range(len(entries)), key=lambda i: policy.rank(entries[i].metrics))
            entries[best] = dataclasses.replace(entries[best], best=True)
        infos.extend(entries)
    return infos


def describe_state(run_dir: str | Path, step: int | None = None) -> tuple[int, list[LeafInfo], dict[str, Any]]:
    """Returns the step, the stored state's arrays, and the checkpoint's meta.

    Args:
        run_dir: the run's directory.
        step: a step of the newest-checkpoint writer (the newest by default).

    Raises:
        CheckpointError: no such directory, not a run, or no such step.
    """
    writers = dict(_check_run_dir(Path(run_dir)))
    directory = writers.get(NEWEST) or next(iter(writers.values()))
    with CheckpointStore(directory, read_only=True) as store:
        steps = store.steps()
        if step is None:
            step = steps[-1]
        elif step not in steps:
            raise CheckpointError(f"{directory} has no checkpoint at step {step}; it has steps {steps}.")
        meta = store.read_meta(step)
        axes = meta.get("logical_axes") or {}
        leaves = []
        for path, leaf in tree_paths.flatten(store.stored_tree(step)).items():
            shape, dtype = tree_paths.shape_and_dtype(leaf)
            named = tuple(axes[path]) if path in axes else None
            leaves.append(LeafInfo(path, shape, str(dtype), int(math.prod(shape)) * dtype.itemsize, named))
        return step, leaves, meta
