"""Seconds this process spent compiling, from JAX's own duration events.

JAX times each compilation's stages (tracing to a jaxpr, lowering to MLIR,
XLA's backend compilation) and reports them only to listeners registered
process-wide with `jax.monitoring`: a process-wide registry is JAX's design,
so one listener sums them for every loop of the process, registered when the
first loop asks (not at import). A loop reads `seconds()` before and after a
segment; the difference is that segment's compilation, which its record
carries as `compile_time`. Compilations on other threads in that window (a
background save's, which orbax rarely compiles) count too.
"""

from __future__ import annotations

import threading

import jax

EVENTS = (
    "/jax/core/compile/jaxpr_trace_duration",
    "/jax/core/compile/jaxpr_to_mlir_module_duration",
    "/jax/core/compile/backend_compile_duration",
)
"""The duration events that make up one compilation (a persistent cache hit reports only the first two)."""

_lock = threading.Lock()
_total = 0.0
_listening = False


def _listen(event: str, duration_secs: float, **_: str | int) -> None:
    global _total
    if event in EVENTS:
        with _lock:
            _total += duration_secs


def seconds() -> float:
    """The seconds this process has spent compiling since the first call (which starts the count)."""
    global _listening
    if not _listening:
        with _lock:
            if not _listening:
                jax.monitoring.register_event_duration_secs_listener(_listen)
                _listening = True
    return _total
