"""Settings read from a config file: a wrong type is one error naming the setting, the value and what it takes."""

import re

import jax.numpy as jnp
import numpy as np
import pytest
from flaxstate_testing import loops, toy

import flaxstate as fs


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
