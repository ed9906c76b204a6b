"""Peer copies of the local tier: which process holds whose parts, and the one collective that moves them.

`CheckpointFileWriter(local_dir, per_process=True, peers=1)`: at each local
save, each process also keeps the parts of `peers` other processes, in
`local_dir/process-<i>/peers/process-<j>/<step>/`: the same two files that
process j wrote for itself, byte for byte. A host that is replaced (its
local directory empty) then gets its parts back from a peer that holds
them, and the run restarts from the local tier instead of the persistent
one (`flaxstate.checkpoint.tiers`).

Which process holds whose parts is picked by host, not by process index: with
one process per GPU, a ring over indices would put the copy on the same
machine. The processes are ordered by (host, index), and process k of that
order keeps the parts of process k - r x H (r = 1 .. peers, H the most
processes a host has): with hosts of equal size, always another host's. Each
round r is a permutation, moved by one `jax.lax.ppermute` over one device of
each process, dispatched where the record's save is (every process in the
same order) and awaited by the save's own thread. A process's host is
`FLAXSTATE_HOST` where set (tests, or a cluster whose host names repeat),
else `socket.gethostname()`.

Parts that data-parallel replicas already hold are not copied: a process
whose parts are exactly those of processes on `peers` other hosts (pure data
parallelism over hosts, or the replicas of a sharded model) sends no copy,
and a restart takes its parts from such a replica's own step instead. Under
pure data parallelism the save then moves nothing at all.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import socket
from collections import Counter
from pathlib import Path
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from flaxstate import collectives

logger = logging.getLogger("flaxstate")

PEERS = "peers"
"""The folder of a process's local directory that holds the other processes' parts."""


def host_name() -> str:
    """This process's host: `FLAXSTATE_HOST` where set, else the machine's name."""
    return os.environ.get("FLAXSTATE_HOST") or socket.gethostname()


@dataclasses.dataclass(frozen=True)
class PeerPlan:
    """Who keeps whose parts: `rounds[r][j]` is the process that keeps process j's parts in round r.

    Attributes:
        rounds: one permutation of the processes a copy.
        one_host: every process is on one host (the copies survive a lost
            directory, not a lost host).
        hosts: each process's host.
    """

    rounds: tuple[tuple[int, ...], ...]
    one_host: bool
    hosts: tuple[str, ...]

    def sources(self, index: int) -> list[int]:
        """The processes whose parts `index` keeps, one a round."""
        return [holders.index(index) for holders in self.rounds]

    def holder(self, owner: int, lost: set[int]) -> int | None:
        """The first process not in `lost` that keeps `owner`'s parts, or `None`."""
        return next((holders[owner] for holders in self.rounds if holders[owner] not in lost), None)


def plan(hosts: list[str], peers: int) -> PeerPlan:
    """Who keeps whose parts, for processes on `hosts` (one name a process), `peers` copies each.

    Raises:
        ValueError: `peers` is not below the process count, or the hosts are
            too few for that many copies each on another host.
    """
    count = len(hosts)
    if not 0 < peers < count:
        raise ValueError(
            f"peers={peers} copies of each process's parts need at least {peers + 1} processes; this run has "
            f"{count}. Give peers between 1 and {count - 1}, or peers=0."
        )
    order = sorted(range(count), key=lambda index: (hosts[index], index))
    position = {index: k for k, index in enumerate(order)}
    stride = max(Counter(hosts).values())
    one_host = stride == count
    if one_host:
        stride = 1
    elif peers * stride >= count:
        raise ValueError(
            f"peers={peers}: {count} processes on {len(set(hosts))} hosts (up to {stride} a host) hold at most "
            f"{count // stride - 1} copies each on other hosts. Give peers={count // stride - 1} or fewer."
        )
    rounds = tuple(
        tuple(order[(position[owner] + r * stride) % count] for owner in range(count)) for r in range(1, peers + 1)
    )
    return PeerPlan(rounds, one_host, tuple(hosts))


def replicated_elsewhere(fingerprints: list[str], hosts: tuple[str, ...], peers: int) -> tuple[bool, ...]:
    """Whether each process's parts are all held by processes on at least `peers` other hosts (it needs no copy).

    Args:
        fingerprints: each process's `fingerprint` of the parts it holds.
        hosts: each process's host.
        peers: the copies each process's parts must survive in.
    """
    return tuple(
        len({host for other, host in zip(fingerprints, hosts, strict=True) if other == mine and host != hosts[j]})
        >= peers
        for j, mine in enumerate(fingerprints)
    )


