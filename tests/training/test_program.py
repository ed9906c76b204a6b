"""The compiled programs of one state: K steps a call equal K single steps, gradients, and FLOPs counted once."""

import jax
import numpy as np
import pytest
from flaxstate_testing import programs
from flaxstate_testing.programs import X, Y

from flaxstate.run_record import fingerprints
from flaxstate.training import program as program_module


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


BACKEND_COMPILES: list[float] = []
"""XLA's compiles in this process, from JAX's own duration event (`backend_compiles`)."""


def backend_compiles() -> int:
    if not BACKEND_COMPILES:
        BACKEND_COMPILES.append(0.0)
        jax.monitoring.register_event_duration_secs_listener(
            lambda event, seconds, **_: (
                BACKEND_COMPILES.append(seconds) if event == "/jax/core/compile/backend_compile_duration" else None
            )
        )
    return len(BACKEND_COMPILES) - 1


def test_a_segment_of_k_steps_counts_xla_s_flops_from_its_own_program_unless_xla_wrote_its_loop_out(monkeypatch):
    # At K > 1 XLA's count of a step comes from a program the segment runs, whose steps' loop XLA counts once:
    # no one-step program is compiled for it. Where the compiled program does not show that loop (XLA unrolled
    # it, or names no trips), the one-step update is compiled for the count, as before.
    rng_data = jax.random.key_data(jax.random.key(1))
    batch = ((X,), (Y,))
    segment = ["update of 2 steps", "update of 2 steps, gradients, fingerprinted"]  # what [2, 2] dispatches
    for n_microbatches in (1, 4):
        one_step, _ = build(n_microbatches)
        counted = one_step.xla_flops_per_step(batch, rng_data)  # compiles the one-step update
        from_steps, _ = build(n_microbatches)
        before = backend_compiles()
        from_steps.compile_ahead(batch, rng_data, [2, 2])
        assert backend_compiles() - before == 2, "a program was compiled that the segment does not run"
        # Without microbatches no one-step program is even made; with them it is lowered for their loop factor.
        assert set(from_steps.made()) - {"update of 1 steps"} == set(segment)
        assert n_microbatches > 1 or "update of 1 steps" not in from_steps.made()
        # The steps' loop adds its own counter (385 FLOPs against 383 for this layer of 8 parameters; an MLP's
        # counts were equal, 37,500,616 both).
        assert counted is not None and from_steps.xla_flops_per_step(batch, rng_data) == pytest.approx(counted, 0.02)
        with monkeypatch.context() as patched:
            patched.setattr(program_module, "TRIPS", "no loop is named so")
            written_out, _ = build(n_microbatches)
            before = backend_compiles()
            written_out.compile_ahead(batch, rng_data, [2, 2])
            assert backend_compiles() - before == 3  # and the one-step update's, for the count
            assert written_out.xla_flops_per_step(batch, rng_data) == counted
