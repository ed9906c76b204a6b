"""Measures this (fresh) process's host memory for records, a save and a restore, beside `fs.plan`'s prediction.

The state is a wide MLP's with adam (`mib` MiB: two square kernels, their
two moments); with `kernels: 1` and `optimizer: "sgd"`, one square kernel
and nothing more (the largest array the whole state). Mode `save`: the plan, then a loop's records (the bytes one more
held record adds) and a writer's save of the newest (the peak it adds above
what the process held). Mode `restore`: the plan, then a reader's restore of
that checkpoint into shapes and shardings (the peak it adds). Prints one JSON
line: `per_host` (the plan's), `state_bytes`, and the measured figures.
With `budget`, the writer and the reader get `host_memory_budget=budget`; with
`local`, the writer is a local tier (`fs.LocalTier`) and the reader reads
`[dir/local, dir/run]` (the persistent tier holds the first record, saved
before the measured save, so that the local tier's newer step is the one restored); with
`record_memory`, the loop's records are held there (`"device"`: saved from the devices).
Mode `peers` (two processes, each on a host of its own): the kernels' hidden
units sharded over both, so that each holds half the state; a local tier with
`peers=1` saves the second record, whose peak above what the process held (its
exchange's first compile included) is measured as `peers`.
"""

from __future__ import annotations

from flaxstate_testing.workers.common import setup

config = setup()

import json  # noqa: E402
import os  # noqa: E402

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import flaxstate as fs  # noqa: E402
from flaxstate.training.memory import host_peak_since_reset, host_resident, reset_host_peak  # noqa: E402

budget = config.get("budget")
kernels, optimizer_name = config.get("kernels", 2), config.get("optimizer", "adam")
copies = {"adam": 3, "sgd": 1}[optimizer_name]  # the parameters, and adam's two moments
width = int((config["mib"] * 2**20 / 4 / copies / kernels) ** 0.5)


sharded = config["mode"] == "peers"
mesh = jax.sharding.Mesh(np.asarray(jax.devices()), ("fsdp",)) if sharded else None
rules = (("batch", "fsdp"), ("hidden", "fsdp")) if sharded else None


class Wide(nn.Module):
    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        def dense(axes: tuple[str | None, str | None]) -> nn.Dense:
            kernel = nn.initializers.lecun_normal()
            return nn.Dense(width, use_bias=False, kernel_init=nn.with_logical_partitioning(kernel, axes))

        hidden = dense((None, "hidden"))(x)
        return hidden if kernels == 1 else dense(("hidden", None))(hidden)


x = np.ones((8, width), np.float32)
model, optimizer = Wide(), {"adam": optax.adam, "sgd": optax.sgd}[optimizer_name](1e-3)
task = fs.TrainTask(
    apply=model.apply,
    optimizer=optimizer,
    loss=lambda y, t: ((y - t) ** 2).mean(),
    data=fs.global_batches((x, x), batch_size=8),
)
plan = fs.plan(
    model.init,
    task,
    target="local",
    host_memory_budget=budget,
    mesh_shape={"fsdp": jax.device_count()} if sharded else None,
    axis_rules=rules,
    local_tier=fs.LocalTier(f"{config['dir']}/local", peers=1) if sharded else None,
)


def added_at_peak(operation) -> tuple[object, int]:
    before = host_resident()
    assert before is not None and reset_host_peak(), "/proc is needed (Linux)"
    result = operation()
    peak = host_peak_since_reset()
    assert peak is not None
    return result, peak - before


measured: dict[str, int] = {}
if config["mode"] == "peers":
    os.environ["FLAXSTATE_HOST"] = f"host-{jax.process_index()}"
if config["mode"] != "restore":
    loop = fs.TrainLoop(
        init=model.init,
        task=task,
        rng=jax.random.key(0),
        n_steps=2,
        n_steps_per_checkpoint=1,
        stdout=False,
        mesh=mesh,
        axis_rules=rules,
        record_memory=config.get("record_memory", "host"),
    )
if config["mode"] == "peers":
    local_tier = fs.CheckpointFileWriter(fs.LocalTier(f"{config['dir']}/local", peers=1), host_memory_budget=budget)
    first = loop.next_checkpoint()
    second = loop.next_checkpoint()
    jax.block_until_ready(second.state)  # its step's own buffers are not the save's
    state_bytes = sum(  # this process's parts
        sum(shard.data.nbytes for shard in leaf.addressable_shards) if isinstance(leaf, jax.Array) else leaf.nbytes
        for leaf in jax.tree.leaves(second.state)
    )

    def save_with_copies() -> None:
        local_tier(second)
        local_tier.close()

    measured["peers"] = added_at_peak(save_with_copies)[1]
elif config["mode"] == "save":
    first = loop.next_checkpoint()
    held = host_resident()
    # A record from the devices comes back while its step still runs (JAX dispatches asynchronously): the step's
    # new buffers, written as it runs, are the record's and the loop's, not the save's (measured apart, they
    # were 250 MiB of the save's peak with this 256 MiB state in a fresh process).
    second = loop.next_checkpoint()
    jax.block_until_ready(second.state)
    measured["one_record"] = host_resident() - held
    state_bytes = sum(leaf.nbytes for leaf in jax.tree.leaves(second.state))
    local = config.get("local", False)
    where = f"{config['dir']}/local" if local else config["dir"]
    if local:
        with fs.CheckpointFileWriter(f"{config['dir']}/run") as persistent:
            persistent(first)
    writer = fs.CheckpointFileWriter(where, host_memory_budget=budget, per_process=local)

    def save() -> None:
        writer(second)
        writer.close()

    measured["save"] = added_at_peak(save)[1]
else:
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    shaped = jax.tree.map(
        lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=device),
        jax.eval_shape(lambda: fs.FlaxOptimTrainState.create(optimizer, model.init(jax.random.key(0), x))),
    )
    state_bytes = sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(shaped))
    tiers = [f"{config['dir']}/local", f"{config['dir']}/run"] if config.get("local") else config["dir"]
    reader = fs.CheckpointFileReader(tiers, host_memory_budget=budget)
    restored, measured["restore"] = added_at_peak(lambda: jax.block_until_ready(reader.restore(shaped)))
    assert int(restored.step) == 2
largest = max(
    leaf.size * leaf.dtype.itemsize for leaf in jax.tree.leaves(jax.eval_shape(model.init, jax.random.key(0), x))
)
print(json.dumps({"per_host": plan.per_host, "state_bytes": state_bytes, "largest": largest, **measured}), flush=True)
