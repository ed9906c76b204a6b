"""Which tier a restart restores from: the newest local step that every process holds, or the persistent tier.

`CheckpointFileReader([local_dir, persistent_dir])` asks `read_tiers` once,
and gets the step and where it came from: the tiers own the two-tier read
(they agree on the step, read it together or fall back together, and say
why). Each process lists its own local steps (`flaxstate.checkpoint.stores.local`)
that are whole and fit the template on its devices; one small collective
gathers them, and the newest step that every process holds, of the
persistent directory's run, is taken when it is newer than the persistent
tier's newest. The persistent directory's run is its newest step's, or, before
its first save, its goodput ledger's; a new directory has none, so another
run's local steps (one /dev/shm path shared by every experiment on a host)
never restore into a new experiment. Otherwise the persistent tier restores
(or the run starts fresh), and the primary process says why in one line: a
process with no local steps (a replaced host), another process count or
mesh, a damaged local step, a local step of another run, or a persistent
step as new.

With peer copies (`flaxstate.checkpoint.tiers.peers`), a step also counts as whole
when a process that lacks it has its parts kept by another process: a peer's
copy of them, or a data-parallel replica's own step (a process whose devices
need exactly the parts that the lacking process's need). Those parts move
back to it (one collective a round), it writes them into its own directory
as its own, and all read the step as usual. The primary names each process
whose parts came from a peer, and which.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Generic, Protocol, TypeVar

import jax

from flaxstate import collectives
from flaxstate.checkpoint import damage, steps, stores
from flaxstate.checkpoint.budget import UNBOUNDED, HostMemoryBudget
from flaxstate.checkpoint.damage import DamagedCheckpointError
from flaxstate.checkpoint.layout import StoredCheckpoint, is_empty_or_missing
from flaxstate.checkpoint.steps import StepKind
from flaxstate.checkpoint.stores import parts
from flaxstate.checkpoint.stores.local import LocalStore, process_directory
from flaxstate.checkpoint.tiers import agreement, peers
from flaxstate.locations import is_url
from flaxstate.run_record import ledger

logger = logging.getLogger("flaxstate")

CANDIDATES = 8
"""How many of its newest local steps each process offers (a run keeps a few)."""


def overlap(local_dir: Path, persistent_dir: Path) -> str | None:
    """How the two tiers' directories overlap ("are the same directory", "... inside ..."), or `None` if apart."""
    if is_url(local_dir) or is_url(persistent_dir):  # a bucket and a local disk never overlap
        return None
    local, persistent = Path(local_dir).absolute().resolve(), Path(persistent_dir).absolute().resolve()
    if local == persistent:
        return f"are the same directory, {local}"
    if persistent in local.parents:
        return f"overlap: the local tier {local} is inside the persistent tier {persistent}"
    if local in persistent.parents:
        return f"overlap: the persistent tier {persistent} is inside the local tier {local}"
    return None


def tiers_apart_advice() -> str:
    """What to do about overlapping tiers."""
    return (
        "each tier lists, removes and sets aside steps in its own directory, so one would take the other's "
        "files for its own. Give the local tier a directory of its own on each host (e.g. /dev/shm/run) and "
        "the persistent tier another (e.g. a shared filesystem's runs/exp1)."
    )


@dataclasses.dataclass(frozen=True)
class LocalStep:
    """A local step that every process holds whole: this process's store, the step, and its meta.

    `meta` is `None` on a process whose own directory lacks the step: its
    parts come back from the peer that keeps them (`transfers`, then `meta`
    is the received step's).
    """

    store: LocalStore
    step: int
    meta: dict[str, Any] | None
    transfers: tuple[tuple[int, bool, int], ...] = ()
    """(holder, as a copy, owner): each process whose parts come from a peer, that peer, and whether from its copy
    (else from its own step, a data-parallel replica's)."""


