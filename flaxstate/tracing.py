"""`TraceWriter`: a profiler trace of one record's steps, as a chain element.

Like the writers, a `TraceWriter` is a callable that returns its record
unchanged. At the first record at or past `at_step` it starts
`jax.profiler.start_trace`; at the next record it stops it, so the trace
covers the steps between those two records (the loop's dispatches carry a
`jax.profiler.StepTraceAnnotation` named "train", so the viewer shows
training steps). The trace lands under `output_dir` where TensorBoard's
profile plugin reads it (`plugins/profile/<run>/`), with a Perfetto trace
beside it (`perfetto_trace.json.gz`, for ui.perfetto.dev). Under several
processes each traces its own host into `output_dir/process-<index>/`.
Tracing changes no result.
"""

from __future__ import annotations

from pathlib import Path

import jax

from flaxstate.locations import local_path
from flaxstate.records import Checkpoint


class TraceWriter:
    """Traces the steps after the record at `at_step` up to the next record (see the module's docstring).

    Example:
        >>> import tempfile
        >>> tracer = TraceWriter(tempfile.mkdtemp(), at_step=100)
        >>> tracer.tracing
        False

    Args:
        output_dir: the run's directory (or TensorBoard's log directory).
        at_step: the trace starts at the first record whose step is at or past this one.

    Raises:
        ValueError: `at_step` is negative.
    """

    def __init__(self, output_dir: str | Path, at_step: int) -> None:
        if int(at_step) != at_step or at_step < 0:
            raise ValueError(f"TraceWriter at_step must be a step (an int, 0 or more), got {at_step!r}.")
        self.output_dir = local_path(output_dir, "TraceWriter")
        self.at_step = int(at_step)
        self.tracing = False
        """Whether a trace is being taken (started at a record, not yet stopped)."""
        self.traced_steps: tuple[int, int] | None = None
        """The steps the finished trace covers, `(first, last)`, or `None` before it is done."""
        self._started_after: int | None = None

    @property
    def log_dir(self) -> Path:
        """Where this process's trace goes."""
        if jax.process_count() > 1:
            return self.output_dir / f"process-{jax.process_index()}"
        return self.output_dir

    def __call__(self, checkpoint: Checkpoint) -> Checkpoint:
        """Starts or stops the trace at this record; returns it unchanged."""
        step = int(checkpoint.step)
        if self.tracing:
            self.close()
            self.traced_steps = (int(self._started_after or 0) + 1, step)
        elif self.traced_steps is None and self._started_after is None and step >= self.at_step:
            if not (checkpoint.final or checkpoint.preempted):  # no steps follow the last record
                jax.profiler.start_trace(str(self.log_dir), create_perfetto_trace=True)
                self.tracing = True
                self._started_after = step
        return checkpoint

    def close(self) -> None:
        """Stops a trace still running (`with TraceWriter(...) as tracer:` does this)."""
        if self.tracing:
            self.tracing = False
            jax.profiler.stop_trace()

    def __enter__(self) -> TraceWriter:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"TraceWriter({str(self.output_dir)!r}, at_step={self.at_step})"
