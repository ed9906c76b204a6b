"""SIGTERM (a preemption notice): the loop stops at a dispatch boundary, the step is saved, the script exits 0.

Real signals to real worker processes (`workers/resume.py`: `for c in loop:
writer(c)`), each with a hard timeout; the restart must end bit-equal to a run
that was never stopped.
"""

import signal

import jax
import optax
from flaxstate_testing import toy

import flaxstate as fs


class NoticeAt:
    """Batches whose generator sends SIGTERM to its own process at one batch (a notice mid-training)."""

    def __init__(self, at):
        self.at = at

    def __iter__(self):
        for index, batch in enumerate(toy.batches(30, 8)):
            if index == self.at:
                signal.raise_signal(signal.SIGTERM)
            yield batch


def test_the_preempted_record_is_the_last_and_the_previous_handler_is_put_back():
    before = signal.getsignal(signal.SIGTERM)
    model = toy.MLP()
    task = fs.TrainTask(apply=model.apply, optimizer=optax.sgd(0.1), loss=toy.mse, data=NoticeAt(13))
    loop = fs.TrainLoop(model.init, task, jax.random.key(0), n_steps=30, n_steps_per_checkpoint=10, stdout=False)
    records = list(loop)
    assert [record.preempted for record in records] == [False, True]
    last = records[-1]
    assert 13 <= last.step < 20 and last.n_completed_steps == last.step - 10
    assert last.grads is None and not last.final and records[0].grads is not None
    assert last.data_position["n_batches"] == last.step  # the batches drawn ahead are not counted
    assert loop.next_checkpoint() is None and loop.step == last.step
    assert signal.getsignal(signal.SIGTERM) is before
