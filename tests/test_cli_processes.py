"""Tier 2 (tests/README.md): tests that start, kill or signal processes of their own, or run servers or commands."""

import subprocess
import sys

from PIL import Image

from flaxstate import cli
from flaxstate.records import format_bytes
from flaxstate.run_record import goodput, ledger


def flaxstate(*args):
    return subprocess.run(
        [sys.executable, "-m", "flaxstate", *map(str, args)], capture_output=True, text=True, timeout=120
    )


def test_ls_lists_checkpoints_per_writer_with_metrics(digits_run, capsys):
    output_dir = digits_run[0]
    assert cli.main(["ls", str(output_dir)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["writer", "step", "time", "eval/acc", "eval/loss", "train/loss", "bytes", "best"]
    *table, peaks = lines
    host_peak = goodput.report(ledger.run_events(output_dir))["total"]["host_memory_peak"]  # the ledger's
    assert peaks.startswith(f"memory at its peak over the run: host {format_bytes(host_peak)}")
    assert 100 * 2**20 < host_peak < 16 * 2**30  # a resident peak: CI saw 1.0 GB on jax 0.12
    rows = [line.split() for line in table[1:]]
    assert [(row[0], row[1]) for row in rows[:2]] == [("newest", "20"), ("newest", "40")]
    best = [row for row in rows if row[0] == "lowest-eval-loss"]
    assert best and best[-1][-1] == "*"
    assert all("kB" in row for row in rows)


def test_show_prints_the_state_tree_and_metadata(digits_run, capsys):
    output_dir = digits_run[0]
    assert cli.main(["show", str(output_dir), "--step", "20"]) == 0
    out = capsys.readouterr().out
    assert f"checkpoint {output_dir}/20" in out
    assert "target/Dense_0/kernel" in out and "[64, 128]" in out and "float32" in out
    assert "flax_mutables/batch_stats/BatchNorm_0/mean" in out
    assert "parameters: 9,866" in out
    assert '"steps": 20' in out


def test_plot_writes_a_png(digits_run, tmp_path):
    output = tmp_path / "curves.png"
    result = flaxstate("plot", digits_run[0], "-o", output)
    assert result.returncode == 0, result.stderr
    assert "eval/acc" in result.stdout and "train/loss" in result.stdout
    assert output.stat().st_size > 20_000
    with Image.open(output) as image:
        assert image.format == "PNG" and image.size[0] >= 600 and image.size[1] >= 600


def test_bad_input_is_one_line_on_stderr_and_exit_2(digits_run, tmp_path):
    cases = [
        (["ls", tmp_path / "missing"], "does not exist"),
        (["ls", tmp_path], "is not a flaxstate run"),
        (["show", digits_run[0], "--step", "7"], "no checkpoint at step 7; it has steps [20, 40]"),
        (["plot", tmp_path, "-o", tmp_path / "x.png"], "holds no TensorBoard event files"),
    ]
    for args, message in cases:
        result = flaxstate(*args)
        assert result.returncode == 2, (args, result.stderr)
        assert message in result.stderr and len(result.stderr.strip().splitlines()) == 1, result.stderr
        assert "Traceback" not in result.stderr


def test_a_reader_that_stops_early_is_no_error(digits_run):
    # `flaxstate show DIR | head -0`: the pipe is closed before the table is printed (Python takes a second to start).
    process = subprocess.Popen(
        [sys.executable, "-m", "flaxstate", "show", str(digits_run[0])], stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    process.stdout.close()
    stderr = process.stderr.read().decode()
    assert process.wait(timeout=120) == 0, stderr
    assert "damaged" not in stderr and "Traceback" not in stderr


def test_a_missing_extra_is_named_with_the_command_that_installs_it(digits_run, tmp_path, monkeypatch):
    from flaxstate_testing.command_line import run_here

    import flaxstate as fs

    output_dir, _, _ = digits_run
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if not installed: its import raises ImportError
    plotted = run_here("plot", output_dir, "-o", tmp_path / "curves.png")
    assert plotted.returncode == 2 and "pip install 'flaxstate[plot]'" in plotted.stderr, plotted
    assert "needs the matplotlib package" in plotted.stderr
    monkeypatch.setitem(sys.modules, "safetensors", None)
    (tmp_path / "model.safetensors").write_bytes(b"")
    try:
        fs.SafetensorsReader(tmp_path / "model.safetensors", target=None).params({})
    except ImportError as error:
        assert "pip install 'flaxstate[safetensors]'" in str(error) and "SafetensorsReader" in str(error)
    else:
        raise AssertionError("no ImportError without safetensors")