def _offer(
    store: LocalStore, listed: list[int], template: Mapping[str, Any] | None, with_optimizer: bool, step: int | None
) -> tuple[dict[int, dict[str, Any]], str | None]:
    """This process's steps of `listed` that fit `template`, newest first, and why its newest does not."""
    held: dict[int, dict[str, Any]] = {}
    wanted = [s for s in reversed(listed) if step is None or s == step]
    if not wanted:
        return held, "it holds no local step (a new or replaced host?)" if step is None else f"no local step {step}"
    if template is None:
        return held, "the read has no template to place the arrays on, or renames paths (the persistent tier's)"
    note = None
    for candidate in wanted:
        found = steps.classify(store, candidate)
        if found.kind is StepKind.VANISHING:
            continue
        if found.meta is None:  # damage, or a newer flaxstate's format
            where = store.directory / str(candidate)
            logger.warning("the local checkpoint %s cannot be restored (%s).", where, found.why)
            note = note or f"step {candidate}: {found.why}"
            continue
        meta = found.meta
        why = parts.covers(meta, template, with_optimizer)
        if why is not None:
            note = note or f"step {candidate}: {why}"
            continue
        held[candidate] = meta
        if len(held) == CANDIDATES:
            break
    return held, note


def _offer_copies(store: LocalStore, step: int | None) -> dict[int, frozenset[agreement.Pair]]:
    """The other processes' steps this process keeps (peer copies) of this process count: `{owner: {(step, run)}}`.

    A damaged copy is set aside (`<step>.damaged`, files kept) with a warning, and not offered.
    """
    offered: dict[int, frozenset[agreement.Pair]] = {}
    for owner in range(jax.process_count()):
        where = peers.copies_directory(store.directory, owner)
        if owner == jax.process_index() or not where.is_dir():
            continue
        copies = LocalStore(where, read_only=True)
        held = []
        for candidate in [s for s in reversed(copies.steps()) if step is None or s == step][:CANDIDATES]:
            found = steps.classify(copies, candidate)
            if found.kind is StepKind.VANISHING:
                continue
            if found.meta is None:
                aside = copies.set_aside(candidate)
                logger.warning(
                    "the peer copy %s cannot be restored (%s); set aside as %s.",
                    where / str(candidate),
                    found.why,
                    aside,
                )
                continue
            if found.meta.get("processes") == jax.process_count() and found.meta.get("process_index") == owner:
                held.append((candidate, found.meta.get("run_id")))
        if held:
            offered[owner] = frozenset(held)
    return offered


@dataclasses.dataclass(frozen=True)
class Agreement:
    """What the processes agreed on: the local step to restore (or `None`), and why.

    Attributes:
        local: the local step to restore; `None`: the persistent tier.
        why: one line that says which tier and why.
        passed_over: a local step newer than the persistent tier's is passed
            over (worth a warning: progress is lost).
        persistent: the persistent tier's newest step as the processes see it
            (the newest of their views), or `None`.
    """

    local: LocalStep | None
    why: str
    passed_over: bool
    persistent: int | None


def agreed_local_step(
    local_dir: Path,
    template: Mapping[str, Any] | None,
    with_optimizer: bool,
    persistent_newest: int | None,
    persistent_run: str | None,
    step: int | None = None,
) -> Agreement:
    """The newest local step of the persistent tier's run whole on every process, when newer (a collective).

    A local step of another run is never restored: the local directory is
    often one path that every run on the host shares (/dev/shm/run), and a
    new experiment must not resume an old one's state.

    Args:
        local_dir: the local tier's directory (each process reads its own part).
        template: the state dict to restore into (its shardings), or `None`.
        with_optimizer: whether the optimizer's arrays are restored.
        persistent_newest: this process's view of the persistent tier's newest step.
        persistent_run: the persistent directory's run (its newest step's, or
            its ledger's), or `None` for a new directory.
        step: only this step (a reader made with `step=`).

    Returns:
        the agreement: the local step to restore or `None`, and why.
    """
    store = LocalStore(process_directory(local_dir), read_only=True)
    listed = store.steps()
    held, note = _offer(store, listed, template, with_optimizer, step)
    mine = agreement.Offer(
        held=frozenset((s, meta.get("run_id")) for s, meta in held.items()),
        copies=_offer_copies(store, step) if template is not None else {},
        needs=peers.fingerprint(parts.needed_parts(template, with_optimizer)) if template is not None else None,
        note=note,
        persistent=persistent_newest,
        run=persistent_run,
        newest=listed[-1] if listed else None,
    )
    gathered = collectives.allgather_json(mine.to_json())
    offers = agreement.Offers([agreement.Offer.from_json(offer) for offer in gathered])
    persistent = offers.persistent
    whole = offers.whole()
    if not whole:
        return Agreement(None, offers.why_none_whole(), offers.passed_over, persistent)
    ours = {pair for pair in whole if pair[1] == offers.run}
    if not ours:
        return Agreement(None, _another_run(max(whole), offers.run), True, persistent)
    newest_pair = max(ours)
    newest = newest_pair[0]
    if persistent is not None and newest <= persistent:
        why = f"the local tier's newest step {newest} is no newer than the persistent tier's {persistent}"
        return Agreement(None, why, False, persistent)
    transfers = offers.transfers(newest_pair)
    chosen = LocalStep(store, newest, held.get(newest), transfers)
    if transfers:
        why = f"step {newest} is whole in the local tiers, counting the parts that peers keep"
    else:
        why = f"step {newest} is whole in every process's local tier"
    return Agreement(chosen, why, False, persistent)


