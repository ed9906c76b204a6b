"""What a task holds, checked: an EMA decay in [0, 1), as a constant at construction or a schedule at every step."""

import optax
import pytest

from flaxstate.training import task as task_module
from flaxstate.training.task import TrainTask


def make(ema_decay):
    return TrainTask(
        apply=lambda v, x: x, optimizer=optax.sgd(0.1), loss=lambda o, y: 0.0, data=[], ema_decay=ema_decay
    )


@pytest.mark.parametrize("decay", [1.0, -0.1, float("nan"), "0.999", True])
def test_a_constant_decay_outside_zero_to_one_or_not_a_number_is_refused_at_construction(decay):
    with pytest.raises(ValueError, match="TrainTask ema_decay must"):
        make(decay)


def test_a_schedule_is_checked_at_every_step_the_loop_will_train_naming_the_first_bad_one(monkeypatch):
    warmup = optax.linear_schedule(0.0, 0.9999, 100)
    make(warmup).check_ema_decays(0, 1_000)  # every value in [0, 1)
    growing = optax.linear_schedule(0.9, 1.1, 100)  # reaches 1 at step 50
    monkeypatch.setattr(task_module, "EMA_CHECK_CHUNK", 16)  # several chunks
    with pytest.raises(ValueError, match=r"got .*1\.0.*\(the schedule's value at step 50\)"):
        make(growing).check_ema_decays(0, 200)
    make(growing).check_ema_decays(0, 50)  # the steps it trains are fine
    with pytest.raises(ValueError, match=r"or a schedule of the step, got .*'slow'.*at step 3"):
        make(lambda step: "slow").check_ema_decays(3, 4)
