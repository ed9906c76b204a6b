"""Summaries at the edges: one line per record on stdout, TensorBoard event files on disk."""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, TextIO

import jax

from flaxstate.locations import run_directory
from flaxstate.records import MEMORY_FIELDS, Checkpoint, bound_note, memory_note, slow_process_note

if TYPE_CHECKING:
    from tensorboardX import SummaryWriter as _EventWriter


def _metrics(checkpoint: Checkpoint) -> dict[str, dict[str, float]]:
    metrics = {group: dict(values) for group, values in checkpoint.metrics.items()}
    metrics.setdefault("train", {}).setdefault("loss", float(checkpoint.loss))
    return metrics


class SummaryLogger:
    """Prints one line per record: step, metrics by group, steps/s, the devices' wait for data and host. Returns it.

    Devices waiting more than half the time are called out (input-bound,
    host-bound: `flaxstate.records.bound_note`); a preempted record is marked.

    Example:
        >>> record = Checkpoint(state=None, grads=None, loss=0.1203, n_completed_steps=500,
        ...                     elapsed_time=0.5, step=500, data_time=0.01, idle_time=0.025)
        >>> _ = SummaryLogger()(record.with_metrics({"eval": {"loss": 0.1311}}))
        step 500: eval/loss 0.1311  train/loss 0.1203  (1000.0 steps/s, 2% waiting for data, devices idle 5%)
    """

    def __init__(self, stream: TextIO | None = None) -> None:
        """Args:
        stream: where to print (stdout by default; only the primary process prints).
        """
        self._stream = stream

    def __call__(self, checkpoint: Checkpoint) -> Checkpoint:
        """Prints the record's line and returns the record unchanged."""
        if jax.process_index() != 0:
            return checkpoint
        values = "  ".join(
            f"{group}/{name} {value:.4g}"
            for group, group_values in _metrics(checkpoint).items()
            for name, value in group_values.items()
        )
        speed = checkpoint.steps_per_second
        data, idle = checkpoint.data_fraction, checkpoint.idle_fraction
        waits = f", {data:.0%} waiting for data, devices idle {idle:.0%}" if checkpoint.elapsed_time > 0 else ""
        if checkpoint.batch_size and checkpoint.elapsed_time > 0:
            mfu = f", MFU {checkpoint.mfu:.1%}" if checkpoint.mfu is not None else ""
            waits = f", {checkpoint.examples_per_second:,.0f} examples/s{mfu}" + waits
        memory = memory_note(checkpoint.device_memory_peak, checkpoint.host_memory, checkpoint.host_memory_peak)
        waits += f", {memory}" if memory else ""
        if checkpoint.compile_time >= 0.05 * checkpoint.elapsed_time > 0:
            waits += f", compiling {checkpoint.compile_time:.1f} s (not in the speeds)"
        bound = bound_note(data, idle)
        slow = slow_process_note(checkpoint.process_waits)
        bound = f"{bound}  {slow}".strip() if slow else bound
        stopped = "  preempted: the last record" if checkpoint.preempted else ""
        for group, (done, asked) in checkpoint.evaluation_cut_short.items():
            stopped += f"  {group} cut short by the preemption notice: {done} of {asked} batches"
        line = f"step {checkpoint.step}: {values}  ({speed:.1f} steps/s{waits}){'  ' + bound if bound else ''}{stopped}"
        print(line, file=self._stream or sys.stdout, flush=True)
        return checkpoint


class SummaryWriter:
    """Writes each record's metrics as TensorBoard scalars (`group/name`) under `output_dir`.

    Beside the metrics: `train/steps_per_second`, `train/data_fraction` and
    `train/idle_fraction` (the shares of the record's time that the devices
    waited for the training data, and for the host at all), and where the
    record knows them `train/examples_per_second`, `train/tflops_per_device`
    and `train/mfu`; `train/compile_seconds` where the record compiled;
    `memory/device_memory_peak`, `memory/host_memory` and
    `memory/host_memory_peak` in bytes where known; and
    `train/goodput`, this process's running goodput: the records' productive
    time (`Checkpoint.productive_time`) over the wall time since the process
    started (`Checkpoint.session`). The run's whole account, across restarts,
    is `flaxstate goodput DIR`.

    Event files come from tensorboardX (no TensorFlow); only the primary
    process writes.

    Example:
        >>> import tempfile
        >>> writer = SummaryWriter(tempfile.mkdtemp())
        >>> record = Checkpoint(state=None, grads=None, loss=0.5, n_completed_steps=10, elapsed_time=1.0, step=10)
        >>> writer(record) is record
        True
        >>> writer.close()
    """

    def __init__(self, output_dir: str | Path) -> None:
        """Args:
        output_dir: the run's directory; event files land in it.
        """
        self.output_dir = run_directory(output_dir, type(self).__name__)
        self._writer: _EventWriter | None = None
        self._productive = 0.0

    def __call__(self, checkpoint: Checkpoint) -> Checkpoint:
        """Writes the record's scalars at its step and returns the record unchanged."""
        if jax.process_index() != 0:
            return checkpoint
        if self._writer is None:
            # Imported at the first record it writes: tensorboardX brings protobuf and Google Cloud Storage's client
            # (0.3-0.4 s of every process's start here), which a process that writes no event file never needs.
            from tensorboardX import SummaryWriter

            self._writer = SummaryWriter(logdir=str(self.output_dir), flush_secs=10)
        for group, values in _metrics(checkpoint).items():
            for name, value in values.items():
                self._writer.add_scalar(f"{group}/{name}", value, global_step=int(checkpoint.step))
        if checkpoint.elapsed_time > 0:
            names = ["steps_per_second", "data_fraction", "idle_fraction", "tflops_per_device", "mfu"]
            names += ["examples_per_second"] if checkpoint.batch_size else []
            for name in names:
                if (value := getattr(checkpoint, name)) is not None:  # FLOPs and MFU only where known
                    self._writer.add_scalar(f"train/{name}", value, global_step=int(checkpoint.step))
            if checkpoint.compile_time > 0:
                self._writer.add_scalar("train/compile_seconds", checkpoint.compile_time, int(checkpoint.step))
        for name in MEMORY_FIELDS:
            if (value := getattr(checkpoint, name)) is not None:
                self._writer.add_scalar(f"memory/{name}", value, global_step=int(checkpoint.step))
        self._productive += checkpoint.productive_time
        if checkpoint.session is not None:
            wall = time.time() - checkpoint.session.started
            if wall > 0:
                self._writer.add_scalar("train/goodput", self._productive / wall, global_step=int(checkpoint.step))
        self._writer.flush()
        return checkpoint

    def close(self) -> None:
        """Closes the event file."""
        if self._writer is not None:
            self._writer.close()
            self._writer = None
