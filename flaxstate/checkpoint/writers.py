"""Writers: callables that save a record and return it unchanged.

`CheckpointFileWriter(output_dir)` keeps the newest checkpoints in
`output_dir/<step>/`; `LowestCheckpointFileWriter` and
`HighestCheckpointFileWriter` keep the best by a metric in their own
subdirectory (`output_dir/lowest-eval-loss/<step>/`), so writers sharing
`output_dir` never collide and resume never picks a best checkpoint.

A writer writes one run. Every record carries its run's id (created when a
run starts fresh, restored on resume); at its first save a writer checks the
directory: checkpoints of another run, or of this run at or after the
record's step (a run resumed from an earlier checkpoint), are refused with an
error that says how to resume or where else to write, unless the writer was
made with `overwrite=True`, which removes them first. One directory has one
open writer at a time.

`CheckpointFileWriter(dir, every=fs.EverySeconds(s))` saves a record only
when that long has passed since its last save (or its creation), so records
can come often for logging while checkpoints land every few minutes. Final and preempted
records are always saved, and the writer waits for them to be on disk
before it returns; a requested record (SIGUSR1, `Checkpoint.requested`) is
always saved too. `every=fs.Continuous()` saves whenever no save is in
flight, and `every=fs.AutoInterval()` at the interval that Young and Daly's
rule gives from the run's own save cost and failure rate
(`flaxstate.checkpoint.policies`, `flaxstate.checkpoint.schedule`).
Under several processes the primary process's clock decides for all (a save
is a collective).

`CheckpointFileWriter(fs.LocalTier(local_dir))` is a local tier: each
process saves its own arrays into its own directory, with no barrier, every
few minutes; a persistent writer in the same chain saves every hour. See
`flaxstate.checkpoint.tiers.restart` for the restart.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils

from flaxstate import settings
from flaxstate.checkpoint import budget, claims, policies, schedule, stores
from flaxstate.checkpoint.best import BestPolicy, Mode
from flaxstate.checkpoint.budget import UNBOUNDED, HostMemoryBudget
from flaxstate.checkpoint.damage import is_damage
from flaxstate.checkpoint.errors import CheckpointError
from flaxstate.checkpoint.layout import encode_rng, to_json
from flaxstate.checkpoint.policies import RunHistory, SavePolicy
from flaxstate.checkpoint.tiers import local_tier
from flaxstate.checkpoint.tiers import peers as peer_copies
from flaxstate.checkpoint.tiers.local_tier import LocalTier
from flaxstate.locations import local_path, run_directory
from flaxstate.records import Checkpoint
from flaxstate.run_record import console, environment
from flaxstate.run_record.ledger import Ledger
from flaxstate.sharding import logical_axes_by_path

logger = logging.getLogger("flaxstate")


def record_meta(
    checkpoint: Checkpoint, metadata: Any, best: BestPolicy | None, run_environment: Any = None
) -> dict[str, Any]:
    """Returns what a record stores as JSON beside its arrays (`run_environment`:
    `flaxstate.run_record.environment.describe`)."""
    return {
        "environment": run_environment,
        "step": int(checkpoint.step),
        "run_id": checkpoint.run_id,
        "loss": float(checkpoint.loss),
        "rng": encode_rng(checkpoint.rng),
        "data_position": checkpoint.data_position,
        "metrics": {group: dict(values) for group, values in checkpoint.metrics.items()},
        "metadata": metadata,
        "best": best.to_json() if best is not None else None,
        "logical_axes": logical_axes_by_path(checkpoint.state),
    }


def metadata_changes(old: Any, new: Any) -> list[str]:
    """Returns one line per metadata key whose value differs: `key: old -> new`."""
    return environment.changes(old, new, root="metadata")


class _Writer:
    def __init__(
        self,
        *,
        output_dir: Path | LocalTier,
        subdir: str | None,
        keep: int,
        metadata: Any,
        best: BestPolicy | None,
        overwrite: bool,
        description: str,
        policy: SavePolicy = policies.EVERY_RECORD,
        clock: Callable[[], float] = time.monotonic,
        ledger: bool = False,
        host_memory_budget: HostMemoryBudget = UNBOUNDED,
    ) -> None:
        """`output_dir`: the run's directory, or a local tier (whose `keep` stands for `keep`)."""
        owner = description.split("(", 1)[0]
        tier = output_dir if isinstance(output_dir, LocalTier) else None
        keep = settings.count(owner, "keep", keep) if tier is None else tier.keep
        overwrite = settings.flag(owner, "overwrite", overwrite)
        ledger = settings.flag(owner, "ledger", ledger)
        if not callable(clock):
            raise ValueError(f"{owner} clock must be a function returning seconds, got {clock!r}.")
        per_process = tier is not None
        output_dir = Path(output_dir.directory) if isinstance(output_dir, LocalTier) else output_dir
        self.output_dir = output_dir
        """The run's directory."""
        directory = stores.store_directory(output_dir, per_process=per_process, subdir=subdir)
        self.directory = directory
        """Where this writer's checkpoints go: the run's directory, a best writer's subdirectory of it, or
        (per process) this process's part of the local tier."""
        self._clock = clock
        self._description = description
        key = claims.check_free(directory, description=description, output_dir=output_dir, per_process=per_process)
        self._metadata = to_json(metadata)
        self._best = best
        self._overwrite = overwrite
        self._claimed = False
        self._environment: dict[str, Any] | None = None
        self._keep = keep
        self._run_id: str | None = None
        self._schedule = schedule.SaveSchedule(policy, clock, self.run_history)
        self._saved_step: int | None = None
        self.busy = False
        """Whether a call is saving a record now (another writer of the directory is refused meanwhile)."""
        self._replaced_by: str | None = None
        copies = None
        if tier is not None and tier.peers:
            copies = peer_copies.PeerCopies(peer_copies.plan_for_this_run(tier.peers, description), host_memory_budget)
        self._store: stores.Store = stores.open_store(
            directory,
            per_process=per_process,
            keep=keep,
            best=best,
            copies=copies,
            host_memory_budget=host_memory_budget,
        )
        self._ledger = Ledger(directory) if ledger and self._store.shared else None
        claims.register(key, self)
        self._key = key
        console.say(self._where())

    def _where(self) -> str:
        """The line that says where this writer's checkpoints go."""
        if self._best is not None:
            which = "lowest" if self._best.mode == "min" else "highest"
            return f"The checkpoints of the {which} {self._best.key} go to {self.directory} (the best {self._keep})."
        if not self._store.shared:
            return (
                f"Local checkpoints go to {self.output_dir}/process-<index> (each process's part, the newest "
                f"{self._keep})."
            )
        return f"Checkpoints go to {self.directory} (the newest {self._keep})."

    @property
    def per_process(self) -> bool:
        """Whether this writer is a local tier (each process writes its own directory)."""
        return not self._store.shared

    def __repr__(self) -> str:
        return self._description

    def __enter__(self) -> _Writer:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _metrics(self, checkpoint: Checkpoint) -> Mapping[str, float] | None:
        return None

    def __call__(self, checkpoint: Checkpoint) -> Checkpoint:
        """Saves the record (asynchronously; a final or preempted one waits for its save) and returns it.

        In one process the record's arrays are read by a background thread:
        do not donate, delete or change them before `wait()` (TrainLoop's
        records hold read-only host copies that nothing donates).

        Raises:
            CheckpointError: (at the first save) the directory holds another
                run's checkpoints, or this run's at or after the record's step,
                and the writer was not made with `overwrite=True`.
            CheckpointSaveError: this save or the previous one failed, naming the step.
        """
        if self._replaced_by is not None:
            raise CheckpointError(
                f"{self!r} was replaced by {self._replaced_by}, made later in this process on the same directory "
                "(a notebook cell run again, or a second loop): it saves nothing more. Give the record to the new "
                "writer, or give each loop's writer its own directory."
            )
        self.busy = True
        try:
            return self._save_record(checkpoint)
        finally:
            self.busy = False

    def hand_over(self, successor: str) -> None:
        """Gives the directory to a new writer of this process: waits for the pending save, then refuses records,
        whatever that save's end (a failed one released the directory: this writer must not save beside the next).

        Args:
            successor: the new writer's description, for the refusal.

        Raises:
            CheckpointSaveError: the pending save failed (the new writer is not made; made again, it is).
        """
        try:
            self.close()
        finally:
            self._replaced_by = successor

    def _save_record(self, checkpoint: Checkpoint) -> Checkpoint:
        last = checkpoint.final or checkpoint.preempted
        held = self._holds(checkpoint)
        if not held and not self._claimed:  # at the first record, saved or not: the ledger writes after it
            self._claim(checkpoint)
            self._claimed = True
        self._run_id = checkpoint.run_id
        if self._ledger is not None and self._claimed:
            self._ledger.record(checkpoint)
        self._schedule.note(checkpoint)
        if not last and not checkpoint.requested and not self._due():
            return checkpoint
        if not held:
            metrics = self._metrics(checkpoint)
            began, start = time.perf_counter(), self._clock()
            self._store.save(
                int(checkpoint.step),
                checkpoint.state.state_dict(),
                record_meta(checkpoint, self._metadata, self._best, self._environment),
                metrics,
            )
            self._saved_step = int(checkpoint.step)
            blocking = time.perf_counter() - began
            previous = self._store.completed  # the save before, which this one waited for
            self._schedule.completed(previous)
            self._schedule.started(int(checkpoint.step), start, blocking)
            if last:
                self.wait()
            if self._ledger is not None:
                self._ledger.saved(int(checkpoint.step), time.perf_counter() - began, previous)
        if last:
            self.wait()
            self._schedule.completed(self._store.completed)
            if self._ledger is not None:
                self._ledger.end(checkpoint, self._store.completed)
        return checkpoint

    def run_history(self) -> RunHistory | None:
        """The run's failures and seconds of running before this session, as this writer's goodput ledger read
        them at its first record; `None` before it, and for a writer that keeps no ledger (a local tier's).

        What an `AutoInterval` chooses from where its own `history` is left out; hand it to another writer's
        policy (`fs.AutoInterval(history=persistent.run_history)`) for a writer without a ledger.
        """
        return None if self._ledger is None else self._ledger.history

    def _due(self) -> bool:
        """Whether the policy saves this record (`flaxstate.checkpoint.schedule`; the primary process decides,
        unless the policy needs no broadcast).

        A change of `AutoInterval`'s interval is logged, with its inputs, and kept in the ledger.
        """
        in_flight = self._store.in_flight()
        self._schedule.completed(self._store.completed)
        due, change = self._schedule.due(in_flight)
        if change is not None and jax.process_index() == 0:
            logger.info("%s", change.line(self._description))
            if self._ledger is not None:
                self._ledger.cadence(change.event())
        if self._schedule.broadcast and jax.process_count() > 1:
            due = bool(multihost_utils.broadcast_one_to_all(np.asarray(due)))
        return due

    def _holds(self, checkpoint: Checkpoint) -> bool:
        """Whether the record's state is already here: this writer saved its step, or it is the step resumed from."""
        step = int(checkpoint.step)
        if step == self._saved_step:
            return True
        if checkpoint.n_completed_steps or step not in self._store.steps():
            return False
        meta = self._readable_meta(step)
        return meta is not None and meta.get("run_id") == checkpoint.run_id

    def _readable_meta(self, step: int) -> dict[str, Any] | None:
        """A step's `meta`, or `None` where its files are damaged, gone or not flaxstate's."""
        try:
            return self._store.read_meta(step)
        except Exception as error:
            if is_damage(error) or isinstance(error, CheckpointError):
                return None
            raise

    def _claim(self, checkpoint: Checkpoint) -> None:
        """Claims the directory before the first save (`claims.claim`), then warns of what a resume changed.

        A resumed run whose metadata or environment differs from the step it
        resumed from says which keys, in one warning each.
        """
        self._environment = environment.describe(checkpoint.session)
        found = claims.claim(self._store, checkpoint, overwrite=self._overwrite, keep=self._keep, writer=self)
        resumed = found.newest_own(checkpoint)
        if resumed is None or self._best is not None or jax.process_index() != 0 or not self._store.shared:
            return
        stored = found.metas[resumed] or {}
        going_on, changes = environment.going_on(stored.get("metadata"), self._metadata, root="metadata")
        if going_on:  # how a run is meant to go on: said once, not warned
            logger.info("the run goes on from step %d in %s with %s", resumed, self.directory, ", ".join(going_on))
        if changes:
            logger.warning(
                "the resumed run's metadata differs from the checkpoint at step %d in %s:\n  %s",
                resumed,
                self.directory,
                "\n  ".join(changes),
            )
        if stored.get("environment") is not None:
            moved = environment.changes(stored["environment"], self._environment, root="environment", besides=going_on)
            if moved:
                logger.warning(
                    "the resumed run's environment differs from the checkpoint at step %d in %s:\n  %s",
                    resumed,
                    self.directory,
                    "\n  ".join(moved),
                )

    def wait(self) -> None:
        """Waits until the pending save is on disk.

        Raises:
            CheckpointSaveError: it failed, naming its step.
        """
        self._store.wait()

    def close(self) -> None:
        """Waits for the pending save and releases the directory (`with writer:` does this).

        A Ctrl-C while waiting leaves the writer open, its directory claimed
        while the save runs: call `close()` again to wait for it.

        Raises:
            CheckpointSaveError: the pending save failed, naming its step.
            KeyboardInterrupt: Ctrl-C while waiting.
        """
        try:
            self._store.close()
        except KeyboardInterrupt:
            raise  # the save still runs: the directory stays this writer's
        except BaseException:
            self._release()
            raise
        self._release()

    def _release(self) -> None:
        if self._ledger is not None:
            self._ledger.close()
        claims.release(self._key, self)


