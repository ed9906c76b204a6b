"""Readers: restore the newest complete (or the best, or a given) checkpoint.

A reader is what `TrainLoop(init=...)` takes to resume a run: with `target`
(a model's `init`) it starts fresh when the directory holds no checkpoint.
It also restores a state on its own: `reader.restore(state)` gives back the
state with the checkpoint's values (an `InferenceState` reads no optimizer
state from disk).
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from flaxstate.checkpoint.best import BestPolicy
from flaxstate.checkpoint.storage import (
    LEGACY_RUN_ID,
    CheckpointError,
    CheckpointStore,
    Rename,
    damage_summary,
    decode_rng,
    is_damage,
    is_empty_or_missing,
)
from flaxstate.records import CheckpointFile

logger = logging.getLogger("flaxstate")


class _DamagedReadFilter(logging.Filter):
    """Drops asyncio's "Task exception was never retrieved" reports of a damaged checkpoint's reads.

    When one array of a damaged checkpoint fails to read, orbax's restore
    stops, and the other reads of that step that failed too are reported by
    asyncio one by one with tensorstore's whole spec. The reader has already
    said, in one line, which step is damaged and that it falls back.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        return not (error is not None and "never retrieved" in record.getMessage() and is_damage(error))


logging.getLogger("asyncio").addFilter(_DamagedReadFilter())


def _quiet_late_reads() -> None:
    """After a damaged read, drops the reports of its other reads finishing into orbax's closed event loop.

    Those reads complete on tensorstore's threads after orbax has closed the
    restore's event loop; each reports `RuntimeError: Event loop is closed`
    through `sys.unraisablehook`, sometimes before the restore has even
    raised. Installed once, before a reader's first read; every other report
    goes on to the previous hook.
    """
    previous = sys.unraisablehook
    if getattr(previous, "flaxstate_quiet_late_reads", False):
        return

    def hook(unraisable: Any) -> None:
        error = unraisable.exc_value
        if not (isinstance(error, RuntimeError) and str(error) == "Event loop is closed"):
            previous(unraisable)

    hook.flaxstate_quiet_late_reads = True  # type: ignore[attr-defined]
    sys.unraisablehook = hook


