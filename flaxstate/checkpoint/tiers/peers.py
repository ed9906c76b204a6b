"""Peer copies of the local tier: which process holds whose parts, and the one collective that moves them.

`CheckpointFileWriter(fs.LocalTier(local_dir, peers=1))`: at each local
save, each process also keeps the parts of `peers` other processes, in
`local_dir/process-<i>/peers/process-<j>/<step>/`: the same two files that
process j wrote for itself, byte for byte. A host that is replaced (its
local directory empty) then gets its parts back from a peer that holds
them, and the run restarts from the local tier instead of the persistent
one (`flaxstate.checkpoint.tiers.restart`).

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

This module owns both halves: `PeerCopies`, which the local store hands
each save to (the exchange, then the copies kept beside its own step), and
`bring_back`, which a restart runs to move a lost process's parts to it.

Parts that data-parallel replicas already hold are not copied: a process
whose parts are exactly those of processes on `peers` other hosts (pure data
parallelism over hosts, or the replicas of a sharded model) sends no copy,
and a restart takes its parts from such a replica's own step instead. Under
pure data parallelism the save then moves nothing at all.

With `host_memory_budget=`, the parts move in slices of the budget's chunk
(`stream`): each gathered from the record's parts without packing them, and
written to the copy's file as it arrives (`Incoming`), so that the exchange
holds a few slices instead of the parts several times over. The loop waits
for that move: a collective run from the save's thread could meet the next
step's collectives in another order on another process.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import json
import logging
import os
import socket
from collections import Counter
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from flaxstate import collectives
from flaxstate.checkpoint.budget import UNBOUNDED, HostMemoryBudget
from flaxstate.checkpoint.stores.local import LocalStore
from flaxstate.checkpoint.stores.packed import (
    ARRAYS,
    Chunk,
    open_partial,
    pack_step,
    place_partial,
    remove_step,
    run_of,
    step_numbers,
    stored_meta,
    write_packed,
)
from flaxstate.checkpoint.stores.parts import DevicePart, held_parts

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


def framed(meta: dict[str, Any], chunks: list[Chunk]) -> list[Chunk]:
    """A local step's bytes as sent, in pieces (no copy of the chunks): the length of its meta's JSON (8 bytes),
    the JSON, then `arrays.bin`'s bytes."""
    text = np.frombuffer(json.dumps(meta).encode(), np.uint8)
    length = np.frombuffer(len(text).to_bytes(8, "little"), np.uint8)
    return [
        length,
        text,
        *(chunk if isinstance(chunk, DevicePart) else chunk.reshape(-1).view(np.uint8) for chunk in chunks),
    ]


def unpack(buffer: np.ndarray) -> tuple[dict[str, Any], np.ndarray]:
    """A local step's meta and `arrays.bin`'s bytes, from one buffer of `framed`'s pieces (padding after the arrays
    dropped)."""
    length = int.from_bytes(buffer[:8].tobytes(), "little")
    meta = json.loads(buffer[8 : 8 + length].tobytes())
    return meta, buffer[8 + length : 8 + length + int(meta["bytes"])]


class Outgoing:
    """The bytes a process sends, in pieces read a slice at a time: arrays (views), parts on a device and files
    (read as needed).

    Args:
        pieces: numpy arrays (their bytes), `DevicePart`s and paths of files (their whole contents), in order.
    """

    def __init__(self, pieces: Sequence[Chunk | Path]) -> None:
        self._pieces = pieces
        self._sizes = [piece.stat().st_size if isinstance(piece, Path) else piece.nbytes for piece in pieces]
        self.size = sum(self._sizes)

    def fill(self, start: int, out: np.ndarray) -> None:
        """Copies bytes `start` to `start + out.size` into `out` (a uint8 row, zeros beyond the end)."""
        offset, written = 0, 0
        for piece, size in zip(self._pieces, self._sizes, strict=True):
            begin, end = max(start + written - offset, 0), min(start + out.size - offset, size)
            if begin < end:
                target = out[written : written + end - begin]
                if isinstance(piece, Path):
                    with open(piece, "rb") as file:
                        file.seek(begin)
                        if file.readinto(target.data) != target.size:
                            raise OSError(f"{piece} ended at {begin + target.size:,} bytes while it was sent")
                elif isinstance(piece, DevicePart):
                    target[:] = piece.read(begin, end)
                else:
                    target[:] = piece.reshape(-1).view(np.uint8)[begin:end]
                written += end - begin
            offset += size
        out[written:] = 0


