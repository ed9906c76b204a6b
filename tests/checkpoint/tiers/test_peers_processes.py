"""Peer copies of the local tier: a lost host's parts come back from the process that keeps them.

Tier 2 (tests/README.md): tests that start, kill or signal processes of their own, or run servers or commands. The
others of peers are in test_peers.py.

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
