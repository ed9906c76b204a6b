"""`TrainLoop`: training as a Python generator of `Checkpoint` records, data-parallel or sharded.

The loop is a driver. Its construction checks the options
(`flaxstate.training.options`), picks the placement
(`flaxstate.training.placement`), looks at the first batch and starts the run
(`flaxstate.training.startup`), and builds the compiled `Program`, the
`Recorder` and the `SegmentRunner`, each from what it needs. Every entry
point (`__iter__`, `next_checkpoint`, `next_step`, `run`) asks `_next_target`
for the next record's step (`None` once the run has ended, which is said and
waited for there) and `_train_until` for the record: the one that an
interrupted call made, else a new one.
"""

from __future__ import annotations

import atexit
import dataclasses
import logging
import time
import weakref
from collections.abc import Callable, Generator, Iterator, Mapping, Sequence
from typing import Any

import jax
from flax.core.scope import CollectionFilter, DenyList
from jax.sharding import Mesh

from flaxstate import background, settings, sharding
from flaxstate.records import Checkpoint
from flaxstate.run_record import console
from flaxstate.sharding import AxisRules, Partitioning
from flaxstate.train_state import FlaxOptimTrainState
from flaxstate.training import copies, placement, startup
from flaxstate.training import rollback as rolling
from flaxstate.training.interrupts import Signals
from flaxstate.training.options import LoopSpec, Schedule, check_peak_flops
from flaxstate.training.program import Program
from flaxstate.training.progress import ProgressDisplay
from flaxstate.training.recording import Recorder
from flaxstate.training.rollback import Rollback
from flaxstate.training.segment import SegmentRunner, Trained
from flaxstate.training.startup import CheckpointSource, ParamsSource
from flaxstate.training.task import TrainTask
from flaxstate.training.watchdog import HangTimeout, Phase, Watchdog, check_timeout

__all__ = ["CheckpointSource", "TrainLoop"]


logger = logging.getLogger("flaxstate")

_OPEN: weakref.WeakSet[Generator[Checkpoint, None, None]] = weakref.WeakSet()
"""The loops' generators that a script may leave unfinished (`it = iter(loop); next(it)`, a notebook's kernel)."""


def _close_open_loops() -> None:
    """At exit, before the interpreter tears its modules down: ends each unfinished loop as leaving it early does
    (its handlers put back, the writers' saves settled), where its generator's own end, during the teardown, would
    print a traceback of modules already gone."""
    for records in list(_OPEN):
        records.close()


atexit.register(_close_open_loops)  # after `background`'s hook (imported above), so it runs before it


