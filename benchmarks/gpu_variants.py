"""What the K-step program's shape costs a step on a device: flaxstate's loop with its update built other ways.

An experiment, not a contract: each variant patches how `flaxstate.training.step`
builds the update while its loop compiles (the patch is undone after), beside the
hand-written jit + scan loop of `loop_overhead.py`, small MLP, K=10, order shuffled.

- "no fence": the K-step updates without `lax.optimization_barrier` on the gradients;
- "unrolled": the K steps' `lax.scan` written out (`unroll=True`), no device loop;
- both.

    python benchmarks/gpu_variants.py [--rounds 5] [--runs 3] [--steps 400]
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import types
from collections.abc import Iterator

import jax
from jax import lax
from loop_overhead import MLP, flaxstate_runner, handwritten_jit_runner, make_data, measure, ratio, spread

from flaxstate.training import step as step_module

CALLS = {"fenced": 0, "unrolled": 0}
"""What the patches built: fenced steps, unrolled scans (printed, to show the patch took)."""


@contextlib.contextmanager
def patched(fence: bool, unroll: bool) -> Iterator[None]:
    make, scan_lax = step_module.make_train_step, step_module.lax

    def make_train_step(*args, fenced=False, **kwargs):
        CALLS["fenced"] += fenced and fence
        return make(*args, fenced=fenced and fence, **kwargs)

    def scan(body, init, xs=None, length=None, **kwargs):
        CALLS["unrolled"] += unroll
        return lax.scan(body, init, xs, length=length, unroll=True if unroll else kwargs.pop("unroll", 1), **kwargs)

    step_module.make_train_step = make_train_step
    step_module.lax = types.SimpleNamespace(**{**vars(lax), "scan": scan})
    try:
        yield
    finally:
        step_module.make_train_step, step_module.lax = make, scan_lax


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--steps", type=int, default=400)
    args = parser.parse_args()
    model, data, k = MLP(64), make_data(64, 64), 10
    device = jax.devices()[0].device_kind
    print(f"jax {jax.__version__}, {device}, small MLP, K={k}, {args.runs} runs of {args.rounds} rounds")
    runners = {"hand-written jit + scan": handwritten_jit_runner(model, data, k)}
    for name, fence, unroll in (
        ("flaxstate", True, False), ("flaxstate, no fence", False, False),
        ("flaxstate, unrolled", True, True), ("flaxstate, no fence, unrolled", False, True),
    ):  # fmt: skip
        with patched(fence, unroll):
            run = flaxstate_runner(model, data, k, args.steps)
            run(args.steps)  # compiles under the patch
        runners[name] = run
        print(f"{name}: built {CALLS}")
        CALLS.update(fenced=0, unrolled=0)
    runs = [measure(runners, args.rounds, args.steps, seed) for seed in range(args.runs)]
    print("\n| loop | us/step | vs hand-written jit + scan |\n|---|---:|---:|")
    for name in runners:
        us = statistics.median(statistics.median(run[name]) for run in runs)
        print(f"| {name} | {us:.1f} | {spread([ratio(run['hand-written jit + scan'], run[name]) for run in runs])} |")


if __name__ == "__main__":
    main()
