"""Writers: when they save (in the background, below the loop's priority), what they keep, how failures surface."""

import dataclasses
import os
import sys
import threading

import numpy as np
import orbax.checkpoint as ocp
import pytest
from flaxstate_testing.checkpoints import fresh_state, patch_async_save, records, saved_steps, summary

import flaxstate as fs


class Clock:
    """A monotonic clock the test moves by hand."""

    def __init__(self):
        self.now = 1000.0

    def monotonic(self):
        return self.now


def test_writer_uses_orbax_standard_layout_and_keeps_the_newest(tmp_path):
    writer = fs.CheckpointFileWriter(tmp_path, keep=2)
    recs = records()
    for record in recs:
        assert writer(record) is record
    assert sorted(int(p.name) for p in tmp_path.iterdir() if p.name.isdigit()) == [4, 6]
    assert {p.name for p in (tmp_path / "6").iterdir()} >= {"model", "optimizer", "meta"}

    # Plain orbax, without flaxstate, lists and restores it.
    manager = ocp.CheckpointManager(tmp_path, item_names=("model", "optimizer", "meta"))
    assert list(manager.all_steps()) == [4, 6]
    restored = manager.restore(6, args=ocp.args.Composite(model=ocp.args.PyTreeRestore(), meta=ocp.args.JsonRestore()))
    np.testing.assert_array_equal(
        restored.model["target"]["Dense_0"]["kernel"], recs[-1].state.params["Dense_0"]["kernel"]
    )
    assert restored.meta["step"] == 6


@pytest.mark.skipif(sys.platform != "linux", reason="a thread's own priority (nice) exists on Linux only")
def test_a_save_runs_in_the_background_below_the_loops_priority(tmp_path, monkeypatch):
    from flaxstate.checkpoint import saving

    seen = []
    save = ocp.CheckpointManager.save

    def observed_save(self, *args, **kwargs):
        seen.append((threading.current_thread() is threading.main_thread(), os.getpriority(os.PRIO_PROCESS, 0)))
        return save(self, *args, **kwargs)

    monkeypatch.setattr(ocp.CheckpointManager, "save", observed_save)
    loop_priority = os.getpriority(os.PRIO_PROCESS, 0)
    with fs.CheckpointFileWriter(tmp_path) as writer:
        writer(records(n_steps=2)[-1])
    assert seen == [(False, min(19, loop_priority + saving.SAVE_NICENESS))]
    assert os.getpriority(os.PRIO_PROCESS, 0) == loop_priority  # the loop's own thread is untouched
    assert saved_steps(tmp_path) == [2]


@pytest.mark.parametrize("when", [{"every_seconds": 60}, {"every": fs.EverySeconds(60)}], ids=["keyword", "policy"])
def test_a_time_based_writer_saves_when_every_seconds_passed_and_always_the_final_and_preempted(tmp_path, when):
    clock = Clock()
    recs = records(n_steps=12, every=2)  # steps 2, 4, ..., 12 (final)
    writer = fs.CheckpointFileWriter(tmp_path, keep=10, clock=clock.monotonic, **when)
    writer(recs[0])  # 0 s since the writer was made
    clock.now += 59
    writer(recs[1])  # 59 s
    assert saved_steps(tmp_path) == []
    clock.now += 1
    writer(recs[2])  # 60 s: saved, and the clock starts again
    clock.now += 30
    writer(recs[3])
    writer.wait()
    assert saved_steps(tmp_path) == [6]
    preempted = dataclasses.replace(recs[4], preempted=True)
    writer(preempted)  # 30 s after the last save, but preempted: saved, and on disk when the call returns
    assert saved_steps(tmp_path) == [6, 10]
    writer(recs[5])  # final
    assert saved_steps(tmp_path) == [6, 10, 12]
    writer.close()


def test_a_preempted_record_at_a_step_already_saved_is_not_saved_twice(tmp_path):
    recs = records(n_steps=4, every=2)
    with fs.CheckpointFileWriter(tmp_path) as writer:
        writer(recs[0])
        writer(dataclasses.replace(recs[0], preempted=True, n_completed_steps=0))
    assert saved_steps(tmp_path) == [2]


def test_every_seconds_must_be_positive(tmp_path):
    with pytest.raises(ValueError, match="every_seconds must be a positive number of seconds or None, got 0"):
        fs.CheckpointFileWriter(tmp_path, every_seconds=0)


def test_best_writers_keep_their_own_subdirectories(tmp_path):
    lowest = fs.LowestCheckpointFileWriter(tmp_path, metric="loss", keep=1)
    highest = fs.HighestCheckpointFileWriter(tmp_path, metric="acc", keep=1)
    newest = fs.CheckpointFileWriter(tmp_path, keep=1)
    losses = {2: 0.5, 4: 0.2, 6: 0.9}
    for record in records():
        s = summary(record, losses[record.step])
        newest(lowest(highest(s)))
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_dir()) == [
        "6",
        "highest-eval-acc",
        "lowest-eval-loss",
    ]
    assert [p.name for p in (tmp_path / "lowest-eval-loss").iterdir() if p.name.isdigit()] == ["4"]
    assert [p.name for p in (tmp_path / "highest-eval-acc").iterdir() if p.name.isdigit()] == ["4"]
    # Resume takes the newest checkpoint of the run, never the best.
    assert int(fs.CheckpointFileReader(tmp_path).restore(fresh_state()).step) == 6
    best = fs.LowestCheckpointFileReader(tmp_path, metric="loss").read(fs.CheckpointFile(fresh_state(), 0))
    assert best.step == 4 and best.metrics["eval"]["loss"] == 0.2
    assert int(fs.HighestCheckpointFileReader(tmp_path, metric="acc").restore(fresh_state()).step) == 4