class TrainLoop:
    """Trains a model, data-parallel or sharded over a mesh, and yields a `Checkpoint` every N steps.

    Iterate it (`for checkpoint in loop:`), or call `next_checkpoint()` cell
    by cell; both train from where the loop stands, so stopping early then
    going on continues exactly where it stopped.

    Interruptions: after any exception out of a call (the data's, the
    model's, Ctrl-C's), the loop stays usable, and the next call goes on as
    if nothing had happened. Ctrl-C is put off to the next dispatch boundary;
    SIGTERM (with `handle_preemption`) ends the run with one last record,
    `preempted=True` (see `flaxstate.training.interrupts`).

    Example:
        >>> import flax.linen as nn, jax.numpy as jnp, numpy as np, optax
        >>> model = nn.Dense(1)
        >>> data = [(np.ones((4, 3), np.float32), np.zeros((4, 1), np.float32))] * 4
        >>> task = TrainTask(apply=model.apply, optimizer=optax.sgd(0.1),
        ...                  loss=lambda y, t: jnp.mean((y - t) ** 2), data=data)
        >>> loop = TrainLoop(init=model.init, task=task, rng=0, n_steps=4,
        ...                  n_steps_per_checkpoint=2, stdout=False)
        >>> [checkpoint.step for checkpoint in loop]
        [2, 4]
    """

    def __init__(
        self,
        init: Callable[..., Any] | CheckpointSource | ParamsSource,
        task: TrainTask,
        rng: jax.Array | int,
        *,
        n_steps: int = 0,
        n_steps_per_checkpoint: int = 1,
        n_steps_per_dispatch: int = 1,
        n_microbatches: int = 1,
        max_device_batch: int | None = None,
        input_sample: Any = None,
        collections: Mapping[str, Sequence[str]] | None = None,
        mutable_collections: CollectionFilter = DenyList("intermediates"),
        devices: Sequence[jax.Device] | None = None,
        mesh: Mesh | None = None,
        axis_rules: AxisRules | None = None,
        partitioning: Partitioning | None = None,
        record_memory: str = "host",
        record_gradients: bool = True,
        peak_flops_per_device: float | str | None = None,
        flops_per_step: float | str | Callable[[Any], float] | None = None,
        handle_preemption: bool = True,
        hang_timeout: HangTimeout = "auto",
        rollback: Rollback | None = None,
        stdout: bool = True,
    ) -> None:
        """Creates (or restores) the state and prepares the compiled update.

        Args:
            init: a linen module's `init`, or a checkpoint reader (e.g.
                `CheckpointFileReader(dir, target=model.init)`) to resume from,
                or `fs.SafetensorsReader(path, target=model.init)` to start
                from the params of safetensors files.
            task: what to train.
            rng: the run's random key (or an int seed): model init and per-step,
                per-device rngs. On resume the checkpoint's key is used.
            n_steps: the total number of steps; the last step always yields.
            n_steps_per_checkpoint: N; a record is yielded at steps N, 2N, ...
            n_steps_per_dispatch: K steps in one compiled call (a scan over K batches).
            n_microbatches: M; each device accumulates the loss and gradients of
                M interleaved microbatches of its batch before one update (see
                `flaxstate.training.step`).
            max_device_batch: the most examples a device may take at once:
                the loop sets `n_microbatches` itself at every start, the fewest
                that split each device's part of the data's batch into equal
                microbatches of at most this many. The global batch (the
                examples of a step) stays the data's on any process count: a
                run resumed on half the processes takes twice the
                microbatches. The session (`Checkpoint.session`) and the
                ledger keep the count; it is logged when it is not 1.
            input_sample: the model's inputs for `init`; the first batch's by default.
            collections: rng collection names, `{"init": [...], "apply": [...]}`;
                by default `params` and `dropout` at init and `dropout` in training.
            mutable_collections: which collections the update may change.
            devices: the devices to train on, data-parallel (all devices of all
                processes by default).
            mesh, axis_rules: a `jax.sharding.Mesh` with named axes and flax-style
                logical axis rules (e.g. `[("batch", ("data", "fsdp")), ("embed",
                "fsdp")]`): each leaf sharded by its logical axes, each process
                feeding its part of the global batch (see `flaxstate.training.placement`).
                Inside `jax.set_mesh(mesh)`, `mesh=` may be left out; a mesh with
                Explicit axes (`jax.make_mesh`) or the context's is traced under it.
            partitioning: `fs.Partitioning`, the devices or the mesh and rules
                stated once for this loop, an `EvalLoop` and `global_batches`
                (instead of `devices=`, `mesh=` and `axis_rules=`).
            record_memory: where records (and `state`) hold their copy: `"host"`
                or `"device"` (faster, room for the state twice; see `flaxstate.training.copies`).
            record_gradients: whether records carry their last step's gradients
                (`Checkpoint.grads`; else `None`). Where a record ends a
                dispatch of one step, its gradients are a second compiled
                program beside the update, with its own forward and backward
                pass: without them a loop compiles and runs what a
                hand-written step does (its first step sooner, and a record
                every step without the second pass). The updates, losses and
                fingerprints are the same either way, bit for bit.
            peak_flops_per_device: one device's peak FLOP/s, for records' MFU (a
                number, or a string of one: YAML 1.1 reads 989e12 as "989e12"); by
                default the known dense bfloat16 peak (`flaxstate.training.throughput`).
            flops_per_step: the FLOPs of one global training step, for records'
                MFU: a number, or a function of the global batch's shapes (a
                tree of `jax.ShapeDtypeStruct`s like a batch) returning one;
                by default the model's count of the step's matrix products
                (`flaxstate.training.throughput.model_flops`).
            handle_preemption: on SIGTERM (to any process), stop at the next
                dispatch boundary and yield a last record with `preempted=True`.
            hang_timeout: seconds without progress after which the watchdog writes
                every thread's stack and ends the process with status 75 (`"auto"`,
                or `None` for none; see `flaxstate.training.watchdog`).
            rollback: on a non-finite loss (or a spike), go back to the newest
                record's state, skip the bad span's batches and train on
                (`fs.Rollback`; `flaxstate.training.rollback`); `None`: a
                non-finite loss raises `FloatingPointError`.
            stdout: print the model's size and live progress.

        Raises:
            ValueError: a bad setting (naming it and the fix); a first batch that
                is empty, of the wrong structure or does not split over the
                devices and microbatches; axis rules that do not fit the mesh or
                the state (naming the path); a resume whose data cannot be moved
                to the examples already trained (see `TrainTask.data`); a `mesh=`
                that is not the mesh of the `jax.set_mesh` around it (naming both).
            TypeError: `rng` is neither a key nor an int.
        """
        self._schedule = Schedule(n_steps, n_steps_per_checkpoint, n_steps_per_dispatch, n_microbatches)
        spec = LoopSpec.taken("TrainLoop", locals())  # the options that `fs.plan` takes, by the same names
        handle_preemption = settings.flag("TrainLoop", "handle_preemption", handle_preemption)
        stdout = settings.flag("TrainLoop", "stdout", stdout)
        self._watchdog = Watchdog(check_timeout(hang_timeout))
        weakref.finalize(self, self._watchdog.close)  # a loop dropped mid-run stops its watchdog's thread
        try:
            rollback = rolling.check(rollback)
            peak_flops_per_device = check_peak_flops(peak_flops_per_device)
            where = placement.create(sharding.resolve("TrainLoop", partitioning, devices, mesh, axis_rules))
            self._placement = where
            with where.context():  # a mesh whose shardings are types: traced under `jax.set_mesh`
                self._progress = ProgressDisplay(stdout)
                console.listen(self._progress.log)  # what the writers say (where their checkpoints go)
                self._signals = Signals(handle_preemption)
                look = startup.first_look(
                    task, where, spec.n_microbatches, input_sample, self._watchdog.beat, spec.max_device_batch
                )
                n_microbatches = look.n_microbatches
                if spec.max_device_batch is not None and n_microbatches > 1:
                    logger.info(
                        "TrainLoop(max_device_batch=%d): %d microbatches a step, each device's %d examples of a "
                        "global batch of %d over %d processes",
                        spec.max_device_batch,
                        n_microbatches,
                        look.device_batch,
                        look.batch_size,
                        jax.process_count(),
                    )
                phase = Phase.RESTORING if isinstance(init, CheckpointSource) else Phase.COMPILING_STATE
                with self._watchdog.watching(phase):
                    begun = startup.start(
                        init=init,
                        task=task,
                        rng=rng,
                        placement=where,
                        look=look,
                        init_names=spec.init_names,
                        progress=self._progress,
                    )
                if rollback is not None and rollback.lr_scale is not None:
                    rolling.learning_rate_holder(begun.state)  # before any compile
                restored_position = None if begun.restored is None else begun.restored.data_position
                self._run_id = begun.run_id
                self._restored_step = begun.restored_step
                self._check_ema_decays = task.check_ema_decays
                # A schedule's bad decay fails before any training.
                self._check_ema_decays(begun.restored_step or 0, n_steps)
                self._ema_checked = n_steps
                """The steps before this one have had their EMA decay checked (a longer run checks the rest)."""
                reads_later = copies.reads_later(where.mesh, spec.record_memory)
                self._program = Program.build(
                    placement=where,
                    task=task,
                    spec=spec,
                    n_microbatches=n_microbatches,
                    state=begun.state,
                    rng=begun.rng,
                    # Where records hold host copies on a CPU of one process, their fingerprint is taken when read.
                    fingerprinted_records=not reads_later,
                )
                self._recorder = Recorder.create(
                    placement=where,
                    shardings=self._program.shardings,
                    record_memory=spec.record_memory,
                    reads_later=reads_later,
                    look=look,
                    begun=begun,
                    progress=self._progress,
                    peak_flops_per_device=peak_flops_per_device,
                    preemption_noticed=self._signals.noticed_here,
                    microbatches=(n_microbatches, spec.max_device_batch),
                )
                self._runner = SegmentRunner(
                    program=self._program,
                    placement=where,
                    data=look.data,
                    signals=self._signals,
                    progress=self._progress,
                    n_microbatches=n_microbatches,
                    state=begun.state,
                    rng=begun.rng,
                    watchdog=self._watchdog,
                    global_batch=look.global_batch,
                    loss_scaling=task.loss_scale is not None,
                    rollback=rollback,
                    rollbacks=rolling.made(restored_position),
                    loss_window=(restored_position or {}).get("loss_window"),
                )
                if rollback is not None:  # the point the first record's steps go back to
                    self._runner.hold(self._recorder.copy(self._runner.leaves, self._runner.treedef, None)[0])
                self._rollback_scale = None if rollback is None else rollback.lr_scale
                self._made: Checkpoint | None = None
                """A record made by a call that an interrupt stopped before it returned: the next call returns it."""
                self._outside: float | None = None
                """Seconds between the previous record's return (or the start) and the next record's training."""
                self._returned_at = time.perf_counter()
        except BaseException:  # a failed construction leaves no thread behind (a notebook keeps its traceback)
            self._watchdog.close()
            raise

    @property
    def step(self) -> int:
        """The number of updates applied so far."""
        return self._runner.step

    @property
    def n_steps(self) -> int:
        """The total number of steps."""
        return self._schedule.n_steps

    @property
    def n_steps_per_checkpoint(self) -> int:
        """N: a record is yielded every N steps."""
        return self._schedule.n_steps_per_checkpoint

    @property
    def run_id(self) -> str:
        """The run's id: created when a run starts fresh, restored on resume, carried by every record."""
        return self._run_id

    @property
    def program(self) -> Program:
        """The compiled update and gradients (e.g. `loop.program.update(1)`, for XLA's cost analysis)."""
        return self._program

    @property
    def state(self) -> FlaxOptimTrainState:
        """A copy of the current state (the loop's own is donated at each step), where records hold theirs.

        By default read-only numpy arrays in host memory (see `record_memory`),
        valid for as long as they are held.
        """
        with self._placement.context():
            return self._recorder.copy(self._runner.leaves, self._runner.treedef, None)[0]

    def __iter__(self) -> Iterator[Checkpoint]:
        """Yields the records up to `n_steps`; leaving the loop early waits for the writers' saves."""
        records = self._records()
        _OPEN.add(records)
        return records

    def _records(self) -> Generator[Checkpoint, None, None]:
        with self._signals.installed(interrupts=False):  # SIGTERM, also while the caller handles a record
            while (target := self._next_target()) is not None:
                try:
                    yield self._train_until(target)
                except GeneratorExit:
                    background.settle_all()  # a save's failure is kept for its writer's next wait (or exit)
                    raise

    def next_checkpoint(self) -> Checkpoint | None:
        """Trains up to the next record and returns it.

        Returns:
            the record, or `None` once `n_steps` is reached or after the
            preempted record (after waiting for every writer's pending save).

        Raises:
            CheckpointSaveError: (at the end) a pending save failed.
            KeyboardInterrupt: Ctrl-C, at a dispatch boundary; call again to go on.
        """
        target = self._next_target()
        return None if target is None else self._train_until(target)

    def next_step(self) -> Checkpoint:
        """Trains one step and returns its record (extending `n_steps` if it is passed).

        After a preemption notice it trains no more: it returns a record at
        the same step, `preempted=True`.

        Raises:
            KeyboardInterrupt: Ctrl-C, at a dispatch boundary; call again to go on.
        """
        if self._made is None:
            self._schedule = dataclasses.replace(self._schedule, n_steps=max(self.n_steps, self.step + 1))
        return self._train_until(self.step + 1)

    def run(self, n_steps: int) -> Iterator[Checkpoint]:
        """Sets the total to `n_steps` and yields the records up to it.

        Args:
            n_steps: the total number of steps (not a number of more steps),
                so `run(10)` then `run(20)` trains as `run(20)` does.

        Returns:
            a generator of records.
        """
        self._schedule = dataclasses.replace(self._schedule, n_steps=n_steps)
        return iter(self)

    def _next_target(self) -> int | None:
        """The step of the next record, or `None` once the run has ended (the end is said and waited for here)."""
        ended_by_preemption = self._signals.preemption_taken
        if self._made is None and (self.step >= self.n_steps or ended_by_preemption):
            self._progress.close()
            if self._restored_step == self.step and not ended_by_preemption:
                self._restored_step = None  # said once
                self._progress.log(
                    f"The checkpoint's step {self.step} is at or past n_steps ({self.n_steps}): nothing to "
                    "train. Raise n_steps to train on."
                )
            with self._watchdog.watching(Phase.WAITING_FOR_SAVES):
                background.wait_all()
            # The watchdog's thread stays (unarmed, it never fires): a next `run()` (a notebook cell's habit)
            # starts no other; a dropped loop's finalizer stops it.
            return None
        return self._schedule.next_record_step(self.step)

    def _train_until(self, target: int) -> Checkpoint:
        """The record that an interrupted call made, else the record at step `target`.

        A Ctrl-C noted while the record was made is raised when the handlers
        are put back; the record stays for the next call.
        """
        record = self._made
        if record is None:
            if self._outside is None:  # an interrupted call's segment goes on: its outside time is counted
                self._outside = time.perf_counter() - self._returned_at
            if self.n_steps > self._ema_checked:  # run(n) or next_step() went past the steps checked
                self._check_ema_decays(self._ema_checked, self.n_steps)
                self._ema_checked = self.n_steps
            with self._signals.installed(interrupts=True), self._watchdog.watching(), self._placement.context():
                self._recorder.views.clear()  # the newest record's device view ends where the state is donated
                record = self._made = self._record(*self._train_rolling_back(target), self._outside)
            self._outside = None
        self._made = None
        self._returned_at = time.perf_counter()
        return record

    def _train_rolling_back(self, target: int) -> tuple[Trained, float]:
        """Trains up to `target`, going back and on again after each bad step (`fs.Rollback`); returns what the
        training gives the record and the seconds that rollbacks threw away."""
        thrown = 0.0
        trained = self._runner.train(self._schedule.dispatch_sizes(self.step, target), self.n_steps)
        while trained.bad is not None:
            began = time.perf_counter()
            entry = self._runner.roll_back(trained.bad)
            thrown += trained.elapsed + time.perf_counter() - began  # the steps thrown away, and going back
            if jax.process_index() == 0:  # every process rolled back: one line says so
                self._log_rollback(trained.bad.reason, entry)
            trained = self._runner.train(self._schedule.dispatch_sizes(self.step, target), self.n_steps)
        return trained, thrown

    def _log_rollback(self, reason: str, entry: Mapping[str, Any]) -> None:
        logger.warning(
            "TrainLoop: the training loss was %s at step %d: rolled back to step %d (rollback %d), skipping the "
            "batches of %d steps%s.",
            "non-finite" if reason == "nonfinite" else "a spike",
            entry["at_step"],
            entry["to_step"],
            len(self._runner.rollbacks),
            len(entry["skipped_steps"]),
            "" if self._rollback_scale is None else f"; the learning rate scaled by {self._rollback_scale:g}",
        )

    def _record(self, trained: Trained, rolled_back: float, outside: float) -> Checkpoint:
        preempted = self._signals.take_preemption()
        self._watchdog.enter(Phase.AGREEING_ON_RECORD)
        record = self._recorder.make(
            trained,
            leaves=self._runner.leaves,
            treedef=self._runner.treedef,
            step=self.step,
            final=self.step >= self.n_steps,
            preempted=preempted,
            requested=self._signals.take_request(),
            flops=self._runner.flops_per_step,
            outside=outside,
            rollbacks=self._runner.rollbacks,
            rolled_back=rolled_back,
            loss_window=self._runner.loss_window(),
        )
        self._runner.hold(record.state)
        return record
