"""A writer's claims on its directory: one open writer a directory, and one run's history in it.

Before a writer opens its store, `check_free` refuses a directory that
another open writer of this process is saving to, takes it over from an idle
one (a notebook cell run again: the old writer then refuses records), and
refuses a local tier that overlaps an open persistent one. At its first record, `claim` surveys the directory
(`survey`: each step's meta, read once) and applies the rules that both
tiers share:

- damaged steps (those the run's reader skipped, or whose meta is damage)
  are set aside (`<step>.damaged`, files kept): they are no other run's;
- steps of another run are refused in a shared directory, naming how to
  resume that run or where else to write, unless the writer has
  `overwrite=True` (they are removed); in a per-process store (a local tier
  that a new experiment shares with an old one) they are stale cache of
  another run, and are set aside (`<step>.other-run`, at most `keep` kept);
- this run's steps at or after the record's step (a run resumed from an
  earlier step) are refused in a shared directory (two histories would
  mix); in a per-process store they were left by a restart that fell back
  to the persistent tier, and are set aside (`<step>.superseded`, at most
  `keep` kept).

A shared store (one directory of every process) is changed by the primary
process only; in a per-process store every process claims its own part.
"""

from __future__ import annotations

import dataclasses
import logging
import weakref
from pathlib import Path
from typing import Any

import jax
from jax.experimental import multihost_utils

from flaxstate import locations
from flaxstate.checkpoint import steps
from flaxstate.checkpoint.errors import CheckpointError
from flaxstate.checkpoint.steps import StepKind
from flaxstate.checkpoint.stores import Store
from flaxstate.checkpoint.tiers import peers, restart
from flaxstate.locations import as_path
from flaxstate.records import Checkpoint

logger = logging.getLogger("flaxstate")

OTHER_RUN = ".other-run"
"""The suffix a local writer gives another run's steps that it finds in its directory: the persistent directory
defines the run, and a local tier shared by experiments (README's `/dev/shm/run`) holds another's stale cache."""

SUPERSEDED = ".superseded"
"""The suffix a local writer gives this run's steps that a restart from an older persistent step passed over."""

_OPEN: weakref.WeakValueDictionary[str, Any] = weakref.WeakValueDictionary()
"""The open writer of each directory (by resolved path): a registry of this process, because two writers made
by unrelated code (two chains, a notebook cell run twice) must still find each other to refuse a shared
directory; entries go with their writer (weak references)."""


def check_free(directory: Path, *, description: str, output_dir: Path, per_process: bool) -> str:
    """Refuses a directory that an open writer writes, or tiers that overlap an open writer's.

    Returns:
        the directory's key in the registry (its resolved path), for `register`.

    Raises:
        CheckpointError: naming the open writer, or both tiers' paths.
    """
    key = locations.key(directory)
    first = _OPEN.get(key)
    if first is not None and first.busy:
        raise CheckpointError(
            f"{directory} is already written by {first!r}, which is saving a record now; two writers on one "
            "directory would save the same steps twice. Give each writer its own directory, or close() the first one."
        )
    if first is not None:  # idle: a notebook cell that makes its writer, run again
        first.hand_over(description)
        logger.warning(
            "%s takes over %s from %r, made before in this process and idle (a notebook cell run again?); that "
            "writer refuses records from now on.",
            description,
            directory,
            first,
        )
    for other in list(_OPEN.values()):
        if other.per_process != per_process:  # one writer a local tier, the other persistent
            local, persistent = (output_dir, other.output_dir) if per_process else (other.output_dir, output_dir)
            overlap = restart.overlap(local, persistent)
            if overlap is not None:
                raise CheckpointError(
                    f"{description} and the open {other!r}: the local and persistent tiers {overlap}; "
                    + restart.tiers_apart_advice()
                )
    return key


def register(key: str, writer: Any) -> None:
    """Marks `key` as written by `writer` (until `release`, or until the writer is gone)."""
    _OPEN[key] = writer


def release(key: str, writer: Any) -> None:
    """Frees `key` if `writer` holds it."""
    if _OPEN.get(key) is writer:
        del _OPEN[key]


@dataclasses.dataclass(frozen=True)
class Survey:
    """What a directory holds, as a writer's first record sees it.

    Attributes:
        metas: each readable step's meta (`None`: a step that is not flaxstate's).
        damaged: the steps to set aside.
        others: the steps of another run.
        ahead: this run's steps at or after the record's step.
        run_of: each step's run (`"(unreadable)"` for one that is not flaxstate's).
    """

    metas: dict[int, dict[str, Any] | None]
    damaged: list[int]
    others: list[int]
    ahead: list[int]
    run_of: dict[int, str]

    def newest_own(self, checkpoint: Checkpoint) -> int | None:
        """This run's newest step before the record's (the one it resumed from), or `None`."""
        own = [step for step in self.metas if step not in self.others and step < checkpoint.step]
        return max(own, default=None)


def survey(store: Store, checkpoint: Checkpoint) -> Survey:
    """Reads each step's meta once and sorts the steps (see `Survey`)."""
    skipped = {locations.key(as_path(path)) for path in checkpoint.skipped_damaged}
    metas: dict[int, dict[str, Any] | None] = {}
    damaged = []
    run_of: dict[int, str] = {}
    for step in store.steps():
        if locations.key(store.directory / str(step)) in skipped:
            damaged.append(step)
            continue
        found = steps.classify(store, step)
        if found.kind is StepKind.DAMAGED:
            damaged.append(step)
        elif found.kind is not StepKind.VANISHING:
            metas[step] = found.meta  # None: not flaxstate's (FOREIGN), which the claim refuses
            run_of[step] = found.run_id or "(unreadable)"
    others = sorted(step for step, run_id in run_of.items() if run_id != checkpoint.run_id)
    ahead = sorted(step for step in metas if step not in others and step >= checkpoint.step)
    return Survey(metas, damaged, others, ahead, run_of)


