"""Tier 2 (tests/README.md): tests that start, kill or signal processes of their own, or run servers or commands. The
others of local_tier are in test_local_tier.py."""

from flaxstate_testing.checkpoints import records

import flaxstate as fs


def test_the_command_line_lists_a_local_tier_s_steps_as_readable_and_says_where_its_ledger_is(tmp_path):
    from flaxstate_testing.command_line import run_here

    local, run = tmp_path / "local", tmp_path / "run"
    with fs.CheckpointFileWriter(local, keep=3, per_process=True) as tier, fs.CheckpointFileWriter(run, keep=3) as w:
        for record in records(n_steps=6, every=2):
            w(tier(record))
    for directory in (local, local / "process-0"):
        listed = run_here("ls", directory)
        assert listed.returncode == 0 and "damaged" not in listed.stdout + listed.stderr, listed
        assert [line.split()[1] for line in listed.stdout.splitlines()[1:]] == ["2", "4", "6"], listed.stdout
    shown = run_here("show", local)
    assert shown.returncode == 0 and f"checkpoint {local / 'process-0' / '6'} (format" in shown.stdout, shown
    assert "target/Dense_0/kernel" in shown.stdout
    compared = run_here("diff", local / "process-0", run)
    assert compared.returncode == 0 and "the same" in compared.stdout, compared
    for command in ("audit", "goodput"):
        refused = run_here(command, local)
        assert refused.returncode == 2 and len(refused.stderr.strip().splitlines()) == 1, refused
        assert "is a local tier's directory" in refused.stderr and "persistent writer" in refused.stderr
