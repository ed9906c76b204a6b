"""Saves a replicated state on this process's devices, or restores one onto them (with `budget`, within
`host_memory_budget=budget`). With `sharded`, the saved state's arrays are split over every process's devices
along their largest axis that the device count divides."""

from __future__ import annotations

from flaxstate_testing.workers.common import setup

config = setup()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec  # noqa: E402

import flaxstate as fs  # noqa: E402
from flaxstate_testing import toy  # noqa: E402

model = toy.MLP(width=config["width"])
mesh = Mesh(np.asarray(jax.devices()), ("devices",))
replicated = NamedSharding(mesh, PartitionSpec())


def create(seed: int) -> fs.FlaxOptimTrainState:
    state = fs.FlaxOptimTrainState.create(optax.adam(1e-2), model.init(jax.random.key(seed), jnp.ones((1, 4))))
    return state.apply_gradient(jax.tree.map(jnp.cos, state.params))


def layout(shape: tuple[int, ...]) -> NamedSharding:
    """Replicated, or (`sharded`) split along the largest axis that the devices divide."""
    axes = [axis for axis, size in enumerate(shape) if size % jax.device_count() == 0]
    if not config.get("sharded") or not axes:
        return replicated
    spec: list[str | None] = [None] * len(shape)
    spec[max(axes, key=lambda axis: shape[axis])] = "devices"
    return NamedSharding(mesh, PartitionSpec(*spec))


if config["mode"] == "save":
    # No collective runs here: the state is computed replicated on every device, then each keeps its part.
    state = jax.jit(lambda: create(0), out_shardings=replicated)()
    state = jax.jit(lambda s: s, out_shardings=jax.tree.map(lambda a: layout(a.shape), state))(state)
    record = fs.Checkpoint(
        state=state,
        grads=None,
        loss=0.0,
        n_completed_steps=1,
        elapsed_time=1.0,
        step=1,
        rng=jax.random.key(0),
        final=True,
    )
    fs.CheckpointFileWriter(config["output_dir"], host_memory_budget=config.get("budget"))(record)
    flat = {
        k: np.asarray(multihost_utils.process_allgather(v, tiled=True))
        for k, v in fs.tree_paths.flatten(state.state_dict()).items()
    }
    if jax.process_index() == 0:
        np.savez(config["out"], **flat)
        print("state_bytes", sum(a.nbytes for a in flat.values()))
else:
    template = jax.jit(lambda: create(1), out_shardings=replicated)()
    restored = fs.CheckpointFileReader(config["output_dir"], host_memory_budget=config.get("budget")).restore(template)
    expected = dict(np.load(config["out"]))
    for path, leaf in fs.tree_paths.flatten(restored.state_dict()).items():
        np.testing.assert_array_equal(np.asarray(leaf), expected[path], err_msg=path)
        assert leaf.sharding.device_set == set(jax.devices()), (path, leaf.sharding)
    print("restored on", jax.device_count(), "devices")
