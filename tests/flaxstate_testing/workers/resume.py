"""Trains with checkpoints and resumes from the newest one; prints each record as it is saved."""

from __future__ import annotations

from pathlib import Path

from flaxstate_testing.workers.common import setup

config = setup()

import grain  # noqa: E402
import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
import redex  # noqa: E402

import flaxstate as fs  # noqa: E402
from flaxstate_testing import toy  # noqa: E402

model = toy.BatchNormNet() if config.get("width") is None else toy.MLP(width=config["width"])
global_batches = toy.batches(64, config.get("global_batch", 8), seed=1)
x = np.concatenate([b[0] for b in global_batches])
y = np.concatenate([b[1] for b in global_batches])
per_host = config.get("global_batch", 8) // jax.process_count()
if config["data"] == "grain":
    examples = list(zip(x, y, strict=True))[jax.process_index() :: jax.process_count()]
    data = grain.MapDataset.source(examples).shuffle(seed=3).repeat().batch(per_host)
else:
    data = toy.shard(global_batches * 100, jax.process_index(), jax.process_count())

output_dir = config["output_dir"]
optimizer = optax.sgd(0.05, momentum=0.9) if config.get("optimizer") == "sgd" else optax.adam(1e-2)
loop = fs.TrainLoop(
    init=fs.CheckpointFileReader(output_dir, target=model.init) if config.get("resume", True) else model.init,
    task=fs.TrainTask(apply=model.apply, optimizer=optimizer, loss=toy.mse, data=data),
    rng=jax.random.key(0),
    n_steps=config["n_steps"],
    n_steps_per_checkpoint=config["every"],
    n_steps_per_dispatch=config.get("per_dispatch", 1),
    stdout=False,
)
print("start", loop.step, flush=True)
process = redex.combinator.serial(fs.CheckpointFileWriter(output_dir, keep=config.get("keep", 2)))
for checkpoint in loop:
    process(checkpoint)
    print("record", checkpoint.step, flush=True)
final = loop.state
if jax.process_index() == 0:
    flat = {k: np.asarray(v) for k, v in fs.tree_paths.flatten(final.state_dict()).items()}
    np.savez(Path(config["out"]), **flat)
print("done", loop.step, flush=True)
