"""The options of a training loop that need checking, checked once, at construction.

Each error names the setting, the value found and the fix, before anything
is read, compiled or restored. `LoopSpec` holds the options that shape the
programs a loop compiles, which `TrainLoop` and `fs.plan` both take from
their keywords: an option added to it reaches the plan with no second list
(MaxText compiles its dry run from the run's own config).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from flax.core.scope import CollectionFilter, DenyList

from flaxstate import settings
from flaxstate.training import copies, throughput


def _positive_int(name: str, value: Any, minimum: int = 1) -> int:
    return settings.count("TrainLoop", name, value, minimum)


@dataclasses.dataclass(frozen=True)
class Schedule:
    """How many steps, how often a record, how many steps a dispatch, how many microbatches a step.

    Attributes:
        n_steps: the total number of steps (0: none until `run` or `next_step` asks).
        n_steps_per_checkpoint: N; a record at steps N, 2N, ... and at the last.
        n_steps_per_dispatch: K steps in one compiled call; N must be a multiple of K.
        n_microbatches: M microbatches a step.

    Raises:
        ValueError: a count that is not a positive int (`n_steps`: not a
            non-negative int), or N not a multiple of K, naming both.
    """

    n_steps: int = 0
    n_steps_per_checkpoint: int = 1
    n_steps_per_dispatch: int = 1
    n_microbatches: int = 1

    def __post_init__(self) -> None:
        # Stored as Python ints (numpy's taken from a config): they reach the ledger's and the metadata's JSON.
        object.__setattr__(self, "n_steps", _positive_int("n_steps", self.n_steps, minimum=0))
        for name in ("n_steps_per_checkpoint", "n_steps_per_dispatch", "n_microbatches"):
            object.__setattr__(self, name, _positive_int(name, getattr(self, name)))
        if self.n_steps_per_checkpoint % self.n_steps_per_dispatch:
            raise ValueError(
                f"TrainLoop n_steps_per_checkpoint ({self.n_steps_per_checkpoint}) must be a multiple of "
                f"n_steps_per_dispatch ({self.n_steps_per_dispatch}): a record can only be taken between dispatches."
            )

    def next_record_step(self, step: int) -> int:
        """The step of the next record after `step`: the next multiple of N, or the last step."""
        every = self.n_steps_per_checkpoint
        return min(self.n_steps, (step // every + 1) * every)

    def dispatch_sizes(self, step: int, target: int) -> list[int]:
        """The steps of each dispatch from `step` to `target`: K at a time, then single steps for the rest."""
        remaining, per_dispatch = target - step, self.n_steps_per_dispatch
        return [per_dispatch] * (remaining // per_dispatch) + [1] * (remaining % per_dispatch)


def check_record_memory(record_memory: str, owner: str = "TrainLoop") -> str:
    """Returns `record_memory`, checked, naming `owner` (the call it was given to) in the error.

    Raises:
        ValueError: not one of `copies.RECORD_MEMORIES`.
    """
    if record_memory not in copies.RECORD_MEMORIES:
        raise ValueError(
            f"{owner} record_memory must be one of {copies.RECORD_MEMORIES}, got {record_memory!r}: "
            "'host' keeps records' copies in host memory (one copy of the state on the devices), 'device' on the "
            "devices (faster to make, room for the state twice)."
        )
    return record_memory


def check_flops_per_step(
    flops_per_step: float | str | Callable[[Any], float] | None,
) -> float | Callable[[Any], float] | None:
    """Returns `flops_per_step` checked: `None`, a function, or a positive number (a string of one parsed).

    Raises:
        ValueError: a value that is neither a function nor a positive finite number.
    """
    if flops_per_step is None or callable(flops_per_step):
        return flops_per_step
    return throughput.checked_flops(flops_per_step, "TrainLoop flops_per_step")


def check_peak_flops(peak_flops_per_device: float | str | None) -> float | None:
    """Returns `peak_flops_per_device` as a float, checked (a string such as "989e12", which YAML 1.1 reads, parsed).

    Raises:
        ValueError: given, and not a positive finite number.
    """
    if peak_flops_per_device is None:
        return None
    value: Any = peak_flops_per_device
    if isinstance(value, str):  # YAML 1.1 reads 989e12 (no dot before the e) as a string
        try:
            value = float(value)
        except ValueError:
            pass
    if not settings.is_real(value) or not math.isfinite(value) or value <= 0:
        raise ValueError(
            f"TrainLoop peak_flops_per_device must be a positive FLOP/s figure (e.g. 989e12 for an H100's dense "
            f"bfloat16), or None to look the devices up; got {peak_flops_per_device!r}."
        )
    return float(value)


def check_max_device_batch(owner: str, max_device_batch: Any, n_microbatches: int) -> int | None:
    """`max_device_batch`, checked: `None`, or a positive int given without `n_microbatches` (both set the
    microbatches).

    Raises:
        ValueError: not a positive int, or given beside `n_microbatches` other than 1, naming both.
    """
    if max_device_batch is None:
        return None
    max_device_batch = settings.count(owner, "max_device_batch", max_device_batch)
    if n_microbatches != 1:
        raise ValueError(
            f"{owner} got n_microbatches={n_microbatches} and max_device_batch={max_device_batch}: both set the "
            f"microbatches. Give max_device_batch alone ({owner} chooses the microbatches from each device's "
            "batch), or n_microbatches alone."
        )
    return max_device_batch


def rng_names(
    collections: Mapping[str, Sequence[str]] | None, owner: str = "TrainLoop"
) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The rng collection names at init and in training.

    Raises:
        ValueError: `collections` has keys other than `init` and `apply`.
    """
    if collections is None:
        return ("params", "dropout"), ("dropout",)
    unknown = set(collections) - {"init", "apply"}
    if unknown:
        raise ValueError(
            f"{owner} collections has keys {sorted(unknown)}; it maps 'init' and 'apply' to rng collection "
            "names, e.g. {'init': ['params', 'dropout'], 'apply': ['dropout']}."
        )
    return tuple(collections.get("init", ("params",))), tuple(collections.get("apply", ()))


