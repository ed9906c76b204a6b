"""Seconds this process spent compiling, from JAX's own duration events.

JAX times each compilation's stages (tracing to a jaxpr, lowering to MLIR,
XLA's backend compilation) and reports them only to listeners registered
process-wide with `jax.monitoring`: a process-wide registry is JAX's design,
so one listener sums them for every loop of the process, registered when the
first loop asks (not at import). A loop reads `seconds()` before and after a
segment; the difference is that segment's compilation, which its record
carries as `compile_time`. Compilations on other threads in that window (a
background save's, which orbax rarely compiles) count too.

`cached()` counts, in the same way, the compile requests that used JAX's
persistent compilation cache and those that it answered: a loop's session
says whether its programs came from the cache (`FROM_CACHE`) or were compiled
in this process (`COMPILED`), as the ledger and the resume audit report it.
"""

from __future__ import annotations

import threading

import jax

EVENTS = (
    "/jax/core/compile/jaxpr_trace_duration",
    "/jax/core/compile/jaxpr_to_mlir_module_duration",
    "/jax/core/compile/backend_compile_duration",
)
"""The duration events that make up one compilation. A persistent cache hit reports all three: the third wraps
JAX's `compile_or_get_cached`, so it times the cache's read (jax 0.10.2 and 0.12 alike)."""
REQUESTS = "/jax/compilation_cache/compile_requests_use_cache"
"""A compilation that looked in the persistent cache (JAX records none without a cache)."""
HITS = "/jax/compilation_cache/cache_hits"
"""A compilation that the persistent cache answered."""

FROM_CACHE = "cache"
"""Every program a loop compiled at its start came from JAX's persistent compilation cache."""
COMPILED = "compiled"
"""At least one program a loop compiled at its start was compiled in its process (no cache, or not in it)."""

_lock = threading.Lock()
_total = 0.0
_counts = {REQUESTS: 0, HITS: 0}
_listening = False


def _listen(event: str, duration_secs: float, **_: str | int) -> None:
    global _total
    if event in EVENTS:
        with _lock:
            _total += duration_secs


def _count(event: str, **_: str | int) -> None:
    if event in _counts:
        with _lock:
            _counts[event] += 1


def _start() -> None:
    global _listening
    if not _listening:
        with _lock:
            if not _listening:
                jax.monitoring.register_event_duration_secs_listener(_listen)
                jax.monitoring.register_event_listener(_count)
                _listening = True


def seconds() -> float:
    """The seconds this process has spent compiling since the first call (which starts the count)."""
    _start()
    return _total


def cached() -> tuple[int, int]:
    """The compile requests that used the persistent cache, and those it answered, since the first call to
    `seconds` or `cached` (which starts the count)."""
    _start()
    with _lock:
        return _counts[REQUESTS], _counts[HITS]


def origin(before: tuple[int, int], after: tuple[int, int], compiled: float) -> str | None:
    """Where the programs compiled between two `cached()` counts came from: `FROM_CACHE`, `COMPILED`, or `None`
    where nothing was compiled (`compiled`: the seconds `seconds()` counted between them)."""
    requests, hits = after[0] - before[0], after[1] - before[1]
    if requests == 0 and compiled == 0.0:
        return None
    return FROM_CACHE if requests > 0 and hits == requests else COMPILED
