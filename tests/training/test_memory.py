"""Memory in records: this process's host memory follows what the data iterator holds; the devices' where known."""

import io

import jax
import numpy as np
import pytest
from flaxstate_testing import loops, toy

import flaxstate as fs
from flaxstate import cli
from flaxstate.records import format_bytes
from flaxstate.run_record import goodput, ledger
from flaxstate.training import memory

MIB = 2**20


class Holding:
    """Toy batches from an iterator that allocates (and touches) `hold` MiB before its `at`th batch, and keeps it."""

    def __init__(self, hold: int, at: int) -> None:
        self.hold, self.at, self.held = hold, at, None
        self.batches = toy.batches(40, 8)

    def __iter__(self):
        for index, batch in enumerate(self.batches):
            if index == self.at:
                self.held = np.ones(self.hold * MIB, np.uint8)  # ones: every page resident
            yield batch


def test_records_report_the_host_memory_that_the_data_iterator_holds_and_no_device_figure_on_a_cpu(tmp_path, capsys):
    data = Holding(hold=256, at=6)
    loop = loops.make_loop(data, n_steps=12, every=4)
    before, after, last = (loop.next_checkpoint() for _ in range(3))
    assert before.host_memory is not None and before.host_memory_peak >= before.host_memory
    grown = after.host_memory - before.host_memory
    assert 0.9 * 256 * MIB <= grown <= 1.5 * 256 * MIB, grown / MIB  # the 256 MiB, and not much else
    # The peak covers what is held now and every earlier peak (the process's since it started: in a test
    # suite's process, an earlier test's may be the larger).
    assert after.host_memory_peak >= max(after.host_memory, before.host_memory_peak)
    assert last.host_memory_peak >= after.host_memory_peak  # a peak never falls
    assert before.device_memory_peak is None  # a CPU keeps no device peak: no guess
    out = io.StringIO()
    fs.SummaryLogger(out)(after)
    assert f"host {format_bytes(after.host_memory)} (peak " in out.getvalue()
    writer = fs.CheckpointFileWriter(tmp_path / "run")
    writer(after)
    writer.close()
    events = [event for event in ledger.run_events(tmp_path / "run") if event["event"] == "record"]
    assert events[-1]["host_memory"] == after.host_memory and events[-1]["device_memory_peak"] is None
    report = goodput.report(ledger.run_events(tmp_path / "run"))
    assert report["total"]["host_memory_peak"] == after.host_memory_peak
    assert report["total"]["device_memory_peak"] is None
    assert "host memory, peak" in goodput.format_report(report)
    cli.main(["ls", str(tmp_path / "run")])
    shown = capsys.readouterr().out
    assert f"memory at its peak over the run: host {format_bytes(after.host_memory_peak)}" in shown


def test_the_devices_peak_is_their_sum_and_none_where_any_reports_none():
    class Device:
        def __init__(self, stats):
            self.stats = stats

        def memory_stats(self):
            if isinstance(self.stats, Exception):
                raise self.stats
            return self.stats

    gib = 2**30
    assert memory.device_peak([Device({"peak_bytes_in_use": gib}), Device({"peak_bytes_in_use": 2 * gib})]) == 3 * gib
    assert memory.device_peak([Device({"peak_bytes_in_use": gib}), Device(None)]) is None
    assert memory.device_peak([Device({"bytes_in_use": gib})]) is None
    assert memory.device_peak([Device(RuntimeError("UNIMPLEMENTED"))]) is None
    assert memory.device_peak(jax.devices()) is None  # this CPU


@pytest.mark.parametrize("read", [memory.host_resident, memory.host_peak])
def test_the_host_figures_are_bytes_of_this_process(read):
    size = read()
    assert size is not None and 10 * MIB < size < 64 * 2**30
