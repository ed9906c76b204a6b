"""A bucket's URL given as a run directory is refused at construction, and nothing lands in a local 'gs:' folder."""

import subprocess
import sys
from pathlib import Path

import pytest

import flaxstate as fs
from flaxstate.locations import local_path


@pytest.mark.parametrize("url", ["gs://my-bucket/run1", "s3://bucket/run", "GS://Bucket/Run", Path("gs://b/run")])
def test_every_public_place_that_takes_a_run_directory_refuses_a_url_and_creates_nothing(url, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    makers = [
        lambda: fs.CheckpointFileWriter(url),
        lambda: fs.CheckpointFileWriter(url, per_process=True),
        lambda: fs.LowestCheckpointFileWriter(url, metric="loss"),
        lambda: fs.CheckpointFileReader(url, target=lambda *_: {}),
        lambda: fs.CheckpointFileReader([tmp_path / "local", url]),
        lambda: fs.HighestCheckpointFileReader(url, metric="acc"),
        lambda: fs.SummaryWriter(url),
        lambda: fs.TraceWriter(url, at_step=1),
    ]
    for make in makers:
        with pytest.raises(ValueError, match=r"a (gs|s3|GS):// URL: .*Give a local path, or the bucket mounted"):
            make()
    assert list(tmp_path.iterdir()) == []  # no local gs: or s3: folder, no ledger


def test_local_and_relative_paths_pass_unchanged():
    assert local_path("runs/digits", "x") == Path("runs/digits")
    assert local_path(Path("/tmp/gs:/x"), "x") == Path("/tmp/gs:/x")  # a folder named gs: inside a path is a path


def test_the_command_line_refuses_a_url_naming_it_and_exits_2(tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "flaxstate", "ls", "gs://my-bucket/run1"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert done.returncode == 2 and "'gs://my-bucket/run1', a gs:// URL" in done.stderr
    assert list(tmp_path.iterdir()) == []
