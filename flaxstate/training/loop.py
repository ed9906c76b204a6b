"""`TrainLoop`: training as a Python generator of `Checkpoint` records, data-parallel or sharded.

The loop is a driver: where it runs is its `Placement`
(`flaxstate.training.placement`), what it runs its `Program` (the compiled
update and gradients), how the steps between records run its
`SegmentRunner`, where a run starts `startup.start`, and what a record
holds its `Recorder` (`flaxstate.training.recording`). Every entry point
(`__iter__`, `next_checkpoint`, `next_step`, `run`) goes through `_train_until`,
which makes the next record, or returns the one that an interrupted call
made, and through one end of the run.
"""

from __future__ import annotations

import dataclasses
import time
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import jax
import numpy as np
from flax.core.scope import CollectionFilter, DenyList
from jax.sharding import Mesh

from flaxstate import background
from flaxstate.records import Checkpoint
from flaxstate.sharding import AxisRules
from flaxstate.train_state import FlaxOptimTrainState
from flaxstate.training import batching, copies, placement, recording, startup, throughput
from flaxstate.training.data import DataStream
from flaxstate.training.interrupts import Signals
from flaxstate.training.options import Schedule, check_peak_flops, check_record_memory
from flaxstate.training.program import Program
from flaxstate.training.progress import ProgressDisplay, count_parameters, format_bytes
from flaxstate.training.recording import Recorder
from flaxstate.training.segment import SegmentRunner, Trained
from flaxstate.training.startup import CheckpointSource
from flaxstate.training.step import make_train_step
from flaxstate.training.task import TrainTask
from flaxstate.training.watchdog import HangTimeout, Watchdog, check_timeout

__all__ = ["CheckpointSource", "TrainLoop"]