class Incoming:
    """A local step received a slice at a time, written to `<step>.partial-<pid>` in `directory` as it comes.

    The first bytes are `framed`'s meta; `arrays.bin` is written as the rest
    arrives (the padding that makes every process's slices equal is dropped),
    and `place` names the step.
    """

    def __init__(self, directory: Path, step: int) -> None:
        self.directory, self.step = directory, step
        self.meta: dict[str, Any] | None = None
        self._head = bytearray()
        self._file: Any = None
        self._left = 0

    def feed(self, data: np.ndarray) -> None:
        """Takes the next slice's bytes."""
        if self.meta is None:
            self._head += data.tobytes()
            length = int.from_bytes(self._head[:8], "little") if len(self._head) >= 8 else None
            if length is None or len(self._head) < 8 + length:
                return
            self.meta = json.loads(bytes(self._head[8 : 8 + length]))
            data = np.frombuffer(bytes(self._head[8 + length :]), np.uint8)
            self._head.clear()
            self._left = int(self.meta["bytes"])
            self._file = open(open_partial(self.directory, self.step) / ARRAYS, "wb")  # noqa: SIM115  closed below
        body = data[: self._left]
        self._file.write(body.data)
        self._left -= body.size

    def place(self, meta: dict[str, Any] | None, keep: int | None) -> dict[str, Any]:
        """Names the step (with `meta`, or the one received) once its bytes are written whole; returns its meta.

        Raises:
            OSError: fewer bytes arrived than its meta names.
        """
        if self.meta is None or self._left:
            raise OSError(f"{self.directory}: step {self.step} arrived short ({self._left:,} bytes missing)")
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        meta = self.meta if meta is None else meta
        place_partial(self.directory, self.step, meta, keep)
        return meta


def send(outgoing: Outgoing, destination: tuple[int, ...], slice_bytes: int | None = None) -> Iterator[jax.Array]:
    """Moves each process's bytes to `destination[process]` (a collective); yields what this process receives.

    The lengths are gathered first; every process then moves slices of one
    size (`slice_bytes`, or the longest process's bytes: one slice), padded
    with zeros, by one `ppermute` each over one device of each process. Each
    received slice is yielded still on its device (`np.asarray` waits); the
    next is gathered and dispatched only when asked for, so every process
    must take every slice.
    """
    lengths = collectives.allgather_json(outgoing.size)
    longest = max(max(lengths), 1)
    size = longest if slice_bytes is None else min(slice_bytes, longest)
    devices = _one_device_a_process()
    mesh = Mesh(np.asarray(devices), ("processes",))
    sharding = NamedSharding(mesh, PartitionSpec("processes"))
    mine = devices[jax.process_index()]
    moves = tuple((source, target) for source, target in enumerate(destination) if source != target)
    permute = _permute(mesh, moves)
    for start in range(0, longest, size):
        row = np.empty((1, size), np.uint8)
        outgoing.fill(start, row[0])
        local = jax.device_put(row, mine)
        array = jax.make_array_from_single_device_arrays((len(devices), size), sharding, [local])
        yield permute(array).addressable_shards[0].data[0]