@dataclasses.dataclass(frozen=True)
class LoopSpec:
    """The options that shape the programs a training loop compiles, checked once: what `TrainLoop` runs and
    `fs.plan` compiles for a target, each from its own keywords of these names.

    Attributes:
        n_steps_per_dispatch: K steps in one compiled call.
        n_microbatches: M microbatches a step (with `max_device_batch`, chosen from the data's batch).
        max_device_batch: the most examples a device may take at once, or `None`.
        collections: the rng collection names at init and in training (`{"init": [...], "apply": [...]}`), or
            `None` for `params` and `dropout` at init and `dropout` in training.
        mutable_collections: which collections the update may change.
        record_memory: where records hold their copy, `"host"` or `"device"`.
        record_gradients: whether records carry their last step's gradients.
        flops_per_step: a step's FLOPs (a number, or a function of the batch's shapes), or `None` to count them.
        owner: the door that took them, which each error names.

    Raises:
        ValueError: a setting that its check refuses, naming the door, the setting and the fix.
    """

    n_steps_per_dispatch: int = 1
    n_microbatches: int = 1
    max_device_batch: int | None = None
    collections: Mapping[str, Sequence[str]] | None = None
    mutable_collections: CollectionFilter = DenyList("intermediates")
    record_memory: str = copies.HOST
    record_gradients: bool = True
    flops_per_step: float | str | Callable[[Any], float] | None = None
    owner: str = dataclasses.field(default="TrainLoop", compare=False, repr=False)

    def __post_init__(self) -> None:
        owner = self.owner
        for name in ("n_steps_per_dispatch", "n_microbatches"):
            object.__setattr__(self, name, settings.count(owner, name, getattr(self, name)))
        max_device_batch = check_max_device_batch(owner, self.max_device_batch, self.n_microbatches)
        object.__setattr__(self, "max_device_batch", max_device_batch)
        rng_names(self.collections, owner)
        object.__setattr__(self, "record_memory", check_record_memory(self.record_memory, owner))
        object.__setattr__(self, "record_gradients", settings.flag(owner, "record_gradients", self.record_gradients))
        object.__setattr__(self, "flops_per_step", check_flops_per_step(self.flops_per_step))

    @property
    def init_names(self) -> tuple[str, ...]:
        """The rng collections the model takes at init."""
        return rng_names(self.collections, self.owner)[0]

    @property
    def apply_names(self) -> tuple[str, ...]:
        """The rng collections the model takes in training."""
        return rng_names(self.collections, self.owner)[1]

    @classmethod
    def names(cls) -> tuple[str, ...]:
        """The options' names: each a keyword of `TrainLoop` and of `fs.plan`."""
        return tuple(field.name for field in dataclasses.fields(cls) if field.name != "owner")

    @classmethod
    def taken(cls, owner: str, keywords: Mapping[str, Any]) -> LoopSpec:
        """The spec of a door's keywords (its `locals()` where it begins), each option by its own name.

        Raises:
            ValueError: as the spec's checks raise, naming `owner`.
        """
        return cls(**{name: keywords[name] for name in cls.names()}, owner=owner)
