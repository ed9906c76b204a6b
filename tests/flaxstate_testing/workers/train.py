"""Trains a toy model with TrainLoop in one of several processes and saves what it got."""

from __future__ import annotations

import json
from pathlib import Path

from flaxstate_testing.workers.common import setup

config = setup()

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import flaxstate as fs  # noqa: E402
from flaxstate_testing import toy  # noqa: E402

if config["model"] == "nnx_dropout":  # a module drawing from its own stream: the module is init and apply
    from flax import nnx  # noqa: E402

    from flaxstate_testing import nnx_models  # noqa: E402

    module = nnx_models.DropoutProbe(nnx.Rngs(0, dropout=1))
    model = type("Module", (), {"init": module, "apply": module})
else:
    model = toy.MODELS[config["model"]]()
batches = toy.batches(config.get("n_batches", config["n_steps"]), config["global_batch"])
batches = [batch for index, batch in enumerate(batches) if index not in config.get("without", [])]
data = toy.shard(batches, jax.process_index(), jax.process_count())
if config.get("poison", {}).get("process") == jax.process_index():  # inf inputs in this process's part only
    x, y = data[config["poison"]["batch"]]
    data[config["poison"]["batch"]] = (np.full_like(x, np.inf), y)
if config.get("optimizer") == "adam":
    optimizer = optax.adam(config.get("learning_rate", 1e-2))
else:
    optimizer = optax.sgd(config.get("learning_rate", 0.1), momentum=0.9)
task = fs.TrainTask(apply=model.apply, optimizer=optimizer, loss=toy.mse, data=data)
loop = fs.TrainLoop(
    init=model.init,
    task=task,
    rng=jax.random.key(0),
    n_steps=config["n_steps"],
    n_steps_per_checkpoint=config.get("n_steps_per_checkpoint", config["n_steps"]),
    n_microbatches=config.get("n_microbatches", 1),
    rollback=fs.Rollback() if config.get("rollback") else None,
    stdout=False,
)
records = list(loop)


def close_count(dtype):
    """How many predictions of a batch (this device's part) lie within 1 of their target, as `dtype`."""
    return lambda outputs, targets: (abs(outputs - targets) < 1.0).sum().astype(dtype)


counts = {"close_int": close_count(np.int32), "close_float": close_count(np.float32)} if config.get("counts") else {}
evaluate = fs.EvalLoop(
    fs.EvalTask(
        apply=model.apply,
        metrics={"loss": toy.mse, **counts},
        data=toy.shard(toy.batches(2, config["global_batch"], seed=7), jax.process_index(), jax.process_count()),
    ),
    rng=jax.random.key(1),
    n_steps=2,
)
final = evaluate(records[-1])
flat = {f"params/{k}": np.asarray(v) for k, v in fs.tree_paths.flatten(final.state.params).items()}
flat.update({f"mutables/{k}": np.asarray(v) for k, v in fs.tree_paths.flatten(final.state.flax_mutables).items()})
flat.update({f"grads/{k}": np.asarray(v) for k, v in fs.tree_paths.flatten(final.grads).items()})
flat["loss"] = np.asarray(final.loss)
flat["eval_loss"] = np.asarray(final.metrics["eval"]["loss"])
for name in counts:  # a count is per device: compared within a run, not across device counts
    flat[f"counts/{name}"] = np.asarray(final.metrics["eval"][name])
np.savez(Path(config["out"]) / f"process_{jax.process_index()}.npz", **flat)
(Path(config["out"]) / f"rollbacks_{jax.process_index()}.json").write_text(json.dumps(list(records[-1].rollbacks)))
print("done", jax.process_index(), final.step, final.loss)
