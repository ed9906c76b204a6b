"""A save's and a restore's host memory budget: the same bits, arrays stored in bounded chunks, bad budgets named."""

import asyncio
import json
import types

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
import tensorstore as ts
from etils import epath
from flaxstate_testing import toy
from flaxstate_testing.checkpoints import assert_trees_equal, fresh_state, records

import flaxstate as fs
from flaxstate.checkpoint import budget
from flaxstate.checkpoint.stores import packed

MODEL = toy.MLP(width=2048)  # a kernel of 4 x 2048 float32 (32 KiB), its Adam moments alike
BUDGET = budget.MINIMUM  # 32 KiB: chunks of 4 KiB, so the largest arrays span 8 chunks


def stored_chunk_bytes(step_dir, name):
    """The bytes of one stored chunk of a model array, read from its tensorstore spec (as any orbax reader would)."""
    item = step_dir / "model"
    info = ocp.type_handlers.ParamInfo(
        name=name,
        parent_dir=epath.Path(item),
        use_zarr3=json.loads((item / "_METADATA").read_text())["use_zarr3"],
        ts_context=ocp.type_handlers.get_ts_context(use_ocdbt=True),
    )
    spec = ocp.type_handlers.get_json_tspec_read(info, use_ocdbt=True)
    store = ts.open(spec, context=info.ts_context).result()
    return int(np.prod(store.chunk_layout.read_chunk.shape)) * store.dtype.numpy_dtype.itemsize


@pytest.mark.parametrize("given", [BUDGET, fs.HostMemoryBudget(BUDGET)], ids=["int", "object"])
def test_a_budget_stores_bounded_chunks_and_restores_the_same_bits(tmp_path, given):
    recs = records(n_steps=4, model=MODEL)
    with fs.CheckpointFileWriter(tmp_path / "budget", host_memory_budget=given) as writer:
        for record in recs:
            writer(record)
    with fs.CheckpointFileWriter(tmp_path / "plain") as writer:
        writer(recs[-1])
    with fs.CheckpointFileWriter(tmp_path / "unbounded", host_memory_budget=fs.HostMemoryBudget()) as writer:
        writer(recs[-1])  # the unbounded budget: what no budget is
    kernel = "target.Dense_0.kernel"
    assert stored_chunk_bytes(tmp_path / "budget" / "4", kernel) <= fs.HostMemoryBudget(BUDGET).chunk_bytes
    assert stored_chunk_bytes(tmp_path / "plain" / "4", kernel) == 4 * 2048 * 4  # orbax's own: one chunk
    assert stored_chunk_bytes(tmp_path / "unbounded" / "4", kernel) == 4 * 2048 * 4

    expected = recs[-1].state
    for directory in ("budget", "plain"):
        for reader_budget in (given, None):
            reader = fs.CheckpointFileReader(tmp_path / directory, host_memory_budget=reader_budget)
            restored = reader.restore(fresh_state(MODEL))
            assert int(restored.step) == 4
            assert_trees_equal(restored, expected)  # parameters, optimizer state, step, batch statistics
            as_numpy = reader.read(None).state  # no template: numpy arrays of the stored tree (state-dict layout)
            assert all(isinstance(leaf, np.ndarray) for leaf in jax.tree.leaves(as_numpy))
            assert_trees_equal(as_numpy["target"], expected.params)

    # Plain orbax, without flaxstate, restores what the budgeted writer stored.
    manager = ocp.CheckpointManager(tmp_path / "budget", item_names=("model", "optimizer", "meta"))
    restored = manager.restore(4, args=ocp.args.Composite(model=ocp.args.PyTreeRestore()))
    np.testing.assert_array_equal(restored.model["target"]["Dense_0"]["kernel"], expected.params["Dense_0"]["kernel"])


def open_array(spec, values):
    store = ts.open(spec, create=True, delete_existing=True, dtype=ts.float32, shape=values.shape).result()
    store.write(values).result()
    return ts.open(spec, open=True).result()  # as a reader opens it: its metadata from storage


@pytest.mark.parametrize(
    "driver",
    [
        {"driver": "zarr", "metadata": {"chunks": [24, 10], "compressor": None}},  # orbax's: one raw chunk
        {"driver": "zarr", "metadata": {"chunks": [8, 5], "compressor": None, "dimension_separator": "/"}},
        {
            "driver": "zarr3",
            "metadata": {"chunk_grid": {"name": "regular", "configuration": {"chunk_shape": [24, 10]}}},
        },
        {
            "driver": "zarr3",
            "metadata": {
                "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": [16, 4]}},
                "chunk_key_encoding": {"name": "v2", "configuration": {"separator": "."}},
            },
        },
    ],
)
@pytest.mark.parametrize("most_bytes", [4, 36, 40, 44, 120])  # one element, under a row of 10, a row, more, 3 rows
def test_an_uncompressed_chunk_larger_than_the_budget_s_is_read_in_byte_ranges_as_tensorstore_reads_it(
    tmp_path, driver, most_bytes, monkeypatch
):
    values = np.arange(24 * 10, dtype=np.float32).reshape(24, 10)
    base = {"driver": "ocdbt", "base": f"file://{tmp_path}/db/"} if driver["driver"] == "zarr" else None
    kvstore = {**base, "path": "kernel/"} if base else {"driver": "file", "path": f"{tmp_path}/kernel/"}
    store = open_array({**driver, "kvstore": kvstore}, values)
    tiny = types.SimpleNamespace(chunk_bytes=most_bytes)  # a budget's chunks, below the minimum budget's
    reading = budget.Reading(store, tiny, "kernel")
    assert reading.raw is not None and not reading.whole
    decoded = []
    monkeypatch.setattr(
        ts.TensorStore,
        "__getitem__",
        lambda self, index: decoded.append(index),  # no chunk is decoded by tensorstore
    )
    for within in [(slice(0, 24), slice(0, 10)), (slice(3, 17), slice(2, 9)), (slice(23, 24), slice(9, 10))]:
        pieces = list(reading.pieces(within))
        assert all(np.prod([p.stop - p.start for p in piece]) * 4 <= max(4, most_bytes) for piece in pieces), pieces
        out = np.full([part.stop - part.start for part in within], np.nan, np.float32)
        for piece in pieces:
            at = tuple(slice(p.start - w.start, p.stop - w.start) for p, w in zip(piece, within, strict=True))
            out[at] = asyncio.run(reading.read(piece))
        np.testing.assert_array_equal(out, values[within])  # every element once, none left unread
    assert decoded == []


