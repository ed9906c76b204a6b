"""What a step of a store is, and the one way a step is read while a writer may delete it.

`classify` answers "is this step readable?" for every reader of a
directory (the reader, its tiers, a writer's claim, `ls`, `show`, `diff`):

- `COMPLETE`: its meta reads and validates (of `run_id`'s run, when one is asked);
- `PARTIAL`: a save that did not finish (still running, failed or killed),
  which no reader takes and a writer removes (`partial_steps`);
- `DAMAGED`: missing, truncated or invalid files, named with the file and
  the field; a reader passes over it, a writer sets it aside;
- `VANISHING`: listed, then deleted while it was read (a live writer
  rotating): never damage, the steps are listed again;
- `FOREIGN`: no flaxstate checkpoint, or one of a newer flaxstate: never
  passed over as if it were damage;
- `ANOTHER_RUN`: a complete step of another run than the one asked for.

`read_first` is the retry policy: try the steps preferred first, list
again when one vanishes (`attempts()`: 20 times and 30 s at the least), pass over a
damaged one, and raise anything else (out of memory, a bug, a Ctrl-C: a
reader never goes back in time for those).
"""

from __future__ import annotations

import dataclasses
import enum
import itertools
import logging
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Protocol, TypeVar

from flaxstate import locations
from flaxstate.checkpoint import damage, layout
from flaxstate.checkpoint.errors import CheckpointError
from flaxstate.checkpoint.layout import LEGACY_RUN_ID

logger = logging.getLogger("flaxstate")

LISTING_ATTEMPTS = 20
"""How often the steps are listed again, at the least, when the one read was deleted meanwhile (a live writer's
rotation)."""
LISTING_SECONDS = 30.0
"""How long, at the least, the steps are listed again when they keep vanishing: on a loaded machine a read can
lose many races in a row to a writer that rotates as fast as it saves (20 attempts in 2 s lost them all, with a
second test run beside it)."""


def _now() -> float:
    return time.monotonic()


def attempts() -> Iterator[int]:
    """Counts the attempts of a read beside a live writer: `LISTING_ATTEMPTS` and `LISTING_SECONDS`, both at the
    least."""
    start = _now()
    for attempt in itertools.count():
        if attempt >= LISTING_ATTEMPTS and _now() - start >= LISTING_SECONDS:
            return
        yield attempt


VANISHING_SECONDS = 1.0
"""How long a step whose read failed is watched for disappearing (a writer's rotation deletes it file by file)
before the failure is taken for damage."""

T = TypeVar("T")


class VanishedStepError(CheckpointError):
    """A step that was listed and is gone: a live writer deleted it meanwhile (never damage)."""


class _Steps(Protocol):
    directory: Path

    def steps(self) -> list[int]: ...

    def read_meta(self, step: int) -> dict[str, Any]: ...

    def unfinished(self) -> list[Path]: ...


class StepKind(enum.Enum):
    """What a step of a store is (see the module)."""

    COMPLETE = "complete"
    PARTIAL = "partial"
    DAMAGED = "damaged"
    VANISHING = "vanishing"
    FOREIGN = "foreign"
    ANOTHER_RUN = "another run"


@dataclasses.dataclass(frozen=True)
class StepState:
    """One step, classified.

    Attributes:
        step: the step.
        kind: what it is.
        meta: its meta (`COMPLETE` and `ANOTHER_RUN`), else `None`.
        why: what is wrong with it, one line naming the file and the field
            (`DAMAGED`, `FOREIGN`), else `None`.
    """

    step: int
    kind: StepKind
    meta: dict[str, Any] | None = None
    why: str | None = None
    error: BaseException | None = dataclasses.field(default=None, compare=False, repr=False)
    """The read's error (`DAMAGED`, `FOREIGN`), to raise where the caller must not pass over it."""

    @property
    def run_id(self) -> str | None:
        """The step's run (`LEGACY_RUN_ID` for a checkpoint of a format before runs had ids), `None` unread."""
        return None if self.meta is None else self.meta.get("run_id", LEGACY_RUN_ID)


def classify(store: _Steps, step: int, run_id: str | None = None) -> StepState:
    """Says what a listed step is, reading its meta once.

    Args:
        store: the step's store.
        step: a step it lists.
        run_id: the run the caller is of; a complete step of another is `ANOTHER_RUN`.

    Raises:
        KeyboardInterrupt: Ctrl-C, wherever the read wrapped it.
        Exception: a read that failed for any reason but damage, deletion or
            a foreign format (out of memory, a bug).
    """
    try:
        meta = store.read_meta(step)
    except VanishedStepError:
        return StepState(step, StepKind.VANISHING)
    except Exception as error:
        damage.reraise_interrupt(error)
        if damage.is_damage(error):
            return StepState(step, StepKind.DAMAGED, why=damage.summary(error), error=error)
        if isinstance(error, CheckpointError):
            return StepState(step, StepKind.FOREIGN, why=damage.summary(error), error=error)
        raise
    state = StepState(step, StepKind.COMPLETE, meta)
    if run_id is not None and state.run_id != run_id:
        return dataclasses.replace(state, kind=StepKind.ANOTHER_RUN)
    return state