class TrainLoop:
    """Trains a model, data-parallel or sharded over a mesh, and yields a `Checkpoint` every N steps.

    Iterate it (`for checkpoint in loop:`), or call `next_checkpoint()` cell
    by cell; both train from where the loop stands, so stopping early then
    going on continues exactly where it stopped.

    Interruptions: after any exception out of a call (from the data, from the
    model, a `KeyboardInterrupt`), the loop stays usable: its state is the
    last completed step's and the batches already drawn are kept for the
    next call, which continues as if nothing had happened. While it trains,
    the loop puts Ctrl-C (SIGINT) off to the next dispatch boundary, so that
    it never lands between a dispatch and the storing of its result, nor
    inside a data generator (see `flaxstate.training.interrupts`). A record
    that was made when the interrupt was raised is returned by the next call.
    On SIGTERM (with `handle_preemption`), the loop finishes the dispatch in
    flight and yields a last record with `preempted=True`; `CheckpointFileWriter`
    saves it and waits. Iterating the loop catches SIGTERM from the first
    record to the last, `next_checkpoint()` while it runs.

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
        init: Callable[..., Any] | CheckpointSource,
        task: TrainTask,
        rng: jax.Array | int,
        *,
        n_steps: int = 0,
        n_steps_per_checkpoint: int = 1,
        n_steps_per_dispatch: int = 1,
        n_microbatches: int = 1,
        input_sample: Any = None,
        collections: Mapping[str, Sequence[str]] | None = None,
        mutable_collections: CollectionFilter = DenyList("intermediates"),
        devices: Sequence[jax.Device] | None = None,
        mesh: Mesh | None = None,
        axis_rules: AxisRules | None = None,
        record_memory: str = "host",
        handle_preemption: bool = True,
        hang_timeout: HangTimeout = "auto",
        stdout: bool = True,
        peak_flops_per_device: float | None = None,
    ) -> None:
        """Creates (or restores) the state and prepares the compiled update.

        Args:
            init: a linen module's `init`, or a checkpoint reader (e.g.
                `CheckpointFileReader(dir, target=model.init)`) to resume from.
            task: what to train.
            rng: the run's random key (or an int seed): model init and per-step,
                per-device rngs. On resume the checkpoint's key is used.
            input_sample: the model's inputs for `init`; the first batch's by default.
            n_steps_per_checkpoint: N; a record is yielded at steps N, 2N, ...
            n_steps: the total number of steps; the last step always yields.
            n_steps_per_dispatch: K steps in one compiled call (a scan over K batches).
            collections: rng collection names, `{"init": [...], "apply": [...]}`;
                by default `params` and `dropout` at init and `dropout` in training.
            mutable_collections: which collections the update may change.
            devices: the devices to train on (all devices of all processes by default).
            stdout: print the model's size and live progress.
            peak_flops_per_device: one device's peak FLOP/s, for records' MFU
                (`Checkpoint.mfu`); by default the devices' dense bfloat16
                peak where `flaxstate.training.throughput` knows it, else no MFU.
            handle_preemption: on SIGTERM (a preemption notice; under several
                processes, on a notice to any one of them), stop at the next
                dispatch boundary and yield one last record with
                `preempted=True`. `False` leaves SIGTERM's handling as it is.
            hang_timeout: seconds without progress while the loop has
                control, after which the watchdog writes what it waited for
                and every thread's stack to stderr and ends the process with
                status 75 for a scheduler to restart (`"auto"`: ten minutes
                or ten times the longest gap seen; `None`: no watchdog; see
                `flaxstate.training.watchdog`).
            record_memory: where records (and `state`) hold their copy of
                the state: `"host"` (the devices hold about one copy of the
                state) or `"device"` (faster to make, room for the state
                twice; see `flaxstate.training.copies`).
            n_microbatches: M; each device splits its batch into M equal,
                interleaved microbatches and accumulates their loss and
                gradients in a `lax.scan` before one update: the whole
                batch's, to float32 rounding (batch statistics and dropout
                per microbatch; see `flaxstate.training.step`).
            mesh: a `jax.sharding.Mesh` with named axes (e.g. `data`, `fsdp`,
                `model`) to shard the state over by `axis_rules`, on the
                mesh's devices; without them the loop is data-parallel
                (every device holds the whole state).
            axis_rules: flax-style logical axis rules, e.g. `[("batch",
                ("data", "fsdp")), ("embed", "fsdp"), ("mlp", "model")]`:
                each state leaf sharded by its logical axes, the batch over
                the axes of `batch`, each process feeding the part of the
                global batch its devices hold (see
                `flaxstate.training.placement`).

        Raises:
            ValueError: bad settings (naming the setting and the fix), or a batch that is empty, of the wrong
                structure, not divisible by the local device count (or the
                batch axes' parts this process holds), or whose per-device
                part does not divide into `n_microbatches`; axis rules
                naming a mesh axis that does not exist, or a state dimension
                that its mesh axes do not divide (naming the path); a
                resume whose data cannot be moved to the examples already
                trained (see `TrainTask.data`).
            TypeError: `rng` is neither a key nor an int.
        """
        self._schedule = Schedule(n_steps, n_steps_per_checkpoint, n_steps_per_dispatch, n_microbatches)
        self._watchdog = Watchdog(check_timeout(hang_timeout))
        weakref.finalize(self, self._watchdog.close)  # a loop dropped mid-run stops its watchdog's thread
        record_memory = check_record_memory(record_memory)
        peak_flops_per_device = check_peak_flops(peak_flops_per_device)
        init_names, apply_names = startup.rng_names(collections)
        self._placement = placement.create("TrainLoop", devices, mesh, axis_rules)
        self._progress = ProgressDisplay(stdout)
        self._signals = Signals(handle_preemption)
        self._data = DataStream(task.data, "TrainTask")

        first_batch = batching.normalize(self._data.peek(), "TrainTask")
        self._placement.check_batch(first_batch, "TrainTask", self._schedule.n_microbatches)
        self._batch_size = self._placement.global_batch_size(int(np.shape(first_batch[0][0])[0]))
        global_batch = batching.global_spec(first_batch, self._batch_size)  # the one-step update's
        if input_sample is None:
            inputs = first_batch[0]
        else:
            inputs = input_sample if isinstance(input_sample, tuple) else (input_sample,)
        key = startup.as_key(rng)  # after the data's first look: nothing is on the devices before the state
        phase = "restoring the checkpoint" if isinstance(init, CheckpointSource) else "compiling the state's creation"
        with self._watchdog.watching(phase):
            begun = startup.start(
                init, task, key, self._placement, inputs, init_names, self._data, self._batch_size, self._progress
            )
        self._rng, self._run_id = begun.rng, begun.run_id
        self._restored_step = None if begun.restored is None else int(begun.restored.step)
        shardings = self._placement.state_shardings(begun.state)
        self._recorder = Recorder(
            copy=copies.record_copier(self._placement.mesh, shardings, record_memory),
            views=copies.DeviceViews(),
            data=self._data,
            progress=self._progress,
            session=recording.session(self._placement, begun.restore_seconds, self._restored_step),
            rng=self._rng,
            run_id=self._run_id,
            batch_size=self._batch_size,
            n_devices=self._placement.mesh.size,
            peak_flops=throughput.peak_flops(peak_flops_per_device, list(self._placement.mesh.devices.flat)),
            skipped_damaged=() if begun.restored is None else begun.restored.skipped_damaged,
        )
        train_step = make_train_step(
            task.apply, task.loss, apply_names, mutable_collections, self._placement.across, n_microbatches
        )
        self._program = Program(self._placement, train_step, shardings, begun.state, jax.random.key_impl(self._rng))
        rng_data = jax.device_put(jax.random.key_data(self._rng), batching.replicated(self._placement.mesh))
        self._runner = SegmentRunner(
            self._program,
            self._placement,
            self._data,
            self._signals,
            self._progress,
            self._recorder.views,
            self._schedule,
            begun.state,
            rng_data,
            self._watchdog,
            global_batch,
            loss_scaling=task.loss_scale is not None,
        )
        self._made: Checkpoint | None = None
        """A record made by a call that an interrupt stopped before it returned: the next call returns it."""
        self._outside: float | None = None
        """Seconds between the previous record's return (or the start) and the next record's training."""
        self._returned_at = time.perf_counter()
        n_params, n_bytes = count_parameters(begun.state.params)
        self._progress.log(f"Total number of trainable weights: {n_params:,} ({format_bytes(n_bytes)}).")

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
        return self._recorder.copy(self._runner.state, None)[0]

    def __iter__(self) -> Iterator[Checkpoint]:
        """Yields the records up to `n_steps`; leaving the loop early waits for the writers' saves."""
        with self._signals.installed(interrupts=False):  # SIGTERM, also while the caller handles a record
            while (record := self._train_until(self._next_target())) is not None:
                try:
                    yield record
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
        return self._train_until(self._next_target())

    def next_step(self) -> Checkpoint:
        """Trains one step and returns its record (extending `n_steps` if it is passed).

        After a preemption notice it trains no more: it returns a record at
        the same step, `preempted=True`.

        Raises:
            KeyboardInterrupt: Ctrl-C, at a dispatch boundary; call again to go on.
        """
        if self._made is None:
            self._schedule = dataclasses.replace(self._schedule, n_steps=max(self.n_steps, self.step + 1))
        record = self._train_until(self.step + 1)
        assert record is not None  # a target always makes a record  # noqa: S101
        return record

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
            with self._watchdog.watching("waiting for the saves to finish"):
                background.wait_all()
            self._watchdog.close()
            return None
        return self._schedule.next_record_step(self.step)

    def _train_until(self, target: int | None) -> Checkpoint | None:
        """The record that an interrupted call made, else the record at step `target` (`None`: the run ended).

        A Ctrl-C noted while the record was made is raised when the handlers
        are put back; the record stays for the next call.
        """
        if self._made is None and target is not None:
            if self._outside is None:  # an interrupted call's segment goes on: its outside time is counted
                self._outside = time.perf_counter() - self._returned_at
            self._data.rewind()  # batches drawn by an interrupted call come again
            with self._signals.installed(interrupts=True), self._watchdog.watching():
                self._made = self._record(self._runner.train(target, self.n_steps), self._outside)
            self._outside = None
        record, self._made = self._made, None
        self._returned_at = time.perf_counter()
        return record

    def _record(self, trained: Trained, outside: float) -> Checkpoint:
        preempted = self._signals.take_preemption()
        self._watchdog.phase = "agreeing with the other processes on the record"
        return self._recorder.make(
            trained,
            self._runner.state,
            self.step,
            final=self.step >= self.n_steps,
            preempted=preempted,
            requested=self._signals.take_request(),
            flops_per_step=self._runner.flops_per_step,
            outside=outside,
        )
