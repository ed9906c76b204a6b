"""The fingerprints of a state and of the batches trained: equal for equal bits, different for one changed bit."""

import zlib

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flaxstate_testing import toy
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import flaxstate as fs
from flaxstate.run_record import fingerprints


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


def reference(leaves):
    """The fingerprint's definition (the module's docstring), leaf by leaf in numpy."""
    first = second = np.uint32(0)
    offset = 0
    for leaf in leaves:
        layout = np.uint32(zlib.crc32(f"{leaf.shape}{leaf.dtype}".encode()))
        if jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):
            leaf = jax.random.key_data(leaf)
        values = np.asarray(leaf).reshape(-1)
        if values.dtype == np.bool_:
            words = values.astype(np.uint32)
        else:
            words = values.view({1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint32}[values.itemsize])
            words = words.astype(np.uint32)
        place = ((np.arange(words.size, dtype=np.uint64) + offset) % 2**32).astype(np.uint32)
        with np.errstate(over="ignore"):
            first += np.sum(words * (place * np.uint32(2) + np.uint32(1)), dtype=np.uint32)
            mixed = (words ^ ((place + layout) * fingerprints._ODD)) * fingerprints._MIX
            second += np.sum(mixed ^ (mixed >> np.uint32(15)), dtype=np.uint32)
        offset += words.size
    return f"{int(first):08x}{int(second):08x}"


def test_a_state_s_fingerprint_is_the_definition_s_leaf_by_leaf_sums():
    # The program concatenates leaves of up to `_SMALL` elements by dtype, in groups of up to `_GROUP` words,
    # and reduces each larger leaf alone: every way must give the leaf-by-leaf sums.
    rng = np.random.default_rng(0)
    many = [jnp.asarray(rng.random(4000, dtype=np.float32)) for _ in range(20)]  # 80,000 words: two groups
    leaves = (
        state()
        + many
        + [
            jnp.asarray(rng.random((70, 90), dtype=np.float32)),  # 6,300 elements
            jnp.asarray(rng.integers(-9, 9, 5000, dtype=np.int8)),
            jnp.zeros((0, 3)),
            jax.random.split(jax.random.key(1), 3),
            jnp.asarray(rng.random(7, dtype=np.float32)).astype(jnp.bfloat16),
        ]
    )
    assert max(leaf.size for leaf in leaves) > fingerprints._SMALL and sum(x.size for x in many) > fingerprints._GROUP
    assert fingerprint(leaves) == reference(leaves)
    assert fingerprint(leaves[::-1]) == reference(leaves[::-1])


@pytest.mark.parametrize("axis_type", ["Auto", "Explicit"])
def test_a_state_on_a_mesh_of_any_axis_type_has_the_definition_s_fingerprint(axis_type):
    # On `jax.make_mesh`'s Explicit axes (its default) an array's type carries its sharding, and flattening it
    # raised JAX's ShardingTypeError ("This reshape is not supported ... float32[32,4@fsdp]").
    mesh = jax.make_mesh((1,), ("fsdp",), axis_types=(getattr(jax.sharding.AxisType, axis_type),))
    rng = np.random.default_rng(2)
    placed = [
        (rng.random((32, 4), dtype=np.float32), P(None, "fsdp")),  # small: concatenated with the others
        (rng.random((300, 40), dtype=np.float32), P("fsdp", None)),  # large: summed alone
        (rng.integers(-9, 9, (64, 8, 16)).astype(jnp.bfloat16), P(None, "fsdp", None)),
        (rng.integers(0, 2**31, (70, 80), dtype=np.int32), P("fsdp")),
        (np.float32(3.0), P()),
    ]
    leaves = [jax.device_put(value, NamedSharding(mesh, spec)) for value, spec in placed]
    keys = jax.device_put(jax.random.split(jax.random.key(1), 8), NamedSharding(mesh, P("fsdp")))
    leaves.append(keys)
    assert str(jax.typeof(leaves[0])) == ("float32[32,4@fsdp]" if axis_type == "Explicit" else "float32[32,4]")
    assert fingerprint(leaves) == reference(leaves)
    assert fingerprint(leaves) == fingerprint([jnp.asarray(np.asarray(x)) for x in leaves[:-1]] + [keys])


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


