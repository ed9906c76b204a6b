"""Device memory of a run with records, an evaluation and checkpoints, against a hand-written loop.

One process, an MLP 32-2048-2048-10 with adam (48.5 MiB of state). Each
contender trains `--steps` steps a round with an evaluation and a checkpoint
every `--every` steps:

- flaxstate as README runs it: `for checkpoint in loop:` an `EvalLoop`, then a
  `CheckpointFileWriter`; with records in host memory (the default) and in
  device memory (`record_memory="device"`, the path before issue 13);
- hand-written: a jitted update with the state donated, the evaluation, and
  orbax's asynchronous `CheckpointManager.save` (which copies the state to
  the host before it returns, then writes from there).

Device bytes (live jax arrays in device memory, counted per device) are
sampled at every batch drawn (training: between dispatches; evaluation: with
the evaluated parameters on the devices), after each evaluation and after
each save. All contenders live in one process, so each one's peak is
taken above what the others hold at rest (their states). The table gives the
peak against the state's bytes, the median ms that a save call blocks the
loop, and the median ms a step over the round (alternating rounds); then
what making a record costs in either memory: ms a step with a record every
step, no writer.

    python benchmarks/memory.py [--rounds 5] [--steps 60] [--every 10]
"""

from __future__ import annotations

import argparse
import collections
import inspect
import itertools
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import jax
import numpy as np
import optax
import orbax.checkpoint as ocp
from checkpoint import Wide, loss_fn  # the checkpoint benchmark's model, here 32-2048-2048-10
from flax.training import train_state

import flaxstate as fs

FEATURES, BATCH = 32, 64


def MLP() -> Wide:  # noqa: N802 - a model, named as one
    return Wide(width=2048)


def device_bytes() -> dict[jax.Device, int]:
    """Bytes of the live arrays in device memory, per device (host-memory arrays not counted)."""
    per_device: dict[jax.Device, int] = collections.Counter()
    for array in jax.live_arrays():
        if array.sharding.memory_kind not in (None, "device"):
            continue
        shard_bytes = int(np.prod(array.sharding.shard_shape(array.shape))) * array.dtype.itemsize
        for device in array.sharding.addressable_devices:
            per_device[device] += shard_bytes
    return per_device


class Peak:
    """The largest device bytes seen on any one device since `reset`."""

    def __init__(self) -> None:
        self.value = 0

    def reset(self) -> None:
        self.value = 0

    def sample(self) -> None:
        self.value = max([self.value, *device_bytes().values()])


def batches(peak: Peak) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    rng = np.random.RandomState(0)
    data = [(rng.randn(BATCH, FEATURES).astype(np.float32), rng.randint(0, 10, BATCH).astype(np.int32))] * 8
    for batch in itertools.cycle(data):
        peak.sample()
        yield batch


Round = Callable[[int], list[float]]
"""Trains n more steps (a checkpoint every `every`); returns the seconds each save call blocked."""


def flaxstate_round(workdir: Path, every: int, peak: Peak, record_memory: str | None) -> tuple[Round, int]:
    model = MLP()
    task = fs.TrainTask(apply=model.apply, optimizer=optax.adam(1e-4), loss=loss_fn, data=batches(peak))
    options = {} if record_memory is None else {"record_memory": record_memory}
    loop = fs.TrainLoop(
        model.init, task, jax.random.key(0), n_steps_per_checkpoint=every, n_steps=0, stdout=False, **options
    )
    evaluate = fs.EvalLoop(fs.EvalTask(apply=model.apply, metrics={"loss": loss_fn}, data=batches(peak)), rng=1)
    writer = fs.CheckpointFileWriter(workdir / f"flaxstate-{record_memory}", keep=2)

    def train(n_steps: int) -> list[float]:
        blocked = []
        for checkpoint in loop.run(loop.step + n_steps):
            summary = evaluate(checkpoint)
            peak.sample()
            start = time.perf_counter()
            writer(summary)
            blocked.append(time.perf_counter() - start)
            peak.sample()
        writer.wait()
        return blocked

    return train, state_bytes(loop.state)


