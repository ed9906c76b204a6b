"""What the time accounting costs: the goodput ledger's line a record, side by side against no ledger.

Two loops of the small MLP (two hidden layers of width 64, batch 64, adam) in
one process, a record every 100 steps, each record handed to a
`CheckpointFileWriter` that saves none of them (`fs.EverySeconds` of an hour),
one with its ledger (a fsync'd JSON line a record) and one with
`ledger=False`, and a second loop without one, to show the noise between two
equal contenders. All carry the FLOPs (counted once, at the first record),
the compile time (two reads of a sum a record) and the session. Rounds of
1,000 steps, each contender first and last in turn; the table gives median
microseconds a step and the ratio; then what one ledger line costs the
writer's call, timed alone.

    python benchmarks/goodput.py [--rounds 9] [--steps 1000]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import jax
from contenders import in_turn, make_loop

import flaxstate as fs
from flaxstate.run_record.ledger import Ledger


def runner(run_dir: Path, ledger: bool, every: int):
    loop = make_loop(every)
    writer = fs.CheckpointFileWriter(run_dir, every=fs.EverySeconds(3600), ledger=ledger)

    def run(n_steps: int) -> None:
        for _ in range(n_steps // every):
            writer(loop.next_checkpoint())

    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--every", type=int, default=100)
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp())
    runners = {
        "no ledger": runner(root / "a", False, args.every),
        "ledger": runner(root / "b", True, args.every),
        "no ledger, again (the noise)": runner(root / "c", False, args.every),
    }
    medians = in_turn({name: lambda run=run: run(args.steps) for name, run in runners.items()}, args.rounds, args.steps)
    print(
        f"jax {jax.__version__}, {jax.devices()[0].device_kind}, {args.rounds} alternating rounds of {args.steps} steps"
    )
    print(f"\n| record every {args.every} steps | us/step (median) | throughput vs no ledger |\n|---|---:|---:|")
    for name, us in medians.items():
        print(f"| {name} | {us:.1f} | {medians['no ledger'] / us:.3f}x |")

    (root / "lines").mkdir()
    ledger = Ledger(root / "lines")
    record = fs.Checkpoint(
        state=None,
        grads=None,
        loss=0.1,
        n_completed_steps=100,
        elapsed_time=0.1,
        step=100,
        run_id="bench",
        session=fs.Session(started=time.time(), startup=1.0),
    )
    ledger.record(record)
    n = 1000
    start = time.perf_counter()
    for _ in range(n):
        ledger.record(record)
    per_line = (time.perf_counter() - start) / n * 1e6
    ledger.close()
    share = per_line / (medians["no ledger"] * args.every)
    print(
        f"\none ledger line in the writer's call (JSON, write, flush; the fsync on its own thread): {per_line:.1f} us,"
    )
    print(f"{share:.2%} of a record of {args.every} steps at the no-ledger speed")


if __name__ == "__main__":
    main()
