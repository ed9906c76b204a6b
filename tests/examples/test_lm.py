import dataclasses

import numpy as np
from flaxstate_testing import examples

lm = examples.load("lm")


def test_the_text_ships_with_python_and_global_batches_of_its_windows_split_across_processes():
    tokens = lm.text()
    assert tokens.dtype == np.uint8 and len(tokens) > 100_000
    config = lm.Config(batch_size=4, seq_len=8)
    batches = lm.batches(tokens, config)
    whole = batches.batch(3)
    assert whole[0].shape == whole[1].shape == (4, 8) and whole[0].dtype == np.int32
    np.testing.assert_array_equal(whole[0][:, 1:], whole[1][:, :-1])  # targets: the next bytes
    starts = batches.indices(3)  # each row is the window of seq_len + 1 bytes at its index
    np.testing.assert_array_equal(whole[0], tokens[starts[:, None] + np.arange(8)])
    # Two processes read one half each of the same global batch.
    halves = [batches.indices(3, (index, 2)) for index in range(2)]
    np.testing.assert_array_equal(np.concatenate(halves), starts)
    train, held_out = lm.split(tokens)
    np.testing.assert_array_equal(np.concatenate([train, held_out]), tokens)  # the held-out end is never trained on
    assert 0.04 < len(held_out) / len(tokens) < 0.06


def test_in_bfloat16_the_activations_are_bfloat16_and_the_parameters_and_loss_stay_float32():
    import jax
    import jax.numpy as jnp

    config = lm.Config(embed=16, heads=2, head_dim=8, mlp=32, layers=1, seq_len=16, dtype="bfloat16")
    model = lm.Transformer(config)
    tokens = jnp.asarray(lm.windows(lm.text()[:64], config)[0][:2])
    variables = model.init(jax.random.key(0), tokens)
    assert {leaf.dtype for leaf in jax.tree.leaves(variables)} == {jnp.dtype("float32")}
    logits = model.apply(variables, tokens)
    assert logits.dtype == jnp.bfloat16 and logits.shape == (2, 16, lm.VOCAB)
    full = lm.Transformer(dataclasses.replace(config, dtype="float32")).apply(variables, tokens)
    assert full.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(logits, np.float32), np.asarray(full), atol=0.1)  # the same model
    assert lm.loss(logits, tokens).dtype == jnp.float32
