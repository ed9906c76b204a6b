"""What checkpoints cost: flaxstate's async writer against no checkpoints and plain orbax.

One process, a model of about 50 MB of state (params and adam moments):

1. training throughput with a checkpoint every 20 steps against the same loop
   yielding its records every 20 steps to no writer, and against no record
   in 200 steps (alternating rounds, medians); from the first, the
   milliseconds of training one save costs;
2. how long a save blocks the loop: flaxstate's asynchronous writer against a
   synchronous orbax save;
3. restore time: `CheckpointFileReader.restore` against plain orbax
   `CheckpointManager.restore` of the same state, with the reader and the
   manager made once before the rounds, and made each round and asked for the
   newest step (as a restarting run restores);
4. bytes on disk against the bytes of one copy of the state, saved from 2 devices.

    python benchmarks/checkpoint.py [--rounds 5] [--restore-only]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import flax.linen as nn
import jax
import numpy as np
import optax
import orbax.checkpoint as ocp

import flaxstate as fs

WIDTH, FEATURES, BATCH = 1800, 512, 32


class Wide(nn.Module):
    """An MLP features-width-width-10."""

    width: int = WIDTH

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        x = nn.relu(nn.Dense(self.width)(x))
        x = nn.relu(nn.Dense(self.width)(x))
        return nn.Dense(10)(x)


def loss_fn(logits: jax.Array, labels: jax.Array) -> jax.Array:
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


def make_loop(steps_per_record: int) -> fs.TrainLoop:
    rng = np.random.RandomState(0)
    data = [(rng.randn(BATCH, FEATURES).astype(np.float32), rng.randint(0, 10, BATCH).astype(np.int32))] * 8
    model = Wide()
    task = fs.TrainTask(apply=model.apply, optimizer=optax.adam(1e-4), loss=loss_fn, data=itertools.cycle(data))
    return fs.TrainLoop(
        model.init, task, jax.random.key(0), n_steps=10**9, n_steps_per_checkpoint=steps_per_record, stdout=False
    )


def state_bytes(state: fs.FlaxOptimTrainState) -> int:
    return sum(leaf.nbytes for leaf in jax.tree.leaves(state))


def dir_bytes(path: Path) -> int:
    return sum(file.stat().st_size for file in path.rglob("*") if file.is_file())


def throughput(rounds: int, workdir: Path, steps: int = 200, every: int = 20) -> dict[str, float]:
    """Median seconds a step: one record a round ("none"), a record every 20 steps, a checkpoint every 20."""
    loops = {"none": make_loop(steps), "records": make_loop(every), "checkpoints": make_loop(every)}
    writer = fs.CheckpointFileWriter(workdir / "throughput", keep=2)
    for loop in loops.values():
        loop.next_checkpoint()  # compiled and warm
    times: dict[str, list[float]] = {name: [] for name in loops}
    for index in range(rounds):
        for name in list(loops) if index % 2 == 0 else list(reversed(loops)):
            loop = loops[name]
            start = time.perf_counter()
            for _ in range(steps // loop.n_steps_per_checkpoint):
                record = loop.next_checkpoint()
                if name == "checkpoints":
                    writer(record)
            times[name].append((time.perf_counter() - start) / steps)
            # The round's last save finishes untimed, so that it never slows the next contender.
            writer.wait()
    return {name: statistics.median(values) for name, values in times.items()}


def save_blocking(rounds: int, workdir: Path) -> tuple[float, float, int]:
    """Median seconds a save blocks the caller: flaxstate's async writer, a synchronous orbax save."""
    loop = make_loop(1)
    record = loop.next_checkpoint()
    writer = fs.CheckpointFileWriter(workdir / "async", keep=2)
    sync_manager = ocp.CheckpointManager(
        workdir / "sync", options=ocp.CheckpointManagerOptions(max_to_keep=2, enable_async_checkpointing=False)
    )
    times: dict[str, list[float]] = {"async": [], "sync": []}
    for step in range(1, rounds + 1):
        writer.wait()
        record = fs.Checkpoint(**{**record.__dict__, "step": step})
        start = time.perf_counter()
        writer(record)
        times["async"].append(time.perf_counter() - start)
        start = time.perf_counter()
        sync_manager.save(step, args=ocp.args.StandardSave(record.state.state_dict()))
        times["sync"].append(time.perf_counter() - start)
    writer.wait()
    return statistics.median(times["async"]), statistics.median(times["sync"]), state_bytes(record.state)


