"""Where run directories may be: local paths, gs:// and s3:// buckets (tests/checkpoint/test_buckets_processes.py),

Tier 2 (tests/README.md): tests that start, kill or signal processes of their own, or run servers or commands. The
others of locations are in test_locations.py.
nothing else.

A URL of a store flaxstate does not write to, or a bucket given where a
local directory is needed (a local tier, a trace), is refused at
construction, naming the URL and what to give instead, and nothing lands in
a local 'az:', 's3:' or 'gs:' folder.
"""

import subprocess
import sys


def test_the_command_line_refuses_a_url_naming_it_and_exits_2(tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "flaxstate", "ls", "az://my-bucket/run1"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert done.returncode == 2 and "'az://my-bucket/run1'" in done.stderr and "not to az:// URLs" in done.stderr
    assert list(tmp_path.iterdir()) == []
