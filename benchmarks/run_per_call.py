"""What a `loop.run(n)` call that ends its run costs, against a record of the same steps.

A notebook cell (or flax_extra's habit) calls `for c in loop.run(loop.step + n): ...` once a cell:
each call ends a run (the saves waited for, the progress display closed) and the next one starts
another. This script measures, in one process and alternating rounds, the time of such a call
against `loop.next_checkpoint()` with a record every n steps (the same steps, one record each), on
the host-bound tiny MLP where a call's fixed cost shows, and prints a table: median microseconds a
call and the ratio.

    python benchmarks/run_per_call.py [--rounds 15] [--calls 200]
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
from loop_overhead import MLP, flaxstate_runner, make_data


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--calls", type=int, default=200, help="calls a round")
    args = parser.parse_args()
    print(
        f"jax {jax.__version__}, {jax.device_count()} x {jax.devices()[0].device_kind}, "
        f"{args.rounds} alternating rounds"
    )
    model, data = MLP(8), make_data(8, 16)
    rows = []
    for steps in (1, 10):
        runners = {
            "next_checkpoint(), a record each call": flaxstate_runner(model, data, 1, steps),
            "run(step + n), the run ended each call": flaxstate_runner(model, data, 1, steps, per_call=True),
        }
        for run in runners.values():
            run(steps)  # compiled, and the first run ended
        times: dict[str, list[float]] = {name: [] for name in runners}
        for round_index in range(args.rounds):
            order = list(runners) if round_index % 2 == 0 else list(reversed(runners))
            for name in order:
                start = time.perf_counter()
                for _ in range(args.calls):
                    runners[name](steps)
                times[name].append((time.perf_counter() - start) / args.calls * 1e6)
        medians = {name: statistics.median(values) for name, values in times.items()}
        record = medians["next_checkpoint(), a record each call"]
        rows += [(steps, name, us, record / us) for name, us in medians.items()]
    print("\n| steps a call | call | us a call (median) | throughput vs a record each call |\n|---:|---|---:|---:|")
    for steps, name, us, ratio in rows:
        print(f"| {steps} | {name} | {us:.0f} | {ratio:.2f}x |")


if __name__ == "__main__":
    main()
