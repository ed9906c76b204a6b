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

import jax
from contenders import in_turn, make_loop


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=9)
    args = parser.parse_args()
    print(f"jax {jax.__version__}, {jax.devices()[0].device_kind}, {args.rounds} rounds, K=10")
    print("\n| model | loop | us/step (median) | throughput vs no EMA |\n|---|---|---:|---:|")
    models = (("small MLP (64, batch 64)", 64, 64, 1000), ("MLP (1024, batch 256)", 1024, 256, 100))
    for title, width, batch, steps in models:

        def loop(ema_decay: float | None, width: int = width, batch: int = batch, steps: int = steps):
            shape = {"width": width, "batch": batch, "per_dispatch": 10}
            return make_loop(steps, task={"ema_decay": ema_decay}, **shape).next_checkpoint

        runners = {"no EMA": loop(None), "EMA (0.999)": loop(0.999), "no EMA, again (the noise)": loop(None)}
        medians = in_turn(runners, args.rounds, steps)
        for name, us in medians.items():
            print(f"| {title} | {name} | {us:.1f} | {medians['no EMA'] / us:.3f}x |")


if __name__ == "__main__":
    main()
