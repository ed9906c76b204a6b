"""The records a loop yields (`Checkpoint`, `Summary`) and what lands on disk (`CheckpointFile`).

`training` produces these records; `checkpoint` and the summary sinks consume
them. Neither side imports the other: this module is what they share.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import jax

PyTree = Any
_Record = TypeVar("_Record")
Metrics = Mapping[str, Mapping[str, float]]

FORMAT_VERSION = 3
"""The version of the on-disk layout that this flaxstate writes and the newest it reads.

Version 3 added the run id, the global batch size of the data position and
the best writers' policy to `meta`; versions 1 and 2 are upgraded on read.
"""


BOUND = 0.5
"""Above this share of its time with the devices waiting, a run is called input-bound (waiting for the data) or
host-bound (waiting for the host otherwise)."""


def bound_note(data_fraction: float, idle_fraction: float) -> str:
    """What the progress bar and the logger say of a run whose devices waited most of the time (else "").

    Args:
        data_fraction: the share of the time the devices waited for the data.
        idle_fraction: the share of the time the devices waited for the host,
            the data included.

    Example:
        >>> bound_note(0.94, 0.97)
        'input-bound: 94% of the time waiting for data'
        >>> bound_note(0.03, 0.92)
        'host-bound: the devices idle 92% of the time, 3% waiting for data'
        >>> bound_note(0.03, 0.1)
        ''
    """
    if data_fraction > BOUND:
        return f"input-bound: {data_fraction:.0%} of the time waiting for data"
    if idle_fraction > BOUND:
        return f"host-bound: the devices idle {idle_fraction:.0%} of the time, {data_fraction:.0%} waiting for data"
    return ""


_UNITS = ("B", "kB", "MB", "GB", "TB")


def format_bytes(size: int) -> str:
    """Returns a byte count in the largest unit that keeps it at or above 1 (1024-based).

    Example:
        >>> format_bytes(3 * 2**30 // 2)
        '1.5 GB'
    """
    if size < 1024:
        return f"{size} B"
    power = min(int(math.log(size, 1024)), len(_UNITS) - 1)
    return f"{size / 1024**power:.1f} {_UNITS[power]}"


MEMORY_FIELDS = ("device_memory_peak", "host_memory", "host_memory_peak")
"""A record's memory figures by the names it reads them (`record.host_memory` is `record.memory.host`), in bytes
(`None` where unknown)."""


def memory_note(device_peak: int | None, host: int | None, host_peak: int | None) -> str:
    """What a record says of memory (the figures that are known), e.g. for the logger's line.

    Example:
        >>> memory_note(2**33, 3 * 2**30, 4 * 2**30)
        'host 3.0 GB (peak 4.0 GB), devices peak 8.0 GB'
        >>> memory_note(None, 3 * 2**30, None)
        'host 3.0 GB'
        >>> memory_note(None, None, None)
        ''
    """
    parts = []
    if host is not None:
        parts.append(f"host {format_bytes(host)}" + (f" (peak {format_bytes(host_peak)})" if host_peak else ""))
    if device_peak is not None:
        parts.append(f"devices peak {format_bytes(device_peak)}")
    return ", ".join(parts)


SLOW_PROCESS = 0.2
"""A process that waited for its data more than this share of a record's time, and three times as much as any
other process did, is named as the slow one."""


def slow_process_note(process_waits: tuple[tuple[float, float, float], ...]) -> str:
    """Names the process whose data wait stands far above the others' (else "").

    Args:
        process_waits: `(data_time, idle_time, elapsed_time)` of each process (`Checkpoint.process_waits`).

    Example:
        >>> slow_process_note(((0.02, 0.9, 1.0), (0.41, 0.45, 1.0)))
        'process 1 waited 41% of the time for its data; the others 2%'
        >>> slow_process_note(((0.02, 0.1, 1.0), (0.03, 0.1, 1.0)))
        ''
    """
    if len(process_waits) < 2:
        return ""
    shares = [data / elapsed if elapsed > 0 else 0.0 for data, _, elapsed in process_waits]
    slow = max(range(len(shares)), key=shares.__getitem__)
    others = max(share for index, share in enumerate(shares) if index != slow)
    if shares[slow] > SLOW_PROCESS and shares[slow] >= 3 * others:
        return f"process {slow} waited {shares[slow]:.0%} of the time for its data; the others {others:.0%}"
    return ""


@dataclasses.dataclass(frozen=True)
class Session:
    """One process's start of a training run, as its records carry it (for the goodput ledger).

    Attributes:
        started: when the process started (wall clock, seconds since the epoch).
        startup: seconds from the process's start to the loop's state created
            or restored (imports, the data's first batch, the restore).
        restore: seconds of `startup` spent restoring a checkpoint (0 for a fresh start).
        restored_step: the step the run resumed from (`None`: it started fresh).
        n_processes: the processes of the run.
        n_devices: the devices of the run (all processes').
        device_kind: the devices' kind, e.g. "NVIDIA H100 80GB HBM3" or "cpu".
        mesh: the loop's mesh, `{axis name: size}`.
        restored_fingerprint: the restored state's fingerprint (`flaxstate.run_record.fingerprints`),
            checked against the step's record of the session that saved it; `None` for a fresh start.
        n_microbatches: the microbatches a step of this session (`TrainLoop(max_device_batch=...)` sets
            them from the devices' batch on every start).
        max_device_batch: the examples a device may take at once, where given (`None`: not given).
        programs: where the programs that the loop compiled at its start came from: `"cache"` (every one
            from JAX's persistent compilation cache, e.g. a restart under `flaxstate launch`), `"compiled"`
            (one at least compiled in this process: no cache, or not in it; on a GPU, autotuned anew);
            `None` until the first record.
    """

    started: float
    startup: float
    restore: float = 0.0
    restored_step: int | None = None
    n_processes: int = 1
    n_devices: int = 1
    device_kind: str = ""
    mesh: Mapping[str, int] | None = None
    restored_fingerprint: str | None = None
    n_microbatches: int = 1
    max_device_batch: int | None = None
    programs: str | None = None


@dataclasses.dataclass(frozen=True)
class Timing:
    """Where a record's time went, and what its steps achieved: a `Checkpoint`'s `timing`.

    Attributes:
        data_time: seconds of `elapsed_time` that the devices waited for the
            training data, on this process: the time in the data iterator's
            `next` of each batch by whose end the devices had finished all
            the work given to them (seen with `jax.Array.is_ready`, not a
            sync). A batch drawn while the devices still compute earlier
            steps costs nothing and is not counted. More than half of
            `elapsed_time` means the run is input-bound.
        idle_time: seconds of `elapsed_time` that the devices had finished
            all the work given to them and waited for the host: for the data
            (`data_time` is part of it), Python between dispatches, threads
            of this process that hold the CPU or the GIL (a data pipeline's
            read threads, a save). Seen at draw and dispatch boundaries
            (`flaxstate.training.waiting`); compilation is not counted. More
            than half of `elapsed_time` with little `data_time` means the run
            is host-bound.
        flops_per_step: the model FLOPs of one global training step (all
            devices): its matrix products counted from the program before any
            backend rewrote it, the same on every backend, or the count given
            to `TrainLoop(flops_per_step=...)` (`flaxstate.training.throughput`);
            `None` where unknown. `mfu` uses it.
        xla_flops_per_step: XLA's cost analysis of the compiled update (all
            devices): elementwise work included, and on a GPU an undercount;
            `None` where the backend gives none.
        batch_size: the global batch's examples a step (all processes).
        n_devices: the devices the step runs on (all processes').
        peak_flops: the devices' dense peak FLOP/s, all of them together;
            `None` where unknown (a CPU), so `mfu` is `None` there.
        compile_time: seconds of `elapsed_time` spent compiling (tracing,
            lowering and XLA's compilation, on this process): the first
            record's, and a record's after a new batch shape. The speeds
            (`steps_per_second`, `examples_per_second`, `mfu`) leave it out.
        outside_time: seconds between the previous record's return and this
            record's training (evaluation, writers and the caller's code; for
            a session's first record, from the state's start to training).
        process_waits: each process's `(data_time, idle_time,
            elapsed_time)` for this record, in process order (one entry in a
            one-process run): a slow host shows data wait where the others
            show idle time (`slow_process_note`).
        rolled_back_time: seconds of training since the previous record
            that rollbacks threw away (`fs.Rollback`), not in `elapsed_time`.
    """

    data_time: float = 0.0
    idle_time: float = 0.0
    compile_time: float = 0.0
    outside_time: float = 0.0
    process_waits: tuple[tuple[float, float, float], ...] = ()
    flops_per_step: float | None = None
    xla_flops_per_step: float | None = None
    batch_size: int | None = None
    n_devices: int | None = None
    peak_flops: float | None = None
    rolled_back_time: float = 0.0


TIMING_FIELDS = tuple(field.name for field in dataclasses.fields(Timing))
"""The names a record takes for its `timing`'s fields (they were the record's own before `timing` grouped them)."""


@dataclasses.dataclass(frozen=True)
class Memory:
    """What a record's process held: a `Checkpoint`'s `memory`, in bytes (`None` where unknown).

    Attributes:
        device_peak: the bytes in use at the devices' peak, summed over this
            process's devices (`jax.Device.memory_stats()`), the highest since
            the process started (JAX keeps no other); `None` where the backend
            reports none (a CPU). See `flaxstate.training.memory`.
        host: this process's resident host memory when the record was made
            (`None` where the system says nothing).
        host_peak: this process's peak resident host memory since it started.
    """

    device_peak: int | None = None
    host: int | None = None
    host_peak: int | None = None


@dataclasses.dataclass(frozen=True)
class Fingerprints:
    """A record's checksums, for the resume audit: a `Checkpoint`'s `fingerprints` (`None` for records made by hand).

    Attributes:
        state: 16 hex digits of the state's bits, the same on any mesh and
            process count (`flaxstate.run_record.fingerprints`).
        data: 16 hex digits of the batches trained since the previous record
            (all their global indices with `fs.global_batches`, else the
            first one's bytes, where a resume starts). The goodput ledger
            keeps both, and a resume's replay is checked against them
            (`flaxstate.run_record.audit`).
    """

    state: str | None = None
    data: str | None = None


_GROUPS: dict[str, tuple[type[Any], dict[str, str]]] = {
    "timing": (Timing, {name: name for name in TIMING_FIELDS}),
    "memory": (Memory, dict(zip(MEMORY_FIELDS, ("device_peak", "host", "host_peak"), strict=True))),
    "fingerprints": (Fingerprints, {"state_fingerprint": "state", "data_fingerprint": "data"}),
}
"""A record's sub-records, each with the flat names it takes and reads its fields by (the record's own fields before
they were grouped): `record.data_time` is `record.timing.data_time`, `record.host_memory` `record.memory.host`."""


def _grouped_by_name(cls: type[_Record]) -> type[_Record]:
    """Lets a record class take its sub-records' fields by their flat names, as it did before they were grouped."""
    init = cls.__init__

    @functools.wraps(init)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        for group, (kind, names) in _GROUPS.items():
            given = {field: kwargs.pop(flat) for flat, field in names.items() if flat in kwargs}
            if given:
                kwargs[group] = dataclasses.replace(kwargs.get(group) or kind(), **given)
        init(self, *args, **kwargs)

    cls.__init__ = __init__  # type: ignore[method-assign]
    return cls


@_grouped_by_name
@dataclasses.dataclass(frozen=True)
class Checkpoint:
    """The training state at one step, as `TrainLoop` yields it.

    A record's arrays are its own: they stay valid for as long as it is
    held, whatever the loop does next. By default (`TrainLoop(...,
    record_memory="host")`) they are read-only numpy arrays in host memory,
    so the devices hold one copy of the state however many records are held
    (by the caller, or by a save running in the background); an `EvalLoop`
    evaluates the loop's own device arrays while the record is the loop's
    newest. With `record_memory="device"` they are copies on the devices.

    Attributes:
        state: the train state: one copy of ordinary (un-stacked) arrays.
        grads: the gradients of the step's update (averaged across devices),
            held as `state` is; `None` in a preempted record, and in every
            record of a loop made with `record_gradients=False`.
        loss: the step's loss (averaged across devices).
        n_completed_steps: steps run since the previous record.
        step: the state's step (total updates applied).
        rng: the loop's random key (restored on resume).
        data_position: where the training data stands after this step (JSON).
        final: whether the loop reached `n_steps` with this record (writers
            save it and wait for the save).
        metrics: `{group: {name: value}}`, e.g. `{"eval": {"loss": 0.1}}`; an
            `EvalLoop` adds its group.
        run_id: the run this record belongs to: created when a run starts
            fresh, restored on resume, stored with every checkpoint, so a
            writer never mixes two runs in one directory.
        preempted: whether the loop stopped here on a preemption notice
            (SIGTERM): the loop's last record, at the dispatch boundary where
            the notice was seen, with `grads=None`. Writers save it whatever
            their interval and wait for the save.
        elapsed_time: seconds since the previous record: the loop's time
            training, up to the devices finishing the record's step (not the
            time the caller held the previous record), compilation included
            (`compile_time`).
        skipped_damaged: the step directories that the reader this run
            resumed from skipped as damaged (absolute paths): the run's
            writer sets those of its directory aside (`<step>.damaged`)
            instead of taking them for another history.
        session: this process's start of the run (for the goodput ledger);
            `None` for records made by hand.
        requested: whether a checkpoint was asked for (SIGUSR1 to any of
            the run's processes) since the previous record: every
            `CheckpointFileWriter` saves it, whatever its policy (`every=`).
        timing: where `elapsed_time` went and what the steps achieved
            (`Timing`); each of its fields reads as an attribute of the record
            too (`record.data_time` is `record.timing.data_time`), and
            `Checkpoint(...)` and `dataclasses.replace` take them by name.
        memory: what this process held (`Memory`); read as
            `record.device_memory_peak`, `record.host_memory` and
            `record.host_memory_peak` too, and taken by those names.
        evaluation_cut_short: `{group: (batches evaluated, batches asked)}`
            of each evaluation that a preemption notice stopped early (an
            `EvalLoop` evaluates no batch of a preempted record, and stops
            at its next batch when a notice comes while it evaluates), so
            that the writers after it save in time; its metrics are the mean
            over the batches evaluated (none: the group is left out).
        preemption_noticed: whether this process has received a preemption
            notice since the record was made (SIGTERM; one process's loop
            only), for an evaluation to stop early; `None` for records made
            by hand. Under several processes it stays false: their
            evaluations must all run the same batches.
        device_state: the loop's own device state that `state` copies,
            while it is valid (until the loop's next dispatch donates it),
            else `None`; an `EvalLoop` evaluates it instead of putting the
            host copy on the devices again. `None` for records made by hand.
        rollbacks: the run's rollbacks so far (`TrainLoop(rollback=fs.Rollback())`),
            oldest first, each `{"at_step": int, "to_step": int, "reason":
            "nonfinite" | "spike", "skipped_steps": [int, ...]}`: the bad
            step, the step gone back to, and the steps whose batches were
            skipped. Saved in `data_position`, so a resume skips the same.
        fingerprints: the state's and the data's checksums for the resume
            audit (`Fingerprints`); read as `record.state_fingerprint` and
            `record.data_fingerprint` too, and taken by those names.

    Example:
        >>> record = Checkpoint(state=None, grads=None, loss=0.5, n_completed_steps=10,
        ...                     elapsed_time=1.0, step=10)
        >>> record.with_metrics({"eval": {"acc": 0.9}}).metrics
        {'eval': {'acc': 0.9}}
    """

    state: PyTree
    grads: PyTree
    loss: float
    n_completed_steps: int
    elapsed_time: float
    step: int
    rng: jax.Array | None = None
    data_position: Mapping[str, Any] | None = None
    final: bool = False
    metrics: Metrics = dataclasses.field(default_factory=dict)
    run_id: str | None = None
    preempted: bool = False
    skipped_damaged: tuple[str, ...] = ()
    session: Session | None = None
    requested: bool = False
    timing: Timing = dataclasses.field(default_factory=lambda: Timing())
    memory: Memory = dataclasses.field(default_factory=lambda: Memory())
    evaluation_cut_short: Mapping[str, tuple[int, int]] = dataclasses.field(default_factory=dict)
    preemption_noticed: Callable[[], bool] | None = dataclasses.field(default=None, repr=False, compare=False)
    device_state: Callable[[], PyTree | None] | None = dataclasses.field(default=None, repr=False, compare=False)
    fingerprints: Fingerprints = dataclasses.field(default_factory=lambda: Fingerprints())
    rollbacks: tuple[Mapping[str, Any], ...] = ()

    @property
    def device_memory_peak(self) -> int | None:
        """`memory.device_peak`."""
        return self.memory.device_peak

    @property
    def host_memory(self) -> int | None:
        """`memory.host`."""
        return self.memory.host

    @property
    def host_memory_peak(self) -> int | None:
        """`memory.host_peak`."""
        return self.memory.host_peak

    @property
    def state_fingerprint(self) -> str | None:
        """`fingerprints.state`."""
        return self.fingerprints.state

    @property
    def data_fingerprint(self) -> str | None:
        """`fingerprints.data`."""
        return self.fingerprints.data

    @property
    def data_time(self) -> float:
        """`timing.data_time`."""
        return self.timing.data_time

    @property
    def idle_time(self) -> float:
        """`timing.idle_time`."""
        return self.timing.idle_time

    @property
    def compile_time(self) -> float:
        """`timing.compile_time`."""
        return self.timing.compile_time

    @property
    def outside_time(self) -> float:
        """`timing.outside_time`."""
        return self.timing.outside_time

    @property
    def process_waits(self) -> tuple[tuple[float, float, float], ...]:
        """`timing.process_waits`."""
        return self.timing.process_waits

    @property
    def flops_per_step(self) -> float | None:
        """`timing.flops_per_step`."""
        return self.timing.flops_per_step

    @property
    def xla_flops_per_step(self) -> float | None:
        """`timing.xla_flops_per_step`."""
        return self.timing.xla_flops_per_step

    @property
    def batch_size(self) -> int | None:
        """`timing.batch_size`."""
        return self.timing.batch_size

    @property
    def n_devices(self) -> int | None:
        """`timing.n_devices`."""
        return self.timing.n_devices

    @property
    def peak_flops(self) -> float | None:
        """`timing.peak_flops`."""
        return self.timing.peak_flops

    @property
    def training_time(self) -> float:
        """`elapsed_time` without `compile_time`: the time the speeds are over."""
        return max(self.elapsed_time - self.compile_time, 0.0)

    @property
    def productive_time(self) -> float:
        """`training_time` without `idle_time`: the devices' time on the steps (goodput's numerator)."""
        return max(self.training_time - self.idle_time, 0.0)

    @property
    def steps_per_second(self) -> float:
        """Steps a second since the previous record, compilation left out (0 when no time elapsed)."""
        return self.n_completed_steps / self.training_time if self.training_time > 0 else 0.0

    @property
    def examples_per_second(self) -> float:
        """Examples a second since the previous record, all processes' (0 when unknown or no time elapsed)."""
        return self.steps_per_second * (self.batch_size or 0)

    @property
    def flops_per_second(self) -> float | None:
        """Achieved FLOP/s since the previous record, all devices' (`None` where the FLOPs are unknown)."""
        return None if self.flops_per_step is None else self.flops_per_step * self.steps_per_second

    @property
    def tflops_per_device(self) -> float | None:
        """Achieved TFLOP/s of one device (`None` where the FLOPs or the devices are unknown)."""
        achieved = self.flops_per_second
        return None if achieved is None or not self.n_devices else achieved / self.n_devices / 1e12

    @property
    def mfu(self) -> float | None:
        """Model FLOPs utilization: `flops_per_second / peak_flops` (`None` where either is unknown)."""
        achieved = self.flops_per_second
        return None if achieved is None or not self.peak_flops else achieved / self.peak_flops

    @property
    def data_fraction(self) -> float:
        """The share of `elapsed_time` that the devices waited for the training data (0 when none elapsed)."""
        return self.data_time / self.elapsed_time if self.elapsed_time > 0 else 0.0

    @property
    def idle_fraction(self) -> float:
        """The share of `elapsed_time` that the devices waited for the host (0 when none elapsed)."""
        return self.idle_time / self.elapsed_time if self.elapsed_time > 0 else 0.0

    @property
    def model_params(self) -> PyTree:
        """The model's parameters."""
        return self.state.params

    @property
    def ema_params(self) -> PyTree:
        """The exponential moving average of the parameters (`TrainTask(ema_decay=...)`), or None without one."""
        return getattr(self.state, "ema", None)

    @property
    def model_state(self) -> PyTree:
        """The model's other (mutable) collections, e.g. batch statistics."""
        return self.state.flax_mutables

    @property
    def optimizer_state(self) -> PyTree:
        """The optax state."""
        return self.state.param_states

    def with_metrics(self, metrics: Metrics) -> Summary:
        """Returns this record as a `Summary` whose metrics extend its own by `metrics`."""
        merged = {group: dict(values) for group, values in self.metrics.items()}
        for group, values in metrics.items():
            merged.setdefault(group, {}).update(values)
        fields = {field.name: getattr(self, field.name) for field in dataclasses.fields(Checkpoint)}
        return Summary(**{**fields, "metrics": merged})


@_grouped_by_name
@dataclasses.dataclass(frozen=True)
class Summary(Checkpoint):
    """A record that an evaluation added metrics to (the same fields as `Checkpoint`)."""

    @classmethod
    def of(cls, checkpoint: Checkpoint, metrics: Metrics) -> Summary:
        """Returns `checkpoint.with_metrics(metrics)`."""
        return checkpoint.with_metrics(metrics)


@dataclasses.dataclass(frozen=True)
class CheckpointFile:
    """What a checkpoint holds on disk, and what a reader gives back.

    Attributes:
        state: the train state (or an inference state restored from it).
        step: the step the state was saved at.
        rng: the training loop's random key.
        data_position: the training data's position (JSON), see `TrainLoop`.
        metrics: the record's metrics.
        metadata: the user's metadata (JSON), e.g. the run's config.
        format_version: the on-disk layout's version.
        run_id: the run that saved it (checkpoints of format 1 and 2 read as `"format-2"`).
        skipped_damaged: the step directories that the reader skipped as
            damaged before it restored this one (absolute paths; not stored).
    """

    state: PyTree
    step: int
    rng: jax.Array | None = None
    data_position: Mapping[str, Any] | None = None
    metrics: Metrics = dataclasses.field(default_factory=dict)
    metadata: Any = None
    format_version: int = FORMAT_VERSION
    run_id: str | None = None
    skipped_damaged: tuple[str, ...] = ()
