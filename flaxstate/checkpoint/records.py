"""The records a loop yields (`Checkpoint`, `Summary`) and what lands on disk (`CheckpointFile`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import jax

PyTree = Any
Metrics = Mapping[str, Mapping[str, float]]

FORMAT_VERSION = 2
"""The version of the on-disk layout that this flaxstate writes (older ones are upgraded on read)."""


@dataclasses.dataclass(frozen=True)
class Checkpoint:
    """The training state at one step, as `TrainLoop` yields it.

    Attributes:
        state: the train state: one copy of ordinary (un-stacked) arrays.
        grads: the gradients of the step's update (averaged across devices).
        loss: the step's loss (averaged across devices).
        n_completed_steps: steps run since the previous record.
        elapsed_time: seconds since the previous record.
        step: the state's step (total updates applied).
        rng: the loop's random key (restored on resume).
        data_position: where the training data stands after this step (JSON).
        final: whether this is the loop's last record (writers wait for their saves).
    """

    state: PyTree
    grads: PyTree
    loss: float
    n_completed_steps: int
    elapsed_time: float
    step: int
    rng: jax.Array | None = None
    data_position: Mapping[str, Any] | None = None
    final: bool = False

    @property
    def model_params(self) -> PyTree:
        """The model's parameters."""
        return self.state.params

    @property
    def model_state(self) -> PyTree:
        """The model's other (mutable) collections, e.g. batch statistics."""
        return self.state.flax_mutables

    @property
    def optimizer_state(self) -> PyTree:
        """The optax state."""
        return self.state.param_states


@dataclasses.dataclass(frozen=True)
class Summary(Checkpoint):
    """A checkpoint with metrics: `{group: {name: value}}`, e.g. `{"eval": {"loss": 0.1}}`."""

    metrics: Metrics = dataclasses.field(default_factory=dict)

    @classmethod
    def of(cls, checkpoint: Checkpoint, metrics: Metrics) -> Summary:
        """Returns a summary of `checkpoint` whose metrics extend any it already has."""
        merged = {group: dict(values) for group, values in getattr(checkpoint, "metrics", {}).items()}
        for group, values in metrics.items():
            merged.setdefault(group, {}).update(values)
        fields = {field.name: getattr(checkpoint, field.name) for field in dataclasses.fields(Checkpoint)}
        return cls(**fields, metrics=merged)


@dataclasses.dataclass(frozen=True)
class CheckpointFile:
    """What a checkpoint holds on disk, and what a reader gives back.

    Attributes:
        state: the train state (or an inference state restored from it).
        step: the step the state was saved at.
        rng: the training loop's random key.
        data_position: the training data's position (JSON), see `TrainLoop`.
        metrics: the record's metrics, if it was a `Summary`.
        metadata: the user's metadata (JSON), e.g. the run's config.
        format_version: the on-disk layout's version.
    """

    state: PyTree
    step: int
    rng: jax.Array | None = None
    data_position: Mapping[str, Any] | None = None
    metrics: Metrics = dataclasses.field(default_factory=dict)
    metadata: Any = None
    format_version: int = FORMAT_VERSION
