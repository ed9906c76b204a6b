"""The compiled programs of one state: K steps a call equal K single steps, gradients, and FLOPs counted once."""

import jax
import numpy as np
from flaxstate_testing import programs
from flaxstate_testing.programs import X, Y

from flaxstate.run_record import fingerprints


def build(n_microbatches=1):
    _, program, state = programs.build(n_microbatches=n_microbatches)
    return program, state


def test_k_steps_in_one_call_equal_k_single_steps():
    program, state = build()
    rng_data = jax.random.key_data(jax.random.key(1))
    batch = ((X,), (Y,))
    leaves = jax.tree.leaves(jax.tree.map(np.array, state))
    for _ in range(3):
        leaves, _ = program.update(1)(leaves, batch, rng_data)
    stacked = ((np.stack([X] * 3),), (np.stack([Y] * 3),))
    once, losses = program.update(3)(jax.tree.leaves(jax.tree.map(np.array, state)), stacked, rng_data)
    assert np.shape(losses) == (3,)
    for a, b in zip(leaves, once, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6)
    assert program.update(3) is program.update(3)  # compiled once


def test_a_record_s_step_gives_its_gradients_and_the_flops_of_a_step_with_microbatches_count_every_microbatch():
    program, state = build()
    rng_data = jax.random.key_data(jax.random.key(1))
    # A record's one step returns the update's state bit for bit, its gradients and the new state's fingerprint.
    leaves = jax.tree.leaves(jax.tree.map(np.array, state))
    updated, losses = program.update(1)(jax.tree.leaves(jax.tree.map(np.array, state)), ((X,), (Y,)), rng_data)
    recorded, record_losses, grads, fingerprint = program.record_update(1)(leaves, ((X,), (Y,)), rng_data)
    for a, b in zip(updated, recorded, strict=True):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(losses, record_losses)
    assert jax.tree.structure(grads) == jax.tree.structure(state.params)
    assert fingerprints.text(fingerprint) == fingerprints.text(fingerprints.of_state(updated))
    flops = program.flops_per_step(((X,), (Y,)), rng_data)
    micro, _ = build(n_microbatches=4)
    micro_flops = micro.flops_per_step(((X,), (Y,)), rng_data)
    assert flops is not None and flops > 0
    assert micro_flops is not None and 0.8 * flops <= micro_flops <= 1.5 * flops  # the same work, not a quarter