def fingerprint(parts: dict[str, Any]) -> str:
    """A digest of which parts a process holds (`{path: [index, ...]}`): equal where two processes hold the same."""
    ordered = {path: sorted(indices) for path, indices in sorted(parts.items())}
    return hashlib.sha256(json.dumps(ordered).encode()).hexdigest()


def plan_for_this_run(peers: int, owner: str) -> PeerPlan:
    """The plan of this run's processes (a collective: every process calls it, in the same order).

    Raises:
        ValueError: as `plan`, naming `owner`.
    """
    hosts = collectives.allgather_json(host_name())
    try:
        made = plan(hosts, peers)
    except ValueError as error:
        raise ValueError(f"{owner}: {error}") from None
    if made.one_host and jax.process_index() == 0:
        logger.warning(
            "%s: every process runs on host %s, so each process's peer copy is on that host too: it survives "
            "a lost local directory, not a lost host (set FLAXSTATE_HOST where host names repeat).",
            owner,
            hosts[0],
        )
    return made


def pack(meta: dict[str, Any], chunks: list[np.ndarray]) -> np.ndarray:
    """One buffer of a local step: the length of its meta's JSON (8 bytes), the JSON, then `arrays.bin`'s bytes."""
    text = np.frombuffer(json.dumps(meta).encode(), np.uint8)
    length = np.frombuffer(len(text).to_bytes(8, "little"), np.uint8)
    return np.concatenate([length, text, *(chunk.reshape(-1).view(np.uint8) for chunk in chunks)])


def unpack(buffer: np.ndarray) -> tuple[dict[str, Any], np.ndarray]:
    """A local step's meta and `arrays.bin`'s bytes, from `pack`'s buffer (padding after the arrays dropped)."""
    length = int.from_bytes(buffer[:8].tobytes(), "little")
    meta = json.loads(buffer[8 : 8 + length].tobytes())
    return meta, buffer[8 + length : 8 + length + int(meta["bytes"])]


def send(buffer: np.ndarray, destination: tuple[int, ...]) -> jax.Array:
    """Moves each process's buffer to `destination[process]` (a collective); returns what this process receives.

    The buffers are padded to the longest (their lengths gathered first) and
    moved by one `ppermute` over one device of each process; the result is
    this process's received buffer, still on its device (`np.asarray` waits).
    """
    lengths = collectives.allgather_json(int(buffer.size))
    longest = max(max(lengths), 1)
    if buffer.size == longest:
        padded = buffer.reshape(1, longest)  # no copy: the longest buffer (all of them, where the parts are equal)
    else:
        padded = np.zeros((1, longest), np.uint8)
        padded[0, : buffer.size] = buffer
    devices = _one_device_a_process()
    mesh = Mesh(np.asarray(devices), ("processes",))
    sharding = NamedSharding(mesh, PartitionSpec("processes"))
    mine = devices[jax.process_index()]
    local = jax.device_put(padded, mine)
    array = jax.make_array_from_single_device_arrays((len(devices), longest), sharding, [local])
    moves = [(source, target) for source, target in enumerate(destination) if source != target]
    moved = _permute(mesh, tuple(moves))(array)
    return moved.addressable_shards[0].data[0]


def _one_device_a_process() -> list[jax.Device]:
    """The first device of each process, by process index."""
    firsts: dict[int, jax.Device] = {}
    for device in jax.devices():
        if device.process_index not in firsts or device.id < firsts[device.process_index].id:
            firsts[device.process_index] = device
    return [firsts[index] for index in range(jax.process_count())]


_PERMUTES: dict[tuple[Any, ...], Any] = {}


def _permute(mesh: Mesh, moves: tuple[tuple[int, int], ...]) -> Any:
    """A jitted `ppermute` of rows over the processes' axis (compiled once a mesh and permutation)."""
    key = (mesh, moves)
    if key not in _PERMUTES:
        spec = PartitionSpec("processes")
        _PERMUTES[key] = jax.jit(
            jax.shard_map(
                lambda rows: jax.lax.ppermute(rows, "processes", list(moves)), mesh=mesh, in_specs=spec, out_specs=spec
            )
        )
    return _PERMUTES[key]


def copies_directory(process_dir: Path, owner: int) -> Path:
    """Where a process keeps process `owner`'s parts: `<its directory>/peers/process-<owner>`."""
    return process_dir / PEERS / f"process-{owner}"
