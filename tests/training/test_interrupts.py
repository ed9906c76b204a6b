"""After an exception or a Ctrl-C the loop goes on where it stood: no state, step, record or batch lost."""

import signal

import jax
import numpy as np
import pytest
from flaxstate_testing import loops, toy

from flaxstate.training.interrupts import Signals

MODEL = toy.BatchNormNet()
BATCHES = toy.batches(40, 8, seed=1)


class FailingOnce:
    """A re-iterable whose generator raises once, at batch `at`, which finishes that generator."""

    def __init__(self, at):
        self.at, self.error, self.passes = at, OSError("the network share went away"), 0

    def __iter__(self):
        self.passes += 1
        for index, batch in enumerate(BATCHES):
            if index == self.at and self.error is not None:
                error, self.error = self.error, None
                raise error
            yield batch


class FlakyIterator:
    """An iterator object (not a generator) that raises once and then goes on with the next batch."""

    def __init__(self, at):
        self.at, self.index, self.failed = at, 0, False

    def __iter__(self):
        return self

    def __next__(self):
        if self.index == self.at and not self.failed:
            self.failed = True
            raise OSError("a read timed out")
        self.index += 1
        return BATCHES[self.index - 1]


def make_loop(data, per_dispatch=1, loss=toy.mse):
    return loops.make_loop(data, model=MODEL, loss=loss, n_steps=30, every=10, per_dispatch=per_dispatch)


def train_through_errors(loop, errors, records=None):
    """Iterates the loop again after each of the `errors`, as a notebook user would; returns every record."""
    records = [] if records is None else records
    while True:
        try:
            for record in loop:
                records.append(record)
            return records
        except errors:
            continue


def assert_same_run(records, loop, per_dispatch):
    expected_loop = make_loop(BATCHES, per_dispatch)
    expected = list(expected_loop)
    assert [r.step for r in records] == [r.step for r in expected]
    assert [r.n_completed_steps for r in records] == [r.n_completed_steps for r in expected]
    assert [r.loss for r in records] == [r.loss for r in expected]
    assert [r.data_position for r in records] == [r.data_position for r in expected]
    for got, want in zip(jax.tree.leaves(loop.state), jax.tree.leaves(expected_loop.state), strict=True):
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("per_dispatch", [1, 5])
def test_an_error_from_a_generator_is_raised_and_the_loop_goes_on_with_the_data_re_created(per_dispatch, caplog):
    data = FailingOnce(at=13)
    loop = make_loop(data, per_dispatch)
    records = []
    with pytest.raises(OSError, match="network share"):
        for record in loop:
            records.append(record)
    assert loop.step in range(8, 14)  # the batches drawn ahead are kept, not trained
    records = train_through_errors(loop, (), records)
    assert "re-created it and moved past the 13 batches drawn" in caplog.text
    assert_same_run(records, loop, per_dispatch)


def test_an_iterator_that_raises_once_goes_on_without_being_re_created():
    data = FlakyIterator(at=17)
    loop = make_loop(data, per_dispatch=5)
    records = train_through_errors(loop, OSError)
    assert data.failed
    assert_same_run(records, loop, per_dispatch=5)


def test_a_one_shot_generator_finished_by_an_error_is_a_clear_error():
    def generator():
        yield from BATCHES[:5]
        raise OSError("the stream broke")

    loop = make_loop(generator())
    with pytest.raises(OSError, match="stream broke"):
        loop.next_checkpoint()
    with pytest.raises(ValueError, match=r"ended right after it raised OSError\(the stream broke\) .* re-iterable"):
        loop.next_checkpoint()
    assert loop.step == 4  # the state stays at the last completed step, and readable
    assert int(loop.state.step) == 4


def test_an_error_from_the_model_leaves_the_loop_usable():
    calls = {"n": 0}

    def loss(outputs, targets):
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("a bug in the loss, fixed after a look in the notebook")
        return toy.mse(outputs, targets)

    loop = make_loop(BATCHES, loss=loss)
    with pytest.raises(RuntimeError, match="bug in the loss"):
        loop.next_checkpoint()
    assert loop.step == 0
    records = train_through_errors(loop, RuntimeError)
    assert_same_run(records, loop, per_dispatch=1)


def test_next_step_after_an_interrupted_dispatch_of_several_steps_takes_the_kept_batches_in_order():
    data = FlakyIterator(at=12)
    loop = make_loop(data, per_dispatch=5)
    with pytest.raises(OSError):
        for _ in loop:
            pass
    step = loop.step
    record = loop.next_step()
    assert record.step == step + 1 and record.data_position["n_batches"] == step + 1
    records = train_through_errors(loop, OSError)
    assert records[-1].step == 30
    fresh = make_loop(BATCHES, per_dispatch=1)
    fresh_records = list(fresh)
    assert records[-1].data_position == fresh_records[-1].data_position


@pytest.fixture
def python_sigint():
    """Python's own SIGINT handler, as in a terminal (a shell that starts pytest in the background ignores SIGINT)."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


def test_handlers_are_put_back_and_a_sigint_noted_while_training_is_raised_at_the_end_of_the_block(python_sigint):
    before_int, before_term = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    signals = Signals(handle_preemption=True)
    with pytest.raises(KeyboardInterrupt):
        with signals.installed(interrupts=True):
            assert getattr(signal.getsignal(signal.SIGINT), "__self__", None) is signals  # its own handler
            assert getattr(signal.getsignal(signal.SIGTERM), "__self__", None) is signals
            signal.raise_signal(signal.SIGINT)  # noted, not raised here
            signal.raise_signal(signal.SIGTERM)
            assert signals.interrupted and signals.preempted
            assert signals.take_preemption()  # acted on (else it is sent again when the handler is put back)
    assert signal.getsignal(signal.SIGINT) is before_int
    assert signal.getsignal(signal.SIGTERM) is before_term
    assert not signals.interrupted and signals.preempted  # a preemption notice stays


def test_handle_preemption_false_and_an_ignored_sigint_are_left_alone():
    signals = Signals(handle_preemption=False)
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        with signals.installed(interrupts=True):
            assert signal.getsignal(signal.SIGINT) == signal.SIG_IGN
            assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL
    finally:
        signal.signal(signal.SIGINT, previous)
