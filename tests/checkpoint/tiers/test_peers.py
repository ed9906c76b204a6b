"""Peer copies of the local tier: a lost host's parts come back from the process that keeps them.

Gloo processes on one machine, each given a host of its own (`FLAXSTATE_HOST`),
each with its own local directory, one shared persistent directory saved at
step 40 only; the local tier saves every record (10 steps) with `peers=1`.
All are killed with SIGKILL after step 70's record; each restart below starts
from a copy of what they left, with local directories deleted as a replaced
host would have them. The model is sharded over the processes (each holds its
share of the hidden units), so that each process's parts need a copy; under
pure data parallelism (`replicas`) no copy is kept, and a replica's own step
serves instead.
"""

import json
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
from flaxstate_testing import cluster, processes
from flaxstate_testing.checkpoints import (
    assert_same,
    local_steps,
    read_packed,
    restored_local_step,
    resume_verdicts,
)

import flaxstate as fs
from flaxstate.checkpoint import budget
from flaxstate.checkpoint.stores.packed import step_numbers, write_packed
from flaxstate.checkpoint.tiers import peers

CONFIG = {"data": "list", "width": 64, "optimizer": "sgd", "every": 10, "global_batch": 8, "n_steps": 100}
PERSISTENT_STEP = 40


def config_for(directory: Path, n_processes: int, **extra) -> dict:
    return {
        **CONFIG,
        "sharded": True,
        "output_dir": str(directory / "persistent"),
        "local_dirs": [str(directory / f"local-{i}") for i in range(n_processes)],
        "out": str(directory / "final.npz"),
        "save_steps": [PERSISTENT_STEP],
        "wait_saved": True,
        "peers": 1,
        "hosts": [f"host-{i}" for i in range(n_processes)],
        **extra,
    }


def run(directory: Path, n_processes: int, **extra) -> tuple[dict, list[str]]:
    outputs = cluster.run("resume", config_for(directory, n_processes, **extra), n_processes, timeout=300)
    return dict(np.load(directory / "final.npz")), outputs


def killed_after_70(directory: Path, n_processes: int, **extra) -> None:
    port = processes.free_port()
    config = config_for(directory, n_processes, **extra)
    workers = [
        processes.Watched(processes.start("resume.py", config, i, n_processes, port)) for i in range(n_processes)
    ]
    processes.kill_all_after(workers, "record 70", timeout=300)


@pytest.fixture(scope="module", params=[2, 4])
def killed(request, tmp_path_factory) -> dict:
    """A straight run's final state (with peer copies), and what the killed processes left, for 2 and 4 processes.

    The replaced host's test runs on both; each other test on the count where its case is not degenerate
    (4 processes cost twice 2's on 2 cores)."""
    n_processes = request.param
    root = tmp_path_factory.mktemp(f"peers-{n_processes}")
    straight, _ = run(root / "straight", n_processes)
    killed_after_70(root / "killed", n_processes)
    return {"straight": straight, "directory": root / "killed", "n": n_processes}


def restart_copy(killed: dict, tmp_path: Path) -> Path:
    directory = tmp_path / "restart"
    shutil.copytree(killed["directory"], directory)
    return directory


def kept_copies(directory: Path, holder: int, owner: int) -> list[int]:
    where = directory / f"local-{holder}" / f"process-{holder}" / "peers" / f"process-{owner}"
    return sorted(int(p.name) for p in where.iterdir() if p.name.isdigit()) if where.is_dir() else []


def test_who_keeps_whose_parts_is_picked_by_host():
    ring = peers.plan(["a", "b", "c"], 1)
    assert ring.rounds == ((1, 2, 0),) and not ring.one_host  # process j's parts kept by j + 1
    two_hosts = peers.plan(["a", "a", "b", "b"], 1)  # two processes a host: each copy on the other host
    assert two_hosts.rounds == ((2, 3, 0, 1),)
    assert peers.plan(["b", "a", "b", "a"], 1).rounds == ((1, 0, 3, 2),)  # by host, not by index
    assert peers.plan(["a", "b", "c", "d"], 2).rounds == ((1, 2, 3, 0), (2, 3, 0, 1))
    same = peers.plan(["a", "a"], 1)
    assert same.one_host and same.rounds == ((1, 0),)
    with pytest.raises(ValueError, match=r"peers=2 copies .* need at least 3 processes; this run has 2"):
        peers.plan(["a", "b"], 2)
    with pytest.raises(ValueError, match=r"peers=2: 4 processes on 2 hosts .* Give peers=1 or fewer"):
        peers.plan(["a", "a", "b", "b"], 2)


