"""A save's and a restore's host memory budget: the same bits, arrays stored in bounded chunks, bad budgets named.

Tier 2 (tests/README.md): tests that start, kill or signal processes of their own, or run servers or commands. The
others of budget are in test_budget.py.
"""

import jax
import numpy as np
import orbax.checkpoint as ocp
from flaxstate_testing import buckets
from flaxstate_testing.checkpoints import assert_trees_equal, fresh_state, records
from test_budget import BUDGET, MODEL, stored_chunk_bytes

import flaxstate as fs
from flaxstate.checkpoint import budget
from flaxstate.checkpoint.stores import parts


def test_arrays_on_the_devices_are_saved_under_a_budget_a_block_at_a_time_as_the_same_bytes(tmp_path, monkeypatch):
    # A record whose state is on the device (record_memory="device"): a local tier and an orbax directory save
    # it under the smallest budget reading 4 KiB of it at a time from the device, never a whole 32 KiB array.
    recs = records(n_steps=4, model=MODEL, record_memory="device")
    assert all(isinstance(leaf, jax.Array) for leaf in jax.tree.leaves(recs[-1].state))
    read = []
    sizes = {"device part": parts.DevicePart.read, "orbax": budget.on_host}

    def spy(name):
        def spied(*args):
            out = sizes[name](*args)
            read.append((name, out.nbytes))
            return out

        return spied

    monkeypatch.setattr(parts.DevicePart, "read", spy("device part"))
    monkeypatch.setattr(budget, "on_host", spy("orbax"))
    for name, per_process in (("local", True), ("orbax", False)):
        with fs.CheckpointFileWriter(tmp_path / name, per_process=per_process, host_memory_budget=BUDGET) as writer:
            writer(recs[-1])
        with fs.CheckpointFileWriter(tmp_path / f"{name}-whole", per_process=per_process) as writer:
            writer(recs[-1])
    assert {name for name, _ in read} == {"device part", "orbax"}
    assert max(size for _, size in read) <= fs.HostMemoryBudget(BUDGET).chunk_bytes
    with buckets.moto_s3() as server:  # an s3:// store's save reads the device the same way (an emulator on 127.0.0.1)
        server.create_bucket("runs")
        read.clear()
        with fs.CheckpointFileWriter("s3://runs/devices", host_memory_budget=BUDGET) as writer:
            writer(recs[-1])
        assert read and max(size for _, size in read) <= fs.HostMemoryBudget(BUDGET).chunk_bytes
        in_s3 = fs.CheckpointFileReader("s3://runs/devices", host_memory_budget=BUDGET).restore(fresh_state(MODEL))
        assert_trees_equal(in_s3, recs[-1].state)
    local, whole = (tmp_path / name / "process-0" / "4" / "arrays.bin" for name in ("local", "local-whole"))
    assert local.read_bytes() == whole.read_bytes()
    assert (
        stored_chunk_bytes(tmp_path / "orbax" / "4", "target.Dense_0.kernel") <= fs.HostMemoryBudget(BUDGET).chunk_bytes
    )
    restored = fs.CheckpointFileReader(tmp_path / "orbax", host_memory_budget=BUDGET).restore(fresh_state(MODEL))
    assert_trees_equal(restored, recs[-1].state)
    # Plain orbax restores it without being told shardings: from the sharding file, as orbax's own save writes it.
    manager = ocp.CheckpointManager(tmp_path / "orbax", item_names=("model", "optimizer", "meta"))
    plain = manager.restore(4, args=ocp.args.Composite(model=ocp.args.PyTreeRestore())).model
    assert isinstance(plain["target"]["Dense_0"]["kernel"], jax.Array)
    np.testing.assert_array_equal(plain["target"]["Dense_0"]["kernel"], recs[-1].state.params["Dense_0"]["kernel"])
