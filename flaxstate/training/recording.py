"""A record from a segment's training: the state's copy, the data position, every process's waits, the run's facts.

`TrainLoop` trains a segment with its `SegmentRunner`, then asks its
`Recorder` for the `Checkpoint`: the copy of the state that the record holds
(the loop's own is donated at the next dispatch), the data position and
every process's waits gathered across processes (one collective each), and
what every record of a run carries (its key, id, session, batch size,
devices and peak FLOP/s).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
from jax.tree_util import PyTreeDef

from flaxstate.records import Checkpoint, Fingerprints, Memory, Session, Timing
from flaxstate.run_record import fingerprints
from flaxstate.train_state import FlaxOptimTrainState
from flaxstate.training import copies, memory, multihost, startup, throughput
from flaxstate.training.data import DataStream
from flaxstate.training.placement import Placement
from flaxstate.training.progress import ProgressDisplay
from flaxstate.training.segment import Trained

PyTree = Any


def scaling_metrics(state: FlaxOptimTrainState) -> dict[str, dict[str, float]]:
    """A record's `train/loss_scale` and `train/skipped_steps` (with loss scaling), from its host copy."""
    if state.loss_scale is None:
        return {}
    scale, n_skipped = jax.device_get((state.loss_scale.dynamic.scale, state.loss_scale.n_skipped))
    return {"train": {"loss_scale": float(scale), "skipped_steps": int(n_skipped)}}


def session(
    placement: Placement,
    restore_seconds: float,
    restored_step: int | None,
    restored_fingerprint: str | None = None,
    microbatches: tuple[int, int | None] = (1, None),
) -> Session:
    """This process's session: its start, startup and restore, the devices it trains on, the restored
    state's fingerprint, and its microbatches a step with the device batch that chose them."""
    started = startup.process_start_time()
    devices = list(placement.mesh.devices.flat)
    return Session(
        started=started,
        startup=max(time.time() - started, 0.0),
        restore=restore_seconds,
        restored_step=restored_step,
        n_processes=jax.process_count(),
        n_devices=len(devices),
        device_kind=devices[0].device_kind,
        mesh=dict(placement.mesh.shape),
        restored_fingerprint=restored_fingerprint,
        n_microbatches=microbatches[0],
        max_device_batch=microbatches[1],
    )


def _state_text(state: PyTree) -> str:
    return fingerprints.text(fingerprints.of_state([copies.on_devices(leaf) for leaf in jax.tree.leaves(state)]))


class LazyFingerprints(Fingerprints):
    """A record's `Fingerprints` whose state fingerprint is taken when it is first read (then kept).

    Where a record holds numpy copies of the state on a CPU of one process
    (`copies.reads_later`), its fingerprint reads the same bits later as at
    once, and a record that no writer saves and nobody asks never reads its
    state again: 8 ms a record for a 48 MiB state on this CPU. The
    fingerprint is the same as the record's dispatch would have given (sums
    of words modulo 2^32, in any order). Under several processes it is a
    collective, and the record's dispatch gives it (never lazily).
    """

    def __init__(
        self, state_of: Callable[[], str] | None = None, data: str | None = None, *, state: str | None = None
    ) -> None:
        super().__init__(state, data)  # `dataclasses.replace` passes `state=` (read): then it is known
        object.__setattr__(self, "_state_of", None if state is not None else state_of)

    def __getattribute__(self, name: str) -> Any:
        if name == "state":
            state_of = object.__getattribute__(self, "_state_of")
            if state_of is not None:
                object.__setattr__(self, "state", state_of())
                object.__setattr__(self, "_state_of", None)
        return object.__getattribute__(self, name)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Fingerprints):
            return NotImplemented
        return (self.state, self.data) == (other.state, other.data)

    __hash__ = Fingerprints.__hash__

    def __reduce__(self) -> tuple[Any, ...]:
        return Fingerprints, (self.state, self.data)


