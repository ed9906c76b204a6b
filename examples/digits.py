"""Trains a small MLP (BatchNorm, Dropout) on scikit-learn's digits with flaxstate.

Checkpoints, resume and TensorBoard logs land in --output-dir; run it again
and it resumes from the newest checkpoint (and the exact data position). The
settings are one frozen dataclass, `Config`, read with tyro (`--help` lists
them) and stored as the checkpoints' metadata. The model is linen's, or with
`--api nnx` the same MLP as a Flax NNX module, given to the loop itself.

    python examples/digits.py --steps 600 --output-dir runs/digits
    python examples/digits.py --api nnx  # runs/digits-nnx by default: another model, a directory of its own

Several processes (one per host, or several on one machine) join with the
standard coordinator settings, as flags or JAX's environment variables:

    python examples/digits.py --num-processes 2 --process-id 0 --coordinator-address 127.0.0.1:12355 &
    python examples/digits.py --num-processes 2 --process-id 1 --coordinator-address 127.0.0.1:12355
"""

from __future__ import annotations

import dataclasses
import os
from typing import Literal

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import redex
import tyro
from flax import nnx
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


class NNXMLP(nnx.Module):
    """`MLP` as a Flax NNX module: its Dropout takes rngs at call time (the loop gives them in training), and the
    loop evaluates a view of it in evaluation mode (running statistics, no dropout)."""

    def __init__(self, *, rngs: nnx.Rngs) -> None:
        self.dense = nnx.Linear(64, 128, rngs=rngs)
        self.norm = nnx.BatchNorm(128, rngs=rngs)
        self.dropout = nnx.Dropout(0.2)
        self.out = nnx.Linear(128, 10, rngs=rngs)

    def __call__(self, x: jax.Array, rngs: nnx.Rngs | None = None) -> jax.Array:
        return self.out(self.dropout(nnx.relu(self.norm(self.dense(x))), rngs=rngs))


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


@dataclasses.dataclass(frozen=True)
class Config:
    """An MLP (BatchNorm, Dropout) on scikit-learn's digits, with checkpoints, resume and TensorBoard logs."""

    steps: int = 600
    """Total training steps."""
    output_dir: str | None = None
    """Checkpoints, the goodput ledger and TensorBoard logs; a second run resumes from the newest checkpoint.
    By default runs/digits, or runs/digits-nnx with --api nnx (another model: a directory of its own)."""
    devices: int | None = None
    """Local devices to use (all by default)."""
    batch_size: int = 64
    """The global batch size (all processes together)."""
    ema_decay: float | None = None
    """Keep an EMA of the parameters with this decay, and evaluate it too (group eval_ema)."""
    api: Literal["linen", "nnx"] = "linen"
    """The model's API: linen's init and apply, or a Flax NNX module given to the loop itself."""
    coordinator_address: str | None = os.environ.get("JAX_COORDINATOR_ADDRESS")
    """Several processes: the coordinator's host:port (or JAX_COORDINATOR_ADDRESS)."""
    num_processes: int = int(os.environ.get("JAX_NUM_PROCESSES", "1"))
    """Several processes: how many (or JAX_NUM_PROCESSES)."""
    process_id: int = int(os.environ.get("JAX_PROCESS_ID", "0"))
    """Several processes: this one's index (or JAX_PROCESS_ID)."""
    join_timeout: int = 1800
    """Several processes: seconds each waits for the others to join (jax.distributed.initialize's
    initialization_timeout, 300 s by default): long, for a cold restart of a large job, whose nodes start late."""


MANAGERS_COUNTS = ("FLAXSTATE_PROCESS_COUNT", "SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE")
"""The process count that `flaxstate launch`, SLURM's srun and Open MPI's mpirun each set."""


def join_processes(config: Config) -> None:
    if config.num_processes > 1:
        # Before initialize, which must come before any call that starts a backend (jax.devices() included).
        jax.config.update("jax_cpu_collectives_implementation", "gloo")  # CPU collectives; GPUs and TPUs ignore it
        jax.distributed.initialize(
            config.coordinator_address,
            config.num_processes,
            config.process_id,
            initialization_timeout=config.join_timeout,
        )
    elif any(int(os.environ.get(count, "1")) > 1 for count in MANAGERS_COUNTS):
        # `flaxstate launch`, srun or mpirun: JAX finds the processes itself
        jax.distributed.initialize(initialization_timeout=config.join_timeout)


def main(config: Config) -> None:
    if config.output_dir is None:  # each model its own run: the NNX module cannot resume the linen MLP's checkpoints
        config = dataclasses.replace(config, output_dir="runs/digits-nnx" if config.api == "nnx" else "runs/digits")
    assert config.output_dir is not None
    join_processes(config)
    devices = jax.devices() if config.devices is None else list(jax.devices())[: config.devices]
    train_data, eval_data = digits(config.batch_size)

    if config.api == "nnx":  # the module itself is the model: its init, its apply
        init = apply = NNXMLP(rngs=nnx.Rngs(0))
    else:
        linen = MLP()
        init, apply = linen.init, linen.apply
    loop = fs.TrainLoop(
        init=fs.CheckpointFileReader(config.output_dir, target=init),  # resume, or init fresh
        task=fs.TrainTask(
            apply=apply, optimizer=optax.adam(1e-3), loss=loss, data=train_data, ema_decay=config.ema_decay
        ),
        rng=jax.random.key(0),
        n_steps=config.steps,
        n_steps_per_checkpoint=100,
        n_steps_per_dispatch=10,
        devices=devices,
    )
    eval_task = fs.EvalTask(apply=apply, metrics={"loss": loss, "acc": accuracy}, data=eval_data)
    evaluations = [fs.EvalLoop(eval_task, rng=jax.random.key(1), n_steps=len(eval_data), devices=devices)]
    if config.ema_decay is not None:
        evaluations.append(
            fs.EvalLoop(
                eval_task,
                rng=jax.random.key(1),
                n_steps=len(eval_data),
                devices=devices,
                group="eval_ema",
                use_ema=True,
            )
        )
    process = redex.combinator.serial(
        *evaluations,
        fs.SummaryLogger(),
        fs.SummaryWriter(config.output_dir),
        fs.CheckpointFileWriter(config.output_dir, keep=3, metadata=config),
        fs.LowestCheckpointFileWriter(config.output_dir, metric="loss", group="eval"),
    )
    for checkpoint in loop:
        process(checkpoint)


if __name__ == "__main__":
    main(tyro.cli(Config))