class CheckpointFileWriter(_Writer):
    """Saves each record to `output_dir/<step>/` and keeps the newest `keep`.

    Example:
        >>> import tempfile
        >>> with CheckpointFileWriter(tempfile.mkdtemp(), keep=3) as writer:
        ...     print(writer)
        CheckpointFileWriter(..., keep=3)
    """

    def __init__(
        self,
        output_dir: str | Path | LocalTier,
        keep: int = local_tier.KEEP,
        metadata: Any = None,
        every_seconds: float | None = None,
        overwrite: bool = False,
        *,
        clock: Callable[[], float] = time.monotonic,
        ledger: bool = True,
        per_process: bool | None = None,
        peers: int = local_tier.PEERS,
        host_memory_budget: HostMemoryBudget | int | None = None,
        every: policies.Every = None,
        min_seconds: float | None = None,
        mtbf: float | None = None,
    ) -> None:
        """Opens (or creates) the directory.

        Args:
            output_dir: the run's directory; or a `fs.LocalTier` (its
                directory, peers and keep): a local tier
                (`flaxstate.checkpoint.stores.local`), each process saving the
                arrays its devices hold (a replicated array once) into
                `directory/process-<index>/` on its own host (`/dev/shm/run`, a
                local SSD), with no barrier and no shared filesystem; restore
                it with `CheckpointFileReader([tier, persistent_dir])`. This
                run's steps newer than the one it resumed from (a restart that
                fell back to the persistent tier) are set aside as
                `<step>.superseded`, not refused. With the tier's `peers=N`,
                each process also keeps the parts of N other processes, on
                other hosts where there are (`flaxstate.checkpoint.tiers.peers`):
                each save moves the parts by one collective, and every process
                makes the writer together.
            keep: how many of the newest checkpoints to keep.
            metadata: a dict or dataclass (e.g. the run's config) stored as JSON;
                a resumed run logs each key that differs from the stored one.
            every_seconds: deprecated: `every=fs.EverySeconds(seconds)`.
            overwrite: remove another run's checkpoints (and this run's at or
                after the first record's step) at the first save, instead of
                refusing to save.
            clock: the monotonic clock that the policy's seconds are measured
                on (a test moves time by giving its own).
            ledger: keep the run's goodput ledger, `output_dir/goodput.jsonl`
                (`flaxstate.run_record.ledger`; `flaxstate goodput DIR` reads
                it): a line each record and save, fsync'd. A per-process
                writer keeps none (the persistent tier's writer does).
            per_process: deprecated: give `output_dir` as a `fs.LocalTier(directory,
                keep=K)`.
            peers: deprecated: `fs.LocalTier(directory, peers=N)`.
            host_memory_budget: a `fs.HostMemoryBudget`, or its bytes: what a save may hold in host memory beyond
                the record it saves, however large its largest array: arrays
                are stored in chunks of an eighth of it, in orbax's format,
                and written chunk by chunk (`flaxstate.checkpoint.budget`).
                `None` (the default): orbax's own save, which holds about a
                copy of the state more. A local tier (`per_process=True`)
                writes a record's host parts to its file as they are, with or
                without one (its restore is what the reader's budget bounds);
                with `peers`, the exchange moves the parts in slices of an
                eighth of it, written to the copy's file as they come, and the
                loop waits for the move. An s3:// directory stores each array
                in chunks of it too (`flaxstate.checkpoint.stores.s3`).
            every: when to save, a policy (`flaxstate.checkpoint.policies`):
                `fs.EveryRecord()` (`None`: every record), `fs.EverySeconds(s)`,
                `fs.Continuous(min_seconds)` (whenever no save of this writer's
                is in flight, so the loop never waits for one) or
                `fs.AutoInterval(min_seconds, mtbf, history)` (as continuously,
                at the interval that Young and Daly's rule gives from this
                writer's measured save cost and the run's failures; each
                change logged). Final, preempted and requested records are
                always saved; under several processes the primary process
                decides. The strings `"continuous"` and `"auto"` are
                deprecated: `fs.Continuous(...)`, `fs.AutoInterval(...)`.
            min_seconds: deprecated: `fs.Continuous(min_seconds)` or
                `fs.AutoInterval(min_seconds)`.
            mtbf: deprecated: `fs.AutoInterval(mtbf=seconds)`.

        Raises:
            CheckpointError: another open writer writes `output_dir`; a local
                tier (`per_process=True`) and an open persistent writer whose
                directories are one or nested (naming both); or `metadata`
                is not JSON-serializable.
            ValueError: `keep` below 1, `every_seconds`, `min_seconds` or
                `mtbf` not positive, `every` not a policy, None, "continuous" or
                "auto", `every` with `every_seconds`, `min_seconds` without
                `every`, `mtbf` without `every="auto"`, a policy with any of
                the three,
                `peers` not below the process count, or without `per_process`,
                or `host_memory_budget` below 32 KiB.
        """
        limit = budget.of(host_memory_budget, "CheckpointFileWriter")  # before a bucket is asked for credentials
        tier: LocalTier | None = None
        per_process_given, peers_given = per_process is not None, not isinstance(peers, local_tier.Unset)
        if per_process is not None:
            per_process = settings.flag("CheckpointFileWriter", "per_process", per_process)
        if isinstance(output_dir, LocalTier):
            keep, peers = local_tier.settings_of(
                output_dir, "CheckpointFileWriter", keep=keep, peers=peers, names=("keep", "peers")
            )
            if per_process is False:
                raise ValueError(
                    f"CheckpointFileWriter got {output_dir!r} and per_process=False: a LocalTier is saved per "
                    "process. Leave per_process out, or give a directory for a persistent writer."
                )
            tier, output_dir, per_process = output_dir, Path(output_dir.directory), True
        per_process = bool(per_process)
        policy = policies.from_keywords("CheckpointFileWriter", every, every_seconds, min_seconds, mtbf)
        when = {"every": every, "every_seconds": every_seconds, "min_seconds": min_seconds, "mtbf": mtbf}
        given = "".join(f", {name}={value!r}" for name, value in when.items() if value is not None)
        given += f", host_memory_budget={host_memory_budget}" if limit.bounded else ""
        local = ", per_process=True" if per_process else ""
        local += f", peers={peers}" if peers else ""
        description = f"CheckpointFileWriter({str(output_dir)!r}, keep={keep}{given}{local})"
        if tier is None:
            tier = _tier_of_keywords(output_dir, keep, per_process, peers, description)
        old = [name for name, given in (("per_process=", per_process_given), ("peers=", peers_given)) if given]
        if old and tier is not None:
            settings.deprecated("CheckpointFileWriter", ", ".join(old), f"CheckpointFileWriter(fs.{tier!r})")
        super().__init__(
            output_dir=tier if tier is not None else run_directory(output_dir, "CheckpointFileWriter"),
            subdir=None,
            keep=keep,
            metadata=metadata,
            best=None,
            overwrite=overwrite,
            description=description,
            policy=policy,
            clock=clock,
            ledger=ledger,
            host_memory_budget=limit,
        )


