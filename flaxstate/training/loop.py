"""`TrainLoop`: data-parallel training as a Python generator of `Checkpoint` records."""

from __future__ import annotations

import collections
import dataclasses
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

import jax
import jax.numpy as jnp
import numpy as np
from flax.core.scope import CollectionFilter, DenyList
from jax.sharding import Mesh

from flaxstate import background
from flaxstate.records import Checkpoint, CheckpointFile
from flaxstate.sharding import AxisRules
from flaxstate.train_state import FlaxOptimTrainState
from flaxstate.training import batching, copies, multihost, scaling
from flaxstate.training.data import DataStream
from flaxstate.training.interrupts import Signals
from flaxstate.training.nonfinite import LossWatch
from flaxstate.training.placement import Placement
from flaxstate.training.progress import ProgressDisplay, count_parameters, format_bytes
from flaxstate.training.step import Sharded, compile_gradients, compile_train_steps, make_train_step
from flaxstate.training.task import TrainTask
from flaxstate.training.waiting import DeviceWaitClock, WaitTimes

PyTree = Any
PREFETCH = 2
"""How many dispatches' batches are drawn from the data ahead of use (under several processes,
also placed on the devices ahead of use), within one record's segment."""


@dataclasses.dataclass
class _Segment:
    """The steps since the last record: kept across an interruption, so the record is the same."""

    start_step: int
    watch: LossWatch
    elapsed: float = 0.0
    waits: WaitTimes = dataclasses.field(default_factory=WaitTimes)
    """Seconds of `elapsed` the devices waited for the host, and for the data (`Checkpoint.idle_time`, `data_time`)."""


@runtime_checkable
class CheckpointSource(Protocol):
    """What `TrainLoop(init=...)` needs of a checkpoint reader.

    `target` is the model's `init` (or `None`). `read(template)` returns the
    checkpoint to resume from, its state restored into the tree, shapes,
    dtypes and shardings of `template.state` (a state whose leaves are
    `jax.ShapeDtypeStruct`s; `template` is `None` when `target` is), or `None`
    when there is none yet and training starts fresh.
    """

    target: Callable[..., Any] | None

    def read(self, template: CheckpointFile | None) -> CheckpointFile | None: ...


def _as_key(rng: jax.Array | int) -> jax.Array:
    """A typed key from a key, raw key data (uint32), or an int seed."""
    if isinstance(rng, int | np.integer) and not isinstance(rng, bool):
        return jax.random.key(int(rng))
    if not hasattr(rng, "dtype"):
        raise TypeError(
            f"TrainLoop rng must be a random key (jax.random.key(0)) or an int seed, got {type(rng).__name__}."
        )
    if jnp.issubdtype(rng.dtype, jax.dtypes.prng_key):
        return rng
    return jax.random.wrap_key_data(jnp.asarray(rng, dtype=jnp.uint32))


def _rng_names(collections_: Mapping[str, Sequence[str]] | None) -> tuple[tuple[str, ...], tuple[str, ...]]:
    if collections_ is None:
        return ("params", "dropout"), ("dropout",)
    unknown = set(collections_) - {"init", "apply"}
    if unknown:
        raise ValueError(
            f"collections has keys {sorted(unknown)}; it maps 'init' and 'apply' to rng collection names, "
            "e.g. {'init': ['params', 'dropout'], 'apply': ['dropout']}."
        )
    return tuple(collections_.get("init", ("params",))), tuple(collections_.get("apply", ()))


def _loss_scale(task: TrainTask) -> scaling.LossScale | None:
    return None if task.loss_scale is None else scaling.LossScale.create(task.loss_scale)


