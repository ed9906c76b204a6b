"""Checkpoints broken as users break them: Ctrl-C inside a restore, damaged files, hostile shapes, full disks."""

import json
import logging

import jax
import pytest
from flaxstate_testing.checkpoints import assert_trees_equal, damage_arrays, fresh_state, records

import flaxstate as fs
from flaxstate import cli


def write_meta(step_dir, change):
    path = step_dir / "meta" / "metadata"
    meta = json.loads(path.read_text())
    change(meta)
    path.write_text(json.dumps(meta))
    return path


BAD_META = {
    "step as a word": lambda meta: meta.update(step="ten"),
    "step null": lambda meta: meta.update(step=None),
    "format version as a string": lambda meta: meta.update(format_version="3"),
    "n_batches as a string": lambda meta: meta["data_position"].update(n_batches="x"),
    "rng without data": lambda meta: meta.update(rng={"impl": 3}),
    "metrics not numbers": lambda meta: meta.update(metrics={"eval": {"loss": "low"}}),
}


@pytest.mark.parametrize("how", sorted(BAD_META))
def test_meta_of_the_wrong_type_is_damage_named_with_its_file(tmp_path, how, caplog):
    recs = records()
    writer = fs.CheckpointFileWriter(tmp_path, keep=3)
    for record in recs:
        writer(record)
    writer.close()
    path = write_meta(tmp_path / "6", BAD_META[how])
    with caplog.at_level(logging.WARNING, logger="flaxstate"):
        restored = fs.CheckpointFileReader(tmp_path).restore(fresh_state())
    assert int(restored.step) == 4
    assert f"{tmp_path}/6 is damaged" in caplog.text and str(path) in caplog.text
    # Nothing to fall back to: a CheckpointError naming the file.
    with pytest.raises(fs.CheckpointError, match=f"step 6: {path}"):
        fs.CheckpointFileReader(tmp_path, step=6).restore(fresh_state())


def test_a_step_whose_meta_file_is_gone_is_damage_named_with_its_file(tmp_path, caplog):
    writer = fs.CheckpointFileWriter(tmp_path, keep=3)
    for record in records():
        writer(record)
    writer.close()
    missing = tmp_path / "6" / "meta" / "metadata"
    missing.unlink()
    with caplog.at_level(logging.WARNING, logger="flaxstate"):
        restored = fs.CheckpointFileReader(tmp_path).restore(fresh_state())
    assert int(restored.step) == 4
    assert f"{tmp_path}/6 is damaged" in caplog.text and f"{missing} is missing" in caplog.text
    with pytest.raises(fs.CheckpointError, match=f"step 6: {missing} is missing"):
        fs.CheckpointFileReader(tmp_path, step=6).restore(fresh_state())


def test_a_loop_resumes_past_a_checkpoint_whose_data_position_is_damaged(tmp_path, caplog):
    from flaxstate_testing import toy

    model = toy.BatchNormNet()
    recs = records()
    writer = fs.CheckpointFileWriter(tmp_path, keep=3)
    for record in recs:
        writer(record)
    writer.close()
    write_meta(tmp_path / "6", BAD_META["n_batches as a string"])
    task = fs.TrainTask(apply=model.apply, optimizer=fresh_state().tx, loss=toy.mse, data=toy.batches(6, 8))
    with caplog.at_level(logging.WARNING, logger="flaxstate"):
        loop = fs.TrainLoop(
            fs.CheckpointFileReader(tmp_path, target=model.init), task, jax.random.key(0), n_steps=6, stdout=False
        )
    assert loop.step == 4
    assert "n_batches" in caplog.text


def test_invalid_json_in_a_best_checkpoint_falls_back_and_ls_lists_the_intact_steps(tmp_path, capsys, caplog):
    writer = fs.LowestCheckpointFileWriter(tmp_path, metric="loss", keep=3)
    for loss, record in zip([0.3, 0.2, 0.1], records(), strict=True):
        writer(fs.Summary.of(record, {"eval": {"loss": loss}}))
    writer.close()
    best_dir = tmp_path / "lowest-eval-loss"
    (best_dir / "6" / "meta" / "metadata").write_text('{"step": 6, "format_')
    with caplog.at_level(logging.WARNING, logger="flaxstate"):
        restored = fs.LowestCheckpointFileReader(tmp_path, metric="loss").restore(fresh_state())
    assert int(restored.step) == 4
    assert f"{best_dir}/6 is damaged" in caplog.text and "not valid JSON" in caplog.text
    assert cli.main(["ls", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    rows = {line.split()[1]: line for line in out.splitlines()[1:]}
    assert set(rows) == {"2", "4", "6"}
    assert "not valid JSON" in rows["6"] and "*" in rows["4"]
    assert cli.main(["show", str(best_dir.parent)]) == 0  # the run's own (newest) writer: none here, the best's


def test_show_passes_over_a_damaged_newest_step_and_names_a_damaged_given_one(tmp_path, capsys, caplog):
    writer = fs.CheckpointFileWriter(tmp_path, keep=3)
    for record in records():
        writer(record)
    writer.close()
    write_meta(tmp_path / "6", BAD_META["step as a word"])
    with caplog.at_level(logging.WARNING, logger="flaxstate"):
        assert cli.main(["show", str(tmp_path)]) == 0
    assert f"checkpoint {tmp_path}/4 " in capsys.readouterr().out
    assert f"{tmp_path}/6 is damaged" in caplog.text
    assert cli.main(["show", str(tmp_path), "--step", "6"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "meta/metadata" in err and "step is 'ten'" in err, err


@pytest.mark.parametrize("what", ["arrays", "meta and arrays"])
def test_a_run_resumed_past_a_damaged_checkpoint_sets_it_aside_and_saves(tmp_path, what, caplog):
    from flaxstate_testing import toy

    model = toy.BatchNormNet()

    def loop(init, n_steps):
        task = fs.TrainTask(apply=model.apply, optimizer=fresh_state().tx, loss=toy.mse, data=toy.batches(8, 8))
        return fs.TrainLoop(init, task, jax.random.key(0), n_steps=n_steps, n_steps_per_checkpoint=2, stdout=False)

    straight = list(loop(model.init, 8))[-1]
    writer = fs.CheckpointFileWriter(tmp_path, keep=3)
    for record in loop(model.init, 6):
        writer(record)
    writer.close()
    damage_arrays(tmp_path / "6", "truncate")
    if what == "meta and arrays":
        (tmp_path / "6" / "meta" / "metadata").write_text("{")
    with caplog.at_level(logging.WARNING, logger="flaxstate"):
        resumed = loop(fs.CheckpointFileReader(tmp_path, target=model.init), 8)
        assert resumed.step == 4
        with fs.CheckpointFileWriter(tmp_path, keep=3) as writer:
            for record in resumed:
                writer(record)
    assert f"the damaged checkpoint of step 6 is set aside as {tmp_path}/6.damaged" in caplog.text
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_dir()) == ["4", "6", "6.damaged", "8"]
    assert_trees_equal(fs.CheckpointFileReader(tmp_path).restore(fresh_state()), straight.state)
