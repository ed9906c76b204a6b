"""What `fs.Rollback` costs: armed and never firing against unarmed, and one rollback against a restart.

One process, three loops of the same model built side by side: without a
rollback, with `rollback=fs.Rollback()` (the non-finite watch), and with
`fs.Rollback(spike=1e3)` (the spike watch too, never firing); rounds
alternate between them in a shuffled order,
each round `--records` records of `--every` steps, timed end to end (medians
over `--rounds`). For a tiny MLP (width 8, batch 8) and a small one (width
256, batch 64), at K=1 and K=10 steps a dispatch.

Then what a rollback costs, on the small MLP: a run with one poisoned batch
(inf inputs) against the same run without it, less the steps it throws away
(the seconds from the bad step's detection to training again: going back to
the host copy of the last record and moving the data), against a restart
from the last checkpoint through `flaxstate launch` (a new process: its
imports, the restore, the compile, one step).

    python benchmarks/rollback.py [--rounds 7] [--records 4] [--every 100]
"""

from __future__ import annotations

import argparse
import random
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

import flaxstate as fs

MODELS = {"tiny": (8, 8), "small": (256, 64)}
"""name: (width, batch)."""


class MLP(nn.Module):
    width: int

    @nn.compact
    def __call__(self, x):
        return nn.Dense(1)(nn.relu(nn.Dense(self.width)(x)))[:, 0]


def mse(outputs, targets):
    return jnp.mean((outputs - targets) ** 2)


def batches(n: int, batch: int, seed: int = 0) -> list[tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, batch, 16)).astype(np.float32)
    return [(x[i], x[i].sum(axis=1)) for i in range(n)]


def make_loop(model: str, k: int, every: int, data, rollback, init=None) -> fs.TrainLoop:
    width, _ = MODELS[model]
    module = MLP(width)
    task = fs.TrainTask(apply=module.apply, optimizer=optax.adam(1e-3), loss=mse, data=data)
    return fs.TrainLoop(
        init or module.init,
        task,
        0,
        n_steps=every,
        n_steps_per_checkpoint=every,
        n_steps_per_dispatch=k,
        rollback=rollback,
        stdout=False,
    )


ARMED = {"unarmed": None, "armed": fs.Rollback(), "armed, spike=1e3": fs.Rollback(spike=1e3)}
"""The contenders: no rollback, the non-finite watch alone, and the spike watch too (never firing at 1e3)."""


def armed_cost(model: str, k: int, rounds: int, records: int, every: int) -> dict[str, tuple[float, list[float]]]:
    """Each contender's microseconds a step (median) and each round's ratio to the unarmed loop's."""
    _, batch = MODELS[model]
    data = batches(64, batch)
    repeated = data * (rounds * records * every // len(data) + 2 * every)
    loops = {name: make_loop(model, k, every, repeated, policy) for name, policy in ARMED.items()}
    for loop in loops.values():  # compiled, and one record made
        list(loop)
    times: dict[str, list[float]] = {name: [] for name in loops}
    for _ in range(rounds):
        order = list(loops)
        random.shuffle(order)
        for name in order:
            loop = loops[name]
            start = time.perf_counter()
            for _ in loop.run(loop.step + records * every):
                pass
            times[name].append((time.perf_counter() - start) / (records * every) * 1e6)
    return {
        name: (statistics.median(each), [a / b for a, b in zip(each, times["unarmed"], strict=True)])
        for name, each in times.items()
    }


def rollback_seconds(every: int) -> tuple[float, float]:
    """The small MLP: seconds a rollback adds beyond the steps it throws away, and the steps thrown away."""
    _, batch = MODELS["small"]
    clean = batches(4 * every, batch)
    poisoned = list(clean)
    x, y = poisoned[every + every // 2]
    poisoned[every + every // 2] = (np.full_like(x, np.inf), y)
    results = []
    for data in (clean, poisoned):
        loop = make_loop("small", 1, every, data, fs.Rollback())
        list(loop)  # compiled, one record
        start = time.perf_counter()
        (record,) = list(loop.run(2 * every))
        results.append((time.perf_counter() - start, record))
    (clean_seconds, _), (poisoned_seconds, record) = results
    assert record.rollbacks, "the poisoned batch rolled nothing back"
    thrown = record.timing.rolled_back_time
    # The poisoned run trains its record's steps after the rollback as the clean one does; what it adds beyond
    # them is the thrown-away steps and going back.
    return poisoned_seconds - clean_seconds, thrown


RESTART = textwrap.dedent(
    """
    import sys, time
    started = time.time()
    sys.path.insert(0, {benchmarks!r})
    import rollback as bench
    import flaxstate as fs
    _, batch = bench.MODELS["small"]
    module = bench.MLP(bench.MODELS["small"][0])
    reader = fs.CheckpointFileReader({directory!r}, target=module.init)
    data = bench.batches(4 * {every}, batch)
    loop = bench.make_loop("small", 1, {every}, data, None, init=reader)
    loop.run(loop.step + 1).__next__()
    print("restarted", time.time() - started, flush=True)
    """
)


def restart_seconds(every: int) -> float:
    """Seconds from `flaxstate launch` starting a process to its first step after restoring the last checkpoint."""
    _, batch = MODELS["small"]
    with tempfile.TemporaryDirectory() as directory:
        loop = make_loop("small", 1, every, batches(4 * every, batch), None)
        with fs.CheckpointFileWriter(directory) as writer:
            for record in loop:
                writer(record)
        script = Path(directory) / "restart.py"
        script.write_text(RESTART.format(benchmarks=str(Path(__file__).parent), directory=directory, every=every))
        start = time.perf_counter()
        done = subprocess.run(
            [sys.executable, "-m", "flaxstate", "launch", "--processes", "1", "--", sys.executable, str(script)],
            capture_output=True,
            text=True,
            timeout=600,
        )
        seconds = time.perf_counter() - start
        assert done.returncode == 0 and "restarted" in done.stdout, done.stdout + done.stderr
        return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--records", type=int, default=4)
    parser.add_argument("--every", type=int, default=100)
    args = parser.parse_args()
    print(f"jax {jax.__version__}, {jax.default_backend()}, {args.rounds} shuffled rounds of {args.records} records")
    print("| model | K | loop | us/step | against unarmed (median of rounds, range) |")
    print("|---|---:|---|---:|---:|")
    for model in MODELS:
        for k in (1, 10):
            for name, (median, ratios) in armed_cost(model, k, args.rounds, args.records, args.every).items():
                spread = f"{statistics.median(ratios):.3f}x ({min(ratios):.3f} to {max(ratios):.3f})"
                print(f"| {model} MLP | {k} | {name} | {median:.1f} | {spread} |")
    added, thrown = rollback_seconds(args.every)
    restart = restart_seconds(args.every)
    print()
    print("| small MLP, K=1 | seconds |")
    print("|---|---:|")
    print(f"| a run with one rollback, beyond the same run without it | {added:.3f} |")
    print(f"| of which the steps thrown away and going back (`timing.rolled_back_time`) | {thrown:.3f} |")
    print(f"| a restart from the last checkpoint through `flaxstate launch` (to its first step) | {restart:.3f} |")


if __name__ == "__main__":
    main()
