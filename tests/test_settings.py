"""Settings read from a config file: a wrong type is one error naming the setting, the value and what it takes."""

import json
import re

import jax.numpy as jnp
import numpy as np
import pytest
from flaxstate_testing import loops, toy

import flaxstate as fs
from flaxstate import launch as fs_launch


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda d: fs.CheckpointFileWriter(d, keep="3"), "CheckpointFileWriter keep must be a positive int, got '3'"),
        (lambda d: fs.CheckpointFileWriter(d, keep=0), "CheckpointFileWriter keep must be a positive int, got 0"),
        (
            lambda d: fs.CheckpointFileWriter(d, every_seconds="60"),
            "CheckpointFileWriter every_seconds must be a positive number of seconds or None, got '60' (a str)",
        ),
        (
            lambda d: fs.CheckpointFileWriter(d, overwrite="false"),
            "CheckpointFileWriter overwrite must be True or False, got 'false' (a str)",
        ),
        (lambda d: fs.CheckpointFileWriter(d, per_process=1), "per_process must be True or False, got 1 (a int)"),
        (
            lambda d: fs.LowestCheckpointFileWriter(d, metric="loss", keep="2"),
            "LowestCheckpointFileWriter keep must be a positive int, got '2'",
        ),
        (
            lambda d: fs.HighestCheckpointFileWriter(d, metric=None),
            "HighestCheckpointFileWriter metric must be a non-empty string, got None",
        ),
        (lambda d: fs.CheckpointFileReader(d, step="7"), "CheckpointFileReader step must be an int of at least 0"),
        (lambda d: fs.CheckpointFileReader(d, target="init"), "CheckpointFileReader target must be a function"),
        (lambda d: fs.CheckpointFileReader(d, rename=[("a", "b")]), "CheckpointFileReader rename must be a dict"),
        (
            lambda d: fs.LowestCheckpointFileReader(d, metric="loss", group=3),
            "LowestCheckpointFileReader group must be a non-empty string, got 3",
        ),
    ],
)
def test_checkpoint_settings_of_the_wrong_type_are_named_at_construction(tmp_path, make, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        make(tmp_path / "run")
    assert not (tmp_path / "run").exists() or not any((tmp_path / "run").iterdir())  # nothing written


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"n_steps": "100"}, "TrainLoop n_steps must be an int of at least 0, got '100' (a str)"),
        ({"every": "10"}, "TrainLoop n_steps_per_checkpoint must be a positive int, got '10' (a str)"),
        ({"stdout": "no"}, "TrainLoop stdout must be True or False, got 'no' (a str)"),
        ({"handle_preemption": "yes"}, "TrainLoop handle_preemption must be True or False, got 'yes'"),
    ],
)
def test_loop_settings_of_the_wrong_type_are_named_at_construction(options, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        loops.make_loop(**options)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"n_steps": "4"}, "EvalLoop n_steps must be a positive int, got '4' (a str)"),
        ({"group": 1}, "EvalLoop group must be a non-empty string, got 1"),
        ({"use_ema": "true"}, "EvalLoop use_ema must be True or False, got 'true'"),
        ({"rng_collections": "dropout"}, "EvalLoop rng_collections must be a list of rng collection names"),
    ],
)
def test_eval_settings_of_the_wrong_type_are_named_at_construction(options, message):
    data = [(np.ones((4, 4), np.float32), np.zeros((4,), np.float32))]
    task = fs.EvalTask(apply=toy.MLP().apply, metrics={"mse": lambda y, t: jnp.mean((y - t) ** 2)}, data=data)
    with pytest.raises(ValueError, match=re.escape(message)):
        fs.EvalLoop(task, rng=0, **options)


def test_numpy_counts_and_seconds_from_a_config_are_taken_and_stored_as_python_numbers(tmp_path):
    # np.int64 is what numpy-backed config libraries and np.arange give: each door takes it, and what lands in the
    # ledger's and the metadata's JSON is a plain number (n_microbatches reached the ledger as an int64 and the
    # first save raised "Object of type int64 is not JSON serializable").
    x, y = np.ones((32, 4), np.float32), np.zeros((32,), np.float32)
    data = fs.global_batches((x, y), batch_size=np.int64(8), seed=np.int64(1))
    loop = loops.make_loop(
        data,
        n_steps=np.int64(8),
        every=np.int64(4),
        per_dispatch=np.int64(2),
        n_microbatches=np.int64(2),
        hang_timeout=np.float64(600),
    )
    run = tmp_path / "run"
    options = {"keep": np.int64(2), "peers": np.int64(0), "every_seconds": np.float32(0.001)}
    with fs.CheckpointFileWriter(run, metadata={"lr": np.float32(0.5), "layers": np.int64(3)}, **options) as writer:
        records = [writer(record) for record in loop]
    assert [int(record.step) for record in records] == [4, 8]
    events = [json.loads(line) for line in (run / "goodput.jsonl").read_text().splitlines()]
    assert any(event["event"] == "record" and type(event["step"]) is int for event in events)
    restored = fs.CheckpointFileReader(run, step=np.int64(8), host_memory_budget=np.int64(2**20)).read(None)
    assert restored.metadata == {"lr": 0.5, "layers": 3} and type(restored.metadata["layers"]) is int
    config = fs_launch.LaunchConfig(("true",), np.int64(2), np.int64(1), np.float64(1.5), np.int64(1), None)
    assert (type(config.n_processes), type(config.grace)) == (int, float)


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda d: fs.CheckpointFileWriter(d, peers=True), "peers must be a count of copies (0, 1, ...), got True"),
        (lambda d: fs.CheckpointFileWriter(d, keep=np.bool_(True)), "keep must be a positive int, got np.True_"),
        (lambda d: fs.global_batches(np.ones((8, 2)), batch_size=True), "batch_size must be a positive int, got True"),
        (lambda d: loops.make_loop(n_microbatches=np.float64(2)), "n_microbatches must be a positive int"),
        (lambda d: fs_launch.LaunchConfig(("true",), True), "--processes must be at least 1, got True"),
        (lambda d: fs_launch.LaunchConfig(("true",), 2, grace="5"), "--grace must be 0 or more seconds, got '5'"),
    ],
)
def test_bools_and_floats_are_still_refused_where_a_count_is_taken(tmp_path, make, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        make(tmp_path / "run")
