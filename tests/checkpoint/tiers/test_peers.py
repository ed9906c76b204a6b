"""Peer copies of the local tier in one process: who keeps whose parts, the copies kept, the slices sent.

The processes that lose a host and get its parts back from a peer are `test_peers_processes.py`'s.
"""

import json

import numpy as np
import pytest
from flaxstate_testing.checkpoints import (
    read_packed,
)

import flaxstate as fs
from flaxstate.checkpoint.stores.packed import step_numbers, write_packed
from flaxstate.checkpoint.tiers import peers


def test_peers_beyond_the_processes_or_without_a_local_tier_are_refused_at_construction(tmp_path):
    with pytest.raises(ValueError, match=r"peers=1 copies of each process's parts need at least 2 processes"):
        fs.CheckpointFileWriter(tmp_path / "local", per_process=True, peers=1)
    with pytest.raises(ValueError, match=r"peers=1 keeps copies of each process's local tier; it needs per_process"):
        fs.CheckpointFileWriter(tmp_path / "persistent", peers=1)
    with pytest.raises(ValueError, match=r"peers must be a count of copies"):
        fs.CheckpointFileWriter(tmp_path / "local", per_process=True, peers=-1)
    assert not (tmp_path / "local").exists() and not (tmp_path / "persistent").exists()


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
