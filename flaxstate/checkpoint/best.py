"""Which checkpoint is best: one policy (metric, group, mode) for writers, readers and the CLI.

The policy names the best writers' subdirectory, scores records for orbax's
`best_fn`, orders a reader's candidates, and is stored in every checkpoint's
`meta`, so `flaxstate ls` reads it back instead of parsing a directory name.
A metric that is nan or infinite is never better than a finite one.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any, Literal

from flaxstate.records import Metrics

Mode = Literal["min", "max"]


@dataclasses.dataclass(frozen=True)
class BestPolicy:
    """Keep the checkpoints whose `group/metric` is lowest (`mode="min"`) or highest (`"max"`).

    Example:
        >>> policy = BestPolicy(metric="loss", group="eval", mode="min")
        >>> policy.subdir
        'lowest-eval-loss'
        >>> sorted([1.0, float("nan"), 0.5], key=lambda v: policy.rank({"eval": {"loss": v}}))
        [0.5, 1.0, nan]
    """

    metric: str
    group: str = "eval"
    mode: Mode = "min"

    def __post_init__(self) -> None:
        if self.mode not in ("min", "max"):
            raise ValueError(f"BestPolicy mode must be 'min' or 'max', got {self.mode!r}.")

    @property
    def subdir(self) -> str:
        """The best writer's subdirectory of the run's directory, e.g. `lowest-eval-loss`."""
        return f"{'lowest' if self.mode == 'min' else 'highest'}-{self.group}-{self.metric}"

    @property
    def key(self) -> str:
        """The metric's '/'-joined name, e.g. `eval/loss`."""
        return f"{self.group}/{self.metric}"

    def value(self, metrics: Metrics) -> float | None:
        """The metric's value in `{group: {name: value}}`, or `None` when it is missing."""
        value = metrics.get(self.group, {}).get(self.metric)
        return None if value is None else float(value)

    def score(self, value: float) -> float:
        """A score that orbax's `best_fn` keeps the lowest (`min`) or highest (`max`) of.

        A nan or infinite value scores worst, so it never pushes out a finite one.
        """
        if math.isfinite(value):
            return value
        return math.inf if self.mode == "min" else -math.inf

    def rank(self, metrics: Metrics) -> tuple[int, float]:
        """A sort key, best first: finite values by the mode, then non-finite, then missing ones."""
        value = self.value(metrics)
        if value is None:
            return (2, 0.0)
        if not math.isfinite(value):
            return (1, 0.0)
        return (0, value if self.mode == "min" else -value)

    def to_json(self) -> dict[str, str]:
        """The policy as stored in a checkpoint's `meta`."""
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, stored: Mapping[str, Any] | None) -> BestPolicy | None:
        """The policy stored in a checkpoint's `meta` (`None` for a newest-checkpoint writer's)."""
        if not stored:
            return None
        return cls(metric=stored["metric"], group=stored["group"], mode=stored["mode"])
