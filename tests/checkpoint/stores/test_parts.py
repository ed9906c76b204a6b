"""The geometry of array parts on one CPU device: what a process holds, what a template needs, and what covers it.

Sharded parts over two processes are checked where they are written and
read: tests/checkpoint/stores/test_local.py and tests/checkpoint/tiers/.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flaxstate.checkpoint.stores import parts


def test_a_host_array_is_one_part_the_whole_and_a_device_array_its_one_shard():
    host = np.zeros((4, 3), np.float32)
    device = jnp.ones((2, 5), jnp.bfloat16)
    assert parts.held_parts({"a": host, "b": device}) == {"a": [[[0, 4], [0, 3]]], "b": [[[0, 2], [0, 5]]]}
    shape, dtype, held = parts.host_parts(device)
    assert shape == (2, 5) and dtype == jnp.bfloat16 and len(held) == 1
    np.testing.assert_array_equal(held[0][1], np.ones((2, 5), jnp.bfloat16))


@pytest.mark.parametrize("block_bytes", [1, 24, 100, 4096])
def test_a_part_on_its_device_reads_any_range_of_its_bytes_a_block_at_a_time(block_bytes):
    # 7 x 5 float32 (140 bytes): blocks of one element, of 6, of 25 (the last one clamped), and the whole.
    device = jnp.arange(35, dtype=jnp.float32).reshape(7, 5) * 1.5
    expected = np.asarray(device).tobytes()
    ((_, part),) = parts.host_parts(device, block_bytes)[2]
    assert isinstance(part, parts.DevicePart) and part.nbytes == len(expected) == 140
    assert part.block_bytes == min(max(block_bytes // 4, 1), 35) * 4
    for begin, end in [(0, 140), (0, 1), (3, 9), (22, 97), (139, 140), (50, 51), (1, 139)]:
        assert part.read(begin, end).tobytes() == expected[begin:end], (begin, end)
    assert parts.host_parts(jnp.float32(2.5), block_bytes)[2][0][1].read(0, 4).tobytes() == np.float32(2.5).tobytes()


def test_distinct_keeps_the_first_item_of_each_place_in_one_shared_order():
    indexed = [([[2, 4]], "second"), ([[0, 2]], "first"), ([[2, 4]], "again")]
    assert parts.distinct(indexed) == [([[0, 2]], "first"), ([[2, 4]], "second")]
    assert parts.index_of((slice(None), slice(2, 4)), (3, 8)) == [[0, 3], [2, 4]]
    assert parts.contains([[0, 4], [0, 8]], [[2, 4], [0, 8]]) and not parts.contains([[0, 2]], [[1, 3]])


def test_covers_names_what_a_step_lacks_for_the_template():
    template = {"params": {"w": jax.ShapeDtypeStruct((4, 2), jnp.float32)}, "state": {"mu": np.zeros(3)}}
    whole = {"shape": [4, 2], "dtype": "float32", "parts": [{"index": [[0, 4], [0, 2]]}]}
    meta = {"processes": 1, "process_index": 0, "arrays": {"params/w": whole}}
    assert parts.covers(meta, template, with_optimizer=False) is None
    assert parts.covers(meta, template, with_optimizer=True) == "it holds no array at state/mu"
    half = dict(whole, parts=[{"index": [[0, 2], [0, 2]]}])
    assert "it holds no part [[0, 4], [0, 2]] of params/w" in parts.covers(
        dict(meta, arrays={"params/w": half}), template, with_optimizer=False
    )
    wider = dict(whole, shape=[4, 3])
    assert parts.covers(dict(meta, arrays={"params/w": wider}), template, False) == (
        "params/w is float32[4, 3] there, the model has float32[4, 2]"
    )
    moved = dict(meta, processes=2, process_index=1)
    assert parts.covers(moved, template, False) == "it was saved by process 1 of 2, this is process 0 of 1"
    assert parts.needed_parts(template, with_optimizer=True) == {"params/w": [[[0, 4], [0, 2]]], "state/mu": [[[0, 3]]]}
