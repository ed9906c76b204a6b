"""What differs per process in a multi-process run: each process's data position and waits.

Every process feeds its devices from its own shard of the data, so each has
its own iterator state. A record carries all of them (gathered from every
process), and on resume each process takes back its own. A record also
carries every process's data and idle time (a slow host shows data wait
where the others show idle time), and whether any process was asked for a
checkpoint (SIGUSR1), so that all save it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils

from flaxstate import collectives


def agree(value: Any) -> Any:
    """Returns the primary process's `value` on every process (JSON-serializable; a collective)."""
    return value if jax.process_count() == 1 else collectives.allgather_json(value)[0]


def gather_position(local: Mapping[str, Any], batch_size: int) -> dict[str, Any]:
    """Returns the run's data position from this process's (a collective in multi-process runs).

    Args:
        local: `{"n_batches": n, "iterator_state": ...}` of this process.
        batch_size: the global batch size that `n_batches` counts in.

    Returns:
        `{"n_batches": n, "batch_size": b, "processes": p, "iterator_states":
        [one per process]}` (the last key only when the data has iterator states).
    """
    position: dict[str, Any] = {
        "n_batches": int(local["n_batches"]),
        "batch_size": int(batch_size),
        "processes": jax.process_count(),
    }
    if "iterator_state" in local:
        state = local["iterator_state"]
        position["iterator_states"] = [state] if jax.process_count() == 1 else collectives.allgather_json(state)
    return position


def local_position(position: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """Returns this process's part of a saved data position.

    Iterator states are used only when the process count is the one saved;
    otherwise the data is advanced past the consumed batches.
    """
    if position is None:
        return None
    local: dict[str, Any] = {"n_batches": int(position["n_batches"])}
    if position.get("processes") is not None:
        local["processes"] = int(position["processes"])
    if position.get("batch_size") is not None:
        local["batch_size"] = int(position["batch_size"])
    states = position.get("iterator_states")
    if states is not None and len(states) == jax.process_count():
        local["iterator_state"] = states[jax.process_index()]
    return local


def gather_waits(
    data_time: float, idle_time: float, elapsed_time: float, requested: bool, digest: int | None = 0
) -> tuple[tuple[tuple[float, float, float], ...], bool, tuple[int | None, ...]]:
    """Every process's waits of a record, whether any process asked for a checkpoint, and every process's
    digest of its span's first batch (one collective).

    Args:
        data_time, idle_time, elapsed_time: this process's, for the record.
        requested: whether this process was asked for a checkpoint (SIGUSR1).
        digest: this process's CRC-32 of its span's first batch (`flaxstate.run_record.fingerprints.BatchDigest`;
            `None`: unknown).

    Returns:
        `(data_time, idle_time, elapsed_time)` of each process in process
        order, whether any was asked, and each process's digest (`None` where unknown).
    """
    if jax.process_count() == 1:
        return ((data_time, idle_time, elapsed_time),), requested, (digest,)
    halves = [-1.0, -1.0] if digest is None else [float(digest >> 16), float(digest & 0xFFFF)]  # exact as float32
    rows = np.asarray(
        multihost_utils.process_allgather(np.asarray([data_time, idle_time, elapsed_time, float(requested), *halves]))
    ).reshape(jax.process_count(), 6)
    waits = tuple((float(data), float(idle), float(elapsed)) for data, idle, elapsed, *_ in rows)
    digests = tuple(None if high < 0 else (int(high) << 16) | int(low) for *_, high, low in rows)
    return waits, bool(np.any(rows[:, 3] > 0)), digests
