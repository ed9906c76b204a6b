import jax.numpy as jnp
import numpy as np
import pytest

from flaxstate.training.nonfinite import CHUNK, LossWatch


def watch_of(start_step, losses):
    watch = LossWatch(start_step)
    for loss in losses:
        loss = jnp.asarray(loss, jnp.float32)
        watch.add(loss, loss.size)
    return watch.result()


def test_finite_losses_give_no_step_and_the_last_loss():
    assert watch_of(10, [0.5 * i for i in range(CHUNK + 5)]) == (None, 0.5 * (CHUNK + 4))


@pytest.mark.parametrize("bad", [0, 3, CHUNK - 1, CHUNK, 2 * CHUNK + 1])
def test_the_first_non_finite_step_is_named_across_chunks(bad):
    losses = [1.0] * (2 * CHUNK + 7)
    losses[bad] = np.nan
    losses[-1] = np.inf  # a later one does not hide the first
    first, last = watch_of(100, losses)
    assert first == 100 + bad + 1
    assert last == np.inf


def test_several_steps_a_dispatch_then_single_steps():
    # Three dispatches of 4 steps (steps 1-12), then two single steps (13, 14).
    losses = [[1.0, 1.0, 1.0, 1.0], [1.0, 1.0, 1.0, 1.0], [1.0, 1.0, 1.0, 2.0], 3.0, np.inf]
    assert watch_of(0, losses) == (14, np.inf)
    losses = [[1.0, 1.0, 1.0, 1.0], [1.0, np.nan, 1.0, 1.0], 3.0]
    assert watch_of(20, losses) == (26, 3.0)


def test_no_losses_give_no_step_and_no_loss():
    assert LossWatch(5).result() == (None, None)
