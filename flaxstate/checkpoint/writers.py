"""Writers: callables that save a record and return it unchanged.

`CheckpointFileWriter(output_dir)` keeps the newest checkpoints in
`output_dir/<step>/`; `LowestCheckpointFileWriter` and
`HighestCheckpointFileWriter` keep the best by a metric in their own
subdirectory (`output_dir/lowest-eval-loss/<step>/`), so writers sharing
`output_dir` never collide and resume never picks a best checkpoint.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from flaxstate.checkpoint.records import Checkpoint
from flaxstate.checkpoint.storage import CheckpointStore, encode_rng, to_json


def best_subdir(metric: str, group: str, mode: str) -> str:
    """Returns the subdirectory name of a best-metric writer, e.g. `lowest-eval-loss`."""
    return f"{'lowest' if mode == 'min' else 'highest'}-{group}-{metric}"


def record_meta(checkpoint: Checkpoint, metadata: Any) -> dict[str, Any]:
    """Returns what a record stores as JSON beside its arrays."""
    return {
        "step": int(checkpoint.step),
        "loss": float(checkpoint.loss),
        "rng": encode_rng(checkpoint.rng),
        "data_position": checkpoint.data_position,
        "metrics": {g: dict(v) for g, v in getattr(checkpoint, "metrics", {}).items()},
        "metadata": metadata,
    }


class _Writer:
    def __init__(self, directory: Path, keep: int, metadata: Any, best: tuple[str, str, str] | None) -> None:
        if keep < 1:
            raise ValueError(f"keep must be at least 1, got {keep}.")
        self.output_dir = directory
        self._metadata = to_json(metadata)
        self._best = best
        self._store = CheckpointStore(directory, keep=keep, best=best)

    def _metrics(self, checkpoint: Checkpoint) -> Mapping[str, float] | None:
        return None

    def __call__(self, checkpoint: Checkpoint) -> Checkpoint:
        """Saves the record (asynchronously; waits for the final record) and returns it.

        In one process the record's arrays are read by a background thread:
        do not donate or delete them before `wait()` (TrainLoop's records
        hold copies that nothing donates).

        Raises:
            CheckpointSaveError: this save or the previous one failed, naming the step.
        """
        metrics = self._metrics(checkpoint)
        self._store.save(
            int(checkpoint.step), checkpoint.state.state_dict(), record_meta(checkpoint, self._metadata), metrics
        )
        if checkpoint.final:
            self.wait()
        return checkpoint

    def wait(self) -> None:
        """Waits until the pending save is on disk.

        Raises:
            CheckpointSaveError: it failed, naming its step.
        """
        self._store.wait()


class CheckpointFileWriter(_Writer):
    """Saves each record to `output_dir/<step>/` and keeps the newest `keep`.

    Example:
        >>> writer = CheckpointFileWriter("runs/mlp", keep=3)  # doctest: +SKIP
        >>> checkpoint = writer(checkpoint)  # returns its input: compose with redex  # doctest: +SKIP
    """

    def __init__(self, output_dir: str | Path, keep: int = 1, metadata: Any = None) -> None:
        """Opens (or creates) the directory.

        Args:
            output_dir: the run's directory.
            keep: how many of the newest checkpoints to keep.
            metadata: a dict or dataclass (e.g. the run's config) stored as JSON.
        """
        super().__init__(Path(output_dir), keep, metadata, best=None)


class _BestWriter(_Writer):
    mode = "min"

    def __init__(
        self, output_dir: str | Path, metric: str, group: str = "eval", keep: int = 1, metadata: Any = None
    ) -> None:
        self.metric, self.group = metric, group
        directory = Path(output_dir) / best_subdir(metric, group, self.mode)
        super().__init__(directory, keep, metadata, best=(group, metric, self.mode))

    def _metrics(self, checkpoint: Checkpoint) -> Mapping[str, float]:
        metrics = getattr(checkpoint, "metrics", None) or {}
        if self.metric not in metrics.get(self.group, {}):
            found = {group: sorted(values) for group, values in metrics.items()}
            raise ValueError(
                f"{type(self).__name__} needs the metric {self.metric!r} in group {self.group!r}, but the "
                f"record has {found or 'no metrics'}; put an EvalLoop before it, or name a metric it has."
            )
        return {f"{self.group}/{self.metric}": float(metrics[self.group][self.metric])}


class LowestCheckpointFileWriter(_BestWriter):
    """Keeps the `keep` checkpoints with the lowest metric in `output_dir/lowest-<group>-<metric>/`.

    Args:
        output_dir: the run's directory.
        metric: the metric's name, e.g. "loss".
        group: the metric's group, e.g. "eval".
        keep: how many of the best to keep.
        metadata: a dict or dataclass stored as JSON.

    Raises:
        ValueError: (when called) the record has no such metric, naming what it has.
    """

    mode = "min"


class HighestCheckpointFileWriter(_BestWriter):
    """Keeps the `keep` checkpoints with the highest metric in `output_dir/highest-<group>-<metric>/`.

    Args:
        output_dir: the run's directory.
        metric: the metric's name, e.g. "acc".
        group: the metric's group, e.g. "eval".
        keep: how many of the best to keep.
        metadata: a dict or dataclass stored as JSON.

    Raises:
        ValueError: (when called) the record has no such metric, naming what it has.
    """

    mode = "max"
