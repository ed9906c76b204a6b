"""The steps between two records: drawing batches ahead, dispatching them, and watching their losses.

A `SegmentRunner` owns the loop's live state (its flat leaves, its step and
its key's raw data) and trains it up to a step: it draws batches ahead of use
(`PREFETCH` dispatches; under several processes also placed on the devices
ahead), dispatches the compiled update K steps at a time, stores the state
and step and commits the batches trained right after each dispatch, before
anything can raise, and checks the losses for nan and inf on the devices. It
counts the time the devices waited for the host and for the data
(`flaxstate.training.waiting`). Between dispatches it hands a Ctrl-C over
(`KeyboardInterrupt`) and stops early on a preemption notice. An interrupted
segment is kept, so the record that the next call makes covers all its steps.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import itertools
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import numpy as np

from flaxstate import private_apis
from flaxstate.train_state import FlaxOptimTrainState
from flaxstate.training import batching, compiling, nonfinite, rollback
from flaxstate.training.data import DataStream
from flaxstate.training.interrupts import Signals
from flaxstate.training.placement import Placement
from flaxstate.training.program import Program
from flaxstate.training.progress import ProgressDisplay
from flaxstate.training.rollback import Rollback
from flaxstate.training.waiting import DeviceWaitClock, WaitTimes
from flaxstate.training.watchdog import Phase, Watchdog

PyTree = Any
_NOT_TRACED = contextlib.nullcontext()
_tracing: Callable[[], bool] = private_apis.profiler_tracing()
"""Whether a profiler trace is being taken (start_trace, or a profiler server's capture): a C++ flag read."""

PREFETCH = 2
"""How many dispatches' batches are drawn from the data ahead of use (under several processes,
also placed on the devices ahead of use), within one record's segment."""


@dataclasses.dataclass
class _Segment:
    """The steps since the last record: kept across an interruption, so the record is the same."""

    start_step: int
    watch: nonfinite.LossWatch
    elapsed: float = 0.0
    compile: float = 0.0
    waits: WaitTimes = dataclasses.field(default_factory=WaitTimes)


@dataclasses.dataclass(frozen=True)
class _Point:
    """The state that a rollback goes back to: the newest record's (or the run's start), held as the record holds
    it, with the data's position, the loss history and the run of non-finite losses there."""

    state: PyTree
    step: int
    position: dict[str, Any]
    history: jax.Array | None
    run: jax.Array | None


@dataclasses.dataclass(frozen=True)
class Trained:
    """What a segment's training gives its record.

    Attributes:
        grads: the last step's gradients (`None` after a preemption notice, or where records carry none).
        fingerprint: the last state's fingerprint (`flaxstate.run_record.fingerprints.of_state`), where the record's
            dispatch computed it (K > 1); else `None`.
        loss: the last loss (`None` if no step ran).
        n_steps: the steps the segment trained.
        elapsed: seconds training, up to the devices finishing the last step.
        compile: seconds of `elapsed` spent compiling.
        waits: seconds of `elapsed` the devices waited for the host, and for the data.
        bad: with a `Rollback`, the first bad step that every process agreed on (the segment's state is then
            to be rolled back, `SegmentRunner.roll_back`); `None`: none.
        programs: where the programs that the loop's first segment compiled ahead came from
            (`compiling.FROM_CACHE` or `compiling.COMPILED`); `None` for every later segment.
    """

    grads: PyTree
    fingerprint: jax.Array | None
    loss: float | None
    n_steps: int
    elapsed: float
    compile: float
    waits: WaitTimes
    bad: nonfinite.BadStep | None = None
    programs: str | None = None


class SegmentRunner:
    """Trains the loop's live state from record to record (see the module's docstring).

    Args:
        program: the compiled update and gradients.
        placement: where the batches go.
        data: the training data.
        signals: Ctrl-C and preemption notices.
        progress: the progress bar.
        n_microbatches: M microbatches a step (a batch must split into them).
        state: the state to train (placed on the devices).
        rng: the run's key.
        watchdog: told of each batch drawn and dispatch made, and what the segment waits for.
        global_batch: the one-step update's global batch (`jax.ShapeDtypeStruct`s), whose
            FLOPs the first segment counts (`flops_per_step`) before its first dispatch.
        loss_scaling: whether the state has loss scaling (which tolerates some non-finite losses).
        rollback: what to do on a bad loss (`flaxstate.training.rollback`); `None`: raise.
        rollbacks: the run's rollbacks made before this start (from the restored data position).
        loss_window: with a spike factor, the losses of the `window` steps before this start (from the restored
            data position, `None` for a loss not known), so that a resume judges its first steps as the run did.
    """

    def __init__(
        self,
        *,
        program: Program,
        placement: Placement,
        data: DataStream,
        signals: Signals,
        progress: ProgressDisplay,
        n_microbatches: int,
        state: FlaxOptimTrainState,
        rng: jax.Array,
        watchdog: Watchdog,
        global_batch: PyTree,
        loss_scaling: bool,
        rollback: Rollback | None = None,
        rollbacks: Sequence[dict[str, Any]] = (),
        loss_window: Sequence[float | None] | None = None,
    ) -> None:
        self._program = program
        self._placement = placement
        self._data = data
        self._signals = signals
        self._progress = progress
        self._n_microbatches = n_microbatches
        self.leaves, self.treedef = jax.tree.flatten(state)
        """The live state as the compiled update takes it (its arrays are donated at the next dispatch)."""
        self.step = int(jax.device_get(state.step))
        self.rng_data = jax.device_put(jax.random.key_data(rng), batching.replicated(placement.mesh))
        """The run key's raw data, on the devices (the compiled programs take it)."""
        self._watchdog = watchdog
        self._global_batch = global_batch
        self._compiled: set[int] = set()
        """The programs (their ids) dispatched before: the first dispatch of each compiles."""
        self._flops_counted = False
        """Whether a segment has counted the FLOPs (`Program` keeps them)."""
        self._patience = nonfinite.patience(loss_scaling)
        self._nonfinite_run: jax.Array | None = None
        """The run of non-finite losses that the last segment ended with (loss scaling tolerates some)."""
        self._segment: _Segment | None = None
        self._rollback = rollback
        self.rollbacks: list[dict[str, Any]] = list(rollbacks)
        """The run's rollbacks so far (`Checkpoint.rollbacks`)."""
        spike = rollback is not None and rollback.spike is not None
        self._history = nonfinite.empty_history(rollback.window) if spike and rollback else None
        if self._history is not None and loss_window is not None and len(loss_window) == len(self._history):
            known = [np.nan if loss is None else float(loss) for loss in loss_window]
            self._history = jax.numpy.asarray(known, jax.numpy.float32)
        if self._history is not None:  # placed as the losses are, so the first check compiles as the later ones
            self._history = jax.device_put(self._history, batching.replicated(placement.mesh))
        """With a spike factor: the last `window` losses, on the devices (nan before the window fills)."""
        self._point: _Point | None = None
        self._clock = DeviceWaitClock()
        self._checked_shapes: set[tuple[Any, ...]] = set()
        self._check_every_shape = placement.n_local_parts * n_microbatches > 1
        """Whether a batch of a new shape can fail to split (else any size divides, and the first is checked)."""

    @property
    def flops_per_step(self) -> tuple[float | None, float | None]:
        """The model's and XLA's FLOPs of one global step (`Program`), once a segment has counted them."""
        if not self._flops_counted:
            return None, None
        batch, rng_data = self._global_batch, self.rng_data
        return self._program.flops_per_step(batch, rng_data), self._program.xla_flops_per_step(batch, rng_data)

    def train(self, sizes: Sequence[int], total: int) -> Trained:
        """Trains dispatches of `sizes` steps each (or up to a preemption notice) of a run of `total` steps.

        `sizes` are counted from the runner's step (`Schedule.dispatch_sizes`);
        `total` is for the progress bar.

        Raises:
            KeyboardInterrupt: Ctrl-C, at a dispatch boundary; the segment is
                kept, and the next call goes on with it.
            FloatingPointError: a non-finite loss (more than loss scaling
                tolerates), naming the step.
        """
        self._data.rewind()  # the batches that an interrupted call drew come again
        segment = self._segment
        if segment is None:
            spike = self._rollback.spike if self._rollback is not None else None
            watched = None if spike is None or self._history is None else (spike, self._history)
            watch = nonfinite.LossWatch(self.step, self._patience, self._nonfinite_run, watched)
            segment = self._segment = _Segment(self.step, watch)
        resumed_at = time.perf_counter()
        compiled_before = compiling.seconds()
        overlapped = 0.0
        """The compile seconds that ran at once (`compile_ahead`) beyond the wall-clock time they took."""
        programs = None
        try:
            if not self._flops_counted:  # compiles the first segment's programs ahead of its dispatches, at once
                self._watchdog.enter(Phase.COMPILING_ONE_STEP)
                cached = compiling.cached()
                self._program.flops_per_step(self._global_batch, self.rng_data)
                began, counted = time.perf_counter(), compiling.seconds()
                self._program.compile_ahead(self._global_batch, self.rng_data, list(sizes))
                overlapped = max(0.0, compiling.seconds() - counted - (time.perf_counter() - began))
                programs = compiling.origin(cached, compiling.cached(), compiling.seconds() - compiled_before)
                self._flops_counted = True
            self._clock.resume(time.perf_counter())  # after the compilation, which is not idle time
            grads, fingerprint = self._dispatch_until(sizes, total, segment)
            self._watchdog.enter(Phase.WAITING_FOR_DEVICES, f" step {self.step}")
            bad, loss = segment.watch.first_bad()  # waits for the devices: their time is the record's
            if self._rollback is not None:
                bad = rollback.agree(bad)  # every process goes back, or none does
        finally:
            segment.elapsed += time.perf_counter() - resumed_at
            segment.compile += compiling.seconds() - compiled_before - overlapped
        self._segment = None
        if bad is not None and self._rollback is None:
            raise nonfinite.error(bad.step, self._patience)
        if bad is None:
            self._nonfinite_run, self._history = segment.watch.run, segment.watch.history
        n_steps = self.step - segment.start_step
        compiled = min(segment.compile, segment.elapsed)
        return Trained(grads, fingerprint, loss, n_steps, segment.elapsed, compiled, segment.waits, bad, programs)

    def loss_window(self) -> list[float | None] | None:
        """With a spike factor, the losses of the last `window` steps (`None` where unknown), for the data position;
        else `None`. Read once a record, after its losses were."""
        if self._history is None:
            return None
        return [float(loss) if np.isfinite(loss) else None for loss in np.asarray(jax.device_get(self._history))]

    def hold(self, state: PyTree) -> None:
        """Holds `state` (a record's copy of the live state at this step) as the point a rollback goes back to."""
        if self._rollback is not None:
            self._point = _Point(state, self.step, self._data.position(), self._history, self._nonfinite_run)

    def roll_back(self, bad: nonfinite.BadStep) -> dict[str, Any]:
        """Goes back to the held point: its state (the learning rate scaled), step and losses; the data past the
        bad span. Returns the rollback's entry (also in `rollbacks`).

        Raises:
            FloatingPointError: past `max_rollbacks`, naming the rollbacks made.
        """
        policy, point = self._rollback, self._point
        assert policy is not None and point is not None, "roll_back without a Rollback, or before hold()"
        if len(self.rollbacks) >= policy.max_rollbacks:
            raise rollback.error(bad, self.rollbacks, policy)
        n_skipped = self._data.roll_back(point.position, bad.step - point.step)
        entry = rollback.entry(bad, point.step, range(point.step + 1, point.step + 1 + n_skipped))
        self.rollbacks.append(entry)
        # A second rollback to this point counts its skip from where the data stands now, past this one's.
        point = self._point = dataclasses.replace(point, position=self._data.position())
        state = point.state
        if policy.lr_scale is not None:
            state = rollback.scaled(state, policy.lr_scale)
            self._point = dataclasses.replace(point, state=state)  # a second rollback here scales it again
        placed = jax.device_put(state, self._program.shardings, may_alias=False)  # the loop's own: donated next
        self.leaves = self.treedef.flatten_up_to(placed)  # type: ignore[attr-defined]
        self.step = point.step
        self._nonfinite_run, self._history = point.run, point.history
        self._segment = None
        return entry

    @property
    def _checking(self) -> bool:
        """Whether a batch can still fail the split check (else the first batch checked stands for all)."""
        return self._check_every_shape or not self._checked_shapes

    def check_batch(self, batch: batching.Batch) -> None:
        """Checks a batch's split over the placement and into microbatches, once per shape."""
        if not self._checking:
            return
        shapes = tuple([np.shape(array) for array in jax.tree.leaves(batch)])
        if shapes not in self._checked_shapes:
            self._placement.check_batch(batch, "TrainTask", self._n_microbatches)
            self._checked_shapes.add(shapes)

    def _host_batch(self, n_steps: int, first_step: int, waits: WaitTimes) -> Any:
        """The next dispatch's batch (K batches stacked), drawn as one timed draw."""
        self._watchdog.enter(Phase.WAITING_FOR_DATA, step=first_step - 1)
        self._signals.in_data = True
        start = time.perf_counter()
        try:
            if n_steps == 1:
                batch = batching.normalize(self._data.next(), "TrainTask", whole=self._data.whole)
            else:
                batches = [
                    batching.normalize(each, "TrainTask", whole=self._data.whole) for each in self._data.take(n_steps)
                ]
        finally:
            self._signals.in_data = False
            self._clock.drew(start, time.perf_counter(), waits)
        if n_steps == 1:
            self.check_batch(batch)
            return batch
        if self._checking:  # skips K calls that would each return at once
            for each in batches:
                self.check_batch(each)
        return batching.stack(batches, first_step)

    def _draw(self, sizes: Sequence[int], waits: WaitTimes) -> Iterator[tuple[int, Any, Any]]:
        """Each dispatch's `(n_steps, host batch, batch)` in turn, drawn when asked.

        Under several processes a batch is placed on the devices as it is
        drawn; one process hands host arrays to the compiled call.
        """
        several_processes = jax.process_count() > 1
        first_step = self.step + 1
        for n in sizes:
            batch = self._host_batch(n, first_step, waits)
            yield n, batch, self._placement.to_devices(batch, stacked=n > 1) if several_processes else batch
            first_step += n

    def _dispatch_until(self, sizes: Sequence[int], total: int, segment: _Segment) -> tuple[Any, Any]:
        """Runs the dispatches of `sizes` steps each; returns the last step's gradients and state fingerprint.

        The last dispatch gives them: its steps by the update that also returns
        its last step's and the fingerprint (`Program.record_update`), at one
        step as at K. Where records carry no gradients
        (`Program.record_gradients`), they are `None`; where records are not
        fingerprinted (`fingerprints.ENABLED`), the fingerprint is. Between
        dispatches it hands a Ctrl-C over (raising `KeyboardInterrupt`) and
        stops early on a preemption notice (returning `None` for both). The
        state and step are stored, and the batches trained committed, right
        after each dispatch, before anything can raise.
        """
        drawn = self._draw(sizes, segment.waits)
        watchdog = self._watchdog
        self._progress.start(self.step, total)
        signals = self._signals
        if signals.reached_preemption():
            return None, None
        queue = collections.deque(itertools.islice(drawn, PREFETCH))
        updates = {n: self._program.update(n) for n in set(sizes)}
        record_update = self._program.record_update(sizes[-1] if sizes else 1)
        grads = fingerprint = None
        for n_left in range(len(sizes) - 1, -1, -1):
            n, host_batch, batch = queue.popleft()
            self._clock.dispatching(time.perf_counter(), segment.waits)
            record = n_left == 0
            update = record_update if record else updates[n]
            compiled = id(update)
            if compiled in self._compiled:
                watchdog.enter(Phase.DISPATCHING, step=self.step)
            else:  # the first dispatch of its kind compiles
                watchdog.enter(Phase.COMPILING_UPDATE, f" of {n} steps", self.step)
                self._compiled.add(compiled)
            with jax.profiler.StepTraceAnnotation("train", step_num=self.step + n) if _tracing() else _NOT_TRACED:
                self.leaves, losses, *outputs = update(self.leaves, batch, self.rng_data)
                if record:  # the steps that also give the last one's gradients and the fingerprint
                    grads = outputs.pop(0) if self._program.record_gradients else None
                    fingerprint = outputs[0] if outputs else None
            self.step += n
            self._clock.dispatched(losses)
            watchdog.dispatched(losses)
            self._data.commit(n, host_batch)  # a span's first batch digested while the devices run it
            segment.watch.add(losses, n)
            self._progress.advance(n)
            if n_left:  # after the last dispatch, the record is made first (an interrupt then keeps it)
                if signals.interrupted:
                    signals.interrupt_now()
                if signals.reached_preemption():
                    return None, None
                if (drawn_next := next(drawn, None)) is not None:  # one popped, one drawn: PREFETCH stay ahead
                    queue.append(drawn_next)
        if signals.reached_preemption():
            return None, None
        return grads, fingerprint