def test_best_writer_names_a_missing_metric(tmp_path):
    writer = fs.LowestCheckpointFileWriter(tmp_path, metric="los", group="eval")
    with pytest.raises(ValueError, match=r"'los' in group 'eval', but the record has \{'eval': \['acc', 'loss'\]\}"):
        writer(summary(records(2, 2)[0], 0.1))
    with pytest.raises(ValueError, match="has no metrics"):
        writer(records(2, 2)[0])


def saved_once_then_failing(tmp_path, monkeypatch):
    """A writer (keep=5) that saved the first of `records()` (step 2), and whose next save fails in the background
    (a full disk, injected); the records."""
    writer = fs.CheckpointFileWriter(tmp_path, keep=5)
    recs = records()
    writer(recs[0])
    writer.wait()
    failures = iter([OSError("No space left on device (injected)")])

    def fail_once():
        if (error := next(failures, None)) is not None:
            raise error

    patch_async_save(monkeypatch, fail_once)
    return writer, recs


def test_a_failed_background_save_is_raised_at_the_next_save_naming_its_step(tmp_path, monkeypatch):
    writer, recs = saved_once_then_failing(tmp_path, monkeypatch)
    writer(recs[1])  # returns at once: the bytes are written in the background, and fail there
    with pytest.raises(fs.CheckpointSaveError, match=f"step 4 to {tmp_path} failed in the background.*No space left"):
        writer(recs[2])
    # What was saved before is intact, and the failed step is never restored.
    assert int(fs.CheckpointFileReader(tmp_path).restore(fresh_state()).step) == 2
    # The writer goes on: the next save works.
    writer(recs[2])
    writer.wait()
    assert int(fs.CheckpointFileReader(tmp_path).restore(fresh_state()).step) == 6


def test_a_writer_replaced_after_its_background_save_failed_refuses_every_record(tmp_path, monkeypatch):
    # The first writer's save fails in the background; a new writer of the directory (a notebook cell run again)
    # reports that failure and is not made; made again, it is. The first must then save nothing more: it took
    # records beside its successor, both writing steps to the directory.
    first, recs = saved_once_then_failing(tmp_path, monkeypatch)
    first(recs[1])  # step 4 fails in the background
    with pytest.raises(fs.CheckpointSaveError, match="step 4"):
        fs.CheckpointFileWriter(tmp_path, keep=5)
    second = fs.CheckpointFileWriter(tmp_path, keep=5)
    with pytest.raises(fs.CheckpointError, match=r"was replaced by CheckpointFileWriter\(.*saves nothing more"):
        first(recs[2])
    second(recs[2])
    second.close()
    with pytest.raises(fs.CheckpointError, match="was replaced by"):
        first(recs[2])  # still, after its successor closed
    assert [int(path.name) for path in sorted(tmp_path.iterdir()) if path.name.isdigit()] == [2, 6]


def test_a_save_returns_before_its_bytes_are_written(tmp_path, monkeypatch):
    recs = records()
    release = threading.Event()
    patch_async_save(monkeypatch, lambda: release.wait(timeout=60))
    writer = fs.CheckpointFileWriter(tmp_path)
    assert writer(recs[0]) is recs[0]  # returns while the write is held back
    assert not (tmp_path / "2").exists()
    release.set()
    writer.wait()
    assert int(fs.CheckpointFileReader(tmp_path).restore(fresh_state()).step) == 2


def test_each_writer_says_once_where_its_checkpoints_go_where_the_loop_prints(tmp_path, capsys):
    import optax
    from flaxstate_testing import toy

    model = toy.MLP()
    task = fs.TrainTask(apply=model.apply, optimizer=optax.sgd(0.1), loss=toy.mse, data=toy.batches(4, 8))
    loop = fs.TrainLoop(model.init, task, 0, n_steps=4, n_steps_per_checkpoint=2)
    with (
        fs.CheckpointFileWriter(tmp_path / "run", keep=3) as writer,
        fs.LowestCheckpointFileWriter(tmp_path / "run", metric="loss", group="train") as best,
    ):
        for record in loop:
            best(writer(record.with_metrics({"train": {"loss": record.loss}})))
    out = capsys.readouterr().out
    assert out.count(f"Checkpoints go to {tmp_path / 'run'} (the newest 3).") == 1, out
    assert out.count(f"The checkpoints of the lowest train/loss go to {tmp_path / 'run' / 'lowest-train-loss'}") == 1
    quiet = fs.TrainLoop(model.init, task, 0, n_steps=4, n_steps_per_checkpoint=2, stdout=False)
    with fs.CheckpointFileWriter(tmp_path / "other") as writer:
        for record in quiet:
            writer(record)
    assert "Checkpoints go to" not in capsys.readouterr().out  # the loop prints nothing: nor do its writers
