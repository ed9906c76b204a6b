"""Compile time from JAX's own duration events: a new compile adds to the process's total, a cached call does not."""

import jax
import jax.numpy as jnp

from flaxstate.training import compiling


def test_a_fresh_compile_adds_to_the_total_and_a_cached_call_adds_nothing():
    before = compiling.seconds()

    @jax.jit
    def fresh(x):
        return jnp.sin(x) * 3.0 + jnp.cos(x) ** 2

    fresh(jnp.ones(17)).block_until_ready()
    compiled = compiling.seconds()
    assert compiled > before
    fresh(jnp.ones(17)).block_until_ready()
    assert compiling.seconds() == compiled
