"""The fingerprints of a state and of the batches trained: equal for equal bits, different for one changed bit."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flaxstate_testing import toy

import flaxstate as fs
from flaxstate import fingerprints


def state(**changed):
    leaves = {
        "w": np.arange(24, dtype=np.float32).reshape(4, 6) / 7,
        "b": np.arange(6, dtype=np.float32) - 2.5,
        "half": np.linspace(-1, 1, 10).astype(jnp.bfloat16),
        "count": np.int32(7),
        "mask": np.array([True, False, True]),
        "small": np.arange(5, dtype=np.int8),
        "key": jax.random.key(3),
    }
    leaves.update(changed)
    return [jnp.asarray(leaf) if not isinstance(leaf, jax.Array) else leaf for leaf in leaves.values()]


def fingerprint(leaves):
    return fingerprints.text(fingerprints.of_state(leaves))


def test_a_state_s_fingerprint_is_its_bits_and_changes_with_any_element_of_any_dtype():
    base = fingerprint(state())
    assert len(base) == 16 and base == fingerprint(state())  # the same bits, the same digits
    w = np.arange(24, dtype=np.float32).reshape(4, 6) / 7
    one_ulp = w.copy()
    one_ulp[3, 5] = np.nextafter(one_ulp[3, 5], np.float32(10))
    swapped = w.copy()
    swapped[0, 1], swapped[0, 2] = w[0, 2], w[0, 1]  # the same values in other places
    changes = {
        "w": [one_ulp, swapped, w.reshape(6, 4)],
        "half": [np.linspace(-1, 1, 10).astype(jnp.bfloat16)[::-1]],
        "count": [np.int32(8)],
        "mask": [np.array([True, True, True])],
        "small": [np.arange(5, dtype=np.int8)[::-1]],
        "key": [jax.random.key(4)],
    }
    seen = {base}
    for name, values in changes.items():
        for value in values:
            changed = fingerprint(state(**{name: value}))
            assert changed not in seen, (name, value)
            seen.add(changed)


def test_the_leaves_order_counts_and_zeros_are_not_nothing():
    a, b = jnp.zeros(3), jnp.ones(3)
    assert fingerprint([a, b]) != fingerprint([b, a])
    assert fingerprint([jnp.zeros(3)]) != fingerprint([jnp.zeros(4)])


def test_a_batch_digest_follows_the_bytes_and_the_order_of_the_batches_whatever_their_stacking():
    def digest(*batches):
        each = fingerprints.BatchDigest()
        for batch in batches:
            each.add(batch)
        return each.take()

    x, y = np.arange(12, dtype=np.float32).reshape(3, 4), np.arange(3, dtype=np.int32)
    one, two = ((x,), (y,)), ((x + 1,), (y,))
    assert digest(one) == digest(((x.copy(),), (y.copy(),)))
    assert digest(one, two) != digest(two, one) != digest(one)
    stacked = ((np.stack([x, x + 1]),), (np.stack([y, y]),))  # K=2 in one dispatch: the same bytes, leaf by leaf
    assert digest(stacked) == digest(one, two)
    assert digest(((x.T,), (y,))) == digest(((np.ascontiguousarray(x.T),), (y,)))  # read in C order
    assert digest(((jnp.asarray(x),), (y,))) is None  # on the devices already: not read
    running = fingerprints.BatchDigest()
    running.add(one)
    assert running.take() == digest(one) and running.take() == digest()  # taken: it starts again


@pytest.mark.parametrize("indices", [[np.arange(4)], [np.arange(4), np.arange(4, 8)]])
def test_global_batches_are_fingerprinted_by_their_indices_in_order(indices):
    assert fingerprints.of_indices(indices) == fingerprints.of_indices([each.copy() for each in indices])
    assert fingerprints.of_indices(indices) != fingerprints.of_indices([each[::-1] for each in indices])
    assert fingerprints.of_digests([1, 2]) != fingerprints.of_digests([2, 1]) != fingerprints.of_digests([1])
    assert fingerprints.of_digests([1, None]) is None


def test_host_batches_of_bfloat16_train_and_are_digested_by_their_bits():
    # numpy exports no buffer format for ml_dtypes' types ("cannot include dtype 'E' in a buffer"): a digest
    # that asked for one stopped the loop at its first dispatch of such a batch.
    x, y = np.linspace(-1, 1, 12, dtype=np.float32).reshape(3, 4), np.zeros(3, np.float32)
    half = ((x.astype(jnp.bfloat16),), (y.astype(jnp.bfloat16),))
    digest = fingerprints.BatchDigest()
    digest.add(half)
    taken = digest.take()
    digest.add(((x,), (y,)))
    assert taken is not None and taken != digest.take()
    model = toy.MLP()
    data = [(bx.astype(jnp.bfloat16), by.astype(jnp.bfloat16)) for bx, by in toy.batches(4, 8)]
    task = fs.TrainTask(apply=model.apply, optimizer=optax.sgd(0.1), loss=toy.mse, data=data)
    loop = fs.TrainLoop(model.init, task, jax.random.key(0), n_steps=4, n_steps_per_checkpoint=2, stdout=False)
    records = list(loop)
    assert [record.step for record in records] == [2, 4]
    seen = [record.data_fingerprint for record in records]
    assert None not in seen and seen[0] != seen[1]
