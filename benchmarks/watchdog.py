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

import jax
from contenders import in_turn, make_loop


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--steps", type=int, default=1000)
    args = parser.parse_args()
    print(f"jax {jax.__version__}, {jax.devices()[0].device_kind}, {args.rounds} rounds of {args.steps} steps")
    print("\n| K | loop | us/step (median) | throughput vs no watchdog |\n|---:|---|---:|---:|")
    for per_dispatch in (1, 10):
        runners = {
            "no watchdog": make_loop(args.steps, per_dispatch=per_dispatch, hang_timeout=None).next_checkpoint,
            'watchdog ("auto")': make_loop(args.steps, per_dispatch=per_dispatch, hang_timeout="auto").next_checkpoint,
            "no watchdog, again (the noise)": make_loop(
                args.steps, per_dispatch=per_dispatch, hang_timeout=None
            ).next_checkpoint,
        }
        medians = in_turn(runners, args.rounds, args.steps)
        for name, us in medians.items():
            print(f"| {per_dispatch} | {name} | {us:.1f} | {medians['no watchdog'] / us:.3f}x |")


if __name__ == "__main__":
    main()
