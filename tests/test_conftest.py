"""The suite's own helpers in `tests/conftest.py` that run in one process: the kept compilation cache's pruning.

The tiers it declares, and its kept cache across sessions, are checked by pytest runs of their own in
`test_conftest_processes.py` (tier 2).
"""

import os

from conftest import prune


def test_pruning_a_kept_cache_removes_its_oldest_files_until_the_rest_fit(tmp_path):
    for age, name in enumerate(["newest", "newer", "older", "oldest"]):
        entry = tmp_path / name
        entry.write_bytes(b"x" * 100)
        os.utime(entry, (1_000_000 - age * 10, 1_000_000 - age * 10))
    prune(tmp_path, 250)
    assert sorted(entry.name for entry in tmp_path.iterdir()) == ["newer", "newest"]
    prune(tmp_path, 200)
    assert sorted(entry.name for entry in tmp_path.iterdir()) == ["newer", "newest"]
    prune(tmp_path, 0)
    assert list(tmp_path.iterdir()) == []
