"""A process's host memory, predicted by kind before the job starts (`fs.plan`'s `per_host`).

What flaxstate holds in a process's host memory beyond the program itself,
from the state's shapes and shardings alone (`S`: the bytes of the state's
parts on one process's devices, a replicated array once; `G`: the same of
the parameters, which the gradients match):

- `records`: with `record_memory="host"` (the default), a record holds a copy
  of the state and of its gradients, and two are held at once (the loop's
  newest while the one before is still held by a save in flight): 2 (S + G),
  or 2 S where records carry no gradients (`record_gradients=False`).
  With `"device"`, none.
- `save`: a save's staging and tensorstore's write buffers, `SAVE` x S; with
  `host_memory_budget=` B, at most B + `BUDGET_ALLOWANCE`.
- `peers`: with peer copies, during a save's exchange, the packed buffer of
  the process's own parts and the collective's copies of it (`EXCHANGE` - 1
  times S), and what arrives from each peer: (`EXCHANGE` - 1 + peers) S;
  with a budget B, which moves the parts in slices, at most B +
  `BUDGET_ALLOWANCE`. None where data-parallel replicas already hold every
  part (nothing is sent).
- `restore`: the reads in flight, `RESTORE_READS` x S (with a budget B, at most
  B + `BUDGET_ALLOWANCE`), at the start of a
  resume (before any record exists); on a CPU target also the restored state
  itself, S, which lives in host memory there.
- `local_tier`: where the local tier's directory is memory-backed (tmpfs,
  `/dev/shm`), its steps: `keep + 1` of them while a save replaces the oldest,
  each `1 + peers` copies of S.
- `total`: `local_tier` + the larger of the resume (`restore`) and training
  (`records + save + peers`, and on a CPU target the devices' own bytes: a
  device's total from the compiled program times the process's devices, as
  a CPU's device memory is host memory).
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from flaxstate import tree_paths
from flaxstate.records import format_bytes

if TYPE_CHECKING:
    from flaxstate.checkpoint.budget import HostMemoryBudget
    from flaxstate.checkpoint.tiers.local_tier import LocalTier

SAVE = 0.8
"""A save's peak host bytes beyond the record it saves, as a fraction of the state's: orbax's writer with its
default concurrency (orbax 0.12.8), measured on this CPU at 0.80x to 0.87x with jax 0.10.2 (Python 3.11) and
0.77x to 0.80x with jax 0.12 (Python 3.12), for states of 128 and 256 MiB (`benchmarks/host_memory.py`, and the
plan's test)."""
RESTORE_READS = 0.45
"""A restore's reads in flight at its peak beyond the restored state itself, as a fraction of the state's: measured
on this CPU at 0.5x to 0.7x with jax 0.10.2 and 0.24x to 0.35x with jax 0.12 (the same measurements)."""
EXCHANGE = 3.5
"""A save's exchange with one peer at its peak beyond the record, as a fraction of the process's parts: the packed
buffer, the copies that the collective (`ppermute` over gloo on a CPU) makes of it, and the peer's parts received.
Measured on this CPU with two processes holding 128 MiB each, in a fresh process (its first compile included), at
3.0x to 3.1x with jax 0.10.2 and 4.0x with jax 0.12 (`tests/test_host_memory_processes.py`); 2.06x in a loaded
CI run, where fewer of the collective's copies lived at once: a peak, not what every exchange holds."""
BUDGET_ALLOWANCE = 96 * 2**20
"""What a save, a peer exchange or a restore under `host_memory_budget=` may hold beyond the budget, whatever the
state's size: tensorstore's pools, the chunks its threads' malloc arenas keep, and a restore's compile of a
shard's update (in a fresh process, XLA's first compile). Measured on this CPU with a 256 MiB state whose
largest array is 43 MiB and a 16 MiB budget, on both stacks: a save 4 to 16 MiB beyond it; a restore 8 to 17
MiB in a process that compiled before (40 to 47 MiB there with JAX's persistent compilation cache on), and 23
to 65 MiB in a fresh process, whose first XLA compile is the restore's (`tests/test_host_memory_processes.py`,
benchmarks/host_memory.py). A peer exchange of two processes' 128 MiB parts in a fresh process: 12 to 31 MiB
with a 16 MiB budget."""
KINDS = ("records", "save", "peers", "restore", "local_tier", "total")
"""The kinds of `Plan.per_host`, as `Plan.__str__` lists them."""
MEMORY_FILESYSTEMS = ("tmpfs", "ramfs")
"""Filesystems whose files are host memory."""


def process_bytes(state: Any) -> tuple[int, int, bool]:
    """`(S, G, replicated)` of the process whose parts are largest (see the module).

    S and G: the bytes of the state's and of its parameters' parts on one
    process's devices, each distinct part once (a replicated array's process
    holds one copy in host memory). `replicated`: whether, with several
    processes, every process holds the same parts (pure data parallelism:
    peer copies send nothing).
    """
    flat = tree_paths.flatten(state.state_dict())
    totals: dict[int, list[int]] = {}
    replicated = True
    for path, leaf in flat.items():
        if not hasattr(leaf, "sharding"):
            continue
        itemsize = np.dtype(leaf.dtype).itemsize
        parts: dict[int, set[tuple[Any, ...]]] = {}
        for device, index in leaf.sharding.devices_indices_map(leaf.shape).items():
            parts.setdefault(device.process_index, set()).add(_key(index, leaf.shape))
        replicated = replicated and len({frozenset(keys) for keys in parts.values()}) == 1
        for process, keys in parts.items():
            size = sum(math.prod(stop - start for start, stop in key) for key in keys) * itemsize
            sums = totals.setdefault(process, [0, 0])
            sums[0] += size
            sums[1] += size if path.startswith("target/") else 0
    state_bytes, param_bytes = max(totals.values(), default=[0, 0])
    return state_bytes, param_bytes, replicated and len(totals) > 1


def _key(index: tuple[slice, ...], shape: tuple[int, ...]) -> tuple[tuple[int, int], ...]:
    return tuple(part.indices(size)[:2] for part, size in zip(index, shape, strict=False))


def per_host(
    state_bytes: int,
    param_bytes: int,
    *,
    record_memory: str,
    replicated: bool,
    record_gradients: bool = True,
    tier: LocalTier | None,
    devices: int | None,
    budget: HostMemoryBudget,
) -> dict[str, int]:
    """A process's host bytes by kind (see the module).

    Args:
        state_bytes, param_bytes: `process_bytes`.
        record_memory: `"host"` or `"device"`, as `TrainLoop` takes it.
        record_gradients: whether records hold gradients, as `TrainLoop` takes it.
        replicated: whether other processes' data-parallel replicas hold every part of this process's.
        tier: the local tier (its directory, peer copies and keep), or `None` (none).
        devices: on a CPU target, the process's devices' bytes (its devices' memory is host memory); else `None`.
        budget: the writer's and reader's `host_memory_budget` (`budget.UNBOUNDED`: none): a save, a peer
            exchange and a restore's reads hold at most it and `BUDGET_ALLOWANCE`.
    """
    peers = tier.peers if tier is not None else 0
    exchange = budget.holds(int((EXCHANGE - 1 + peers) * state_bytes), BUDGET_ALLOWANCE)
    sizes = {
        "records": 2 * (state_bytes + param_bytes * record_gradients) if record_memory == "host" else 0,
        "save": budget.holds(int(SAVE * state_bytes), BUDGET_ALLOWANCE),
        "peers": exchange if peers and not replicated else 0,
        "restore": budget.holds(int(RESTORE_READS * state_bytes), BUDGET_ALLOWANCE)
        + (state_bytes if devices is not None else 0),
        "local_tier": 0,
    }
    if tier is not None and memory_backed(tier.directory):
        sizes["local_tier"] = (tier.keep + 1) * (1 + peers) * state_bytes
    training = (devices or 0) + sizes["records"] + sizes["save"] + sizes["peers"]
    sizes["total"] = sizes["local_tier"] + max(training, sizes["restore"])
    return sizes


def memory_backed(directory: str | os.PathLike[str]) -> bool:
    """Whether a directory (or, where it does not exist yet, its nearest existing parent) is on tmpfs or ramfs."""
    path = Path(directory).absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    resolved = str(path.resolve())
    best, kind = "", ""
    for mount, filesystem in _mounts():
        inside = resolved == mount or resolved.startswith(mount.rstrip("/") + "/")
        if inside and len(mount) > len(best):
            best, kind = mount, filesystem
    return kind in MEMORY_FILESYSTEMS


def _mounts() -> list[tuple[str, str]]:
    """`(mount point, filesystem type)` of each mount (`/proc/mounts`; none where it is missing)."""
    try:
        lines = Path("/proc/mounts").read_text().splitlines()
    except OSError:
        return []
    fields = [line.split() for line in lines]
    return [(f[1].replace("\\040", " "), f[2]) for f in fields if len(f) >= 3]


def this_machine() -> int | None:
    """This machine's memory in bytes (`None` where the system does not say)."""
    try:
        return int(os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
    except (OSError, ValueError):
        return None


def advice(sizes: Mapping[str, int], host_memory: int) -> str:
    """What to change when a process's host memory does not fit: its kinds largest first, and each one's fix."""
    fixes = {
        "records": "record_memory='device' (records held on the devices)",
        "save": "host_memory_budget= on the writer (a save chunk by chunk), or more processes",
        "peers": "host_memory_budget= on the local tier (its parts sent in slices), or fewer peer copies",
        "restore": "host_memory_budget= on the reader (a restore chunk by chunk), or more processes",
        "local_tier": "a local tier on a disk instead of memory (not tmpfs), or a smaller keep",
    }
    ranked = sorted(((size, kind) for kind, size in sizes.items() if kind in fixes and size), reverse=True)
    listed = "; ".join(f"{kind} {format_bytes(size)}: {fixes[kind]}" for size, kind in ranked)
    return (
        f"host memory does not fit: {format_bytes(sizes['total'])} a process against {format_bytes(host_memory)}. "
        f"Largest first: {listed}."
    )