def claim(store: Store, checkpoint: Checkpoint, *, overwrite: bool, keep: int, writer: Any) -> Survey:
    """Checks (or, with `overwrite`, clears) a writer's directory before its first save (see the module's rules).

    Args:
        store: the writer's store.
        checkpoint: its first record.
        overwrite: remove what would be refused.
        keep: at most this many superseded steps are kept (per-process stores).
        writer: named in the log lines (its repr).

    Returns:
        what the directory held.

    Raises:
        CheckpointError: another run's steps, or (shared) this run's at or
            after the record's step, without `overwrite`.
    """
    found = survey(store, checkpoint)
    _set_aside_damaged(store, found.damaged, writer)
    if store.shared:
        _claim_shared(store, checkpoint, found, overwrite, writer)
    else:
        _claim_per_process(store, checkpoint, found, overwrite, keep, writer)
    return found


def _set_aside_damaged(store: Store, damaged: list[int], writer: Any) -> None:
    """Moves damaged steps aside (`<step>.damaged`, files kept) and removes unfinished saves' folders."""
    if jax.process_index() == 0 or not store.shared:
        for step in damaged:
            target = store.set_aside(step)
            logger.warning("%r: the damaged checkpoint of step %d is set aside as %s.", writer, step, target)
        removed = store.remove_unfinished()
        if removed:
            names = ", ".join(path.name for path in removed)
            logger.warning("%r: removed the folders of saves that did not finish: %s.", writer, names)
    if jax.process_count() > 1 and damaged and store.shared:
        multihost_utils.sync_global_devices("flaxstate: damaged steps set aside")


def _claim_shared(store: Store, checkpoint: Checkpoint, found: Survey, overwrite: bool, writer: Any) -> None:
    """One directory of every process: another run's steps, and this run's ahead of the record, are refused."""
    refused = found.others + found.ahead
    if not refused:
        return
    if not overwrite:
        raise CheckpointError(_refusal(store.directory, checkpoint, found, found.ahead))
    if jax.process_index() == 0:
        logger.warning("%r: overwrite=True, removing steps %s of %s.", writer, refused, store.directory)
    store.delete(refused)


def _claim_per_process(
    store: Store, checkpoint: Checkpoint, found: Survey, overwrite: bool, keep: int, writer: Any
) -> None:
    """A local tier: every process checks its own part, and all refuse if one must.

    Neither is refused: the persistent directory defines the run, and the
    reader never restores a local step of another run. Another run's steps
    (a new experiment beside an old one's local tier) are set aside as
    `<step>.other-run` (removed with `overwrite`), and this run's steps at or
    after the record's (left by a restart that restored an older persistent
    step) as `<step>.superseded`; at most `keep` of each are kept.
    """
    if found.others and overwrite:
        logger.warning("%r: overwrite=True, removing steps %s of %s.", writer, found.others, store.directory)
        store.delete(found.others)
    elif found.others:
        runs = sorted({found.run_of[step] for step in found.others})
        moved = [store.set_aside(step, OTHER_RUN) for step in found.others]
        logger.warning(
            "%r: steps %s are of another run (%s), not this one (%s, whose persistent directory defines it); they "
            "are set aside as %s.",
            writer,
            found.others,
            ", ".join(runs),
            checkpoint.run_id,
            ", ".join(path.name for path in moved),
        )
        _prune(store, OTHER_RUN, keep, writer)
    if not store.shared:  # a local tier: copies of other processes' steps from the history this restart left
        dropped = peers.drop_copies_from(store.directory, checkpoint.step)
        if dropped:
            logger.warning("%r: removed peer copies of steps %s, at or after this record's.", writer, dropped)
    if found.ahead:
        moved = [store.set_aside(step, SUPERSEDED) for step in found.ahead]
        logger.warning(
            "%r: steps %s of this run are at or after this record's step %d (the restart resumed from an "
            "earlier step, of another tier); they are set aside as %s.",
            writer,
            found.ahead,
            checkpoint.step,
            ", ".join(path.name for path in moved),
        )
        _prune(store, SUPERSEDED, keep, writer)


def _prune(store: Store, suffix: str, keep: int, writer: Any) -> None:
    """Removes the oldest steps set aside with `suffix` beyond `keep`, in one line."""
    pruned = store.prune_aside(suffix, keep)
    if pruned:
        logger.warning(
            "%r: removed the oldest steps set aside (%s kept at most): %s.",
            writer,
            keep,
            ", ".join(path.name for path in pruned),
        )


def _refusal(directory: Path, checkpoint: Checkpoint, found: Survey, ahead: list[int]) -> str:
    """Why a writer refuses its directory, and what to do (another run's steps first, else this run's `ahead`)."""
    if found.others:
        runs = sorted({found.run_of[step] for step in found.others})
        return (
            f"{directory} holds checkpoints of another run (steps {found.others}, run {', '.join(runs)}); "
            f"this run ({checkpoint.run_id}) would mix with them and its checkpoints would not be the "
            f"newest. To resume that run, give TrainLoop init=CheckpointFileReader({str(directory)!r}, "
            "target=model.init); to replace it, make the writer with overwrite=True (its checkpoints are "
            "removed first); or write to another directory."
        )
    return (
        f"{directory} already holds steps {ahead} of this run, at or after the record's step "
        f"{checkpoint.step} (was it resumed from an earlier checkpoint?); saving would mix two histories. "
        "Make the writer with overwrite=True to remove those steps first, or write to another directory."
    )