def restore_times(rounds: int, workdir: Path) -> dict[str, tuple[float, float]]:
    """Median seconds to restore, flaxstate's reader against plain orbax with an abstract target, two ways.

    `"open"`: the reader (or orbax's `CheckpointManager`) made once, before
    the rounds, and asked again each round. `"from the directory"`: made each
    round and asked for the newest step, as a run that restarts does once.
    """
    loop = make_loop(1)
    record = loop.next_checkpoint()
    fs.CheckpointFileWriter(workdir / "restore")(fs.Checkpoint(**{**record.__dict__, "final": True}))
    plain = ocp.CheckpointManager(workdir / "plain")
    plain.save(1, args=ocp.args.StandardSave(record.state.state_dict()))
    plain.wait_until_finished()
    template = jax.device_put(loop.state)  # on the device: the records' host copies have no sharding
    abstract = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), template.state_dict()
    )
    reader = fs.CheckpointFileReader(workdir / "restore")

    def from_directory() -> Any:
        manager = ocp.CheckpointManager(workdir / "plain")
        return manager.restore(manager.latest_step(), args=ocp.args.StandardRestore(abstract))

    ways: dict[str, dict[str, Callable[[], Any]]] = {
        "open": {
            "flaxstate": lambda: reader.restore(template),
            "orbax": lambda: plain.restore(1, args=ocp.args.StandardRestore(abstract)),
        },
        "from the directory": {
            "flaxstate": lambda: fs.CheckpointFileReader(workdir / "restore").restore(template),
            "orbax": from_directory,
        },
    }
    medians = {}
    for way, contenders in ways.items():
        times: dict[str, list[float]] = {name: [] for name in contenders}
        for index in range(rounds):
            for name in ("flaxstate", "orbax") if index % 2 == 0 else ("orbax", "flaxstate"):
                start = time.perf_counter()
                jax.block_until_ready(contenders[name]())
                times[name].append(time.perf_counter() - start)
        medians[way] = statistics.median(times["flaxstate"]), statistics.median(times["orbax"])
    return medians


def bytes_on_two_devices(workdir: Path) -> tuple[int, int]:
    """Saves a replicated state from a process with 2 CPU devices; returns (bytes on disk, bytes of one copy)."""
    code = f"""
import json, sys, jax, numpy as np
sys.path.insert(0, {str(Path(__file__).parent)!r})
from jax.sharding import Mesh, NamedSharding, PartitionSpec
import optax, flaxstate as fs, checkpoint as bench
mesh = Mesh(np.asarray(jax.devices()), ("devices",))
assert len(mesh.devices) == 2
def create():
    variables = bench.Wide().init(jax.random.key(0), np.ones((1, bench.FEATURES), np.float32))
    return fs.FlaxOptimTrainState.create(optax.adam(1e-4), variables)
state = jax.jit(create, out_shardings=NamedSharding(mesh, PartitionSpec()))()
record = fs.Checkpoint(state=state, grads=None, loss=0.0, n_completed_steps=1, elapsed_time=1.0, step=1, final=True)
fs.CheckpointFileWriter({str(workdir / "two")!r})(record)
print(json.dumps(bench.state_bytes(state)))
"""
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=2", "JAX_PLATFORMS": "cpu"}
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    if result.returncode:
        raise RuntimeError(result.stderr)
    return dir_bytes(workdir / "two" / "1"), json.loads(result.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--restore-only", action="store_true", help="only 3., the restore times")
    args = parser.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="flaxstate-bench-"))
    try:
        print(
            f"jax {jax.__version__}, orbax {ocp.__version__}, {jax.devices()[0].device_kind}, "
            f"{args.rounds} alternating rounds"
        )
        if args.restore_only:
            for way, (restore_fs, restore_orbax) in restore_times(args.rounds, workdir).items():
                print(
                    f"| ms to restore ({way}): CheckpointFileReader vs plain orbax CheckpointManager | "
                    f"{restore_fs * 1e3:.1f} | {restore_orbax * 1e3:.1f} | {restore_fs / restore_orbax:.2f}x |"
                )
            return
        step_times = throughput(args.rounds, workdir)
        blocked_async, blocked_sync, n_bytes = save_blocking(args.rounds, workdir)
        restores = restore_times(args.rounds, workdir)
        on_disk, one_copy = bytes_on_two_devices(workdir)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    print(f"\nstate: {n_bytes / 2**20:.1f} MiB\n")
    print("| measure | flaxstate | baseline | ratio |\n|---|---:|---:|---:|")
    with_ckpt = step_times["checkpoints"]
    for baseline, what in (("records", "records every 20 steps, no writer"), ("none", "one record in 200 steps")):
        ratio = with_ckpt / step_times[baseline]
        print(
            f"| ms a training step, checkpoint every 20 steps vs {what} | {with_ckpt * 1e3:.1f} | "
            f"{step_times[baseline] * 1e3:.1f} | {ratio:.3f}x ({(ratio - 1) * 100:+.1f}%) |"
        )
    lost = (with_ckpt - step_times["records"]) * 20
    print(
        f"| ms of training a save costs, and the interval at which that is 5% | {lost * 1e3:.1f} | "
        f"{lost / 0.05 * 1e3:.0f} | |"
    )
    print(
        f"| ms a save blocks the loop: async writer vs synchronous orbax save | {blocked_async * 1e3:.1f} | "
        f"{blocked_sync * 1e3:.1f} | {blocked_async / blocked_sync:.2f}x |"
    )
    for way, (restore_fs, restore_orbax) in restores.items():
        print(
            f"| ms to restore ({way}): CheckpointFileReader vs plain orbax CheckpointManager | "
            f"{restore_fs * 1e3:.1f} | {restore_orbax * 1e3:.1f} | {restore_fs / restore_orbax:.2f}x |"
        )
    print(
        f"| MiB on disk (2 devices) vs one copy of the state | {on_disk / 2**20:.1f} | {one_copy / 2**20:.1f} | "
        f"{on_disk / one_copy:.3f}x |"
    )


if __name__ == "__main__":
    main()
