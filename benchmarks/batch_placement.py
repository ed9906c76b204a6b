"""Where batches go on the devices: three ways to feed TrainLoop, side by side.

- host arrays to the compiled step (flaxstate's way in one process): the step
  states its input shardings and places them in JAX's C++ dispatch path;
- `jax.device_put` ahead of use, two dispatches ahead (the classic prefetch);
- a compiled identity that places each batch ahead of use.

Small MLP (width 64, batch 64), one process, alternating rounds, medians.

    python benchmarks/batch_placement.py [--rounds 7] [--steps 400]
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
from jax.sharding import NamedSharding
from loop_overhead import MLP, flaxstate_runner, make_data

import flaxstate.training.batching as batching

HOST = batching.to_devices


def device_put_ahead(batch, mesh, stacked):
    return jax.device_put(batch, NamedSharding(mesh, batching.batch_spec(stacked)))


_placers: dict = {}


def compiled_identity_ahead(batch, mesh, stacked):
    if stacked not in _placers:
        sharding = NamedSharding(mesh, batching.batch_spec(stacked))
        _placers[stacked] = jax.jit(lambda b: b, in_shardings=sharding, out_shardings=sharding)
    return _placers[stacked](batch)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=400)
    args = parser.parse_args()
    ways = {
        "host arrays to the step": HOST,
        "device_put ahead": device_put_ahead,
        "compiled identity ahead": compiled_identity_ahead,
    }
    model, data = MLP(64), make_data(64, 64)
    runners = {}
    for name, way in ways.items():
        batching.to_devices = way
        runners[name] = (way, flaxstate_runner(model, data, 1, args.steps))
    times = {name: [] for name in ways}
    for way, run in runners.values():
        batching.to_devices = way
        run(args.steps)
    for index in range(args.rounds):
        for name in ways if index % 2 == 0 else reversed(list(ways)):
            way, run = runners[name]
            batching.to_devices = way
            start = time.perf_counter()
            run(args.steps)
            times[name].append((time.perf_counter() - start) / args.steps * 1e6)
    batching.to_devices = HOST
    base = statistics.median(times["host arrays to the step"])
    print(f"jax {jax.__version__}, {jax.devices()[0].device_kind}, {args.rounds} alternating rounds, K=1")
    print("\n| batches placed by | us/step (median) | throughput vs host arrays |\n|---|---:|---:|")
    for name, values in times.items():
        print(f"| {name} | {statistics.median(values):.1f} | {base / statistics.median(values):.2f}x |")


if __name__ == "__main__":
    main()
