"""A step's lifecycle, both ways, on a disk: what is complete, unfinished, set aside and deleted, and the rotation.

The same strategies serve a bucket (`CommitMarker` for s3:// and orbax's
gs://), tested against emulators in tests/checkpoint/test_buckets_processes.py.
"""

import pytest

from flaxstate.checkpoint.stores.lifecycle import CommitMarker, RenameIntoPlace, beyond_keep


def folders(root, *names, marker=None):
    for name in names:
        (root / name).mkdir()
        (root / name / "data").write_text(name)
        if marker is not None and "." not in name:
            (root / name / marker).write_text("")


def test_renamed_into_place_a_listed_step_is_whole_and_a_marked_name_unfinished(tmp_path):
    steps = RenameIntoPlace(".partial-")
    folders(tmp_path, "2", "10", "4.partial-77", "12.partial-78", "6.damaged", "notes")
    assert steps.complete(tmp_path) == [2, 10]
    assert sorted(path.name for path in steps.unfinished(tmp_path)) == ["12.partial-78", "4.partial-77"]
    assert [path.name for path in steps.unfinished(tmp_path, 4)] == ["4.partial-77"]
    assert steps.complete(tmp_path / "missing") == [] and steps.unfinished(tmp_path / "missing") == []


def test_renamed_into_place_set_aside_keeps_the_files_under_a_free_name_and_delete_leaves_nothing(tmp_path):
    steps = RenameIntoPlace(".partial-")
    folders(tmp_path, "2", "4", "2.damaged")
    aside = steps.set_aside(tmp_path / "2", ".damaged")
    assert aside.name == "2.damaged-2" and (aside / "data").read_text() == "2"
    steps.delete(tmp_path / "4")
    steps.delete(tmp_path / "8")  # gone already: nothing to do
    assert sorted(path.name for path in tmp_path.iterdir()) == ["2.damaged", "2.damaged-2"]


def test_with_a_commit_marker_a_step_is_whole_where_its_marker_is(tmp_path):
    steps = CommitMarker("commit_success.txt")
    folders(tmp_path, "2", "4", marker="commit_success.txt")
    folders(tmp_path, "6")  # a save in progress: no marker yet
    assert steps.complete(tmp_path) == [2, 4]
    assert [path.name for path in steps.unfinished(tmp_path)] == ["6"] and steps.unfinished(tmp_path, 2) == []
    aside = steps.set_aside(tmp_path / "2", ".damaged")
    assert aside.name == "2.damaged" and (aside / "data").read_text() == "2"
    steps.delete(tmp_path / "4")
    assert steps.complete(tmp_path) == [] and not (tmp_path / "4").exists()


@pytest.mark.parametrize(
    ("keep", "rank", "deleted"),
    [
        (None, None, []),
        (2, None, [1, 3]),
        (5, None, []),
        (2, {1: 0.5, 3: 0.1, 7: 0.9, 9: 0.1}.get, [1, 7]),  # the worst go
        (1, {1: 0.5, 3: 0.1, 7: 0.9, 9: 0.1}.get, [1, 3, 7]),  # of equal ranks the newer stays
    ],
)
def test_rotation_deletes_the_oldest_or_the_worst_beyond_keep(keep, rank, deleted):
    assert sorted(beyond_keep([9, 1, 7, 3], keep, rank)) == deleted
