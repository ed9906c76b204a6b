"""Restore anywhere: a checkpoint saved on N devices restores on any other number.

Tier 2 (tests/README.md): tests that start, kill or signal processes of their own, or run servers or commands.

Devices of one process here run no collective (PLATFORM.md: those deadlock on
several CPU devices in one process); processes join over gloo.
"""

import pytest
from flaxstate_testing import cluster, processes


def run(mode, tmp_path, n_devices, n_processes, width, budget, sharded=False):
    """The worker in `mode` ("save" or "restore"), on N devices of one process or on N processes."""
    config = {
        "sharded": sharded,
        "mode": mode,
        "output_dir": str(tmp_path / "run"),
        "out": str(tmp_path / "state.npz"),
        "width": width,
        "budget": budget,
    }
    if n_devices == 1:
        return cluster.run("devices", config, n_processes=n_processes, timeout=180)
    return processes.run("devices.py", config, timeout=180, n_devices=n_devices)


def save(tmp_path, n_devices=1, n_processes=1, width=64, budget=None, sharded=False):
    outputs = run("save", tmp_path, n_devices, n_processes, width, budget, sharded)
    return int(outputs[0].split("state_bytes ")[1].split()[0])


def restore(tmp_path, n_devices=1, n_processes=1, width=64, budget=None):
    outputs = run("restore", tmp_path, n_devices, n_processes, width, budget)
    assert f"restored on {n_devices * n_processes} devices" in outputs[0], outputs
    return outputs


@pytest.mark.parametrize(("saved_on", "restored_on"), [(2, 1), (1, 2), (2, 3)])
def test_restores_on_another_device_count(tmp_path, saved_on, restored_on):
    save(tmp_path, n_devices=saved_on)
    restore(tmp_path, n_devices=restored_on)


def test_replicated_arrays_are_stored_once(tmp_path):
    state_bytes = save(tmp_path, n_devices=2, width=100_000)
    on_disk = sum(p.stat().st_size for p in (tmp_path / "run" / "1").rglob("*") if p.is_file())
    assert state_bytes > 5_000_000
    assert on_disk <= 1.05 * state_bytes, (on_disk, state_bytes)


def test_saved_by_two_processes_restores_in_one_and_the_reverse(tmp_path):
    save(tmp_path / "a", n_processes=2)
    restore(tmp_path / "a", n_devices=1)
    save(tmp_path / "b", n_devices=1)
    restore(tmp_path / "b", n_processes=2)


def test_a_budget_saves_on_two_devices_and_restores_in_two_processes_chunk_by_chunk(tmp_path):
    # A 40 KiB kernel in 4 KiB chunks: each process makes its device's copy from the chunks it reads.
    save(tmp_path, n_devices=2, width=2560, budget=32768)
    outputs = restore(tmp_path, n_processes=2, width=2560, budget=32768)
    assert not any("decoded whole" in output for output in outputs), outputs  # stored in the budget's chunks


def test_a_budget_saves_each_process_s_shards_from_its_devices_chunk_by_chunk_and_one_process_restores_them(tmp_path):
    # Each of two processes writes its half of the 40 KiB kernel (and of the rest) in 4 KiB chunks, sliced on its
    # device; one process reads them back, with and without a budget.
    save(tmp_path, n_processes=2, width=2560, budget=32768, sharded=True)
    for process in (0, 1):  # each wrote its own part (compressed: about 32 KiB each), not process 0 all
        written = (tmp_path / "run" / "1" / "model" / f"ocdbt.process_{process}").rglob("*")
        assert sum(path.stat().st_size for path in written if path.is_file()) > 16384, process
    (output,) = restore(tmp_path, n_devices=1, width=2560, budget=32768)
    assert "decoded whole" not in output, output  # stored in the budget's chunks
    restore(tmp_path, n_devices=3, width=2560)


def test_a_budget_reads_a_checkpoint_written_without_one_in_byte_ranges_of_its_chunks(tmp_path):
    # orbax's one uncompressed chunk an array (a 40 KiB kernel) is read in 4 KiB byte ranges, onto 2 devices each
    # taking half; the worker checks every value.
    save(tmp_path, n_devices=1, width=2560)
    outputs = restore(tmp_path, n_devices=2, width=2560, budget=32768)
    assert "decoded whole" not in outputs[0], outputs