def stream(
    outgoing: Outgoing, destination: tuple[int, ...], slice_bytes: int | None, incoming: Incoming | None
) -> None:
    """`send` in slices of `slice_bytes`, each received one fed to `incoming` (none: this process receives none).

    Two slices are in flight at most: the next is dispatched before the one
    before it is awaited and written, so a process holds a few slices, not
    the step.
    """
    in_flight: collections.deque[jax.Array] = collections.deque()

    def take() -> None:
        received = np.asarray(in_flight.popleft())
        if incoming is not None:
            incoming.feed(received)

    for received in send(outgoing, destination, slice_bytes):
        in_flight.append(received)
        if len(in_flight) > 1:
            take()
    while in_flight:
        take()


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


@dataclasses.dataclass(frozen=True)
class Exchanged:
    """What one save's exchange gave this process.

    Attributes:
        anyone_saved: some process holds the step already (every process refuses the save together).
        packed: this process's step as written (meta and chunks), where it was packed to be sent.
        received: `(owner, arrived)` for each process whose parts this one keeps: a packed buffer (still on
            the device, where it was sent whole) or an `Incoming` already written (under a budget); `None`:
            they are replicated on other hosts, so no copy is kept.
    """

    anyone_saved: bool
    packed: tuple[dict[str, Any], list[Chunk]] | None = None
    received: tuple[tuple[int, jax.Array | np.ndarray | Incoming | None], ...] = ()

    def keep(self, directory: Path, step: int, keep: int | None) -> None:
        """Writes the copies this process keeps of `step` (in the save's thread), after its own step.

        An owner whose parts are replicated elsewhere gets no copy, and none
        is kept, so that no stale copy outlives its use.
        """
        for owner, arrived in self.received:
            where = copies_directory(directory, owner)
            if arrived is None:
                for old in step_numbers(where):
                    remove_step(where, old)
                continue
            if isinstance(arrived, Incoming):
                copy_meta, body = (arrived.meta or {}), None
            else:
                copy_meta, body = unpack(np.asarray(arrived))
            for old in step_numbers(where):  # another run's copies, and this run's from a history a restart left
                if old >= step or run_of(where / str(old)) != copy_meta.get("run_id"):
                    remove_step(where, old)
            if body is None:
                assert isinstance(arrived, Incoming)
                arrived.place(None, keep)
            else:
                write_packed(where, step, copy_meta, [body], keep)


class PeerCopies:
    """The peer copies of one local tier: the exchange at each save, and the copies it keeps.

    Args:
        plan: who keeps whose parts (`plan_for_this_run`).
        host_memory_budget: move the parts in slices of `budget.chunk_bytes` bytes, each received slice
            written to the copy's file as it comes, so that the exchange holds a few slices instead of the
            step's bytes three to four times over (`host_memory.EXCHANGE`); the loop waits for the move.
    """

    def __init__(self, plan: PeerPlan, host_memory_budget: HostMemoryBudget = UNBOUNDED) -> None:
        self.plan = plan
        self.host_memory_budget = host_memory_budget

    def exchange(
        self, saved: bool, flat: Mapping[str, Any], header: dict[str, Any], directory: Path, step: int
    ) -> Exchanged:
        """Runs with every process, in the record's order: one gather of who holds what, then a move a round.

        Args:
            saved: whether this process holds the step already.
            flat: this process's state, by path.
            header: the meta its own step stores.
            directory: this process's local directory (under a budget, the copies are written there as they come).
            step: the step saved.
        """
        offers = collectives.allgather_json([saved, fingerprint(held_parts(flat))])
        if any(saved for saved, _ in offers):
            return Exchanged(anyone_saved=True)
        me = jax.process_index()
        replicated = replicated_elsewhere([held for _, held in offers], self.plan.hosts, len(self.plan.rounds))
        if all(replicated):  # pure data parallelism over hosts: nothing moves
            return Exchanged(False, None, tuple((owner, None) for owner in self.plan.sources(me)))
        block = self.host_memory_budget.block_bytes
        packed = pack_step(flat, header, block)
        outgoing = Outgoing([] if replicated[me] else list(framed(*packed)))
        received: list[tuple[int, jax.Array | Incoming | None]] = []
        for owner, holders in zip(self.plan.sources(me), self.plan.rounds, strict=True):
            if not self.host_memory_budget.bounded:
                (arrived,) = send(outgoing, holders)
                received.append((owner, None if replicated[owner] else arrived))
                continue
            incoming = None if replicated[owner] else Incoming(copies_directory(directory, owner), step)
            stream(outgoing, holders, self.host_memory_budget.chunk_bytes, incoming)
            received.append((owner, incoming))
        return Exchanged(False, packed, tuple(received))


