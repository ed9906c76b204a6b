"""Dynamic loss scaling for float16 training: the scale, kept in the state, and its rule.

A float16 backward pass flushes small gradients to zero. Multiplying the loss
by a large scale before the backward pass (and the gradients by its inverse
after) keeps them representable; a step whose gradients overflow to inf or
nan is skipped (parameters, optimizer state and mutable collections
unchanged) and the scale lowered. The scale follows flax's
`flax.training.dynamic_scale.DynamicScale` (its factors, interval and
minimum; its `value_and_grad` applies the rule to one gradient computation,
where flaxstate applies it once per step, after accumulating microbatches
and averaging over devices).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import struct
from flax.training.dynamic_scale import DynamicScale

MAX_NONFINITE_LOSSES = 10
"""With loss scaling, this many consecutive steps whose loss itself is inf or nan (which no scale mends:
the forward pass overflowed) are skipped; one more raises `FloatingPointError`."""


class LossScale(struct.PyTreeNode):
    """The state's part for dynamic loss scaling: flax's `DynamicScale` and the number of steps skipped."""

    dynamic: DynamicScale
    n_skipped: jax.Array

    @classmethod
    def create(cls, dynamic: DynamicScale) -> LossScale:
        """Starts at `dynamic`'s scale, with no step skipped."""
        return cls(
            dynamic=dynamic.replace(
                scale=jnp.asarray(dynamic.scale, jnp.float32), fin_steps=jnp.asarray(dynamic.fin_steps, jnp.int32)
            ),
            n_skipped=jnp.zeros((), jnp.int32),
        )

    def after(self, finite: jax.Array) -> LossScale:
        """The scale after a step whose gradients were `finite` (or not: skipped, counted, the scale lowered)."""
        ds = self.dynamic
        grow = ds.fin_steps == ds.growth_interval
        grown = jnp.where(grow & finite, jnp.minimum(ds.scale * ds.growth_factor, jnp.finfo(jnp.float32).max), ds.scale)
        lowered: Any = ds.scale * ds.backoff_factor
        if ds.minimum_scale is not None:
            lowered = jnp.maximum(lowered, ds.minimum_scale)
        return self.replace(
            dynamic=ds.replace(
                scale=jnp.where(finite, grown, lowered).astype(jnp.float32),
                fin_steps=jnp.where(grow | ~finite, 0, ds.fin_steps + 1).astype(jnp.int32),
            ),
            n_skipped=self.n_skipped + (~finite).astype(jnp.int32),
        )
