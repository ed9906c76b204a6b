"""Readers: restore the newest complete (or the best, or a given) checkpoint.

A reader is what `TrainLoop(init=...)` takes to resume a run: with `target`
(a model's `init`) it starts fresh when the directory holds no checkpoint.
It also restores a state on its own: `reader.restore(state)` gives back the
state with the checkpoint's values (an `InferenceState` reads no optimizer
state from disk).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from flaxstate.checkpoint.records import CheckpointFile
from flaxstate.checkpoint.storage import (
    CheckpointError,
    CheckpointStore,
    Rename,
    decode_rng,
    is_empty_or_missing,
)
from flaxstate.checkpoint.writers import best_subdir
from flaxstate.train_state import StateMismatchError

logger = logging.getLogger("flaxstate")


class CheckpointFileReader:
    """Restores the newest complete checkpoint of `output_dir` (or the one at `step`).

    Example:
        >>> reader = CheckpointFileReader("runs/mlp", target=model.init)  # doctest: +SKIP
        >>> loop = TrainLoop(init=reader, task=task, rng=jax.random.key(0))  # doctest: +SKIP
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

    def _directory(self) -> Path:
        return self.output_dir

    def _candidates(self, store: CheckpointStore) -> list[int]:
        """Steps to try, preferred first."""
        return sorted(store.steps(), reverse=True)

    def read(self, template: CheckpointFile | None) -> CheckpointFile | None:
        """Restores the checkpoint into the tree and shardings of `template.state`.

        Args:
            template: a fresh state in a `CheckpointFile`, or `None` to read
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
            raise CheckpointError(
                f"{directory} {what}; give the reader target=model.init to start fresh, "
                "or point it at a directory that a CheckpointFileWriter wrote."
            )
        store = CheckpointStore(directory, read_only=True)
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
        for step in steps:
            try:
                stored = store.read(step, state_dict, self.rename, with_optimizer=with_optimizer)
            except (StateMismatchError, CheckpointError):
                raise
            except Exception as error:  # a damaged checkpoint: say which, then fall back to an older one
                logger.warning("the checkpoint %s/%d is damaged (%s); trying an older one.", directory, step, error)
                errors.append(f"step {step}: {type(error).__name__}: {error}")
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

    def __call__(self, template: CheckpointFile | None = None) -> CheckpointFile | None:
        """The same as `read`."""
        return self.read(template)


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

    def _directory(self) -> Path:
        return self.output_dir / best_subdir(self.metric, self.group, self.mode)

    def _candidates(self, store: CheckpointStore) -> list[int]:
        def value(step: int) -> float:
            return float(store.read_meta(step)["metrics"][self.group][self.metric])

        return sorted(store.steps(), key=value, reverse=self.mode == "max")


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