def _tier_of_keywords(
    output_dir: str | Path, keep: int, per_process: bool, peers: int, description: str
) -> LocalTier | None:
    """The local tier that the writer's old keywords name (`per_process=True`, `peers=N`, `keep=K`), checked with
    the writer's own messages; `None` for a persistent directory."""
    if not settings.is_integer(peers) or peers < 0:
        raise ValueError(f"{description}: peers must be a count of copies (0, 1, ...), got {peers!r}.")
    if peers and not per_process:
        raise ValueError(
            f"{description}: peers={peers} keeps copies of each process's local tier; it needs "
            "per_process=True (a persistent directory is every process's already)."
        )
    if not per_process:
        return None
    directory = local_path(output_dir, "CheckpointFileWriter's local tier (per_process=True)")
    return LocalTier(directory, peers=int(peers), keep=settings.count("CheckpointFileWriter", "keep", keep))


class _BestWriter(_Writer):
    mode: Mode = "min"

    def __init__(
        self,
        output_dir: str | Path,
        metric: str,
        group: str = "eval",
        *,
        keep: int = 1,
        metadata: Any = None,
        overwrite: bool = False,
    ) -> None:
        metric = settings.text(type(self).__name__, "metric", metric)
        group = settings.text(type(self).__name__, "group", group)
        self.metric, self.group = metric, group
        self.policy = BestPolicy(metric=metric, group=group, mode=self.mode)
        description = f"{type(self).__name__}({str(output_dir)!r}, metric={metric!r}, group={group!r}, keep={keep})"
        super().__init__(
            output_dir=run_directory(output_dir, type(self).__name__),
            subdir=self.policy.subdir,
            keep=keep,
            metadata=metadata,
            best=self.policy,
            overwrite=overwrite,
            description=description,
        )

    def __call__(self, checkpoint: Checkpoint) -> Checkpoint:
        if checkpoint.preempted and self.policy.value(checkpoint.metrics) is None:
            return checkpoint  # not evaluated (the grace period is short): nothing to rank it by
        return super().__call__(checkpoint)

    def _metrics(self, checkpoint: Checkpoint) -> Mapping[str, float]:
        value = self.policy.value(checkpoint.metrics)
        if value is None:
            found = {group: sorted(values) for group, values in checkpoint.metrics.items()}
            raise ValueError(
                f"{type(self).__name__} needs the metric {self.metric!r} in group {self.group!r}, but the "
                f"record has {found or 'no metrics'}; put an EvalLoop before it, or name a metric it has."
            )
        if not math.isfinite(value):
            logger.warning(
                "step %d: %s is %s; %s never counts it better than a finite value.",
                checkpoint.step,
                self.policy.key,
                value,
                type(self).__name__,
            )
        return {self.policy.key: value}


class LowestCheckpointFileWriter(_BestWriter):
    """Keeps the `keep` checkpoints with the lowest metric in `output_dir/lowest-<group>-<metric>/`.

    A nan or infinite metric is never better than a finite one.

    Args:
        output_dir: the run's directory.
        metric: the metric's name, e.g. "loss".
        group: the metric's group, e.g. "eval".
        keep: how many of the best to keep.
        metadata: a dict or dataclass stored as JSON.
        overwrite: remove another run's checkpoints at the first save instead of refusing.

    Raises:
        ValueError: (when called) the record has no such metric, naming what it has.
    """

    mode = "min"


class HighestCheckpointFileWriter(_BestWriter):
    """Keeps the `keep` checkpoints with the highest metric in `output_dir/highest-<group>-<metric>/`.

    A nan or infinite metric is never better than a finite one.

    Args:
        output_dir: the run's directory.
        metric: the metric's name, e.g. "acc".
        group: the metric's group, e.g. "eval".
        keep: how many of the best to keep.
        metadata: a dict or dataclass stored as JSON.
        overwrite: remove another run's checkpoints at the first save instead of refusing.

    Raises:
        ValueError: (when called) the record has no such metric, naming what it has.
    """

    mode = "max"