def reading(step_dir: Path, read: Callable[[], T]) -> T:
    """Runs a read of one step: a Ctrl-C comes out as `KeyboardInterrupt`, a step deleted meanwhile as
    `VanishedStepError`, anything else as it was raised.

    A read that failed on files which read but do not validate is no
    deletion in progress; any other failure is taken for a deletion when the
    step's directory disappears within `VANISHING_SECONDS`.
    """
    try:
        return read()
    except Exception as error:
        damage.reraise_interrupt(error)
        locations.forget_listings(step_dir)
        if isinstance(error, damage.DamagedCheckpointError):
            gone = not step_dir.is_dir()
        else:
            gone = _disappears(step_dir)
        if gone:
            raise VanishedStepError(f"{step_dir} was deleted while it was read.") from error
        raise


def _disappears(step_dir: Path) -> bool:
    """Whether a step's directory is gone, or goes within `VANISHING_SECONDS`."""
    deadline = time.monotonic() + VANISHING_SECONDS
    while step_dir.is_dir():
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)
        locations.forget_listings(step_dir)
    return True


def partial_steps(store: _Steps) -> list[StepState]:
    """The store's saves that did not finish (`PARTIAL`), by the step in their folder's name."""
    return [StepState(int(path.name.split(".")[0]), StepKind.PARTIAL, why=path.name) for path in store.unfinished()]


def read_first(
    directory: Path,
    candidates: Callable[[], list[int]],
    read: Callable[[int], T],
    damaged: dict[int, str],
    *,
    warning: str = "trying another one",
) -> T:
    """Reads the first step of `candidates` that reads, listing again when one vanishes.

    Args:
        directory: the store's directory (named in warnings and errors).
        candidates: lists the steps to try, preferred first (called again after a step vanished).
        read: reads one step (raising `VanishedStepError` when it was deleted meanwhile).
        damaged: filled with each damaged step and what is wrong with it (one
            warning each); steps already in it are not tried.
        warning: the end of each damaged step's warning.

    Returns:
        what `read` returned for the first step that read.

    Raises:
        CheckpointError: no step could be read: none listed, every one
            damaged (naming each and what is wrong), or steps kept vanishing.
        Exception: a read's failure that is not damage, as it was raised.
    """
    vanished = False
    for _ in attempts():
        steps = [step for step in candidates() if step not in damaged]
        if not steps and not damaged and not layout.is_empty_or_missing(directory):
            time.sleep(0.05)  # a step being deleted, and the next one not yet renamed into place
            continue
        for step in steps:
            try:
                return read(step)
            except VanishedStepError:
                vanished = True
                break  # a live writer deleted it: list again
            except Exception as error:
                damage.reraise_interrupt(error)
                if not damage.is_damage(error):
                    raise
                note_damaged(damaged, directory, step, damage.summary(error), warning)
        else:
            break  # every candidate was tried, and none vanished
    else:
        if vanished:
            raise CheckpointError(
                f"{directory}: its steps kept vanishing while they were read; is a writer deleting them?"
            )
    if not damaged:
        raise CheckpointError(f"{directory} holds no complete flaxstate checkpoint.")
    each = [f"step {step}: {summary}" for step, summary in damaged.items()]
    separator = " " if len(each) == 1 else "\n  "  # one damaged step: one line (the command line shows the first)
    raise CheckpointError(
        f"every checkpoint in {directory} is damaged and none could be restored:{separator}" + "\n  ".join(each)
    )


def retrying(directory: Path, attempt: Callable[[], T]) -> T:
    """Runs `attempt` again (from its own listing) when a step it reads vanishes meanwhile.

    Raises:
        CheckpointError: steps kept vanishing for the `attempts()`.
    """
    for _ in attempts():
        try:
            return attempt()
        except VanishedStepError:
            time.sleep(0.05)
    raise CheckpointError(f"{directory}: its steps kept vanishing while they were read; is a writer deleting them?")


def note_damaged(damaged: dict[int, str], directory: Path, step: int, why: str, warning: str) -> None:
    """Notes a damaged step and what is wrong with it, and says so in one warning."""
    damaged[step] = why
    logger.warning("the checkpoint %s is damaged (%s); %s.", directory / str(step), why, warning)
