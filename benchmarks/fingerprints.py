"""What a resume audit's fingerprints cost: the state's at a record against the record's host copy, and the
bytes digest of a batch (data that is not `fs.global_batches`) against nothing.

Both in one process, alternating, medians over `--rounds`:

- a record: `fingerprints.of_state` of a state of `--mib` MiB (four float32
  arrays on the default device), read back, against the copy a record makes
  of the same state in host memory (numpy, leaf by leaf);
- a batch: `BatchDigest.add` of an `(x, y)` batch of each size, in
  microseconds (the loop's thread adds each dispatch's batch after it
  dispatched it, while the devices run it).

    python benchmarks/fingerprints.py [--rounds 9] [--mib 1,49]
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax.numpy as jnp
import numpy as np

from flaxstate import fingerprints


def seconds(work, rounds: int) -> list[float]:
    work()
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        work()
        times.append(time.perf_counter() - start)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--mib", default="1,49", help="state sizes in MiB")
    args = parser.parse_args()
    print(f"{'state':>10} {'fingerprint ms':>15} {'host copy ms':>13} {'ratio':>6}")
    for mib in (int(size) for size in args.mib.split(",")):
        n = mib * 2**20 // 16
        leaves = [jnp.full((n,), float(index), jnp.float32) for index in range(4)]
        fingerprint, copy = [], []
        for _ in range(args.rounds):  # alternating
            fingerprint += seconds(lambda leaves=leaves: fingerprints.text(fingerprints.of_state(leaves)), 1)
            copy += seconds(lambda leaves=leaves: [np.array(leaf) for leaf in leaves], 1)
        f, c = statistics.median(fingerprint) * 1e3, statistics.median(copy) * 1e3
        print(f"{mib:>6} MiB {f:>15.2f} {c:>13.2f} {f / c:>6.2f}")
    print(f"\n{'batch (x, y)':>16} {'bytes':>9} {'digest us':>10}")
    for rows, features in ((64, 32), (256, 784), (32, 1024)):
        x = np.random.default_rng(0).random((rows, features), dtype=np.float32)
        y = np.arange(rows, dtype=np.int32)
        digest = fingerprints.BatchDigest()
        each = statistics.median(seconds(lambda digest=digest, x=x, y=y: digest.add(((x,), (y,))), args.rounds * 100))
        print(f"{f'{rows} x {features}':>16} {x.nbytes + y.nbytes:>9,} {each * 1e6:>10.2f}")


if __name__ == "__main__":
    main()
