"""Trains on `flaxstate.global_batches` with checkpoints, from and to any process count.

Prints `served <step> <indices...>` for every global batch part this process
read (its source records the indices), and writes the final parameters.
"""

from __future__ import annotations

import os
from pathlib import Path

from flaxstate_testing.workers.common import setup

config = setup()

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402

import flaxstate as fs  # noqa: E402
from flaxstate_testing import toy  # noqa: E402

rng = np.random.RandomState(0)
x = rng.randn(40, 4).astype(np.float32)
y = (x @ np.arange(1.0, 5.0, dtype=np.float32)).astype(np.float32)


class Recording:
    """A random-access source of `(x, y)` examples that prints which it served."""

    def __len__(self):
        return len(x)

    def __getitem__(self, index):
        print("read", index, flush=True)
        return x[index], y[index]


try:
    fs.global_batches(Recording(), batch_size=7)
except ValueError as error:
    print("REFUSED", error, flush=True)
mesh = rules = None
model = toy.MLP()
if config.get("fsdp"):  # the batch and the hidden units split over a mesh's fsdp axis: every device one share
    from jax.sharding import Mesh

    mesh = Mesh(np.asarray(jax.devices()).reshape(1, jax.device_count(), 1), ("data", "fsdp", "model"))
    rules = [("batch", ("data", "fsdp")), ("hidden", "fsdp")]
    model = toy.ShardedMLP()
data = fs.global_batches(Recording(), batch_size=8, seed=3, mesh=mesh, axis_rules=rules)
output_dir = config["output_dir"]
lost = config.get("lost")  # {"index", "count", "after"}: a process that fails after that step on a job that wide
broken = lost is not None and (jax.process_index(), jax.process_count()) == (lost["index"], lost["count"])
loop = fs.TrainLoop(
    fs.CheckpointFileReader(output_dir, target=model.init) if config.get("resume") else model.init,
    fs.TrainTask(apply=model.apply, optimizer=optax.adam(1e-2), loss=toy.mse, data=data),
    jax.random.key(0),
    n_steps=config["n_steps"],
    n_steps_per_checkpoint=5,
    n_steps_per_dispatch=config.get("per_dispatch", 1),
    stdout=False,
    mesh=mesh,
    axis_rules=rules,
    max_device_batch=config.get("max_device_batch"),
)
print("start", loop.step, flush=True)
if mesh is not None:  # each device's share of the hidden layer's kernel: (4, 16 / devices) under FSDP
    print("hidden kernel shard", loop.state.params["Dense_0"]["kernel"].addressable_shards[0].data.shape, flush=True)
if broken and loop.step >= lost["after"]:
    os._exit(5)  # the broken host fails again at once (as a crash: no exit handler waits for the others)
with fs.CheckpointFileWriter(output_dir, keep=2) as writer:
    for checkpoint in loop:
        writer(checkpoint)
        print("record", checkpoint.step, "microbatches", checkpoint.session.n_microbatches, flush=True)
        if broken and checkpoint.step == lost["after"]:
            writer.wait()  # every process saved the step (a collective): the next round resumes from it
            os._exit(5)
flat = {  # every process gathers the parts of sharded arrays (a collective); the first writes them
    key: multihost_utils.process_allgather(value, tiled=True)
    if isinstance(value, jax.Array) and not value.is_fully_addressable
    else np.asarray(value)
    for key, value in fs.tree_paths.flatten(loop.state.state_dict()).items()
}
if jax.process_index() == 0:
    np.savez(Path(config["out"]), **flat)
