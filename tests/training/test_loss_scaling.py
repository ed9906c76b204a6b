"""float16 compute with dynamic loss scaling: overflowing steps skipped, the scale in the state."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax.training.dynamic_scale import DynamicScale
from flaxstate_testing import loops, toy

import flaxstate as fs
from flaxstate.training import scaling


class Float16MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.tanh(nn.Dense(32, dtype=jnp.float16, param_dtype=jnp.float32)(x))
        return nn.Dense(1, dtype=jnp.float16, param_dtype=jnp.float32)(x)[:, 0]


MODEL = Float16MLP()
START = 2.0**24  # the scaled loss's gradient overflows float16 (max 65504) until the scale has come down


def make_loop(data=None, n_steps=12, every=4, init=MODEL.init, loss_scale=None, **kwargs):
    return loops.make_loop(
        toy.batches(1, 16) * 40 if data is None else data,
        model=MODEL,
        init=init,
        loss_scale=loss_scale or DynamicScale(scale=START, growth_interval=4),
        n_steps=n_steps,
        every=every,
        **kwargs,
    )


def leaves(tree):
    return [np.asarray(leaf) for leaf in jax.tree.leaves(tree)]


def test_overflowing_steps_are_skipped_and_the_scale_comes_down_then_training_goes_on():
    loop = make_loop(n_steps=40)
    initial = loop.state
    records = list(loop)
    first = records[0]
    # 2**24 to 2**21: the first record's four steps all overflow; nothing moved but the step.
    assert first.metrics["train"] == {"loss_scale": START / 16, "skipped_steps": 4}
    for a, b in zip(
        leaves((first.state.params, first.state.param_states)),
        leaves((initial.params, initial.param_states)),
        strict=True,
    ):
        np.testing.assert_array_equal(a, b)
    last = records[-1]
    scales = [record.metrics["train"]["loss_scale"] for record in records]
    assert any(later > earlier for earlier, later in zip(scales[:-1], scales[1:], strict=True))  # grows again
    assert last.loss < 0.5 * records[0].loss
    assert {leaf.dtype for leaf in leaves((last.state.params, last.grads))} == {np.dtype(np.float32)}


def test_a_skipped_step_leaves_parameters_and_optimizer_state_as_they_were():
    loop = make_loop(n_steps=1, every=1)
    before = loop.state
    record = loop.next_checkpoint()
    assert record.metrics["train"] == {"loss_scale": START / 2, "skipped_steps": 1}
    assert record.step == 1 and int(record.state.step) == 1
    assert not all(np.isfinite(leaf).all() for leaf in leaves(record.grads))
    for a, b in zip(
        leaves((record.state.params, record.state.param_states)),
        leaves((before.params, before.param_states)),
        strict=True,
    ):
        np.testing.assert_array_equal(a, b)


def test_the_scale_is_saved_and_a_resumed_run_ends_bit_for_bit_as_an_uninterrupted_one(tmp_path):
    def run(directory, n_steps):
        loop = make_loop(n_steps=n_steps, every=5, init=fs.CheckpointFileReader(directory, target=MODEL.init))
        with fs.CheckpointFileWriter(directory) as writer:
            for record in loop:
                writer(record)
        return record

    straight = run(tmp_path / "straight", 20)
    run(tmp_path / "resumed", 10)
    resumed = run(tmp_path / "resumed", 20)
    assert resumed.metrics == straight.metrics and straight.metrics["train"]["skipped_steps"] > 0
    for a, b in zip(leaves(resumed.state), leaves(straight.state), strict=True):
        np.testing.assert_array_equal(a, b)
    saved = fs.CheckpointFileReader(tmp_path / "resumed").read(None).state
    assert float(saved["state"]["loss_scale"]["dynamic"]["scale"]) == straight.metrics["train"]["loss_scale"]
    inference = fs.InferenceState.create(MODEL.init(jax.random.key(0), np.ones((1, 4), np.float32)))
    restored = inference.restore_state(saved)  # the scale is training state: ignored, as the optimizer's
    for a, b in zip(leaves(restored.params), leaves(straight.state.params), strict=True):
        np.testing.assert_array_equal(a, b)


def nan_batches(n_good, n_nan, n_after):
    good = toy.batches(1, 16)
    x, y = good[0]
    return good * n_good + [(x, np.full_like(y, np.nan))] * n_nan + good * n_after


def test_a_few_non_finite_losses_are_skipped_but_too_many_in_a_row_raise():
    patience = scaling.MAX_NONFINITE_LOSSES
    data = nan_batches(4, patience, 6)
    records = list(make_loop(data=data, n_steps=4 + patience + 6, every=2, loss_scale=DynamicScale()))
    assert records[-1].metrics["train"]["skipped_steps"] >= patience
    assert np.isfinite(records[-1].loss)

    loop = make_loop(data=nan_batches(4, patience + 1, 5), n_steps=4 + patience + 6, every=2, loss_scale=DynamicScale())
    with pytest.raises(
        FloatingPointError, match=rf"non-finite .* for {patience + 1} steps in a row, up to step {4 + patience + 1}"
    ):
        list(loop)


def test_with_a_rollback_loss_scaling_skips_its_overflows_first_and_a_longer_run_rolls_back():
    patience = scaling.MAX_NONFINITE_LOSSES
    skipped = list(
        make_loop(data=nan_batches(4, patience, 12), n_steps=4 + patience + 6, every=2, rollback=fs.Rollback())
    )
    assert skipped[-1].rollbacks == () and skipped[-1].metrics["train"]["skipped_steps"] >= patience
    # One more bad loss than the scale tolerates: the run goes back to the last record before it (step 4) and
    # skips through the step that went past the patience.
    at = 4 + patience + 1
    rolled = list(make_loop(data=nan_batches(4, patience + 1, 30), n_steps=at + 6, every=2, rollback=fs.Rollback()))
    assert [(entry["at_step"], entry["to_step"]) for entry in rolled[-1].rollbacks] == [(at, (at - 1) // 2 * 2)]
    assert np.isfinite(rolled[-1].loss)