def _scaling_metrics(state: FlaxOptimTrainState) -> dict[str, dict[str, float]]:
    """A record's `train/loss_scale` and `train/skipped_steps` (with loss scaling), from its host copy."""
    if state.loss_scale is None:
        return {}
    scale, n_skipped = jax.device_get((state.loss_scale.dynamic.scale, state.loss_scale.n_skipped))
    return {"train": {"loss_scale": float(scale), "skipped_steps": int(n_skipped)}}


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
        input_sample: Any = None,
        n_steps_per_checkpoint: int = 1,
        n_steps: int = 0,
        n_steps_per_dispatch: int = 1,
        collections: Mapping[str, Sequence[str]] | None = None,
        mutable_collections: CollectionFilter = DenyList("intermediates"),
        devices: Sequence[jax.Device] | None = None,
        stdout: bool = True,
        handle_preemption: bool = True,
        record_memory: str = "host",
        n_microbatches: int = 1,
        mesh: Mesh | None = None,
        axis_rules: AxisRules | None = None,
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
            handle_preemption: on SIGTERM (a preemption notice; under several
                processes, on a notice to any one of them), stop at the next
                dispatch boundary and yield one last record with
                `preempted=True`. `False` leaves SIGTERM's handling as it is.
            record_memory: where records (and `state`) hold their copy of the
                state and gradients: `"host"`, host memory, so the devices hold
                about one copy of the state (the copy is an asynchronous
                device-to-host transfer a record); or `"device"`, a device
                copy, which is faster to make but needs room for the state
                twice (three times while a record is saved as the next is made).
            n_microbatches: M; each device splits its batch into M equal
                microbatches, interleaved (microbatch i holds examples i,
                i + M, i + 2M, ...; under a mesh, of the global batch, which
                gives the same microbatches), and accumulates their loss and gradients in a
                `lax.scan` (the activations of one microbatch at a time) before
                one update: the update of the whole batch, to float32 rounding.
                Batch statistics (BatchNorm) are updated once per microbatch,
                in order, as over M smaller steps; dropout masks differ per
                microbatch. M = 1 compiles the plain step.
            mesh: a `jax.sharding.Mesh` with named axes (e.g. `data`, `fsdp`,
                `model`) to shard the state over, with `axis_rules`; the
                loop then trains on the mesh's devices (not `devices`).
                Without them the loop is data-parallel: every device holds
                the whole state and computes on its part of the batch.
            axis_rules: flax-style logical axis rules, e.g. `[("batch",
                ("data", "fsdp")), ("embed", "fsdp"), ("mlp", "model")]`.
                Each state leaf is sharded by its logical axes through the
                rules (optimizer state as its parameter; unnamed leaves and
                axes no rule names are replicated, the latter with a
                warning); the batch's first dimension over the mesh axes of
                `batch`. The update is the global batch's (its loss and
                gradients, batch statistics over the whole batch), compiled
                once with `jax.jit` and explicit shardings (GSPMD inserts
                the collectives), the state donated. Each process feeds the
                part of the global batch that its devices hold along the
                batch axes (`flaxstate.sharding.BatchLayout.process_part`):
                FSDP over two processes, half each; tensor-parallel
                (`data=1, model=2`), the whole batch each. Dropout rngs are
                drawn per step for the global batch, so the masks do not
                depend on the mesh.

        Raises:
            ValueError: bad settings, or a batch that is empty, of the wrong
                structure, not divisible by the local device count (or the
                batch axes' parts this process holds), or whose per-device
                part does not divide into `n_microbatches`; axis rules
                naming a mesh axis that does not exist, or a state dimension
                that its mesh axes do not divide (naming the path); a
                resume whose data cannot be moved to the examples already
                trained (see `TrainTask.data`).
            TypeError: `rng` is neither a key nor an int.
        """
        if record_memory not in copies.RECORD_MEMORIES:
            raise ValueError(f"record_memory must be one of {copies.RECORD_MEMORIES}, got {record_memory!r}.")
        if n_steps_per_dispatch < 1 or n_steps_per_checkpoint < 1:
            raise ValueError(
                f"n_steps_per_dispatch ({n_steps_per_dispatch}) and n_steps_per_checkpoint "
                f"({n_steps_per_checkpoint}) must be at least 1."
            )
        if not isinstance(n_microbatches, int | np.integer) or n_microbatches < 1:
            raise ValueError(f"n_microbatches must be a positive int, got {n_microbatches!r}.")
        if n_steps_per_checkpoint % n_steps_per_dispatch:
            raise ValueError(
                f"n_steps_per_checkpoint ({n_steps_per_checkpoint}) must be a multiple of "
                f"n_steps_per_dispatch ({n_steps_per_dispatch}): a record can only be taken between dispatches."
            )
        self._n_steps = n_steps
        self._n_steps_per_checkpoint = n_steps_per_checkpoint
        self._n_steps_per_dispatch = n_steps_per_dispatch
        self._n_microbatches = int(n_microbatches)
        self._placement = Placement.create("TrainLoop", devices, mesh, axis_rules)
        self._mesh = self._placement.mesh
        self._n_local_parts = self._placement.n_local_parts
        self._progress = ProgressDisplay(stdout)
        self._signals = Signals(handle_preemption)
        self._segment: _Segment | None = None
        self._clock = DeviceWaitClock()
        self._nonfinite_patience = scaling.MAX_NONFINITE_LOSSES if task.loss_scale is not None else 0
        self._nonfinite_run: jax.Array | None = None
        """The run of non-finite losses that the last segment ended with (loss scaling tolerates some)."""
        self._undelivered: Checkpoint | None = None
        """A record made by a call that an interrupt stopped before it returned: the next call returns it."""
        self._last_loss = float("nan")
        self._data = DataStream(task.data, "TrainTask")
        init_names, apply_names = _rng_names(collections)

        first_batch = batching.normalize(self._data.peek(), "TrainTask")
        self._placement.check_batch(first_batch, "TrainTask", self._n_microbatches)
        self._batch_size = self._placement.global_batch_size(int(np.shape(first_batch[0][0])[0]))
        if input_sample is None:
            inputs = first_batch[0]
        else:
            inputs = input_sample if isinstance(input_sample, tuple) else (input_sample,)
        self._rng = _as_key(rng)
        self._views = copies.DeviceViews()
        state, restored = self._initial_state(init, task, inputs, init_names)
        shardings = self._placement.state_shardings(state)
        self._copy = copies.record_copier(self._mesh, shardings, record_memory)
        self._restored_step = None if restored is None else int(restored.step)
        self._skipped_damaged = () if restored is None else restored.skipped_damaged
        if restored is not None:
            self._rng = _as_key(restored.rng) if restored.rng is not None else self._rng
            message = self._data.restore(
                multihost.local_position(restored.data_position), int(restored.step), self._batch_size
            )
            self._progress.log(
                f"Resumed from the checkpoint at step {restored.step}." + (f" {message}" if message else "")
            )
        restored_run_id = restored.run_id if restored is not None else None
        self._run_id = restored_run_id or multihost.agree(uuid.uuid4().hex[:12])
        self._state_leaves, self._treedef = jax.tree.flatten(state)
        self._rng_data = jax.device_put(jax.random.key_data(self._rng), self._placement.replicated)
        self._step = int(jax.device_get(state.step))
        self._sharded = None
        if self._placement.sharded:
            self._sharded = Sharded(jax.tree.leaves(shardings), shardings.params, self._placement.batch_layout)
        self._train_step = make_train_step(
            task.apply,
            task.loss,
            apply_names,
            mutable_collections,
            1 if self._sharded else self._mesh.size,
            self._n_microbatches,
        )
        self._compiled: dict[int, Callable[..., Any]] = {}
        self._compiled_gradients: Callable[..., Any] | None = None
        self._checked_shapes: set[tuple[Any, ...]] = set()
        n_params, n_bytes = count_parameters(state.params)
        self._progress.log(f"Total number of trainable weights: {n_params:,} ({format_bytes(n_bytes)}).")

    def _initial_state(
        self, init: Any, task: TrainTask, inputs: tuple[Any, ...], init_names: tuple[str, ...]
    ) -> tuple[FlaxOptimTrainState, CheckpointFile | None]:
        reader = init if isinstance(init, CheckpointSource) else None
        model_init = reader.target if reader is not None else init
        if model_init is None:
            restored = reader.read(None) if reader is not None else None
            if restored is None:
                raise ValueError("TrainLoop needs init: a model's init, or a reader with a checkpoint or a target.")
            return self._state_from_state_dict(task, restored.state), restored
        init_rng = jax.random.fold_in(self._rng, 0)
        per_device = [np.asarray(x)[: max(1, len(x) // self._placement.n_local_devices)] for x in inputs]

        def create(rng: jax.Array, *sample: Any) -> FlaxOptimTrainState:
            rngs = {name: jax.random.fold_in(rng, index) for index, name in enumerate(init_names)}
            return FlaxOptimTrainState.create(task.optimizer, model_init(rngs, *sample), _loss_scale(task))

        shardings = self._placement.state_shardings(jax.eval_shape(create, init_rng, *per_device))
        fresh = jax.jit(create, out_shardings=shardings)
        if reader is None:
            return fresh(init_rng, *per_device), None
        # The template is abstract: a resumed run never holds a fresh state beside the restored one.
        restored = reader.read(CheckpointFile(state=fresh.eval_shape(init_rng, *per_device), step=0, rng=self._rng))
        if restored is None:
            self._progress.log(f"No checkpoint found by {reader!r}: training starts from step 0.")
            return fresh(init_rng, *per_device), None
        return restored.state, restored

    def _state_from_state_dict(self, task: TrainTask, state_dict: Mapping[str, Any]) -> FlaxOptimTrainState:
        def create() -> FlaxOptimTrainState:
            variables = {"params": state_dict["target"], **state_dict.get("flax_mutables", {})}
            return FlaxOptimTrainState.create(task.optimizer, variables, _loss_scale(task)).restore_state(state_dict)

        return jax.jit(create, out_shardings=self._placement.state_shardings(jax.eval_shape(create)))()

    @property
    def step(self) -> int:
        """The number of updates applied so far."""
        return self._step

    @property
    def n_steps(self) -> int:
        """The total number of steps."""
        return self._n_steps

    @property
    def n_steps_per_checkpoint(self) -> int:
        """N: a record is yielded every N steps."""
        return self._n_steps_per_checkpoint

    @property
    def run_id(self) -> str:
        """The run's id: created when a run starts fresh, restored on resume, carried by every record."""
        return self._run_id

    @property
    def state(self) -> FlaxOptimTrainState:
        """A copy of the current state (the loop's own is donated at each step), where records hold theirs.

        By default read-only numpy arrays in host memory (see `record_memory`),
        valid for as long as they are held.
        """
        return self._copy(self._current_state(), None)[0]

    def _current_state(self) -> FlaxOptimTrainState:
        return jax.tree.unflatten(self._treedef, self._state_leaves)

    def __iter__(self) -> Iterator[Checkpoint]:
        """Yields the records up to `n_steps`; leaving the loop early waits for the writers' saves."""
        with self._signals.installed(interrupts=False):  # SIGTERM, also while the caller handles a record
            while True:
                self._make_next_record()
                # No call between taking the record and yielding it: an interrupt cannot land in between.
                record, self._undelivered = self._undelivered, None
                if record is None:
                    return
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
        self._make_next_record()
        record, self._undelivered = self._undelivered, None
        return record

    def next_step(self) -> Checkpoint:
        """Trains one step and returns its record (extending `n_steps` if it is passed).

        After a preemption notice it trains no more: it returns a record at
        the same step, `preempted=True`.

        Raises:
            KeyboardInterrupt: Ctrl-C, at a dispatch boundary; call again to go on.
        """
        if self._undelivered is None:
            self._n_steps = max(self._n_steps, self._step + 1)
            self._train_until(self._step + 1)
        record, self._undelivered = self._undelivered, None
        assert record is not None
        return record

    def _make_next_record(self) -> None:
        """Trains up to the next record and leaves it for the caller to take (nothing once the loop ended)."""
        if self._undelivered is not None:  # made by a call that an interrupt stopped
            return
        ended_by_preemption = self._signals.preemption_taken
        if self._step >= self._n_steps or ended_by_preemption:
            self._progress.close()
            if self._restored_step == self._step and not ended_by_preemption:
                self._restored_step = None  # said once
                self._progress.log(
                    f"The checkpoint's step {self._step} is at or past n_steps ({self._n_steps}): nothing to "
                    "train. Raise n_steps to train on."
                )
            background.wait_all()
            return
        every = self._n_steps_per_checkpoint
        self._train_until(min(self._n_steps, (self._step // every + 1) * every))

    def run(self, n_steps: int) -> Iterator[Checkpoint]:
        """Sets the total to `n_steps` and yields the records up to it.

        Args:
            n_steps: the total number of steps (not a number of more steps),
                so `run(10)` then `run(20)` trains as `run(20)` does.

        Returns:
            a generator of records.
        """
        self._n_steps = n_steps
        return iter(self)

    def _compiled_steps(self, n_steps: int) -> Callable[..., Any]:
        if n_steps not in self._compiled:
            self._compiled[n_steps] = compile_train_steps(
                self._train_step, self._mesh, n_steps, self._treedef, jax.random.key_impl(self._rng), self._sharded
            )
        return self._compiled[n_steps]

    def _gradients(self) -> Callable[..., Any]:
        if self._compiled_gradients is None:
            self._compiled_gradients = compile_gradients(
                self._train_step, self._mesh, self._treedef, jax.random.key_impl(self._rng), self._sharded
            )
        return self._compiled_gradients

    def _host_batch(self, n_steps: int, first_step: int) -> Any:
        if n_steps == 1:
            return self._next_batch()
        return batching.stack([self._next_batch() for _ in range(n_steps)], first_step)

    def _next_batch(self) -> Any:
        self._signals.in_data = True
        start = time.perf_counter()
        try:
            batch = batching.normalize(self._data.next(), "TrainTask")
        finally:
            self._signals.in_data = False
            self._clock.drew(start, time.perf_counter(), self._segment.waits)
        if self._n_local_parts * self._n_microbatches > 1 or not self._checked_shapes:  # else any size divides
            shapes = tuple([array.shape for part in batch for array in part])
            if shapes not in self._checked_shapes:
                self._placement.check_batch(batch, "TrainTask", self._n_microbatches)
                self._checked_shapes.add(shapes)
        return batch

    def _train_until(self, target: int) -> None:
        """Trains up to step `target` (or a preemption notice) and leaves the record for the caller to take.

        A Ctrl-C noted while the record was made is raised when the handlers
        are put back; the record stays for the next call.
        """
        self._data.rewind()  # batches drawn by an interrupted call come again
        with self._signals.installed(interrupts=True):
            self._undelivered = self._train_segment(target)

    def _train_segment(self, target: int) -> Checkpoint:
        segment = self._segment
        if segment is None:
            watch = LossWatch(self._step, self._nonfinite_patience, self._nonfinite_run)
            segment = self._segment = _Segment(self._step, watch)
        resumed_at = time.perf_counter()
        self._clock.resume(resumed_at)
        try:
            grads = self._dispatch_until(target, segment)
            first_nonfinite, loss = segment.watch.result()  # waits for the devices: their time is the record's
        finally:
            segment.elapsed += time.perf_counter() - resumed_at
        self._segment = None
        if first_nonfinite is not None:
            if self._nonfinite_patience:
                raise FloatingPointError(
                    f"the training loss was non-finite (nan or inf) for {self._nonfinite_patience + 1} steps in a "
                    f"row, up to step {first_nonfinite}: loss scaling skips such steps, but no scale mends a "
                    "forward pass that overflows. No record was yielded after it. Compute the loss in float32, "
                    "lower the learning rate, or check the data."
                )
            raise FloatingPointError(
                f"the training loss became non-finite (nan or inf) at step {first_nonfinite}; no record "
                "was yielded after it. Lower the learning rate, clip gradients, or check the data."
            )
        self._nonfinite_run = segment.watch.run
        self._last_loss = self._last_loss if loss is None else loss
        preempted = self._signals.take_preemption()
        current = self._current_state()
        state, grads = self._copy(current, None if preempted else grads)
        self._views.publish(state, current)
        record = Checkpoint(
            state=state,
            grads=grads,
            loss=self._last_loss,
            n_completed_steps=self._step - segment.start_step,
            elapsed_time=segment.elapsed,
            step=self._step,
            rng=self._rng,
            data_position=multihost.gather_position(self._data.position(), self._batch_size),
            final=self._step >= self._n_steps,
            run_id=self._run_id,
            preempted=preempted,
            data_time=segment.waits.data,
            idle_time=segment.waits.idle,
            metrics=_scaling_metrics(state),
            skipped_damaged=self._skipped_damaged,
        )
        self._progress.record(record)
        return record

    def _dispatch_until(self, target: int, segment: _Segment) -> Any:
        """Runs the dispatches up to step `target`; returns the last step's gradients.

        Between dispatches it hands a Ctrl-C over (raising `KeyboardInterrupt`)
        and stops early on a preemption notice (returning `None`). The state
        and step are stored, and the batches trained committed, right after
        each dispatch, before anything can raise.
        """
        per_dispatch = self._n_steps_per_dispatch
        remaining = target - self._step
        sizes = [per_dispatch] * (remaining // per_dispatch) + [1] * (remaining % per_dispatch)
        chunks = iter(sizes)
        queue: collections.deque[tuple[int, Any]] = collections.deque()
        queued_steps = 0
        several_processes = jax.process_count() > 1  # one process hands host arrays to the compiled call

        def prefetch() -> None:
            nonlocal queued_steps
            while len(queue) < PREFETCH and (n := next(chunks, None)) is not None:
                batch = self._host_batch(n, self._step + queued_steps + 1)
                if several_processes:
                    batch = self._placement.to_devices(batch, stacked=n > 1)
                queue.append((n, batch))
                queued_steps += n

        self._progress.start(self._step, self._n_steps)
        self._views.clear()  # the newest record's device view ends where the state is donated
        signals = self._signals
        if signals.reached_preemption():
            return None
        prefetch()
        compiled = {n: self._compiled_steps(n) for n in {per_dispatch, 1}}
        grads = None
        for n_left in range(len(sizes) - 1, -1, -1):
            n, batch = queue.popleft()
            self._clock.dispatching(time.perf_counter(), segment.waits)
            if n > 1:
                self._state_leaves, grads, losses = compiled[n](self._state_leaves, batch, self._rng_data)
            else:
                if n_left == 0:  # the record's gradients: the last step's, before the update donates its state
                    grads = self._gradients()(self._state_leaves, batch, self._rng_data)
                self._state_leaves, losses = compiled[1](self._state_leaves, batch, self._rng_data)
            self._step += n
            queued_steps -= n
            self._clock.dispatched(losses)
            self._data.commit(n)
            segment.watch.add(losses, n)
            self._progress.advance(n)
            if n_left:  # after the last dispatch, the record is made first (an interrupt then keeps it)
                grads = None  # not the record's: freed before the next dispatch
                if signals.interrupted:
                    signals.interrupt_now()
                if signals.reached_preemption():
                    return None
                prefetch()
        if signals.reached_preemption():
            return None
        return grads
