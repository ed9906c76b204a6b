import dataclasses
import io

import jax
import optax
import pytest
from flaxstate_testing import toy
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

import flaxstate as fs


def summaries():
    model = toy.MLP()
    task = fs.TrainTask(apply=model.apply, optimizer=optax.sgd(0.05), loss=toy.mse, data=toy.batches(6, 8))
    loop = fs.TrainLoop(model.init, task, jax.random.key(0), n_steps=6, n_steps_per_checkpoint=3, stdout=False)
    evaluate = fs.EvalLoop(
        fs.EvalTask(apply=model.apply, metrics={"loss": toy.mse}, data=toy.batches(2, 8, seed=9)),
        rng=jax.random.key(1),
        n_steps=2,
    )
    return [evaluate(record) for record in loop]


def test_summary_logger_prints_one_line_per_record():
    stream = io.StringIO()
    logger = fs.SummaryLogger(stream)
    records = summaries()
    for record in records:
        assert logger(record) is record
    lines = stream.getvalue().splitlines()
    assert len(lines) == 2
    assert lines[0].startswith("step 3: eval/loss ")
    assert f"train/loss {records[1].loss:.4g}" in lines[1] and "steps/s" in lines[1]
    assert f"{records[1].data_fraction:.0%} waiting for data" in lines[1]


def test_summary_logger_calls_an_input_bound_or_host_bound_record_so():
    stream = io.StringIO()
    record = fs.Checkpoint(state=None, grads=None, loss=0.5, n_completed_steps=10, elapsed_time=2.0, step=10)
    fs.SummaryLogger(stream)(dataclasses.replace(record, data_time=1.88, idle_time=1.9))
    fs.SummaryLogger(stream)(dataclasses.replace(record, data_time=0.06, idle_time=1.84))
    fs.SummaryLogger(stream)(dataclasses.replace(record, data_time=0.2, idle_time=0.3))
    input_bound, host_bound, fine = stream.getvalue().splitlines()
    assert input_bound.endswith(
        "(5.0 steps/s, 94% waiting for data, devices idle 95%)  input-bound: 94% of the time waiting for data"
    )
    assert host_bound.endswith(
        "(5.0 steps/s, 3% waiting for data, devices idle 92%)  host-bound: the devices idle 92% of the time, "
        "3% waiting for data"
    )
    assert fine.endswith("(5.0 steps/s, 10% waiting for data, devices idle 15%)")


def test_summary_writer_writes_tensorboard_scalars(tmp_path):
    writer = fs.SummaryWriter(tmp_path)
    records = summaries()
    for record in records:
        assert writer(record) is record
    writer.close()
    events = EventAccumulator(str(tmp_path))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {"train/loss", "eval/loss", "train/steps_per_second", "train/data_fraction", "train/idle_fraction"} <= tags
    for name in ("data_fraction", "idle_fraction"):
        fractions = events.Scalars(f"train/{name}")
        assert [e.step for e in fractions] == [3, 6]
        assert abs(fractions[1].value - getattr(records[1], name)) < 1e-6 and 0 < fractions[1].value < 1
    eval_loss = events.Scalars("eval/loss")
    assert [e.step for e in eval_loss] == [3, 6]
    assert abs(eval_loss[1].value - records[1].metrics["eval"]["loss"]) < 1e-6


def test_summary_writer_writes_the_compile_time_and_the_running_goodput(tmp_path):
    writer = fs.SummaryWriter(tmp_path)
    records = [writer(record) for record in summaries()]
    writer.close()
    events = EventAccumulator(str(tmp_path))
    events.Reload()
    compiled = events.Scalars("train/compile_seconds")
    assert compiled[0].step == 3 and abs(compiled[0].value - records[0].compile_time) < 1e-6
    goodput = events.Scalars("train/goodput")
    assert [e.step for e in goodput] == [3, 6] and all(0 < e.value < 1 for e in goodput)
    productive = sum(record.productive_time for record in records)
    assert goodput[1].value <= productive / (records[1].session.startup + records[1].elapsed_time) + 1e-6


def test_the_speeds_leave_the_compile_time_out():
    record = fs.Checkpoint(
        state=None,
        grads=None,
        loss=0.5,
        n_completed_steps=10,
        elapsed_time=2.0,
        step=10,
        compile_time=1.5,
        idle_time=0.1,
        batch_size=4,
        flops_per_step=100.0,
    )
    assert record.training_time == 0.5 and record.steps_per_second == 20.0
    assert record.examples_per_second == 80.0 and record.flops_per_second == 2000.0
    assert record.productive_time == pytest.approx(0.4)
    stream = io.StringIO()
    fs.SummaryLogger(stream)(record)
    assert "(20.0 steps/s" in stream.getvalue() and "compiling 1.5 s (not in the speeds)" in stream.getvalue()
