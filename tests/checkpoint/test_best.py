"""The best-checkpoint policy: one object for the writers, the readers and the CLI."""

import logging
import math

import jax
import numpy as np
import optax
import pytest
from flaxstate_testing import toy

import flaxstate as fs
from flaxstate import cli

MODEL = toy.BatchNormNet()
TX = optax.adam(1e-2)


def records(n_steps=6, every=2):
    task = fs.TrainTask(apply=MODEL.apply, optimizer=TX, loss=toy.mse, data=toy.batches(n_steps, 8))
    loop = fs.TrainLoop(
        MODEL.init, task, jax.random.key(0), n_steps=n_steps, n_steps_per_checkpoint=every, stdout=False
    )
    return list(loop)


def fresh_state():
    return fs.FlaxOptimTrainState.create(TX, MODEL.init(jax.random.key(3), np.ones((8, 4), np.float32)))


@pytest.mark.parametrize(
    ("writer", "reader", "values"),
    [
        (fs.LowestCheckpointFileWriter, fs.LowestCheckpointFileReader, [1.0, math.nan, 2.0]),
        (fs.LowestCheckpointFileWriter, fs.LowestCheckpointFileReader, [1.0, -math.inf, 2.0]),
        (fs.HighestCheckpointFileWriter, fs.HighestCheckpointFileReader, [2.0, math.nan, 1.0]),
        (fs.HighestCheckpointFileWriter, fs.HighestCheckpointFileReader, [2.0, math.inf, 1.0]),
    ],
)
def test_a_non_finite_metric_never_replaces_the_best_checkpoint(tmp_path, caplog, writer, reader, values):
    with caplog.at_level(logging.WARNING, logger="flaxstate"):
        with writer(tmp_path, metric="loss", keep=1) as best:
            for record, value in zip(records(), values, strict=True):
                best(record.with_metrics({"eval": {"loss": value}}))
    assert f"step 4: eval/loss is {values[1]}" in caplog.text and "never counts it better" in caplog.text
    kept = sorted(int(p.name) for p in (tmp_path / best.policy.subdir).iterdir() if p.name.isdigit())
    assert kept == [2]
    restored = reader(tmp_path, metric="loss").read(fs.CheckpointFile(fresh_state(), 0))
    assert restored.step == 2 and restored.metrics["eval"]["loss"] == values[0]


def test_the_reader_puts_non_finite_metrics_last(tmp_path):
    with fs.LowestCheckpointFileWriter(tmp_path, metric="loss", keep=3) as best:
        for record, value in zip(records(), [math.nan, 3.0, 2.0], strict=True):
            best(record.with_metrics({"eval": {"loss": value}}))
    assert fs.LowestCheckpointFileReader(tmp_path, metric="loss").read(None).step == 6


def test_ls_marks_the_best_by_the_stored_policy_even_with_dashes_in_names(tmp_path, capsys):
    # The old CLI split "lowest-val-set-top-1-error" on '-' and marked the wrong checkpoint.
    with (
        fs.CheckpointFileWriter(tmp_path, keep=3) as newest,
        fs.LowestCheckpointFileWriter(tmp_path, metric="top-1-error", group="val-set", keep=3) as best,
    ):
        for record, value in zip(records(), [0.5, 0.2, 0.4], strict=True):
            summary = record.with_metrics({"val-set": {"top-1-error": value}, "set": {"top": 0.0}})
            newest(summary)
            best(summary)
    assert cli.main(["ls", str(tmp_path)]) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines()[1:]]
    marked = [(row[0], row[1]) for row in rows if row[-1] == "*"]
    assert marked == [("lowest-val-set-top-1-error", "4")]


def test_the_policy_is_stored_with_every_best_checkpoint(tmp_path):
    with fs.HighestCheckpointFileWriter(tmp_path, metric="acc", keep=2) as best:
        best(records(2, 2)[-1].with_metrics({"eval": {"acc": 0.5}}))
    reader = fs.HighestCheckpointFileReader(tmp_path, metric="acc")
    assert reader.policy == fs.BestPolicy(metric="acc", group="eval", mode="max")
    meta = fs.checkpoint.stores.orbax_manager.CheckpointStore(tmp_path / "highest-eval-acc", read_only=True)
    with meta as store:
        assert fs.BestPolicy.from_json(store.read_meta(2)["best"]) == reader.policy


def test_a_bad_mode_is_refused():
    with pytest.raises(ValueError, match="mode must be 'min' or 'max'"):
        fs.BestPolicy(metric="loss", mode="lowest")
