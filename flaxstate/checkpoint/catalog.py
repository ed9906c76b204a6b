"""What a run directory holds: its checkpoints (per writer) and their state trees, for the CLI.

A run may be read while it is written: a step that a live writer deletes
meanwhile is left out, and a damaged step is listed as damaged (or, where a
state is shown, passed over for the newest intact one), never a traceback.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from flaxstate import tree_paths
from flaxstate.checkpoint import steps
from flaxstate.checkpoint.best import BestPolicy
from flaxstate.checkpoint.errors import CheckpointError
from flaxstate.checkpoint.layout import is_empty_or_missing, is_step_entry
from flaxstate.checkpoint.steps import StepKind
from flaxstate.checkpoint.stores import Store, open_store
from flaxstate.checkpoint.stores.packed import META_FILE, step_numbers
from flaxstate.locations import is_url, run_directory, tree_size
from flaxstate.run_record import environment

logger = logging.getLogger("flaxstate")

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
    damaged: str | None = None
    """What is wrong with it, for a damaged checkpoint (its time and metrics are then unknown)."""


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
        (child.name, child) for child in sorted(run_dir.iterdir()) if not is_step_entry(child.name) and child.is_dir()
    ]  # a live writer renames and deletes its steps' directories: they are never looked into
    return [(name, path) for name, path in writers if not is_empty_or_missing(path)]


def _check_run_dir(run_dir: Path) -> list[tuple[str, Path]]:
    if not run_dir.is_dir():
        raise CheckpointError(f"{run_dir} does not exist or is not a directory.")
    writers = _writer_dirs(run_dir)
    if not writers:
        raise CheckpointError(f"{run_dir} is not a flaxstate run: it holds no checkpoint.")
    return writers


def _writer_checkpoints(writer: str, store: Store) -> list[CheckpointInfo]:
    """One writer's checkpoints by step: steps deleted meanwhile left out, damaged ones marked."""
    entries, metas = [], {}
    for step in store.steps():
        found = steps.classify(store, step)
        if found.kind is StepKind.VANISHING:
            continue
        if found.kind is StepKind.DAMAGED:
            size = tree_size(store.directory / str(step))
            entries.append(CheckpointInfo(writer, step, None, {}, size, False, found.why))
            continue
        if found.meta is None:
            assert found.error is not None
            raise found.error  # not flaxstate's, or a newer flaxstate's
        meta = metas[step] = found.meta
        info = CheckpointInfo(writer, step, meta.get("time"), meta.get("metrics") or {}, 0)
        entries.append(dataclasses.replace(info, bytes=tree_size(store.directory / str(step))))
    # The policy the writer stored (checkpoints of format 2 and older have none: nothing is marked).
    policy = next((BestPolicy.from_json(meta.get("best")) for meta in metas.values() if meta.get("best")), None)
    intact = [i for i, entry in enumerate(entries) if entry.damaged is None]
    if policy is not None and intact:
        best = min(intact, key=lambda i: policy.rank(entries[i].metrics))
        entries[best] = dataclasses.replace(entries[best], best=True)
    return entries


def list_checkpoints(run_dir: str | Path) -> list[CheckpointInfo]:
    """Returns the run's checkpoints, newest writer first, each writer's by step.

    Raises:
        CheckpointError: no such directory, or no flaxstate checkpoint in it.
    """
    infos = []
    for writer, directory in _check_run_dir(run_directory(run_dir, "flaxstate's catalog")):
        with _open(directory) as store:
            infos.extend(_writer_checkpoints(writer, store))
    return infos


def describe_state(run_dir: str | Path, step: int | None = None) -> tuple[int, list[LeafInfo], dict[str, Any]]:
    """Returns the step, the stored state's arrays, and the checkpoint's meta.

    Args:
        run_dir: the run's directory.
        step: a step of the newest-checkpoint writer (the newest by default).

    Raises:
        CheckpointError: no such directory, not a run, or no such step.
    """
    with stored_step(run_dir, step) as (_, chosen, leaves, meta):
        return chosen, leaves, meta


@contextlib.contextmanager
def stored_step(
    run_dir: str | Path, step: int | None = None
) -> Iterator[tuple[Store, int, list[LeafInfo], dict[str, Any]]]:
    """Opens a run's step for reading some of its arrays (`store.read_paths(step, paths)`) and no others.

    Yields:
        the open store, the step (the newest intact one by default: a
        damaged one is passed over with a warning), its arrays as
        `describe_state` gives them, and its meta.

    Raises:
        CheckpointError: no such directory, not a run, or no such step.
    """
    with _open(newest_writer(run_dir)) as store:
        yield (
            store,
            *steps.read_first(
                store.directory,
                lambda: _pick(store, step),
                lambda chosen: _describe(store, chosen),
                {},
                warning="passed over",
            ),
        )


def _open(directory: Path) -> Store:
    return open_store(directory, per_process=is_local_tier(directory), read_only=True)


def holds_local_tier(run_dir: Path) -> bool:
    """Whether `run_dir` is a local tier's directory (`d`, or its `d/process-<i>`), not a run's."""
    if is_url(run_dir) or not run_dir.is_dir():
        return False
    return any(is_local_tier(directory) for _, directory in _writer_dirs(run_dir))


def is_local_tier(directory: Path) -> bool:
    """Whether `directory` holds a process's local steps (`CheckpointFileWriter(fs.LocalTier(d))`'s
    `d/process-<i>`): packed files (`meta.json`, `arrays.bin`), which orbax's reader would call damaged."""
    if is_url(directory):
        return False
    listed = step_numbers(directory)
    return bool(listed) and (directory / str(listed[-1]) / META_FILE).is_file()


