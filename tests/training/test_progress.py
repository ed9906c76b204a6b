"""The progress bar says the records' speed: steps the devices completed over recent records, compiling left out."""

import dataclasses

import pytest
from flaxstate_testing.loops import make_loop

from flaxstate.training.progress import SPEED_WINDOW, ProgressDisplay


def test_the_bar_speed_is_the_recent_records_steps_over_their_training_time():
    records = list(make_loop(n_steps=40, every=4))
    display = ProgressDisplay(enabled=False)
    for record in records:
        display.record(record)
    window = records[-SPEED_WINDOW:]
    expected = sum(r.n_completed_steps for r in window) / sum(r.training_time for r in window)
    assert display.speed == pytest.approx(expected)
    assert records[0].compile_time > 0  # the first record compiled; its time is not in any speed
    slow_compile = dataclasses.replace(records[-1], compile_time=records[-1].elapsed_time * 0.9)
    assert slow_compile.steps_per_second == pytest.approx(
        slow_compile.n_completed_steps / (slow_compile.elapsed_time * 0.1)
    )


def test_the_bar_shows_the_speed_mfu_and_loss_of_the_records(capsys):
    loop = make_loop(n_steps=40, every=4, stdout=True, peak_flops_per_device=1e9)
    records = list(loop)
    shown = capsys.readouterr().out
    assert "steps/s  MFU " in shown and "40/40" in shown
    assert f"{records[-1].loss:.4g}" in shown
    assert "MFU" not in (make_loop(n_steps=4, every=4, stdout=True).next_checkpoint() and capsys.readouterr().out)