def test_a_large_leaf_is_summed_by_its_places_and_a_stacked_dispatch_digests_as_its_batches_one_by_one():
    rng = np.random.default_rng(1)
    x = rng.random((2, 320, 1024), dtype=np.float32)  # 1.25 MiB a batch: above `_LARGE`, over two `_CHUNK`s
    y = rng.integers(0, 9, (2, 5001), dtype=np.int8)  # 5,001 bytes a batch: not a multiple of 8, CRC'd
    assert x[0].nbytes >= fingerprints._LARGE and x[0].size // 2 > fingerprints._CHUNK

    def digest(*dispatches):
        each = fingerprints.BatchDigest()
        for batch, n in dispatches:
            each.add(batch, n)
        return each.take()

    one, two = ((x[0],), (y[0],)), ((x[1],), (y[1],))
    both = digest((one, 1), (two, 1))
    assert digest((((x,), (y,)), 2)) == both  # K=2 stacked: the same as one by one
    assert digest((two, 1), (one, 1)) != both
    changed = x[1].copy()
    changed.reshape(-1)[-1] = np.nextafter(changed.reshape(-1)[-1], np.float32(2))  # its last bit, in the 2nd chunk
    moved = x[1].copy()
    moved[[0, 1]] = moved[[1, 0]]  # the same words in other places
    assert len({both, digest((one, 1), (((changed,), (y[1],)), 1)), digest((one, 1), (((moved,), (y[1],)), 1))}) == 3
    half = x[0].astype(jnp.bfloat16)  # a type numpy gives no buffer format: read as words all the same
    assert digest((((half,), (y[0],)), 1)) != digest((((half + 1,), (y[0],)), 1))
    # The weighted sum chunk by chunk is the sum over the whole leaf.
    words = x[0].reshape(-1).view(np.uint64)
    golden = fingerprints._GOLDEN
    expected = sum(int(w) * (((2 * i + 1) * golden) % 2**64) for i, w in enumerate(words.tolist())) % 2**64
    assert fingerprints._weighted(words) == expected


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


def test_a_record_s_data_fingerprint_reads_the_first_batch_of_its_span_for_any_k():
    # A resume starts at a record, so the first batch of each span is where a wrong data position shows; it is the
    # one batch a record that is read (the steps between records read none). K=2 stacks two batches a dispatch:
    # the record reads the first row, as K=1 reads the first dispatch.
    model = toy.MLP()
    batches = [(np.asarray(x), np.asarray(y)) for x, y in toy.batches(8, 8)]

    def records(data, k=1):
        task = fs.TrainTask(apply=model.apply, optimizer=optax.sgd(0.1), loss=toy.mse, data=data)
        loop = fs.TrainLoop(
            model.init,
            task,
            jax.random.key(0),
            n_steps=8,
            n_steps_per_checkpoint=4,
            n_steps_per_dispatch=k,
            stdout=False,
        )
        return [(record.data_fingerprint, record.state_fingerprint) for record in loop]

    def changed(index):
        x, y = batches[index]
        return [*batches[:index], (x + 1, y), *batches[index + 1 :]]

    straight = records(batches)
    assert records(batches, k=2) == straight and straight[0][0] != straight[1][0]
    first_of_second = records(changed(4))  # step 5: the second span's first batch
    assert first_of_second[0] == straight[0] and first_of_second[1][0] != straight[1][0]
    inside = records(changed(2))  # step 3: inside the first span, not read; the state shows it
    assert inside[0][0] == straight[0][0] and inside[0][1] != straight[0][1]
    x, y = batches[0]
    stacked = ((np.stack([x, x + 1]),), (np.stack([y, y]),))
    assert fingerprints.first_of(stacked, 2)[0][0].base is not None  # a view: nothing copied
    digest = fingerprints.BatchDigest()
    digest.add(fingerprints.first_of(stacked, 2))
    alone = fingerprints.BatchDigest()
    alone.add(((x,), (y,)))
    assert digest.take() == alone.take()