@dataclasses.dataclass
class Recorder:
    """Makes a run's records (see the module's docstring).

    Attributes:
        copy: `(state_leaves, treedef, grads) -> (state, grads)` as a record holds them (`copies.record_copier`).
        views: the loop's device state behind its newest record's copy.
        data: the loop's data, for its position.
        progress: the progress display, told of every record.
        session: this process's session.
        rng, run_id, batch_size, n_devices, peak_flops, skipped_damaged: what every record carries.
    """

    copy: copies.Copier
    views: copies.DeviceViews
    data: DataStream
    progress: ProgressDisplay
    session: Session
    rng: jax.Array
    run_id: str
    batch_size: int
    n_devices: int
    peak_flops: float | None
    skipped_damaged: tuple[str, ...]
    reads_later: bool = False
    """Whether a record's state fingerprint is taken when first read, from its state (`copies.reads_later`)."""
    local_devices: tuple[jax.Device, ...] = ()
    """This process's devices of the mesh, whose memory a record reports."""
    preemption_noticed: Callable[[], bool] | None = None
    """Whether a preemption notice has come since (`Checkpoint.preemption_noticed`)."""
    last_loss: float = math.nan
    """The newest loss trained: a record of a segment that trained no step carries it again."""

    @classmethod
    def create(
        cls,
        *,
        placement: Placement,
        shardings: PyTree,
        record_memory: str,
        reads_later: bool,
        look: startup.FirstLook,
        begun: startup.Start,
        progress: ProgressDisplay,
        peak_flops_per_device: float | None,
        preemption_noticed: Callable[[], bool] | None = None,
        microbatches: tuple[int, int | None] = (1, None),
    ) -> Recorder:
        """The recorder of a run that `begun` starts on `placement`, with `look`'s data and batch size.

        Args:
            shardings: the state's shardings.
            record_memory: where records hold their copy (`copies.RECORD_MEMORIES`).
            reads_later: whether a record's fingerprint is taken when first read (`copies.reads_later`, which
                the loop asks once for its programs and its records).
            peak_flops_per_device: one device's peak FLOP/s, or `None` to look the devices up.
            preemption_noticed: whether a preemption notice has come (records carry it for an evaluation).
            microbatches: the microbatches a step, and the `max_device_batch` that set them (or `None`).
        """
        devices = list(placement.mesh.devices.flat)
        restored = None
        if begun.restored_step is not None:
            restored = fingerprints.text(fingerprints.of_state(jax.tree.leaves(begun.state)))
        return cls(
            copy=copies.record_copier(placement.mesh, shardings, record_memory),
            reads_later=reads_later,
            views=copies.DeviceViews(),
            data=look.data,
            progress=progress,
            session=session(placement, begun.restore_seconds, begun.restored_step, restored, microbatches),
            rng=begun.rng,
            run_id=begun.run_id,
            batch_size=look.batch_size,
            n_devices=len(devices),
            peak_flops=throughput.peak_flops(peak_flops_per_device, devices),
            skipped_damaged=() if begun.restored is None else begun.restored.skipped_damaged,
            local_devices=tuple(device for device in devices if device.process_index == jax.process_index()),
            preemption_noticed=preemption_noticed,
        )

    def make(
        self,
        trained: Trained,
        *,
        leaves: list[jax.Array],
        treedef: PyTreeDef,
        step: int,
        final: bool,
        preempted: bool,
        requested: bool,
        flops: tuple[float | None, float | None],
        outside: float,
        rollbacks: Sequence[Mapping[str, Any]] = (),
        rolled_back: float = 0.0,
        loss_window: Sequence[float | None] | None = None,
    ) -> Checkpoint:
        """The record of a segment, the loop's live state at `step` (a collective in multi-process runs).

        Args:
            trained: what the segment's training gives.
            leaves, treedef: the loop's own state, as it holds it (copied for the record, and published
                as its device view).
            step, final, preempted: the record's step, and whether it ends the run, or a preemption notice does.
            requested: whether this process was asked for a checkpoint (SIGUSR1); any process's request counts.
            flops: the model's and XLA's counts of a step's FLOPs (either `None` where unknown).
            outside: seconds between the previous record's return and this segment's training.
            rollbacks: the run's rollbacks so far (`Checkpoint.rollbacks`; saved in the data position).
            rolled_back: seconds of training since the previous record that rollbacks threw away.
            loss_window: a spike watch's last losses, kept in the data position for a resume.
        """
        self.last_loss = self.last_loss if trained.loss is None else trained.loss
        if trained.programs is not None:  # the first segment's, which compiled the loop's programs
            self.session = dataclasses.replace(self.session, programs=trained.programs)
        position = multihost.gather_position(self.data.position(), self.batch_size)
        if rollbacks:
            position["rollbacks"] = [dict(entry) for entry in rollbacks]
        if loss_window is not None:
            position["loss_window"] = list(loss_window)
        state_lanes = None
        lazy = fingerprints.ENABLED and trained.fingerprint is None and self.reads_later  # from the record's state
        if fingerprints.ENABLED and not lazy:  # the record's dispatch's, else dispatched before the copy
            state_lanes = trained.fingerprint if trained.fingerprint is not None else fingerprints.of_state(leaves)
        indices, digest = self.data.take_fingerprint()
        waits = trained.waits
        process_waits, requested, digests = multihost.gather_waits(
            waits.data, waits.idle, trained.elapsed, requested, digest
        )
        data_fingerprint = indices if indices is not None else fingerprints.of_digests(digests)
        host_state, grads = self.copy(leaves, treedef, None if preempted else trained.grads)
        self.views.publish(host_state, leaves, treedef)
        record = Checkpoint(
            state=host_state,
            grads=grads,
            loss=self.last_loss,
            n_completed_steps=trained.n_steps,
            elapsed_time=trained.elapsed,
            step=step,
            rng=self.rng,
            data_position=position,
            final=final,
            run_id=self.run_id,
            preempted=preempted,
            metrics=scaling_metrics(host_state),
            skipped_damaged=self.skipped_damaged,
            session=self.session,
            requested=requested,
            timing=Timing(
                data_time=waits.data,
                idle_time=waits.idle,
                compile_time=trained.compile,
                outside_time=outside,
                process_waits=process_waits,
                flops_per_step=flops[0],
                xla_flops_per_step=flops[1],
                batch_size=self.batch_size,
                n_devices=self.n_devices,
                peak_flops=self.peak_flops,
                rolled_back_time=rolled_back,
            ),
            memory=Memory(memory.device_peak(self.local_devices), memory.host_resident(), memory.host_peak()),
            preemption_noticed=self.preemption_noticed,
            rollbacks=tuple(dict(entry) for entry in rollbacks),
            device_state=functools.partial(self.views.lookup, host_state),
            fingerprints=(
                LazyFingerprints(functools.partial(_state_text, host_state), data_fingerprint)
                if lazy
                else Fingerprints()
                if state_lanes is None
                else Fingerprints(fingerprints.text(state_lanes), data_fingerprint)
            ),
        )
        self.progress.record(record)
        return record
