"""Checkpoints broken as users break them: Ctrl-C inside a restore, damaged files, hostile shapes, full disks."""

import json
import logging
import os
import random
import signal
import subprocess
import sys
import time

import jax
import pytest
import tensorstore as ts
from flaxstate_testing import processes
from flaxstate_testing.checkpoints import assert_trees_equal, damage_arrays, fresh_state, records

import flaxstate as fs
from flaxstate import cli


def test_ctrl_c_anywhere_in_a_restore_comes_out_as_keyboard_interrupt(tmp_path):
    directory = tmp_path / "ck"
    attempts = 12
    worker = processes.Watched(
        processes.start(
            "checkpoint_faults", {"mode": "restore_interrupts", "dir": str(directory), "attempts": attempts}
        )
    )
    worker.wait_for("RESTORE SECONDS", 240)
    seconds = float(next(line for line in worker.lines if line.startswith("RESTORE SECONDS")).split()[-1])
    chance = random.Random(0)
    for attempt in range(attempts):
        worker.wait_for(f"START {attempt}", 120)
        time.sleep(chance.uniform(0.0, seconds))  # lands anywhere in the restore (or just after it)
        os.kill(worker.process.pid, signal.SIGINT)
        (directory / f"sent-{attempt}").touch()
    worker.wait_for("DONE", 120)
    assert worker.finish(60) == 0, worker.output
    outcomes = [line.split()[0] for line in worker.lines if line.split()[0] in ("RESTORED", "INTERRUPTED", "FAULT")]
    assert "FAULT" not in outcomes, worker.output[-3000:]
    assert outcomes.count("INTERRUPTED") >= 1, worker.output[-3000:]
    assert "DONE 7" in worker.output
    assert "Traceback" not in worker.output, worker.output[-3000:]


HALF_CLOSED_LOOP = """
import asyncio, gc
from flaxstate.checkpoint.damage import quiet_orbax

quiet_orbax()
loop = asyncio.new_event_loop()
loop._ssock.close()  # a Ctrl-C between the self-pipe's close and its reset, inside loop.close()
del loop
gc.collect()


class Broken:
    def __del__(self):
        raise ValueError("a bug of the user's, still reported")


Broken()
gc.collect()
print("END")
"""


def test_an_event_loop_whose_close_a_ctrl_c_stopped_halfway_is_not_reported_and_other_errors_are():
    result = subprocess.run(
        [sys.executable, "-c", HALF_CLOSED_LOOP],
        env=processes.worker_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0 and "END" in result.stdout, result.stdout + result.stderr
    assert "BaseEventLoop.__del__" not in result.stderr, result.stderr
    assert "Invalid file descriptor" not in result.stderr, result.stderr
    assert "a bug of the user's, still reported" in result.stderr, result.stderr


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


def claim_shape(step_dir, array, shape):
    """Rewrites one array's stored zarr metadata (inside the OCDBT store) to claim another shape."""
    store = ts.KvStore.open({"driver": "ocdbt", "base": f"file://{step_dir}/model/"}).result()
    key = f"{array}/.zarray"
    zarray = json.loads(store.read(key).result().value)
    zarray["shape"] = zarray["chunks"] = list(shape)
    store.write(key, json.dumps(zarray).encode()).result()


HOSTILE_READ = """
import sys, flaxstate as fs
try:
    fs.CheckpointFileReader(sys.argv[1]).read(None)
except fs.CheckpointError as error:
    print("CheckpointError:", error)
"""


def read_in_a_process(directory):
    """Reads the newest checkpoint with no template in a process of its own (an allocation of 160 GB would
    abort it); returns the finished process, which must have exited 0."""
    result = subprocess.run(
        [sys.executable, "-c", HOSTILE_READ, str(directory)],
        env=processes.worker_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return result


def test_a_hostile_shape_is_refused_before_anything_is_allocated(tmp_path, caplog):
    writer = fs.CheckpointFileWriter(tmp_path, keep=3)
    recs = records(4, 2)
    for record in recs:
        writer(record)
    writer.close()
    claim_shape(tmp_path / "4", "target.Dense_0.kernel", (200_000, 200_000))
    # With no template:
    result = read_in_a_process(tmp_path)
    assert f"{tmp_path}/4 is damaged" in result.stderr  # falls back to step 2
    claim_shape(tmp_path / "2", "target.Dense_0.kernel", (200_000, 200_000))
    result = read_in_a_process(tmp_path)
    assert "target/Dense_0/kernel claims shape [200000, 200000] (160,000,000,000 bytes)" in result.stdout
    assert "the step's files hold" in result.stdout
    # With a template, the shapes are compared first: a clear mismatch, nothing read.
    with pytest.raises(
        fs.StateMismatchError,
        match=r"target/Dense_0/kernel \(expected float32\[4, 8\], found float32\[200000, 200000\]\)",
    ):
        fs.CheckpointFileReader(tmp_path).restore(fresh_state())


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


def test_a_failed_save_says_one_line_and_leaves_no_partial_folder(tmp_path):
    output = processes.run("checkpoint_faults", {"mode": "full_disk", "dir": str(tmp_path)}, timeout=240)[0]
    failed = [line for line in output.splitlines() if line.startswith("SAVE FAILED")]
    assert [line.split()[2] for line in failed] == ["4:", "6:"], output
    assert "partial files were removed" in failed[0]
    assert "LEFT ['2']" in output
    assert "Traceback" not in output and len(output.splitlines()) <= 4, output
    assert fs.CheckpointFileReader(tmp_path).read(None).step == 2