def test_the_copies_a_save_keeps_replace_stale_ones_and_a_restart_drops_those_at_or_after_its_step(tmp_path):
    # One process, no collective: what the exchange received, kept as peers.Exchanged.keep writes it.
    mine = tmp_path / "process-0"
    copies = peers.copies_directory(mine, 1)
    write_packed(copies, 3, {"bytes": 1, "run_id": "other"}, [np.zeros(1, np.uint8)], None)  # another run's
    write_packed(copies, 9, {"bytes": 1, "run_id": "this"}, [np.zeros(1, np.uint8)], None)  # a history left behind
    body = np.arange(5, dtype=np.uint8)
    received = np.concatenate(peers.framed({"bytes": 5, "run_id": "this", "step": 6}, [body]))
    peers.Exchanged(anyone_saved=False, received=((1, received), (2, None))).keep(mine, 6, keep=2)
    assert step_numbers(copies) == [6] and step_numbers(peers.copies_directory(mine, 2)) == []
    meta, stored = read_packed(copies / "6")
    assert meta["step"] == 6 and stored.tobytes() == body.tobytes()
    write_packed(copies, 8, {"bytes": 1, "run_id": "this"}, [np.zeros(1, np.uint8)], 2)
    assert peers.drop_copies_from(mine, 7) == [8] and step_numbers(copies) == [6]


def test_peers_beyond_the_processes_or_without_a_local_tier_are_refused_at_construction(tmp_path):
    with pytest.raises(ValueError, match=r"peers=1 copies of each process's parts need at least 2 processes"):
        fs.CheckpointFileWriter(tmp_path / "local", per_process=True, peers=1)
    with pytest.raises(ValueError, match=r"peers=1 keeps copies of each process's local tier; it needs per_process"):
        fs.CheckpointFileWriter(tmp_path / "persistent", peers=1)
    with pytest.raises(ValueError, match=r"peers must be a count of copies"):
        fs.CheckpointFileWriter(tmp_path / "local", per_process=True, peers=-1)
    assert not (tmp_path / "local").exists() and not (tmp_path / "persistent").exists()


def test_a_replaced_host_gets_its_parts_from_its_peer_and_resumes_from_the_local_tier_bit_for_bit(killed, tmp_path):
    directory, n = restart_copy(killed, tmp_path), killed["n"]
    # The newest step whole without process 1's directory: the others' own, and process 1's parts as kept by
    # the next host's process (a kill can land between a process's own save and its copy of its peer's).
    others = [set(local_steps(directory / f"local-{i}", i)) for i in range(n) if i != 1]
    newest = max(set.intersection(*others, set(kept_copies(directory, 2 % n, 1))))
    assert newest > PERSISTENT_STEP
    shutil.rmtree(directory / "local-1")  # a replaced host
    final, outputs = run(directory, n)
    assert restored_local_step(outputs[0]) == newest, outputs[0][-3000:]
    assert f"process 1's parts of step {newest} come from process {2 % n}'s peer copy" in outputs[0]
    assert all(f"start {newest}" in output for output in outputs), outputs
    assert_same(final, killed["straight"])
    # The state restored through the peer's copy is the one the killed run logged at its step, and the steps
    # trained again up to step 70 give the same bits.
    (resume,) = resume_verdicts(directory / "persistent")
    assert resume["from_step"] == newest and resume["verdict"] == ("bit-exact" if newest < 70 else "nothing replayed")
    # Its own saves, and its copies of process 0's, go on after the restart.
    assert local_steps(directory / "local-1", 1)[-1] == kept_copies(directory, 1, 0)[-1] == 100