def handwritten_round(workdir: Path, every: int, peak: Peak) -> tuple[Round, int]:
    model = MLP()
    params = model.init(jax.random.key(0), np.ones((1, FEATURES), np.float32))["params"]
    state = jax.device_put(train_state.TrainState.create(apply_fn=model.apply, params=params, tx=optax.adam(1e-4)))

    @jax.jit
    def evaluate(params: dict, batch: tuple) -> jax.Array:
        return loss_fn(model.apply({"params": params}, batch[0]), batch[1])

    @jax.jit
    def update(state: train_state.TrainState, batch: tuple) -> tuple[train_state.TrainState, jax.Array]:
        loss, grads = jax.value_and_grad(lambda p: loss_fn(model.apply({"params": p}, batch[0]), batch[1]))(
            state.params
        )
        return state.apply_gradients(grads=grads), loss

    step = jax.jit(update, donate_argnums=0)
    manager = ocp.CheckpointManager(workdir / "orbax", options=ocp.CheckpointManagerOptions(max_to_keep=2))
    data, eval_data = batches(peak), batches(peak)
    holder = {"state": state, "step": 0}

    def train(n_steps: int) -> list[float]:
        blocked = []
        for _ in range(n_steps):
            holder["state"], loss = step(holder["state"], next(data))
            holder["step"] += 1
            if holder["step"] % every == 0:
                float(loss), float(evaluate(holder["state"].params, next(eval_data)))
                peak.sample()
                start = time.perf_counter()
                manager.save(holder["step"], args=ocp.args.StandardSave(holder["state"]))
                blocked.append(time.perf_counter() - start)
                peak.sample()
        manager.wait_until_finished()
        return blocked

    return train, state_bytes(state)


def record_every_step(rounds: int) -> dict[str, float]:
    """Median ms of `next_checkpoint()` with a record every step (no writer): what making a record costs."""
    model, loops = MLP(), {}
    for memory in ("host", "device"):
        task = fs.TrainTask(apply=model.apply, optimizer=optax.adam(1e-4), loss=loss_fn, data=batches(Peak()))
        loops[memory] = fs.TrainLoop(
            model.init, task, jax.random.key(0), n_steps=10**9, stdout=False, record_memory=memory
        )
        loops[memory].next_checkpoint()  # compiled and warm
    times: dict[str, list[float]] = {memory: [] for memory in loops}
    for index in range(rounds):
        for memory in list(loops) if index % 2 == 0 else list(reversed(loops)):
            start = time.perf_counter()
            for _ in range(10):
                loops[memory].next_checkpoint()
            times[memory].append((time.perf_counter() - start) / 10)
    return {memory: statistics.median(values) for memory, values in times.items()}


def state_bytes(state: object) -> int:
    return sum(leaf.nbytes for leaf in jax.tree.leaves(state))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=60, help="steps a round")
    parser.add_argument("--every", type=int, default=10, help="steps between checkpoints")
    args = parser.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="flaxstate-memory-"))
    peak = Peak()
    contenders: dict[str, tuple[Round, int]] = {}
    if "record_memory" in inspect.signature(fs.TrainLoop).parameters:
        contenders["flaxstate, records in host memory"] = flaxstate_round(workdir, args.every, peak, "host")
        contenders["flaxstate, records in device memory"] = flaxstate_round(workdir, args.every, peak, "device")
    else:
        contenders["flaxstate (before record_memory)"] = flaxstate_round(workdir, args.every, peak, None)
    contenders["hand-written jit + orbax async save"] = handwritten_round(workdir, args.every, peak)
    peaks: dict[str, list[float]] = {name: [] for name in contenders}
    blocked: dict[str, list[float]] = {name: [] for name in contenders}
    step_times: dict[str, list[float]] = {name: [] for name in contenders}
    try:
        print(
            f"jax {jax.__version__}, orbax {ocp.__version__}, {jax.devices()[0].device_kind}, "
            f"{args.rounds} alternating rounds of {args.steps} steps, a checkpoint every {args.every}"
        )
        for train, _ in contenders.values():
            train(args.every)  # compiled and warm
        for index in range(args.rounds):
            for name in list(contenders) if index % 2 == 0 else list(reversed(contenders)):
                train, n_bytes = contenders[name]
                at_rest = max(device_bytes().values())
                peak.reset()
                start = time.perf_counter()
                blocked[name] += train(args.steps)
                step_times[name].append((time.perf_counter() - start) / args.steps)
                peaks[name].append(peak.value - at_rest + n_bytes)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    n_bytes = next(iter(contenders.values()))[1]
    print(f"\nstate: {n_bytes / 2**20:.1f} MiB\n")
    if "record_memory" in inspect.signature(fs.TrainLoop).parameters:
        per_record = record_every_step(args.rounds)
        print(
            f"\nms a step with a record every step (no writer, no evaluation): records in host memory "
            f"{per_record['host'] * 1e3:.1f}, in device memory {per_record['device'] * 1e3:.1f} "
            f"({per_record['host'] / per_record['device']:.2f}x)\n"
        )
    print("| contender | peak device MiB | x state | ms a save call blocks (median) | ms a step (median) |")
    print("|---|---:|---:|---:|---:|")
    for name in contenders:
        worst = max(peaks[name])
        print(
            f"| {name} | {worst / 2**20:.1f} | {worst / n_bytes:.2f}x | "
            f"{statistics.median(blocked[name]) * 1e3:.1f} | {statistics.median(step_times[name]) * 1e3:.1f} |"
        )


if __name__ == "__main__":
    main()
