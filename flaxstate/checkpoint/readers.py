"""Readers: restore the newest complete (or the best, or a given) checkpoint.

A reader is what `TrainLoop(init=...)` takes to resume a run: with `target`
(a model's `init`) it starts fresh when the directory holds no checkpoint,
and with a `fs.SafetensorsReader` as `target` from the files' params (a
fine-tune that resumes from its own checkpoints once it has some).
It also restores a state on its own: `reader.restore(state)` gives back the
state with the checkpoint's values (an `InferenceState` reads no optimizer
state from disk).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Container, Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import jax
import numpy as np
from flax import serialization

from flaxstate import nnx, settings, train_state, tree_paths
from flaxstate.checkpoint import budget, damage, steps, stores
from flaxstate.checkpoint.best import BestPolicy, Mode
from flaxstate.checkpoint.budget import UNBOUNDED, HostMemoryBudget
from flaxstate.checkpoint.errors import CheckpointError
from flaxstate.checkpoint.layout import LEGACY_RUN_ID, Rename, StoredCheckpoint, decode_rng, is_empty_or_missing
from flaxstate.checkpoint.steps import StepKind
from flaxstate.checkpoint.stores import Store
from flaxstate.checkpoint.tiers import restart
from flaxstate.checkpoint.tiers.local_tier import LocalTier
from flaxstate.locations import local_path, run_directory
from flaxstate.records import CheckpointFile

if TYPE_CHECKING:
    from flaxstate.checkpoint.safetensors import SafetensorsReader

logger = logging.getLogger("flaxstate")


@dataclasses.dataclass(frozen=True)
class _Source:
    """Where a read's step came from: a store's directory, and whether it is a per-process (local) one."""

    directory: Path
    per_process: bool
    host_memory_budget: HostMemoryBudget = UNBOUNDED

    def open(self) -> Store:
        return stores.open_store(
            self.directory, per_process=self.per_process, read_only=True, host_memory_budget=self.host_memory_budget
        )


class CheckpointFileReader:
    """Restores the newest complete checkpoint of `output_dir` (or the one at `step`), or of two tiers.

    Given `[local_dir, persistent_dir]`, it restores the newest step that is
    whole in every process's local tier (`CheckpointFileWriter(
    fs.LocalTier(local_dir))`) when that is newer than the persistent tier's newest,
    and the persistent tier's otherwise (`flaxstate.checkpoint.tiers.restart`); it
    logs which, and why a local step was passed over.

    Example:
        >>> import tempfile
        >>> reader = CheckpointFileReader(tempfile.mkdtemp(), target=lambda rngs, x: {"params": {}})
        >>> reader.read(None) is None  # no checkpoint yet, and a target: TrainLoop(init=reader) starts fresh
        True
    """

    def __init__(
        self,
        output_dir: str | Path | Sequence[str | Path | LocalTier],
        target: Callable[..., Any] | SafetensorsReader | None = None,
        step: int | None = None,
        rename: Rename = None,
        *,
        host_memory_budget: HostMemoryBudget | int | None = None,
    ) -> None:
        """Points the reader at a directory, or at two tiers (nothing is read yet).

        Args:
            output_dir: the directory a `CheckpointFileWriter` wrote; or
                `[local_dir, persistent_dir]`: the `fs.LocalTier` a
                `CheckpointFileWriter` was given, or its directory (each
                process reads its own part of it), and the persistent one.
            target: the model's `init` (or the `nnx.Module`), to start fresh
                when there is no checkpoint; or a `fs.SafetensorsReader`, to
                start from its files' params then.
            step: restore this step instead of the newest.
            rename: `{old regex: new}` on '/'-joined state-dict paths (e.g.
                `{"Dense_0/": "Encoder_0/"}`), to load a checkpoint of an
                earlier model layout (the persistent tier only).
            host_memory_budget: a `fs.HostMemoryBudget`, or its bytes: what a restore may hold in host memory
                beyond the restored state, however large its largest array:
                each device's shard is made on the device and filled chunk by
                chunk (`flaxstate.checkpoint.budget`), bounded for a checkpoint
                that a writer with a budget wrote; a local tier's step is read
                in slices of its stored parts' rows. `None` (the default):
                orbax's own restore, which holds each array whole on the host
                first.

        Raises:
            ValueError: a list that is not `[local_dir, persistent_dir]`,
                tiers that are one directory or one inside the other (naming
                both), or `host_memory_budget` below 32 KiB.
        """
        self.local_dir: Path | None = None
        """The local tier's directory, or `None` (one directory)."""
        if isinstance(output_dir, str | Path):
            self.output_dir = run_directory(output_dir, type(self).__name__)
        else:
            given = list(output_dir)
            # A LocalTier first: its directory is what a reader needs of the tier.
            dirs = [Path(d.directory) if i == 0 and isinstance(d, LocalTier) else d for i, d in enumerate(given)]
            if len(dirs) != 2 or not all(isinstance(d, str | Path) for d in dirs):
                raise ValueError(
                    "CheckpointFileReader takes one directory or two tiers, [local_dir, persistent_dir] (local_dir "
                    f"a path or a fs.LocalTier); got {given!r}."
                )
            local, persistent = dirs
            assert isinstance(local, str | Path) and isinstance(persistent, str | Path)
            self.local_dir = local_path(local, f"{type(self).__name__}'s local tier")
            self.output_dir = run_directory(persistent, type(self).__name__)
            overlap = restart.overlap(self.local_dir, self.output_dir)
            if overlap is not None:
                raise ValueError(
                    f"CheckpointFileReader's tiers [{str(dirs[0])!r}, {str(dirs[1])!r}] {overlap}: "
                    + restart.tiers_apart_advice()
                )
        owner = type(self).__name__
        # A source of params alone (`fs.SafetensorsReader`) is a start as a model's init is: the loop takes both.
        starts_from_params = callable(getattr(target, "params", None)) and hasattr(target, "target")
        self.target: Callable[..., Any] | SafetensorsReader | None = (
            target if starts_from_params else settings.optional_callable(owner, "target", target)
        )
        self.step = settings.optional_count(owner, "step", step)
        if rename is not None and not isinstance(rename, Mapping):
            raise ValueError(
                f"{owner} rename must be a dict of {{old regex: new}} state-dict paths, or None; got {rename!r}."
            )
        self.rename = rename
        self.host_memory_budget = budget.of(host_memory_budget, owner)

    def __repr__(self) -> str:
        where = repr(str(self.output_dir))
        if self.local_dir is not None:
            where = f"[{str(self.local_dir)!r}, {where}]"
        return f"{type(self).__name__}({where}{self._repr_extra()})"

    def _repr_extra(self) -> str:
        return f", step={self.step}" if self.step is not None else ""

    def _directory(self) -> Path:
        return self.output_dir

    def _candidates(self, store: Store, damaged: dict[int, str]) -> list[int]:
        """Steps to try, preferred first (a reader that reads metas to rank them adds damaged ones to `damaged`)."""
        return sorted(store.steps(), reverse=True)

    def read(self, template: CheckpointFile | None) -> CheckpointFile | None:
        """Restores the checkpoint into the tree and shardings of `template.state`.

        The newest complete step is restored. A step that disappears while it
        is read (a live writer rotating its checkpoints) is not damage: the
        steps are listed again and the newest complete one is taken. A
        damaged step (missing or truncated files, metadata that does not
        validate, arrays that claim more than the step's files hold) is
        skipped with one warning, and the record says which were skipped, so
        that the run's writer sets them aside instead of refusing to save.

        Args:
            template: a state in a `CheckpointFile` (its leaves arrays or
                `jax.ShapeDtypeStruct`s with shardings), or `None` to read
                numpy arrays of the stored tree (a state dict) as the state.

        Returns:
            the restored checkpoint, or `None` when the directory holds none and
            a `target` was given (training starts fresh).

        Raises:
            CheckpointError: no checkpoint and no target, the step does not
                exist, not a flaxstate checkpoint, or every checkpoint damaged
                (naming each step and what is wrong in it).
            StateMismatchError: the checkpoint does not fit the model, naming
                every differing path.
            KeyboardInterrupt: Ctrl-C, wherever it landed in the read (never
                taken for damage); reading again starts over.
        """
        return self._restored(template)[0]

    def _restored(self, template: CheckpointFile | None) -> tuple[CheckpointFile | None, _Source | None]:
        """`read`, and the store its step came from (`None` with no checkpoint); two tiers ask `restart.read_tiers`."""
        try:
            if self.local_dir is None:
                persistent = self._read_persistent(template)
                return persistent, self._source(self._directory()) if persistent is not None else None
            state, state_dict, with_optimizer = _template(template)
            read: restart.TierRead[CheckpointFile] = restart.read_tiers(
                self.local_dir,
                self._directory(),
                state_dict if self.rename is None else None,  # a local step restores only without renames
                with_optimizer,
                step=self.step,
                read_persistent=lambda: self._read_persistent(template),
                host_memory_budget=self.host_memory_budget,
            )
            if read.directory is None:
                return None, None
            if read.local is None:
                return read.persistent, self._source(read.directory)
            restored = self._checkpoint_file(read.local, state, with_optimizer, read.directory, {})
            skipped = read.persistent.skipped_damaged if read.persistent is not None else ()
            return dataclasses.replace(restored, skipped_damaged=skipped), _Source(read.directory, per_process=True)
        except Exception as error:
            damage.reraise_interrupt(error)
            raise

    def _source(self, directory: Path) -> _Source:
        """An orbax directory to read, within this reader's budget."""
        return _Source(directory, per_process=False, host_memory_budget=self.host_memory_budget)

    def _read_persistent(self, template: CheckpointFile | None) -> CheckpointFile | None:
        """The run directory's (the persistent tier's) checkpoint; `None` where it holds none and `target` starts fresh.

        Raises:
            CheckpointError: it holds none and there is no target (or a `step` was asked for).
        """
        directory = self._directory()
        if is_empty_or_missing(directory):
            if self.target is not None and self.step is None:
                return None
            what = "does not exist" if not directory.exists() else "holds no checkpoint"
            fix = (
                "drop step= to start fresh from target"
                if self.target is not None
                else "give the reader target=model.init to start fresh"
            )
            raise CheckpointError(f"{directory} {what}; {fix}, or point it at a directory that a writer wrote.")
        with self._source(directory).open() as store:
            return self._read(store, template)

    def _steps_to_try(self, store: Store, damaged: dict[int, str]) -> list[int]:
        """The candidates not yet found damaged, preferred first (only `step` when it was given)."""
        listed = [step for step in self._candidates(store, damaged) if step not in damaged]
        if self.step is None:
            return listed
        if self.step not in listed and self.step not in damaged:
            raise CheckpointError(
                f"{store.directory} has no checkpoint at step {self.step}; it has steps {sorted(store.steps())}."
            )
        return [self.step] if self.step in listed else []

    def _read(self, store: Store, template: CheckpointFile | None) -> CheckpointFile:
        """The first candidate that reads whole (`steps.read_first`: damaged ones passed over, vanished relisted)."""
        state, state_dict, with_optimizer = _template(template)
        damaged: dict[int, str] = {}

        def read(step: int) -> CheckpointFile:
            stored = store.read(step, state_dict, with_optimizer=with_optimizer, rename=self.rename)
            return self._checkpoint_file(stored, state, with_optimizer, store.directory, damaged)

        return steps.read_first(store.directory, lambda: self._steps_to_try(store, damaged), read, damaged)

    @staticmethod
    def _checkpoint_file(
        stored: StoredCheckpoint, state: Any, with_optimizer: bool, directory: Path, damaged: dict[int, str]
    ) -> CheckpointFile:
        restored = stored.state_dict
        if not with_optimizer:
            restored["state"] = {"step": np.int32(stored.meta["step"])}
        return CheckpointFile(
            state=state.restore_state(restored) if state is not None else restored,
            step=int(stored.meta["step"]),
            rng=decode_rng(stored.meta.get("rng")),
            data_position=stored.meta.get("data_position"),
            metrics=stored.meta.get("metrics") or {},
            metadata=stored.meta.get("metadata"),
            format_version=int(stored.meta["format_version"]),
            run_id=stored.meta.get("run_id") or LEGACY_RUN_ID,
            skipped_damaged=tuple(str(directory / str(step)) for step in damaged),
        )

    def restore(self, state: Any, use_ema: bool = False) -> Any:
        """Returns `state` with the checkpoint's values (same tree, same shardings).

        Args:
            state: a `FlaxOptimTrainState`, or an `InferenceState` (which
                reads no optimizer state from disk), or an `nnx.Module`
                (its Variables get the checkpoint's values in place, and it is
                returned: `flaxstate.nnx.nnx_update`).
            use_ema: an `InferenceState` gets the checkpoint's EMA of the
                parameters (`state/ema`, `TrainTask(ema_decay=...)`) as its
                parameters, in their dtypes and shardings; of the optimizer's
                item only the EMA's arrays are read.

        Raises:
            CheckpointError: there is no checkpoint to restore, or (with
                `use_ema`) it holds no EMA, or `state` is not an `InferenceState`.
        """
        if nnx.is_module(state):  # an NNX module: its Variables, in place
            return nnx.nnx_update(state, self, use_ema=use_ema)
        nnx.refuse_nnx_object(state, "CheckpointFileReader.restore")  # nnx.state(model): the module goes there
        if use_ema and getattr(state, "param_states", None) is not None:
            raise CheckpointError(
                "restore(use_ema=True) takes an InferenceState (the EMA becomes its parameters); a training "
                "state restores its EMA as state.ema without it."
            )
        restored, source = self._restored(CheckpointFile(state=state, step=0))
        if restored is None or source is None:
            raise CheckpointError(f"{self._directory()} holds no checkpoint to restore.")
        if not use_ema:
            return restored.state
        rename = None if source.per_process else self.rename  # a local step restores only without renames
        return restored.state.replace(params=_ema_params(restored.state.params, source, restored.step, rename))


def _ema_params(params: Any, source: _Source, step: int, rename: Rename) -> Any:
    """A step's EMA of the parameters (`state/ema/...`), as `params`' tree, dtypes and shardings.

    Only the EMA's arrays are read, from the store that gave `step`.

    Raises:
        CheckpointError: the step holds no EMA (naming the first missing path).
    """
    targets = tree_paths.flatten({"target": _plain_tree(params)})
    paths = {"state/ema/" + path.removeprefix("target/"): path for path in targets}  # the EMA's, as restored
    with source.open() as store:  # a local tier's step: the EMA's parts of the same file, and no other
        stored = tree_paths.flatten(store.stored_tree(step))
        names = dict(zip(tree_paths.rename(stored, rename), stored, strict=True))  # as restored -> stored
        _check_ema(paths, names, step, source.directory)
        read = store.read_paths(step, [names[path] for path in paths])

    def placed(template: Any, value: Any) -> Any:
        value = value.astype(template.dtype)
        sharding = getattr(template, "sharding", None)
        return jax.device_put(value, sharding) if isinstance(template, jax.Array) else np.asarray(value)

    by_target = {target.removeprefix("target/"): read[names[ema_path]] for ema_path, target in paths.items()}
    return jax.tree.map(placed, params, serialization.from_state_dict(params, tree_paths.unflatten(by_target)))


def _template(template: CheckpointFile | None) -> tuple[Any, dict[str, Any] | None, bool]:
    """A read's template state, its state dict, and whether the optimizer's arrays are read (all, without one)."""
    state = template.state if template is not None else None
    state_dict = state.state_dict() if state is not None else None
    return state, state_dict, state_dict is None or train_state.is_training(state_dict)


def _check_ema(paths: Iterable[str], stored: Container[str], step: int, directory: Path) -> None:
    """Raises unless a step holds every EMA path.

    Raises:
        CheckpointError: it holds none or some (naming the first missing path and how many).
    """
    missing = [path for path in paths if path not in stored]
    if missing:
        raise CheckpointError(
            f"the checkpoint of step {step} in {directory} holds no EMA of the parameters "
            f"({missing[0]} and {len(missing) - 1} more are missing): it was trained without "
            "TrainTask(ema_decay=...); restore without use_ema."
        )


def _plain_tree(tree: Any) -> Any:
    return serialization.to_state_dict(tree)


class _BestReader(CheckpointFileReader):
    mode: Mode = "min"

    def __init__(
        self,
        output_dir: str | Path,
        metric: str,
        group: str = "eval",
        *,
        target: Callable[..., Any] | None = None,
        step: int | None = None,
        rename: Rename = None,
    ) -> None:
        if not isinstance(output_dir, str | Path):
            raise ValueError(f"{type(self).__name__} reads one run directory, not tiers; got {output_dir!r}.")
        super().__init__(output_dir, target=target, step=step, rename=rename)
        self.metric = settings.text(type(self).__name__, "metric", metric)
        self.group = settings.text(type(self).__name__, "group", group)
        self.policy = BestPolicy(metric=metric, group=group, mode=self.mode)

    def _repr_extra(self) -> str:
        return f", metric={self.metric!r}, group={self.group!r}" + super()._repr_extra()

    def _directory(self) -> Path:
        return self.output_dir / self.policy.subdir

    def _candidates(self, store: Store, damaged: dict[int, str]) -> list[int]:
        """The best first; nan, infinite and missing metrics last. A step whose meta is damaged is not ranked."""
        ranks = {}
        for step in store.steps():
            if step in damaged:
                continue
            found = steps.classify(store, step)
            if found.kind is StepKind.DAMAGED:
                steps.note_damaged(damaged, store.directory, step, found.why or "", "trying another one")
            elif found.error is not None:
                raise found.error  # not flaxstate's, or a newer flaxstate's: never passed over
            elif found.meta is not None:
                ranks[step] = self.policy.rank(found.meta.get("metrics") or {})
        return sorted(ranks, key=ranks.__getitem__)


class LowestCheckpointFileReader(_BestReader):
    """Restores the checkpoint with the lowest metric that `LowestCheckpointFileWriter` kept.

    Args:
        output_dir: the run's directory (the writer's subdirectory is found from metric and group).
        metric: the metric's name.
        group: the metric's group.
        target: the model's `init`, to start fresh when there is none.
        step: restore this step instead of the best.
        rename: regex rules from old paths to new ones.
    """

    mode = "min"


class HighestCheckpointFileReader(_BestReader):
    """Restores the checkpoint with the highest metric that `HighestCheckpointFileWriter` kept.

    Args:
        output_dir: the run's directory.
        metric: the metric's name.
        group: the metric's group.
        target: the model's `init`, to start fresh when there is none.
        step: restore this step instead of the best.
        rename: regex rules from old paths to new ones.
    """

    mode = "max"
