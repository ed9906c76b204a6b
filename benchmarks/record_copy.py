"""What a record's host copy of the state costs, by the ways of making it: flaxstate's and the alternatives.

One process, one device; each way copies the same state (adam over an MLP) to host memory, from new arrays that
are ready, in alternating rounds; the table gives the median milliseconds of a copy.

    python benchmarks/record_copy.py [--rounds 20] [--widths 64,2048]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax

from flaxstate.training import copies


def state_leaves(width: int) -> list[jax.Array]:
    """The leaves of an MLP's parameters (784-width-width-10) and their adam state, on the device."""
    sizes = [(784, width), (width,), (width, width), (width,), (width, 10), (10,)]
    params = [jnp.full(shape, 0.5, jnp.float32) for shape in sizes]
    return jax.tree.leaves((params, optax.adam(1e-3).init(params), jnp.zeros((), jnp.int32)))


@jax.jit
def _concatenate(leaves: list[jax.Array]) -> jax.Array:
    return jnp.concatenate([x.ravel().astype(jnp.float32) for x in leaves])


def concatenated(leaves: list[jax.Array]) -> list[np.ndarray]:
    """One device buffer of every leaf raveled as float32 (one transfer), split again on the host."""
    flat = _concatenate(leaves)
    host = np.asarray(flat)
    out, start = [], 0
    for leaf in leaves:
        out.append(host[start : start + leaf.size].reshape(leaf.shape))
        start += leaf.size
    return out


def measure(width: int, rounds: int, mesh: jax.sharding.Mesh) -> tuple[list[jax.Array], dict[str, list[float]]]:
    """Milliseconds of each way's copy of one state, a value a round (the order rotates every round)."""
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    base = [jax.device_put(leaf, sharding) for leaf in state_leaves(width)]
    treedef = jax.tree.structure(base)
    copier = copies.record_copier(mesh, sharding, "host")
    ways: dict[str, Callable[[list[jax.Array]], object]] = {
        "flaxstate's record copier": lambda leaves: copier(leaves, treedef, None),
        "jax.device_get of the leaves (a view, not a copy, on a CPU)": jax.device_get,
        "np.array leaf by leaf": lambda leaves: [np.array(leaf) for leaf in leaves],
        "one concatenated buffer, split on the host": concatenated,
    }
    times: dict[str, list[float]] = {name: [] for name in ways}
    for index in range(rounds + 1):  # the first round warms up
        for name in list(ways)[index % len(ways) :] + list(ways)[: index % len(ways)]:
            # New arrays every time, ready: a jax.Array caches its host value once read (a second read is free).
            leaves = jax.block_until_ready([jnp.copy(leaf) for leaf in base])
            start = time.perf_counter()
            ways[name](leaves)
            if index:
                times[name].append((time.perf_counter() - start) * 1e3)
    return base, times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--widths", default="64,2048")
    args = parser.parse_args()
    device = jax.devices()[0]
    mesh = jax.sharding.Mesh(np.array([device]), ("batch",))
    print(f"jax {jax.__version__}, {device.device_kind}, host memory kind {copies.host_memory_kind(mesh)}")
    print("\n| state | way | ms a copy (median) |\n|---|---|---:|")
    for width in (int(w) for w in args.widths.split(",")):
        leaves, times = measure(width, args.rounds, mesh)
        state = f"MLP width {width}, {len(leaves)} leaves, {sum(leaf.nbytes for leaf in leaves) / 2**20:.2f} MiB"
        for name, values in times.items():
            print(f"| {state} | {name} | {statistics.median(values):.3f} |")


if __name__ == "__main__":
    main()
