"""The options of a training loop that need checking, checked once, at construction.

Each error names the setting, the value found and the fix, before anything
is read, compiled or restored.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

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
