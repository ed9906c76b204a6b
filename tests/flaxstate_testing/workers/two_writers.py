"""Two writers in one process (the run's and the best one's) saving every record, on several processes."""

from __future__ import annotations

from flaxstate_testing.workers.common import setup

config = setup()

import jax  # noqa: E402
import optax  # noqa: E402
import redex  # noqa: E402

import flaxstate as fs  # noqa: E402
from flaxstate_testing import toy  # noqa: E402

model = toy.MLP()
shard = lambda batches: toy.shard(batches, jax.process_index(), jax.process_count())  # noqa: E731
n_steps = config["n_steps"]
loop = fs.TrainLoop(
    init=fs.CheckpointFileReader(config["out"], target=model.init),
    task=fs.TrainTask(apply=model.apply, optimizer=optax.sgd(0.05), loss=toy.mse, data=shard(toy.batches(n_steps, 8))),
    rng=jax.random.key(0),
    n_steps=n_steps,
    n_steps_per_checkpoint=1,
    stdout=False,
)
process = redex.combinator.serial(
    fs.EvalLoop(
        fs.EvalTask(apply=model.apply, metrics={"loss": toy.mse}, data=shard(toy.batches(1, 8, seed=7))),
        rng=jax.random.key(1),
    ),
    fs.CheckpointFileWriter(config["out"], keep=n_steps),
    fs.LowestCheckpointFileWriter(config["out"], metric="loss", group="eval", keep=n_steps),
)
for checkpoint in loop:
    process(checkpoint)
print("done", jax.process_index(), loop.step, flush=True)