def _bring_back(chosen: LocalStep, host_memory_budget: HostMemoryBudget) -> LocalStep:
    """Moves each lost process's parts of the chosen step from the peer that keeps them (`peers.bring_back`)."""
    meta = peers.bring_back(chosen.store, chosen.step, chosen.transfers, chosen.meta, host_memory_budget)
    assert meta is not None
    return dataclasses.replace(chosen, meta=meta)


def _another_run(newest: tuple[int, str | None], run: str | None) -> str:
    """Why the local tier's newest step, of another run than the persistent directory's, is not restored."""
    step, its_run = newest
    whose = (
        "the persistent directory is new (it holds no checkpoint and no goodput ledger)"
        if run is None
        else f"the persistent directory's checkpoints are of run {run}"
    )
    return (
        f"the local tier's step {step} is of run {its_run}, and {whose}: a run restores only its own local "
        "steps. Its local writer refuses to mix with the other "
        "run's steps: give that CheckpointFileWriter overwrite=True (they are removed) or a directory of its "
        f"own; to resume run {its_run} instead, point the reader's persistent tier at that run's directory"
    )


@dataclasses.dataclass(frozen=True)
class LocalRead:
    """What the two-tier read gave: the local step read (or none), and the persistent tier's newest step.

    Attributes:
        local: the local step restored, or `None`: the persistent tier restores.
        stored: its state dict and meta (`None` with `local`).
        persistent: the persistent tier's newest step as the processes agreed on it.
    """

    local: LocalStep | None
    stored: StoredCheckpoint | None
    persistent: int | None


class PersistentStep(Protocol):
    """What the tiers need of a persistent tier's read: its step and its run (to agree again against it)."""

    @property
    def step(self) -> int: ...

    @property
    def run_id(self) -> str | None: ...


P = TypeVar("P", bound=PersistentStep)


@dataclasses.dataclass(frozen=True)
class TierRead(Generic[P]):
    """What a two-tier restart restored, and where from.

    Attributes:
        local: the local step read (its state dict and meta), or `None`.
        persistent: the persistent tier's read, where one was made (also
            when a local step restores after it: it says which persistent
            steps were found damaged).
        directory: the directory of the step restored (this process's local
            part, or the persistent tier); `None`: neither tier holds one.
    """

    local: StoredCheckpoint | None
    persistent: P | None
    directory: Path | None


def read_tiers(
    local_dir: Path,
    persistent_dir: Path,
    template: Mapping[str, Any] | None,
    with_optimizer: bool,
    *,
    step: int | None,
    read_persistent: Callable[[], P | None],
    host_memory_budget: HostMemoryBudget = UNBOUNDED,
) -> TierRead[P]:
    """The two-tier read, asked once: the local step every process holds, else the persistent tier's.

    The processes agree on a local step first (`_read_local`). Where none
    restores, the persistent tier is read (`read_persistent`, the reader's
    own read: its candidates, its damage handling). Where that read passed
    over damaged steps to an older one than the processes agreed against,
    they agree again against the step read: a local step newer than it is
    not lost.

    Args:
        local_dir: the local tier's directory.
        persistent_dir: the persistent tier's.
        template: the state dict to restore into (`None`: no local step can restore).
        with_optimizer: whether the optimizer's arrays are read.
        step: only this step (a reader made with `step=`).
        read_persistent: reads the persistent tier; `None` where it holds
            nothing and training starts fresh.
        host_memory_budget: a local step's read, in bounded slices (`LocalStore.read`).

    Raises:
        Exception: a local read's failure that is not damage (out of memory, a bug), or what
            `read_persistent` raises.
    """

    def agree(persistent_step: int | None = None, persistent_run: str | None = None) -> LocalRead:
        return _read_local(
            local_dir,
            persistent_dir,
            template,
            with_optimizer,
            step=step,
            persistent_step=persistent_step,
            persistent_run=persistent_run,
            host_memory_budget=host_memory_budget,
        )

    first = agree()
    if first.local is not None:
        return TierRead(first.stored, None, first.local.store.directory)
    persistent = read_persistent()
    if persistent is None:
        return TierRead(None, None, None)
    if first.persistent is not None and persistent.step < first.persistent:
        # The persistent tier's newest step read as a step but its arrays were damaged.
        again = agree(persistent.step, persistent.run_id)
        if again.local is not None:
            return TierRead(again.stored, persistent, again.local.store.directory)
    return TierRead(None, persistent, persistent_dir)