def newest_writer(run_dir: str | Path) -> Path:
    """The directory of the run's newest-checkpoint writer (else of its first best writer)."""
    writers = dict(_check_run_dir(run_directory(run_dir, "flaxstate's catalog")))
    return writers.get(NEWEST) or next(iter(writers.values()))


def _pick(store: Store, step: int | None) -> list[int]:
    """`step`, or the store's steps newest first.

    Raises:
        CheckpointError: the store has no step `step`.
    """
    listed = store.steps()
    if step is not None and step not in listed:
        raise CheckpointError(f"{store.directory} has no checkpoint at step {step}; it has steps {listed}.")
    return [step] if step is not None else listed[::-1]


def _describe(store: Store, step: int) -> tuple[int, list[LeafInfo], dict[str, Any]]:
    """A step's arrays (their paths, shapes, dtypes, bytes and logical axes) and meta."""
    meta = store.read_meta(step)
    stored = store.stored_tree(step)
    axes = meta.get("logical_axes") or {}
    leaves = []
    for path, leaf in tree_paths.flatten(stored).items():
        shape, dtype = tree_paths.shape_and_dtype(leaf)
        named = tuple(axes[path]) if path in axes else None
        leaves.append(LeafInfo(path, shape, str(dtype), int(math.prod(shape)) * dtype.itemsize, named))
    return step, leaves, meta


TOP_CHANGED = 20
"""How many of the changed arrays a diff lists (largest relative change first)."""


@dataclasses.dataclass(frozen=True)
class CheckpointDiff:
    """What differs between two checkpoints (see `diff_checkpoints`).

    Attributes:
        a, b: the two checkpoints' step directories.
        metadata, environment: one line per entry that differs (`key: a -> b`).
        only_a, only_b: the arrays that only one of them holds.
        mismatched: the arrays of both whose shape or dtype differ (`path: a -> b`).
        changed: `(path, |a - b| / |a|)` of the arrays of both whose values
            differ, largest first (all of them; a report shows `TOP_CHANGED`).
        n_compared: the arrays whose values were compared.
    """

    a: Path
    b: Path
    metadata: list[str]
    environment: list[str]
    only_a: list[str]
    only_b: list[str]
    mismatched: list[str]
    changed: list[tuple[str, float]]
    n_compared: int

    @property
    def differ(self) -> bool:
        """Whether anything differs."""
        parts = (self.metadata, self.environment, self.only_a, self.only_b, self.mismatched, self.changed)
        return any(parts)


def _relative_change(a: Any, b: Any) -> float:
    a64, b64 = a.astype("float64", copy=False), b.astype("float64", copy=False)
    difference = float(math.sqrt(float(((a64 - b64) ** 2).sum())))
    if difference == 0:
        return 0.0
    norm = float(math.sqrt(float((a64**2).sum())))
    return difference / norm if norm else math.inf


def diff_checkpoints(
    a: str | Path, b: str | Path, step_a: int | None = None, step_b: int | None = None
) -> CheckpointDiff:
    """Compares two checkpoints: their metadata, environment, state tree and values, one array at a time.

    Args:
        a, b: run directories (their newest-checkpoint writer's).
        step_a, step_b: the steps to compare (the newest by default).

    Raises:
        CheckpointError: a directory that is not a run, or no such step.
    """
    with _open(newest_writer(a)) as store_a, _open(newest_writer(b)) as store_b:

        def compare() -> CheckpointDiff:  # again from the listing when a step vanished meanwhile
            return _diff(store_a, _pick(store_a, step_a), store_b, _pick(store_b, step_b))

        return steps.retrying(store_a.directory, compare)


def _diff(store_a: Store, steps_a: list[int], store_b: Store, steps_b: list[int]) -> CheckpointDiff:
    if not steps_a or not steps_b:
        empty = store_a if not steps_a else store_b
        raise CheckpointError(f"{empty.directory} holds no complete checkpoint.")
    step_a, step_b = steps_a[0], steps_b[0]
    meta_a, meta_b = store_a.read_meta(step_a), store_b.read_meta(step_b)
    flat_a = tree_paths.flatten(store_a.stored_tree(step_a))
    flat_b = tree_paths.flatten(store_b.stored_tree(step_b))
    mismatched, changed, compared = [], [], 0
    for path in sorted(flat_a.keys() & flat_b.keys()):
        (shape_a, dtype_a), (shape_b, dtype_b) = (tree_paths.shape_and_dtype(flat[path]) for flat in (flat_a, flat_b))
        if shape_a != shape_b or dtype_a != dtype_b:
            mismatched.append(f"{path}: {list(shape_a)} {dtype_a} -> {list(shape_b)} {dtype_b}")
            continue
        change = _relative_change(store_a.read_paths(step_a, [path])[path], store_b.read_paths(step_b, [path])[path])
        compared += 1
        if change:
            changed.append((path, change))
    changed.sort(key=lambda item: -item[1])
    return CheckpointDiff(
        a=store_a.directory / str(step_a),
        b=store_b.directory / str(step_b),
        metadata=environment.changes(meta_a.get("metadata"), meta_b.get("metadata"), root="metadata"),
        environment=environment.changes(meta_a.get("environment"), meta_b.get("environment"), root="environment"),
        only_a=sorted(flat_a.keys() - flat_b.keys()),
        only_b=sorted(flat_b.keys() - flat_a.keys()),
        mismatched=mismatched,
        changed=changed,
        n_compared=compared,
    )