def test_a_compressed_chunk_larger_than_the_budget_s_is_decoded_whole_once_and_said(tmp_path, caplog):
    values = np.arange(64 * 64, dtype=np.float32).reshape(64, 64)
    spec = {"driver": "zarr", "kvstore": {"driver": "file", "path": f"{tmp_path}/k/"}, "metadata": {"chunks": [64, 64]}}
    store = open_array(spec, values)  # zarr's default compressor (blosc)
    with caplog.at_level("WARNING", logger="flaxstate"):
        reading = budget.Reading(store, fs.HostMemoryBudget(BUDGET), "k")
    assert reading.whole and "k is stored in compressed chunks of 16384 bytes" in caplog.text
    np.testing.assert_array_equal(
        asyncio.run(budget.read_host(reading, budget.Slots(fs.HostMemoryBudget(BUDGET)))), values
    )
    sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    made = asyncio.run(budget.read_shards(reading, sharding, budget.Slots(fs.HostMemoryBudget(BUDGET))))
    np.testing.assert_array_equal(np.asarray(made), values)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"host_memory_budget": 1000}, r"CheckpointFileWriter host_memory_budget must be .*at least 32768"),
        ({"host_memory_budget": "1G"}, r"CheckpointFileWriter host_memory_budget must be"),
    ],
)
def test_a_writer_names_a_bad_budget(tmp_path, kwargs, message):
    with pytest.raises(ValueError, match=message):
        fs.CheckpointFileWriter(**{"output_dir": tmp_path, **kwargs})
    assert not any(tmp_path.iterdir())  # refused before anything was written


def test_the_unbounded_budget_bounds_nothing_and_is_what_none_means():
    unbounded = fs.HostMemoryBudget()
    assert budget.of(None, "test") == unbounded == budget.UNBOUNDED and not unbounded.bounded
    assert unbounded.holds(2**40, allowance=1) == 2**40 and unbounded.block_bytes is None
    assert unbounded.handler_options() == {}  # orbax's own type handlers
    bounded = fs.HostMemoryBudget(BUDGET)
    assert bounded.bounded and bounded.holds(2**40, allowance=1) == BUDGET + 1 == bounded.holds(2**40, 0) + 1
    assert bounded.block_bytes == bounded.chunk_bytes == BUDGET // (budget.COPIES * budget.SLOTS)
    assert "type_handler_registry" in bounded.handler_options()
    with pytest.raises(ValueError, match=r"HostMemoryBudget bytes must be an int of at least 32768, got 1.5"):
        fs.HostMemoryBudget(1.5)


def test_a_reader_names_a_bad_budget(tmp_path):
    with pytest.raises(ValueError, match=r"CheckpointFileReader host_memory_budget must be .*at least 32768"):
        fs.CheckpointFileReader(tmp_path, host_memory_budget=-1)


def test_a_local_tier_step_restores_the_same_bits_read_in_slices(tmp_path, caplog, monkeypatch):
    recs = records(n_steps=4, model=MODEL)
    local, persistent = tmp_path / "local", tmp_path / "run"
    with fs.CheckpointFileWriter(persistent) as writer:  # the run's persistent tier, one step behind
        writer(recs[0])
    with fs.CheckpointFileWriter(local, per_process=True, host_memory_budget=BUDGET) as writer:
        for record in recs:
            writer(record)
    reads = []
    original = packed.PartsFile._bytes

    def spied(self, offset, size):
        reads.append(size)
        return original(self, offset, size)

    monkeypatch.setattr(packed.PartsFile, "_bytes", spied)
    budget_of_rows = 2 * BUDGET  # a kernel's row is 8 KiB: slices of whole rows within a chunk of this budget
    reader = fs.CheckpointFileReader([local, persistent], host_memory_budget=budget_of_rows)
    with caplog.at_level("INFO", logger="flaxstate"):
        restored = reader.restore(fresh_state(MODEL))
    assert "from the local tier" in caplog.text
    assert_trees_equal(restored, recs[-1].state)
    assert max(reads) <= fs.HostMemoryBudget(budget_of_rows).chunk_bytes and len(reads) > len(jax.tree.leaves(restored))