def _read_local(
    local_dir: Path,
    persistent_dir: Path,
    template: Mapping[str, Any] | None,
    with_optimizer: bool,
    *,
    step: int | None = None,
    persistent_step: int | None = None,
    persistent_run: str | None = None,
    host_memory_budget: HostMemoryBudget = UNBOUNDED,
) -> LocalRead:
    """The two-tier read's local half: the processes agree on a local step, read it together, or fall back together.

    Every process reads its own part of the agreed step; if any cannot (a
    damaged file), all fall back to the persistent tier. Process 0 says
    which tier restores and why, in one line (a WARNING where a newer local
    step is passed over). The arguments are `read_tiers`'s, and
    `persistent_step`: the step that a persistent read restored after
    skipping damaged newer ones (of `persistent_run`), which the tiers agree
    again against; `None`: against the persistent tier's newest readable step.
    """
    newest, run = persistent_step, persistent_run
    if persistent_step is None and not is_empty_or_missing(persistent_dir):
        with stores.open_store(persistent_dir, per_process=False, read_only=True) as store:
            newest, run = _newest_readable(store)
    agreement = agreed_local_step(
        local_dir, template, with_optimizer, newest, run or ledger.run_of(persistent_dir), step
    )
    chosen, why, passed_over = agreement.local, agreement.why, agreement.passed_over
    if chosen is not None:
        error: Exception | None = None
        if chosen.transfers:
            chosen = _bring_back(chosen, host_memory_budget)
        try:
            assert chosen.meta is not None
            why_not = parts.covers(chosen.meta, template or {}, with_optimizer)
            if why_not is not None:
                raise DamagedCheckpointError(f"step {chosen.step} from a peer's copy does not fit: {why_not}")
            stored = chosen.store.read(
                chosen.step,
                template or {},
                with_optimizer=with_optimizer,
                meta=chosen.meta,
                host_memory_budget=host_memory_budget,
            )
        except Exception as caught:  # noqa: BLE001 - every process says how its read went before any raises
            damage.reraise_interrupt(caught)
            error = caught
        failed = all_read(error)
        if failed is None:
            say("restored step %d from the local tier %s: %s.", chosen.step, local_dir, why)
            return LocalRead(chosen, stored, agreement.persistent)
        if error is not None and not damage.is_damage(error):
            raise error
        why, passed_over = f"the local step {chosen.step} could not be read ({failed})", True
    if persistent_step is None and (newest is not None or passed_over):  # else both empty: nothing to say
        say("restoring from the persistent tier %s: %s.", persistent_dir, why, warn=passed_over)
    return LocalRead(None, None, agreement.persistent)


def _newest_readable(store: stores.Store) -> tuple[int | None, str | None]:
    """The newest step whose meta reads (a damaged newest step must not hide a newer local one), and its run.

    The run is `None` where no step's meta reads (the tiers then ask the
    directory's ledger).
    """
    for step in sorted(store.steps(), reverse=True):
        found = steps.classify(store, step)
        if found.kind in (StepKind.VANISHING, StepKind.DAMAGED):
            continue
        return step, found.run_id  # a foreign step's run is None: the persistent tier's read reports it
    return None, None


def all_read(error: BaseException | None) -> str | None:
    """Whether every process read its local step (a collective): `None` if so, else which could not and why."""
    summary = None if error is None else damage.summary(error)
    notes = collectives.allgather_json(summary)
    failed = [f"process {i}: {note}" for i, note in enumerate(notes) if note is not None]
    return "; ".join(failed) if failed else None


def say(line: str, *args: Any, warn: bool = False) -> None:
    """Logs a line about the tiers once (on the primary process)."""
    if jax.process_index() == 0:
        (logger.warning if warn else logger.info)(line, *args)