@pytest.mark.parametrize("killed", [2], indirect=True)  # two processes' parts span two slices
def test_under_a_budget_a_lost_host_s_parts_and_the_copies_after_it_move_in_slices_bit_for_bit(killed, tmp_path):
    # The smallest budget (32 KiB) moves 4 KiB slices: a step of two processes spans two, the arrays across. The
    # restart brings process 1's parts back in slices from the holder's file, and each save after it exchanges
    # in slices.
    directory, n = restart_copy(killed, tmp_path), killed["n"]
    shutil.rmtree(directory / "local-1")
    final, outputs = run(directory, n, budget=budget.MINIMUM)
    newest = restored_local_step(outputs[0])
    assert newest > PERSISTENT_STEP and f"process 1's parts of step {newest} come from" in outputs[0], outputs[0]
    assert_same(final, killed["straight"])
    for owner in range(n):  # each copy byte for byte as its owner wrote its own step
        holder = (owner + 1) % n
        own_dir = directory / f"local-{owner}" / f"process-{owner}"
        copy_dir = directory / f"local-{holder}" / f"process-{holder}" / "peers" / f"process-{owner}"
        assert kept_copies(directory, holder, owner)[-1] == 100
        (own_meta, own), (copy_meta, copy) = read_packed(own_dir / "100"), read_packed(copy_dir / "100")
        assert own.tobytes() == copy.tobytes() and own_meta == copy_meta
        sent = 8 + len(json.dumps(own_meta)) + own.size  # two slices or more of two processes' larger parts
        assert sent > fs.HostMemoryBudget(budget.MINIMUM).chunk_bytes, sent


@pytest.mark.parametrize("slice_bytes", [1, 7, 64, 10**6])
def test_a_step_sent_in_slices_of_any_size_arrives_whole_and_the_padding_is_dropped(tmp_path, slice_bytes):
    # What each process does with its own bytes and the slices it receives (the collective between is the test
    # above's): pieces of arrays and of a file, gathered a slice at a time, then written as they come.
    meta = {"bytes": 300, "run_id": "this", "arrays": {"w": "x" * 100}}
    body = np.arange(300, dtype=np.uint8)
    (tmp_path / "tail.bin").write_bytes(body[200:].tobytes())
    outgoing = peers.Outgoing([*peers.framed(meta, [body[:120], body[120:200]]), tmp_path / "tail.bin"])
    assert outgoing.size == 8 + len(json.dumps(meta)) + 300
    incoming = peers.Incoming(tmp_path / "copies", 6)
    longest = outgoing.size + 50  # another process sent more: every slice is as long, and the last padded
    for start in range(0, longest, slice_bytes):
        row = np.full(min(slice_bytes, longest), 255, np.uint8)
        outgoing.fill(start, row)
        incoming.feed(row)
    assert incoming.place(None, keep=1) == meta
    stored_meta, stored = read_packed(tmp_path / "copies" / "6")
    assert stored_meta == meta and stored.tobytes() == body.tobytes()
    short = peers.Incoming(tmp_path / "copies", 7)
    short.feed(np.concatenate(peers.framed(meta, [body]))[:-1])
    with pytest.raises(OSError, match=r"step 7 arrived short \(1 bytes missing\)"):
        short.place(None, keep=1)
    assert step_numbers(tmp_path / "copies") == [6]


@pytest.mark.parametrize("killed", [4], indirect=True)  # of two, both are lost: no other to say why
def test_adjacent_lost_hosts_fall_back_to_the_persistent_tier_and_say_why(killed, tmp_path):
    directory, n = restart_copy(killed, tmp_path), killed["n"]
    for process in {1, 2 % n}:  # process 1 and the process that keeps its parts (2; 0 of two processes)
        shutil.rmtree(directory / f"local-{process}")
    final, outputs = run(directory, n)
    assert "restoring from the persistent tier" in outputs[0], outputs[0][-3000:]
    lacking = r"still lacks the parts of process [\d, ]*\b1\b.*neither its own directory nor a peer"
    assert re.search(lacking, outputs[0]), outputs[0][-3000:]
    assert all(f"start {PERSISTENT_STEP}" in output for output in outputs), outputs
    assert_same(final, killed["straight"])


