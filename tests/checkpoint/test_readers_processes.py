"""Readers: the newest complete step restored into the model's tree; damage passed over, renames, live writers.

Tier 2 (tests/README.md): tests that start, kill or signal processes of their own, or run servers or commands. The
others of readers are in test_readers.py.
"""

import pytest
from flaxstate_testing.checkpoints import (
    read_beside_a_rotating_writer,
)


@pytest.mark.parametrize("keep", [1, 3])
def test_a_reader_beside_a_live_writer_restores_the_newest_complete_step(tmp_path, keep, capsys):
    from flaxstate import cli

    def inspect(step: int) -> None:
        for command in ("ls", "show"):
            assert cli.main([command, str(tmp_path)]) == 0, capsys.readouterr().err

    steps = read_beside_a_rotating_writer(str(tmp_path), keep, reads=25, each=inspect)
    assert "Traceback" not in capsys.readouterr().err
    assert steps == sorted(steps) and len(set(steps)) > 1, steps  # the writer rotated all along
