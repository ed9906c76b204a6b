"""What an EMA of the parameters costs: the loop with TrainTask(ema_decay=0.999) and without, side by side.

Three loops in one process, a record every 1,000 steps: with the EMA, without
it, and without it again, to show the noise of two equal contenders. Two
models: the small MLP (two hidden layers of width 64, batch 64, adam: bound by
the host) and a larger one (width 1024, batch 256: bound by compute here).
K=10; rounds of 1,000 steps (100 for the larger), each contender first and last
in turn; the table gives median microseconds a step and the ratio.

    python benchmarks/ema.py [--rounds 9]
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
    width: int = 64

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        for _ in range(2):
            x = nn.relu(nn.Dense(self.width)(x))
        return nn.Dense(10)(x)


def loss_fn(logits: jax.Array, labels: jax.Array) -> jax.Array:
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


def runner(ema_decay: float | None, width: int, batch: int, steps: int):
    rng = np.random.RandomState(0)
    data = [(rng.randn(batch, 64).astype(np.float32), rng.randint(0, 10, batch).astype(np.int32)) for _ in range(64)]
    model = MLP(width)
    task = fs.TrainTask(
        apply=model.apply,
        optimizer=optax.adam(1e-3),
        loss=loss_fn,
        data=itertools.cycle(data),
        ema_decay=ema_decay,
    )
    loop = fs.TrainLoop(
        model.init, task, 0, n_steps=10**9, n_steps_per_checkpoint=steps, n_steps_per_dispatch=10, stdout=False
    )
    return loop.next_checkpoint


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=9)
    args = parser.parse_args()
    print(f"jax {jax.__version__}, {jax.devices()[0].device_kind}, {args.rounds} rounds, K=10")
    print("\n| model | loop | us/step (median) | throughput vs no EMA |\n|---|---|---:|---:|")
    for title, width, batch, steps in (
        ("small MLP (64, batch 64)", 64, 64, 1000),
        ("MLP (1024, batch 256)", 1024, 256, 100),
    ):
        runners = {
            "no EMA": runner(None, width, batch, steps),
            "EMA (0.999)": runner(0.999, width, batch, steps),
            "no EMA, again (the noise)": runner(None, width, batch, steps),
        }
        for run in runners.values():
            run()
        times: dict[str, list[float]] = {name: [] for name in runners}
        names = list(runners)
        for index in range(args.rounds):
            for name in names[index % 3 :] + names[: index % 3]:
                start = time.perf_counter()
                runners[name]()
                times[name].append((time.perf_counter() - start) / steps * 1e6)
        medians = {name: statistics.median(values) for name, values in times.items()}
        for name, us in medians.items():
            print(f"| {title} | {name} | {us:.1f} | {medians['no EMA'] / us:.3f}x |")


if __name__ == "__main__":
    main()
