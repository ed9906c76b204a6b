"""Gradient accumulation: compiled temporary memory and step time against the number of microbatches.

One process, an MLP whose activations dominate its memory (a large batch
through `--depth` layers of `--width`, adam), trained by TrainLoop at the
same global batch with `n_microbatches` M = 1, 2, 4, 8. For each M: the
compiled update's temporary bytes (XLA's `memory_analysis()` of the program
the loop runs: activations, gradients and scratch), and the median seconds a
step over alternating rounds (one record a round, so the host waits for the
devices once a round). Ratios are to M = 1.

    python benchmarks/accumulation.py [--rounds 5] [--steps 5] [--batch 4096] [--width 512] [--depth 4]
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import numpy as np
import optax
from loop_overhead import MLP, loss_fn  # the loop benchmark's model: `depth` layers of `width`

import flaxstate as fs

FEATURES = 256


def make_loop(model: MLP, batch: tuple[np.ndarray, np.ndarray], n_microbatches: int, steps: int) -> fs.TrainLoop:
    task = fs.TrainTask(apply=model.apply, optimizer=optax.adam(1e-3), loss=loss_fn, data=Forever(batch))
    return fs.TrainLoop(
        model.init,
        task,
        jax.random.key(0),
        n_steps=10**9,
        n_steps_per_checkpoint=steps,
        n_microbatches=n_microbatches,
        stdout=False,
    )


class Forever:
    """The same batch, forever (re-iterable)."""

    def __init__(self, batch: tuple[np.ndarray, np.ndarray]) -> None:
        self._batch = batch

    def __iter__(self):
        while True:
            yield self._batch


def temporary_bytes(loop: fs.TrainLoop, batch: tuple[np.ndarray, np.ndarray]) -> int:
    """XLA's temporary bytes for the loop's compiled one-step update (its own program, lowered again)."""
    rng_data = jax.random.key_data(jax.random.key(0))  # the programs take a key's raw data
    lowered = loop.program.update(1).lower(jax.tree.leaves(loop.state), ((batch[0],), (batch[1],)), rng_data)
    return int(lowered.compile().memory_analysis().temp_size_in_bytes)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=5, help="steps a round")
    parser.add_argument("--batch", type=int, default=4096)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--depth", type=int, default=4)
    args = parser.parse_args()
    rng = np.random.RandomState(0)
    batch = (rng.randn(args.batch, FEATURES).astype(np.float32), rng.randint(0, 10, args.batch).astype(np.int32))
    model = MLP(args.width, args.depth)
    loops = {m: make_loop(model, batch, m, args.steps) for m in (1, 2, 4, 8)}
    for loop in loops.values():
        loop.next_checkpoint()  # compiled and warm
    temporary = {m: temporary_bytes(loop, batch) for m, loop in loops.items()}
    times: dict[int, list[float]] = {m: [] for m in loops}
    for index in range(args.rounds):
        for m in list(loops) if index % 2 == 0 else list(reversed(loops)):
            start = time.perf_counter()
            loops[m].next_checkpoint()
            times[m].append((time.perf_counter() - start) / args.steps)
    n_params = sum(leaf.size for leaf in jax.tree.leaves(loops[1].state.params))
    print(
        f"jax {jax.__version__}, {jax.devices()[0].device_kind}; MLP {FEATURES}-{args.width}x{args.depth}-10 "
        f"({n_params / 1e6:.2f}M parameters, adam), global batch {args.batch}, {args.rounds} alternating rounds "
        f"of {args.steps} steps\n"
    )
    print("| n_microbatches | temporary MiB | x M=1 | ms a step (median) | x M=1 |")
    print("|---:|---:|---:|---:|---:|")
    for m in loops:
        median = statistics.median(times[m])
        print(
            f"| {m} | {temporary[m] / 2**20:.1f} | {temporary[m] / temporary[1]:.2f}x | {median * 1e3:.1f} | "
            f"{median / statistics.median(times[1]):.2f}x |"
        )


if __name__ == "__main__":
    main()
