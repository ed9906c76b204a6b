import jax.numpy as jnp
import numpy as np
import pytest

from flaxstate.training import nonfinite
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


def test_a_window_s_median_by_counting_is_numpy_s_for_any_window_and_ties():
    rows = np.random.default_rng(0).normal(size=(64, 16)).astype(np.float32)
    rows[3, :5] = 1.0  # ties
    rows[4] = 2.0
    for width in (1, 2, 5, 16):
        part = jnp.asarray(rows[:, :width])
        lower, upper = nonfinite._order_statistics(part, ((width - 1) // 2, width // 2))
        np.testing.assert_allclose((np.asarray(lower) + np.asarray(upper)) / 2, np.median(rows[:, :width], axis=1))


def test_a_spike_is_a_loss_above_the_factor_times_the_window_s_median_once_the_window_is_full():
    history = nonfinite.empty_history(4)
    losses = [1.0, 1.1, 0.9, 1.0, 3.5, 1.0, 1.2, 5.0]  # 3.5 is below 4 x 1.0; 5.0 is above 4 x 1.1
    watch = LossWatch(10, spike=(4.0, history))
    for loss in losses:
        watch.add(jnp.asarray(loss, jnp.float32), 1)
    bad, last = watch.first_bad()
    assert bad == nonfinite.BadStep(18, "spike") and last == 5.0
    early = LossWatch(0, spike=(4.0, nonfinite.empty_history(4)))
    for loss in [1.0, 100.0, 1.0, 1.0]:  # within the first window: not judged
        early.add(jnp.asarray(loss, jnp.float32), 1)
    assert early.first_bad() == (None, 1.0)
