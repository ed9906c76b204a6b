"""Peak host memory of a save and of a restore: flaxstate's writer and reader, with and without a host memory
budget, against plain orbax.

Each measurement runs in a fresh process (a subprocess of this script), so
that one contender's freed memory does not hide the next one's peak. A
process trains one step of a wide MLP with adam (the state: `--mib` MiB of
float32 in two square kernels and adam's two moments of each: its largest
array a sixth of it), so that a record exists as a
user's loop makes it, then:

- `save`: flaxstate writes the record (`CheckpointFileWriter`, waiting for
  the save to finish; `flaxstate-budget`: with `host_memory_budget=` of
  `--budget-mib`, below the largest array); plain orbax saves the loop's device state
  (`CheckpointManager.save` with `StandardSave`, then `wait_until_finished`),
  as a hand-written loop does;
- `restore`: flaxstate's `CheckpointFileReader(dir).read(template)` (with the
  same budget for `flaxstate-budget`) and plain
  orbax's `CheckpointManager.restore` with an abstract target, each of the
  checkpoint that it saved.

The process's peak resident set is reset just before the operation
(`/proc/self/clear_refs`, then `VmHWM`), so a figure is what the operation
added at its peak above what the process already held (its device state and,
for a save, the record). On a CPU, device memory is host memory: a restore's
figure includes the restored state itself. The table gives the medians over
`--rounds` (the contenders alternate), in MiB and as a multiple of the
state's bytes, and the seconds the operation took.

    python benchmarks/host_memory.py [--rounds 3] [--mib 256] [--budget-mib 16] [--record-memory host]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

MiB = 2**20
CONTENDERS = ("flaxstate", "flaxstate-budget", "orbax")
CASES = tuple((operation, contender) for operation in ("save", "restore") for contender in CONTENDERS)


def measure(
    operation: str, contender: str, directory: str, mib: int, budget_mib: int = 16, record_memory: str = "host"
) -> dict[str, Any]:
    """One operation in this (fresh) process: its seconds, and the peak bytes it added."""
    import flax.linen as nn
    import jax
    import numpy as np
    import optax
    import orbax.checkpoint as ocp

    import flaxstate as fs
    from flaxstate.training.memory import host_peak_since_reset, host_resident, reset_host_peak

    width = int((mib * MiB / 4 / 3 / 2) ** 0.5)  # adam: params, mu, nu; two square kernels

    class Wide(nn.Module):
        @nn.compact
        def __call__(self, x: jax.Array) -> jax.Array:
            return nn.Dense(width)(nn.Dense(width)(x))

    x = np.ones((8, width), np.float32)
    model, optimizer = Wide(), optax.adam(1e-3)
    flax_dir, orbax_dir = Path(directory) / contender, Path(directory) / "orbax"
    budget = budget_mib * MiB if contender == "flaxstate-budget" else None
    if operation == "save":
        loop = fs.TrainLoop(
            init=model.init,
            task=fs.TrainTask(
                apply=model.apply,
                optimizer=optimizer,
                loss=lambda y, t: ((y - t) ** 2).mean(),
                data=fs.global_batches((x, x), batch_size=8),
            ),
            rng=jax.random.key(0),
            n_steps=1,
            n_steps_per_checkpoint=1,
            stdout=False,
            record_memory=record_memory,
        )
        record = loop.next_checkpoint()
        state_bytes = sum(leaf.nbytes for leaf in jax.tree.leaves(record.state))
        # flaxstate saves the record (host copies, or device copies with --record-memory device); orbax, the state
        # on the devices, as a hand-written loop does.
        device_state = jax.device_put(record.state.state_dict()) if contender == "orbax" else None
        manager = ocp.CheckpointManager(orbax_dir) if contender == "orbax" else None
        writer = fs.CheckpointFileWriter(flax_dir, host_memory_budget=budget) if contender != "orbax" else None
        before = host_resident()
        reset_host_peak()
        start = time.perf_counter()
        if writer is not None:
            writer(record)
            writer.close()
        else:
            assert manager is not None
            manager.save(1, args=ocp.args.StandardSave(device_state))
            manager.wait_until_finished()
            manager.close()
    else:  # a resume into shapes and shardings (nothing allocated before: freed pages would stay resident)
        device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        shaped = jax.tree.map(
            lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=device),
            jax.eval_shape(lambda: fs.FlaxOptimTrainState.create(optimizer, model.init(jax.random.key(0), x))),
        )
        state_bytes = sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(shaped))
        before = host_resident()
        reset_host_peak()
        start = time.perf_counter()
        if contender != "orbax":
            restored: Any = fs.CheckpointFileReader(flax_dir, host_memory_budget=budget).restore(shaped)
        else:
            manager = ocp.CheckpointManager(orbax_dir)
            restored = manager.restore(manager.latest_step(), args=ocp.args.StandardRestore(shaped.state_dict()))
        jax.block_until_ready(jax.tree.leaves(restored))
    seconds = time.perf_counter() - start
    peak = host_peak_since_reset()
    assert before is not None and peak is not None, "/proc is needed (Linux)"
    largest = max(
        leaf.size * leaf.dtype.itemsize for leaf in jax.tree.leaves(jax.eval_shape(model.init, jax.random.key(0), x))
    )
    return {"seconds": seconds, "added": peak - before, "state_bytes": state_bytes, "largest": largest}


def in_fresh_process(module: str, function: str, *arguments: Any, timeout: float = 600) -> Any:
    """`module.function(*arguments)` (a module of this folder) in a fresh Python process: its result, as JSON."""
    code = f"import json, sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); import {module}; "
    code += f"print(json.dumps({module}.{function}(*{arguments!r})))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False, timeout=timeout)
    if done.returncode != 0:
        raise RuntimeError(f"{module}.{function}{arguments!r} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def run(
    operation: str, contender: str, directory: str, mib: int, budget_mib: int, record_memory: str
) -> dict[str, Any]:
    """`measure` in a fresh process."""
    return in_fresh_process("host_memory", "measure", operation, contender, directory, mib, budget_mib, record_memory)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--mib", type=int, default=256, help="the train state's MiB (params and adam's two moments)")
    parser.add_argument("--budget-mib", type=int, default=16, help="flaxstate-budget's host_memory_budget, in MiB")
    parser.add_argument(
        "--record-memory", choices=("host", "device"), default="host", help="where flaxstate's loop holds its records"
    )
    args = parser.parse_args()
    figures: dict[tuple[str, str], list[dict[str, Any]]] = {case: [] for case in CASES}
    for index in range(args.rounds):
        with tempfile.TemporaryDirectory() as directory:
            order = CONTENDERS[index % 3 :] + CONTENDERS[: index % 3]  # each contender first in turn
            for operation in ("save", "restore"):  # a restore reads what the save of its round wrote
                for contender in order:
                    figures[operation, contender].append(
                        run(operation, contender, directory, args.mib, args.budget_mib, args.record_memory)
                    )
    first = figures[CASES[0]][0]
    state_bytes = first["state_bytes"]
    print(
        f"state: {state_bytes / MiB:.0f} MiB, its largest array {first['largest'] / MiB:.0f} MiB; flaxstate-budget: "
        f"host_memory_budget={args.budget_mib} MiB; records in {args.record_memory} memory; medians of "
        f"{args.rounds} rounds, a fresh process each"
    )
    print(f"{'operation':<10} {'contender':<10} {'peak added (MiB)':>17} {'x state':>8} {'seconds':>8}")
    for operation, contender in CASES:
        added = statistics.median(figure["added"] for figure in figures[operation, contender])
        seconds = statistics.median(figure["seconds"] for figure in figures[operation, contender])
        print(f"{operation:<10} {contender:<10} {added / MiB:>17.0f} {added / state_bytes:>8.2f} {seconds:>8.2f}")


if __name__ == "__main__":
    main()