def drop_copies_from(process_dir: Path, step: int) -> list[int]:
    """Removes the peer copies of `step` and later ones (a restart resumed from an earlier step); returns them."""
    dropped = []
    for where in (process_dir / PEERS).glob("process-*"):
        for old in step_numbers(where):
            if old >= step:
                remove_step(where, old)
                dropped.append(old)
    return sorted(set(dropped))


def bring_back(
    store: LocalStore,
    step: int,
    transfers: tuple[tuple[int, bool, int], ...],
    meta: dict[str, Any] | None,
    host_memory_budget: HostMemoryBudget = UNBOUNDED,
) -> dict[str, Any] | None:
    """Moves each lost process's parts of `step` from the process that keeps them (a collective).

    Each transfer is `(holder, as_copy, owner)`: the holder sends its copy of
    the owner's parts, or (`as_copy` false, a data-parallel replica) its own
    step. The owner writes them into its own directory, as its own save would
    have; a step of its own there (which it could not offer: damaged) is set
    aside first. Moves run in rounds in which no process sends or receives twice.

    Args:
        store: this process's local store.
        step: the step agreed on.
        transfers: the moves, from the agreement.
        meta: this process's own step's meta, where it holds the step.
        host_memory_budget: move the step in slices of `budget.chunk_bytes` bytes; without one, of
            `budget.LARGEST_CHUNK` (4 MiB). Either way the slices are read from the holder's file and written to
            the owner's as they come: a 200 MiB step moved in 4 MiB slices in a third of the time it took in one
            (benchmarks/RESULTS.md, "Issue 60, item 2: peer copies").

    Returns:
        This process's meta of the step: its own, or the one it received.
    """
    me, process_dir = jax.process_index(), store.directory
    pending = list(transfers)
    while pending:
        batch: list[tuple[int, bool, int]] = []
        for holder, as_copy, owner in pending:
            if all(holder not in (h, o) and owner not in (h, o) for h, _, o in batch):
                batch.append((holder, as_copy, owner))
        pending = [transfer for transfer in pending if transfer not in batch]
        destination = list(range(jax.process_count()))
        outgoing = Outgoing([])
        for holder, as_copy, owner in batch:
            destination[holder] = owner
            if holder == me:  # its copy of owner's parts, or its own step (whose parts owner's devices need)
                step_dir = (copies_directory(process_dir, owner) if as_copy else process_dir) / str(step)
                outgoing = Outgoing([*framed(stored_meta(step_dir), []), step_dir / ARRAYS])
            if me == 0:
                held_as = "peer copy" if as_copy else "own step (a data-parallel replica)"
                logger.info("process %d's parts of step %d come from process %d's %s.", owner, step, holder, held_as)
        receiving = any(owner == me for _, _, owner in batch)
        incoming = Incoming(process_dir, step) if receiving else None
        slice_bytes = host_memory_budget.chunk_bytes
        stream(outgoing, tuple(destination), slice_bytes, incoming)
        if incoming is not None:
            meta = {**(incoming.meta or {}), "process_index": me, "devices": [d.id for d in jax.local_devices()]}
            if (process_dir / str(step)).is_dir():  # its own, which it could not offer: damaged
                aside = store.set_aside(step)
                logger.warning("process %d's own step %d could not be restored; set aside as %s.", me, step, aside)
            incoming.place(meta, None)
    return meta
