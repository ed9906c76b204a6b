"""What a run directory holds, through the catalog's own interface: its checkpoints, a step's arrays, a diff."""

import json
import shutil

import numpy as np
import pytest

from flaxstate.checkpoint import catalog
from flaxstate.checkpoint.errors import CheckpointError
from flaxstate.checkpoint.stores.orbax_manager import CheckpointStore


def state(scale):
    return {
        "target": {"w": np.full((2, 3), scale, np.float32), "b": np.zeros(3, np.float32)},
        "flax_mutables": {},
        "state": {"step": np.int32(1)},
    }


def write(directory, steps, scale=1.0):
    with CheckpointStore(directory, keep=5) as store:
        for step in steps:
            meta = {"step": step, "run_id": "r", "metrics": {"eval": {"loss": 1.0 / step}}, "metadata": {"lr": scale}}
            store.save(step, state(scale), meta)
            store.wait()


def test_list_names_each_writer_s_steps_and_marks_a_damaged_one(tmp_path):
    write(tmp_path, [1, 2, 3])
    (tmp_path / "2" / "meta" / "metadata").write_text(json.dumps({"format_version": 3, "step": "two"}))
    infos = catalog.list_checkpoints(tmp_path)
    assert [(info.writer, info.step) for info in infos] == [("newest", 1), ("newest", 2), ("newest", 3)]
    damaged = infos[1]
    assert damaged.damaged is not None and "step is 'two'" in damaged.damaged and damaged.time is None
    assert infos[2].metrics == {"eval": {"loss": 1.0 / 3}} and infos[2].bytes > 0
    with pytest.raises(CheckpointError, match="is not a flaxstate run: it holds no checkpoint"):
        catalog.list_checkpoints(tmp_path / "2" / "meta")


def test_the_catalog_never_looks_into_a_step_s_temporary_directory_that_a_live_writer_renames(tmp_path, monkeypatch):
    # CI once met `flaxstate show` beside a writer: it took orbax's `11.orbax-checkpoint-tmp` for a best writer's
    # directory, and listed it just as the writer renamed it to `11` (FileNotFoundError, "a damaged checkpoint").
    # Here the rename comes at that worst moment whenever anything lists the temporary directory.
    import pathlib

    write(tmp_path, [1, 2])
    shutil.copytree(tmp_path / "2", tmp_path / "3.orbax-checkpoint-tmp")
    (tmp_path / "4.damaged").mkdir()
    iterdir = pathlib.Path.iterdir

    def renamed_as_it_is_listed(path):
        if ".orbax-checkpoint-tmp" in path.name:
            path.rename(path.with_name("3"))
        return iterdir(path)

    monkeypatch.setattr(pathlib.Path, "iterdir", renamed_as_it_is_listed)
    assert [(info.writer, info.step) for info in catalog.list_checkpoints(tmp_path)] == [("newest", 1), ("newest", 2)]
    assert catalog.describe_state(tmp_path)[0] == 2
    assert (tmp_path / "3.orbax-checkpoint-tmp").is_dir()


def test_describe_gives_a_step_s_arrays_and_passes_over_a_damaged_newest(tmp_path, caplog):
    write(tmp_path, [1, 2])
    (tmp_path / "2" / "meta" / "metadata").write_text("{")
    step, leaves, meta = catalog.describe_state(tmp_path)
    assert step == 1 and meta["metadata"] == {"lr": 1.0}
    by_path = {leaf.path: leaf for leaf in leaves}
    assert (
        by_path["target/w"].shape == (2, 3)
        and by_path["target/w"].bytes == 24
        and by_path["target/w"].dtype == "float32"
    )
    assert "2 is damaged" in caplog.text
    with pytest.raises(CheckpointError, match="has no checkpoint at step 7; it has steps \\[1, 2\\]"):
        catalog.describe_state(tmp_path, step=7)


def test_diff_compares_metadata_trees_and_values_one_array_at_a_time(tmp_path):
    write(tmp_path / "a", [4], scale=1.0)
    write(tmp_path / "b", [4], scale=2.0)
    same = catalog.diff_checkpoints(tmp_path / "a", tmp_path / "a")
    assert not same.differ and same.n_compared == 3
    diff = catalog.diff_checkpoints(tmp_path / "a", tmp_path / "b", step_a=4)
    assert diff.differ and diff.metadata == ["lr: 1.0 -> 2.0"]
    assert [path for path, _ in diff.changed] == ["target/w"] and diff.changed[0][1] == pytest.approx(1.0)
    assert (diff.a, diff.b) == (tmp_path / "a" / "4", tmp_path / "b" / "4")
