"""What the watchdog costs on the per-step path: the loop with it and without, side by side.

Three loops of the small MLP (two hidden layers of width 64, batch 64, adam)
in one process, a record every 1,000 steps: with the watchdog
(`hang_timeout="auto"`, the default: a thread looking once a second, and per
dispatch two stores and a deque append on the loop's side), without it
(`hang_timeout=None`), and without it again, to show the noise of two equal
contenders. K=1 and K=10; rounds of 1,000 steps, each contender first and
last in turn; the table gives median microseconds a step and the ratio.

    python benchmarks/watchdog.py [--rounds 15]
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import time

import flax.linen as nn
import jax
import numpy as np
import optax

import flaxstate as fs


class MLP(nn.Module):
    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        for _ in range(2):
            x = nn.relu(nn.Dense(64)(x))
        return nn.Dense(10)(x)


def loss_fn(logits: jax.Array, labels: jax.Array) -> jax.Array:
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


def runner(hang_timeout: float | str | None, per_dispatch: int, steps: int):
    rng = np.random.RandomState(0)
    data = [(rng.randn(64, 64).astype(np.float32), rng.randint(0, 10, 64).astype(np.int32)) for _ in range(64)]
    model = MLP()
    task = fs.TrainTask(apply=model.apply, optimizer=optax.adam(1e-3), loss=loss_fn, data=itertools.cycle(data))
    loop = fs.TrainLoop(
        model.init,
        task,
        0,
        n_steps=10**9,
        n_steps_per_checkpoint=steps,
        n_steps_per_dispatch=per_dispatch,
        hang_timeout=hang_timeout,
        stdout=False,
    )
    return loop.next_checkpoint


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--steps", type=int, default=1000)
    args = parser.parse_args()
    print(f"jax {jax.__version__}, {jax.devices()[0].device_kind}, {args.rounds} rounds of {args.steps} steps")
    print("\n| K | loop | us/step (median) | throughput vs no watchdog |\n|---:|---|---:|---:|")
    for per_dispatch in (1, 10):
        runners = {
            "no watchdog": runner(None, per_dispatch, args.steps),
            'watchdog ("auto")': runner("auto", per_dispatch, args.steps),
            "no watchdog, again (the noise)": runner(None, per_dispatch, args.steps),
        }
        for run in runners.values():
            run()
        times: dict[str, list[float]] = {name: [] for name in runners}
        names = list(runners)
        for index in range(args.rounds):
            for name in names[index % 3 :] + names[: index % 3]:
                start = time.perf_counter()
                runners[name]()
                times[name].append((time.perf_counter() - start) / args.steps * 1e6)
        medians = {name: statistics.median(values) for name, values in times.items()}
        for name, us in medians.items():
            print(f"| {per_dispatch} | {name} | {us:.1f} | {medians['no watchdog'] / us:.3f}x |")


if __name__ == "__main__":
    main()
