"""The loop on an Explicit mesh against the same loop on an Auto mesh: start-up and step time, linen and NNX.

One process, its one device, the same model, data and rules: `jax.make_mesh((1,), ("data",))` (Explicit axes,
JAX's default now; the loop traces under `jax.set_mesh`) against `jax.sharding.Mesh(devices, ("data",))` (Auto).
Each round builds a fresh loop of each in turn, the order rotating: start-up is construction to the first record
(the compile with it), a step the time from the first record to the last over the steps between. Medians over
the rounds after the first (the process's own warm-up), and the ratio Explicit / Auto.

With `--processes 2`, each contender is data-parallel over two processes of one CPU device each, joined over gloo
on loopback (several CPU devices in one process deadlock in collectives here): each round starts two fresh
processes for each contender in turn, the order rotating, and process 0's figures count (its start-up, JAX's join
and imports apart, is construction to the first record, as above). Every round counts: each is a fresh process.

    python benchmarks/explicit_mesh.py [--rounds 7] [--steps 400] [--width 512] [--processes 2]
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import flaxstate as fs

RULES = [("batch", "data")]
BATCH = 64
RECORD_EVERY = 100


class MLP(nn.Module):
    width: int

    @nn.compact
    def __call__(self, x):
        for _ in range(3):
            x = nn.relu(nn.Dense(self.width)(x))
        return nn.Dense(1)(x)[:, 0]


class NNXMLP(nnx.Module):
    def __init__(self, width: int, rngs: nnx.Rngs) -> None:
        self.layers = nnx.List([nnx.Linear(width, width, rngs=rngs) for _ in range(3)])
        self.out = nnx.Linear(width, 1, rngs=rngs)

    def __call__(self, x):
        for layer in self.layers:
            x = nnx.relu(layer(x))
        return self.out(x)[:, 0]


def mse(outputs, targets):
    return jnp.mean((outputs - targets) ** 2)


CONTENDERS = ("Explicit (jax.make_mesh)", "Auto (jax.sharding.Mesh)")


def meshes(n_devices: int = 1) -> dict[str, jax.sharding.Mesh]:
    devices = jax.devices()[:n_devices]
    explicit = jax.make_mesh((n_devices,), ("data",), devices=devices)
    return dict(zip(CONTENDERS, (explicit, jax.sharding.Mesh(np.asarray(devices), ("data",))), strict=True))


def run(api: str, mesh: jax.sharding.Mesh, width: int, steps: int) -> tuple[float, float]:
    """One fresh loop: seconds to its first record, and seconds a step after it (this process's part of the batch)."""
    rng = np.random.default_rng(jax.process_index())
    part = BATCH // jax.process_count()
    data = [(rng.standard_normal((part, width), np.float32), rng.standard_normal(part).astype(np.float32))] * steps
    model: Any = MLP(width) if api == "linen" else NNXMLP(width, nnx.Rngs(0))
    task = fs.TrainTask(
        apply=model.apply if api == "linen" else model, optimizer=optax.adam(1e-3), loss=mse, data=iter(data)
    )
    start = time.perf_counter()
    loop = fs.TrainLoop(
        model.init if api == "linen" else model,
        task,
        0,
        n_steps=steps,
        n_steps_per_checkpoint=RECORD_EVERY,
        stdout=False,
        mesh=mesh,
        axis_rules=RULES,
    )
    records = iter(loop)
    next(records)
    first = time.perf_counter()
    (last,) = collections.deque(records, maxlen=1)
    assert np.isfinite(last.loss)
    return first - start, (time.perf_counter() - first) / (steps - RECORD_EVERY)


def worker(config: dict) -> None:
    """One of two processes of a contender: joins the other over gloo, trains, prints its figures as JSON."""
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    address = f"127.0.0.1:{config['port']}"
    jax.distributed.initialize(address, 2, config["id"], coordinator_bind_address=address)
    figure = run(config["api"], meshes(2)[config["mesh"]], config["width"], config["steps"])
    print("figure", json.dumps(figure), flush=True)


def in_processes(api: str, name: str, width: int, steps: int) -> tuple[float, float]:
    """Two fresh processes train the contender `name`; process 0's figures."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    started = [
        subprocess.Popen(
            [
                sys.executable,
                __file__,
                "--worker",
                json.dumps(dict(api=api, mesh=name, width=width, steps=steps, port=port, id=index)),
            ],
            stdout=subprocess.PIPE,
            text=True,
            env={**os.environ, "JAX_PLATFORMS": "cpu"},
        )  # fmt: skip
        for index in range(2)
    ]
    outputs = [process.communicate(timeout=600)[0] for process in started]
    assert all(process.returncode == 0 for process in started), outputs
    return tuple(json.loads(next(line for line in outputs[0].splitlines() if line.startswith("figure "))[7:]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--processes", type=int, choices=(1, 2), default=1)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(json.loads(args.worker))
    contenders = meshes() if args.processes == 1 else dict.fromkeys(CONTENDERS)
    figures: dict[tuple[str, str], list[tuple[float, float]]] = {}
    for index in range(args.rounds):
        for api in ("linen", "nnx"):
            names = list(contenders)
            shift = index % len(names)
            for name in names[shift:] + names[:shift]:  # each first in turn
                if args.processes == 2:
                    figures.setdefault((api, name), []).append(in_processes(api, name, args.width, args.steps))
                    continue
                figure = run(api, contenders[name], args.width, args.steps)
                if index:  # the first round warms the process
                    figures.setdefault((api, name), []).append(figure)
    counted = f"rounds 2-{args.rounds}" if args.processes == 1 else f"{args.rounds} rounds of fresh processes"
    where = jax.devices()[0] if args.processes == 1 else "2 processes of one CPU device, gloo"
    print(
        f"MLP of width {args.width} (3 hidden layers), batch {BATCH}, adam, a record every {RECORD_EVERY} steps, "
        f"{args.steps} steps a loop; medians of {counted}; jax {jax.__version__}, {where}"
    )
    print(f"{'model':<6} {'mesh':<26} {'start-up (s)':>12} {'ms/step':>8} {'start-up ratio':>15} {'step ratio':>11}")
    for api in ("linen", "nnx"):
        auto = figures[(api, "Auto (jax.sharding.Mesh)")]
        for name in contenders:
            runs = figures[(api, name)]
            startup = statistics.median(figure[0] for figure in runs)
            step = statistics.median(figure[1] for figure in runs)
            startup_ratio = startup / statistics.median(figure[0] for figure in auto)
            step_ratio = step / statistics.median(figure[1] for figure in auto)
            print(
                f"{api:<6} {name:<26} {startup:>12.2f} {step * 1e3:>8.3f} {startup_ratio:>14.2f}x {step_ratio:>10.2f}x"
            )


if __name__ == "__main__":
    main()
