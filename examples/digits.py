"""Trains a small MLP (BatchNorm, Dropout) on scikit-learn's digits with flaxstate.

Checkpoints, resume and TensorBoard logs land in --output-dir; run it again
and it resumes from the newest checkpoint (and the exact data position).

    python examples/digits.py --steps 600 --output-dir runs/digits

Several processes (one per host, or several on one machine) join with the
standard coordinator settings, as flags or JAX's environment variables:

    python examples/digits.py --num-processes 2 --process-id 0 --coordinator-address 127.0.0.1:12355 &
    python examples/digits.py --num-processes 2 --process-id 1 --coordinator-address 127.0.0.1:12355
"""

from __future__ import annotations

import argparse
import os

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import redex
from sklearn.datasets import load_digits

import flaxstate as fs


class MLP(nn.Module):
    """Trains with batch statistics and dropout when they are mutable / given rngs."""

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        train = self.is_mutable_collection("batch_stats")
        x = nn.Dense(128)(x)
        x = nn.BatchNorm(use_running_average=not train)(x)
        x = nn.Dropout(0.2, deterministic=not self.has_rng("dropout"))(nn.relu(x))
        return nn.Dense(10)(x)


def loss(logits: jax.Array, labels: jax.Array) -> jax.Array:
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


def accuracy(logits: jax.Array, labels: jax.Array) -> jax.Array:
    return jnp.mean(jnp.argmax(logits, -1) == labels)


def digits(batch_size: int, seed: int = 0) -> tuple[fs.GlobalBatches, list[tuple[np.ndarray, np.ndarray]]]:
    """The train split as global batches (shuffled each epoch, forever), and this process's shard of the eval split.

    `fs.global_batches` fixes the examples of the global batch at every step
    (a permutation an epoch, one numpy gather a batch): each process reads
    its part, and a resume on any number of processes trains the same
    examples in the same order, starting where it stopped without drawing.
    """
    x, y = load_digits(return_X_y=True)
    x = (x / 16.0).astype(np.float32)
    y = y.astype(np.int32)
    order = np.random.RandomState(seed).permutation(len(x))
    train, test = order[:1500], order[1500:]
    train_data = fs.global_batches((x[train], y[train]), batch_size, seed=seed)
    shard = slice(jax.process_index(), None, jax.process_count())
    per_host = batch_size // jax.process_count()
    x_test, y_test = x[test][shard], y[test][shard]
    eval_data = [
        (x_test[i : i + per_host], y_test[i : i + per_host]) for i in range(0, len(x_test) - per_host + 1, per_host)
    ]
    return train_data, eval_data


def join_processes(args: argparse.Namespace) -> None:
    if args.num_processes > 1:
        # Before initialize, which must come before any call that starts a backend (jax.devices() included).
        jax.config.update("jax_cpu_collectives_implementation", "gloo")  # CPU collectives; GPUs and TPUs ignore it
        jax.distributed.initialize(args.coordinator_address, args.num_processes, args.process_id)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--output-dir", default="runs/digits")
    parser.add_argument("--devices", type=int, default=None, help="local devices to use (all by default)")
    parser.add_argument("--batch-size", type=int, default=64, help="global batch size")
    parser.add_argument("--coordinator-address", default=os.environ.get("JAX_COORDINATOR_ADDRESS"))
    parser.add_argument("--num-processes", type=int, default=int(os.environ.get("JAX_NUM_PROCESSES", "1")))
    parser.add_argument("--process-id", type=int, default=int(os.environ.get("JAX_PROCESS_ID", "0")))
    args = parser.parse_args()
    join_processes(args)
    devices = jax.devices() if args.devices is None else [d for d in jax.devices()][: args.devices]
    train_data, eval_data = digits(args.batch_size)

    model = MLP()
    loop = fs.TrainLoop(
        init=fs.CheckpointFileReader(args.output_dir, target=model.init),  # resume, or init fresh
        task=fs.TrainTask(apply=model.apply, optimizer=optax.adam(1e-3), loss=loss, data=train_data),
        rng=jax.random.key(0),
        n_steps=args.steps,
        n_steps_per_checkpoint=100,
        n_steps_per_dispatch=10,
        devices=devices,
    )
    process = redex.combinator.serial(
        fs.EvalLoop(
            fs.EvalTask(apply=model.apply, metrics={"loss": loss, "acc": accuracy}, data=eval_data),
            rng=jax.random.key(1),
            n_steps=len(eval_data),
            devices=devices,
        ),
        fs.SummaryLogger(),
        fs.SummaryWriter(args.output_dir),
        fs.CheckpointFileWriter(args.output_dir, keep=3, metadata=vars(args)),
        fs.LowestCheckpointFileWriter(args.output_dir, metric="loss", group="eval"),
    )
    for checkpoint in loop:
        process(checkpoint)


if __name__ == "__main__":
    main()
