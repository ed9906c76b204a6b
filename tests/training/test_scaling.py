"""Dynamic loss scaling's state: the scale grows after finite steps, backs off and counts a skipped step."""

import jax.numpy as jnp
import numpy as np
from flax.training.dynamic_scale import DynamicScale

from flaxstate.training.scaling import LossScale


def test_the_scale_grows_after_growth_interval_finite_steps_and_backs_off_on_a_non_finite_one():
    scale = LossScale.create(DynamicScale(growth_factor=2.0, backoff_factor=0.5, growth_interval=2, scale=8.0))
    assert float(scale.dynamic.scale) == 8.0 and int(scale.n_skipped) == 0
    finite, overflow = jnp.asarray(True), jnp.asarray(False)
    scale = scale.after(finite).after(finite)
    assert float(scale.dynamic.scale) == 8.0 and int(scale.dynamic.fin_steps) == 2
    scale = scale.after(finite)  # the growth interval's finite steps done: doubled, the count restarts
    assert float(scale.dynamic.scale) == 16.0 and int(scale.dynamic.fin_steps) == 0
    scale = scale.after(overflow)
    assert float(scale.dynamic.scale) == 8.0 and int(scale.n_skipped) == 1 and int(scale.dynamic.fin_steps) == 0
    assert scale.dynamic.scale.dtype == np.float32 and scale.dynamic.fin_steps.dtype == np.int32


def test_the_scale_never_falls_below_its_minimum_nor_grows_past_float32():
    low = LossScale.create(DynamicScale(backoff_factor=0.5, scale=2.0, minimum_scale=1.5))
    assert float(low.after(jnp.asarray(False)).dynamic.scale) == 1.5
    huge = LossScale.create(DynamicScale(growth_factor=4.0, growth_interval=0, scale=float(np.finfo(np.float32).max)))
    assert np.isfinite(float(huge.after(jnp.asarray(True)).dynamic.scale))