class CheckpointFileReader:
    """Restores the newest complete checkpoint of `output_dir` (or the one at `step`).

    Example:
        >>> import tempfile
        >>> reader = CheckpointFileReader(tempfile.mkdtemp(), target=lambda rngs, x: {"params": {}})
        >>> reader.read(None) is None  # no checkpoint yet, and a target: TrainLoop(init=reader) starts fresh
        True
    """

    def __init__(
        self,
        output_dir: str | Path,
        target: Callable[..., Any] | None = None,
        step: int | None = None,
        rename: Rename = None,
    ) -> None:
        """Points the reader at a directory (nothing is read yet).

        Args:
            output_dir: the directory a `CheckpointFileWriter` wrote.
            target: the model's `init`, to start fresh when there is no checkpoint.
            step: restore this step instead of the newest.
            rename: `{old regex: new}` on '/'-joined state-dict paths (e.g.
                `{"Dense_0/": "Encoder_0/"}`), to load a checkpoint of an
                earlier model layout.
        """
        self.output_dir = Path(output_dir)
        self.target = target
        self.step = step
        self.rename = rename

    def __repr__(self) -> str:
        return f"{type(self).__name__}({str(self.output_dir)!r}{self._repr_extra()})"

    def _repr_extra(self) -> str:
        return f", step={self.step}" if self.step is not None else ""

    def _directory(self) -> Path:
        return self.output_dir

    def _candidates(self, store: CheckpointStore) -> list[int]:
        """Steps to try, preferred first."""
        return sorted(store.steps(), reverse=True)

    def read(self, template: CheckpointFile | None) -> CheckpointFile | None:
        """Restores the checkpoint into the tree and shardings of `template.state`.

        Args:
            template: a state in a `CheckpointFile` (its leaves arrays or
                `jax.ShapeDtypeStruct`s with shardings), or `None` to read
                numpy arrays of the stored tree (a state dict) as the state.

        Returns:
            the restored checkpoint, or `None` when the directory holds none and
            a `target` was given (training starts fresh).

        Raises:
            CheckpointError: no checkpoint and no target, the step does not
                exist, not a flaxstate checkpoint, or every checkpoint damaged.
            StateMismatchError: the checkpoint does not fit the model, naming
                every differing path.
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
        with CheckpointStore(directory, read_only=True) as store:
            return self._read(store, template)

    def _read(self, store: CheckpointStore, template: CheckpointFile | None) -> CheckpointFile:
        directory = store.directory
        steps = self._candidates(store)
        if not steps:
            raise CheckpointError(f"{directory} holds no complete flaxstate checkpoint.")
        if self.step is not None:
            if self.step not in steps:
                raise CheckpointError(
                    f"{directory} has no checkpoint at step {self.step}; it has steps {sorted(steps)}."
                )
            steps = [self.step]
        state = template.state if template is not None else None
        state_dict = state.state_dict() if state is not None else None
        with_optimizer = state_dict is None or "param_states" in state_dict["state"]
        errors = []
        _quiet_late_reads()
        for step in steps:
            try:
                stored = store.read(step, state_dict, self.rename, with_optimizer=with_optimizer)
            except Exception as error:
                if not is_damage(error):
                    raise  # out of memory, a wrong template, a bug: never a reason to go back in time
                summary = damage_summary(error)
                logger.warning(
                    "the checkpoint %s is damaged (%s); trying an older one.", directory / str(step), summary
                )
                errors.append(f"step {step}: {summary}")
                continue
            restored = stored.state_dict
            if not with_optimizer:
                restored["state"] = {"step": np.int32(stored.meta["step"])}
            return CheckpointFile(
                state=state.restore_state(restored) if state is not None else restored,
                step=int(stored.meta["step"]),
                rng=decode_rng(stored.meta.get("rng")),
                data_position=stored.meta.get("data_position"),
                metrics=stored.meta.get("metrics", {}),
                metadata=stored.meta.get("metadata"),
                format_version=int(stored.meta["format_version"]),
                run_id=stored.meta.get("run_id", LEGACY_RUN_ID),
            )
        raise CheckpointError(
            f"every checkpoint in {directory} is damaged and none could be restored:\n  " + "\n  ".join(errors)
        )

    def restore(self, state: Any) -> Any:
        """Returns `state` with the checkpoint's values (same tree, same shardings).

        Args:
            state: a `FlaxOptimTrainState`, or an `InferenceState` (which
                reads no optimizer state from disk).

        Raises:
            CheckpointError: there is no checkpoint to restore.
        """
        restored = self.read(CheckpointFile(state=state, step=0))
        if restored is None:
            raise CheckpointError(f"{self._directory()} holds no checkpoint to restore.")
        return restored.state


class _BestReader(CheckpointFileReader):
    mode = "min"

    def __init__(
        self,
        output_dir: str | Path,
        metric: str,
        group: str = "eval",
        target: Callable[..., Any] | None = None,
        step: int | None = None,
        rename: Rename = None,
    ) -> None:
        super().__init__(output_dir, target=target, step=step, rename=rename)
        self.metric, self.group = metric, group
        self.policy = BestPolicy(metric=metric, group=group, mode=self.mode)

    def _repr_extra(self) -> str:
        return f", metric={self.metric!r}, group={self.group!r}" + super()._repr_extra()

    def _directory(self) -> Path:
        return self.output_dir / self.policy.subdir

    def _candidates(self, store: CheckpointStore) -> list[int]:
        """The best first; nan, infinite and missing metrics last."""
        return sorted(store.steps(), key=lambda step: self.policy.rank(store.read_meta(step).get("metrics", {})))


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