@pytest.mark.parametrize("killed", [2], indirect=True)  # one process count: see `killed`
def test_a_damaged_peer_copy_is_passed_over_and_set_aside(killed, tmp_path):
    directory, n = restart_copy(killed, tmp_path), killed["n"]
    holder = 2 % n
    others = [set(local_steps(directory / f"local-{i}", i)) for i in range(n) if i != 1]
    whole = sorted(set.intersection(*others, set(kept_copies(directory, holder, 1))))  # without process 1's own
    damaged = whole[-1]  # the step a replaced process 1 would otherwise restore
    arrays = directory / f"local-{holder}" / f"process-{holder}" / "peers" / "process-1" / str(damaged) / "arrays.bin"
    with open(arrays, "r+b") as file:
        file.truncate(arrays.stat().st_size // 2)
    shutil.rmtree(directory / "local-1")
    final, outputs = run(directory, n)
    assert "peer copy" in outputs[holder] and "set aside" in outputs[holder], outputs[holder][-3000:]
    assert arrays.parent.with_name(f"{damaged}.damaged").is_dir()
    if len(whole) > 1:  # the newest step still whole with the copies left
        assert restored_local_step(outputs[0]) == whole[-2], outputs[0][-3000:]
    else:  # where a kill left no older copy
        assert "restoring from the persistent tier" in outputs[0], outputs[0][-3000:]
    assert_same(final, killed["straight"])


@pytest.mark.parametrize("killed", [4], indirect=True)  # 4 to 2 keeps peers on both sides
def test_a_changed_process_count_never_uses_peer_copies(killed, tmp_path):
    directory = restart_copy(killed, tmp_path)
    fewer = killed["n"] // 2  # process 1's own parts are lost; its peer keeps them, for the old process count
    shutil.rmtree(directory / "local-1")
    config = config_for(directory, fewer, peers=1 if fewer > 1 else 0)
    outputs = cluster.run("resume", config, fewer, timeout=300)
    assert "restoring from the persistent tier" in outputs[0], outputs[0][-3000:]
    assert f"saved by process 0 of {killed['n']}, this is process 0 of {fewer}" in outputs[0], outputs[0][-3000:]
    assert "peer copy" not in outputs[0]
    assert all(f"start {PERSISTENT_STEP}" in output for output in outputs), outputs


def test_replicated_parts_need_no_copy():
    same, other = "a" * 64, "b" * 64
    hosts = ("h0", "h0", "h1", "h1")
    # Pure data parallelism over two hosts: every process's parts are on the other host too.
    assert peers.replicated_elsewhere([same] * 4, hosts, 1) == (True,) * 4
    assert peers.replicated_elsewhere([same] * 4, hosts, 2) == (False,) * 4  # two copies need three hosts
    # FSDP within a host, replicas across hosts: process 0's shard is process 2's.
    assert peers.replicated_elsewhere([same, other, same, other], hosts, 1) == (True,) * 4
    # Replicas only on the same host survive no lost host.
    assert peers.replicated_elsewhere([same, same, other, "c" * 64], hosts, 1) == (False,) * 4
    assert peers.fingerprint({"w": [[[0, 2]], [[2, 4]]]}) == peers.fingerprint({"w": [[[2, 4]], [[0, 2]]]})
    assert peers.fingerprint({"w": [[[0, 2]]]}) != peers.fingerprint({"w": [[[2, 4]]]})


@pytest.fixture(scope="module")
def replicas(tmp_path_factory) -> dict:
    """Two data-parallel processes on two hosts with peers=1: a straight run, and what the killed ones left."""
    root = tmp_path_factory.mktemp("replicas")
    straight, _ = run(root / "straight", 2, sharded=False)
    killed_after_70(root / "killed", 2, sharded=False)
    return {"straight": straight, "directory": root / "killed", "n": 2}


def test_data_parallel_replicas_keep_no_copies_and_a_replaced_host_restores_from_a_replica(replicas, tmp_path):
    directory = restart_copy(replicas, tmp_path)
    for process in range(2):  # each holds the whole state, as the other host does: nothing was copied
        assert local_steps(directory / f"local-{process}", process)
        assert kept_copies(directory, process, 1 - process) == []
    newest = local_steps(directory / "local-0", 0)[-1]
    assert newest > PERSISTENT_STEP
    shutil.rmtree(directory / "local-1")  # a replaced host
    final, outputs = run(directory, 2, sharded=False)
    assert restored_local_step(outputs[0]) == newest, outputs[0][-3000:]
    assert f"process 1's parts of step {newest} come from process 0's own step (a data-parallel replica)" in outputs[0]
    assert all(f"start {newest}" in output for output in outputs), outputs
    assert_same(final, replicas["straight"])
    assert local_steps(directory / "local-1", 1)[-1] == 100 and kept_copies(directory, 0, 1) == []


def test_both_replicas_lost_fall_back_to_the_persistent_tier(replicas, tmp_path):
    directory = restart_copy(replicas, tmp_path)
    for process in range(2):
        shutil.rmtree(directory / f"local-{process}")
    final, outputs = run(directory, 2, sharded=False)
    assert "restoring from the persistent tier" in outputs[0], outputs[0][-3000:]
    assert all(f"start {PERSISTENT_STEP}" in output for output in outputs), outputs
    assert_same(final, replicas["straight"])
