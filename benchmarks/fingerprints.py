"""What a resume audit's fingerprints cost: the state's at a record against the record's host copy, and the
bytes digest of a batch (data that is not `fs.global_batches`) against nothing.

Both in one process, alternating, medians over `--rounds`:

- a record: `fingerprints.of_state` of a state of `--mib` MiB (four float32
  arrays on the default device), and of a tiny MLP's (20 small leaves), read
  back, against the copy a record makes of the same state in host memory
  (numpy, leaf by leaf);
- a batch: `BatchDigest.add` of an `(x, y)` batch of each size, in
  microseconds (the loop's thread adds each dispatch's batch after it
  dispatched it, while the devices run it);
- a tiny step (a host-bound loop of 8 x 16 batches): its time with no
  digest, with `BatchDigest` on the host, and with a digest of the batch's
  bits computed inside the step's program instead (a carried uint32 and an
  output more), the alternative that the issue's "inside the step" suggests;
- a loop on 0.8 MB batches: a record of 100 steps of a `TrainLoop` with its
  fingerprints and without them, at K=1 and K=10.

    python benchmarks/fingerprints.py [--rounds 9] [--mib 1,49]
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax.numpy as jnp
import numpy as np

from flaxstate.run_record import fingerprints


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
    print(f"{'state':>22} {'fingerprint ms':>15} {'host copy ms':>13} {'ratio':>6}")
    states = {
        f"{mib} MiB, 4 leaves": [jnp.full((mib * 2**20 // 16,), float(index)) for index in range(4)]
        for mib in (int(size) for size in args.mib.split(","))
    }
    tiny = [(16, 8), (8,), (8, 8), (8,), (8, 10), (10,)] * 3 + [(), ()]  # an MLP's parameters and adam's moments
    states["a tiny MLP, 20 leaves"] = [jnp.full(shape, 0.5) for shape in tiny]
    for name, leaves in states.items():
        repeat = 1 if sum(leaf.size for leaf in leaves) > 2**20 else 200
        fingerprint, copy = [], []
        for _ in range(args.rounds):  # alternating
            each = seconds(lambda leaves=leaves: fingerprints.text(fingerprints.of_state(leaves)), repeat)
            fingerprint.append(statistics.median(each))
            copy.append(statistics.median(seconds(lambda leaves=leaves: [np.array(x) for x in leaves], repeat)))
        f, c = statistics.median(fingerprint) * 1e3, statistics.median(copy) * 1e3
        print(f"{name:>22} {f:>15.3f} {c:>13.3f} {f / c:>6.2f}")
    print(f"\n{'batch (x, y)':>16} {'bytes':>9} {'digest us':>10}")
    for rows, features in ((64, 32), (256, 784), (32, 1024)):
        x = np.random.default_rng(0).random((rows, features), dtype=np.float32)
        y = np.arange(rows, dtype=np.int32)
        digest = fingerprints.BatchDigest()
        each = statistics.median(seconds(lambda digest=digest, x=x, y=y: digest.add(((x,), (y,))), args.rounds * 100))
        print(f"{f'{rows} x {features}':>16} {x.nbytes + y.nbytes:>9,} {each * 1e6:>10.2f}")
    digest_inside_the_step(args.rounds * 3)
    a_loop_on_large_batches(args.rounds * 3)


def digest_inside_the_step(rounds: int, steps: int = 400) -> None:
    """A tiny step's time with no digest, with `BatchDigest` on the host after each dispatch, and with a digest
    of the batch's bits computed inside the step's program (one more carried array and output)."""
    import jax

    params = [jnp.ones((16, 8)), jnp.ones((8,)), jnp.ones((8, 8)), jnp.ones((8,)), jnp.ones((8, 1)), jnp.ones((1,))]
    x, y = np.ones((8, 16), np.float32), np.ones((8,), np.float32)

    def step(p, x, y):
        h = jnp.tanh(x @ p[0] + p[1])
        h = jnp.tanh(h @ p[2] + p[3])
        loss = jnp.mean(((h @ p[4] + p[5])[:, 0] - y) ** 2)
        return [a - 0.01 * a for a in p], loss

    def step_digested(p, total, x, y, at):
        p, loss = step(p, x, y)
        words = jnp.concatenate([jax.lax.bitcast_convert_type(leaf, jnp.uint32).ravel() for leaf in (x, y)])
        place = jnp.arange(words.size, dtype=jnp.uint32) + at * jnp.uint32(words.size)
        return p, total + jnp.sum(words * (place * 2 + 1), dtype=jnp.uint32), loss

    plain = jax.jit(step, donate_argnums=0)
    digested = jax.jit(step_digested, donate_argnums=(0, 1))
    state = {"p": params, "total": jnp.uint32(0)}

    def none() -> None:
        for _ in range(steps):
            state["p"], loss = plain(state["p"], x, y)
        loss.block_until_ready()

    def host() -> None:
        digest = fingerprints.BatchDigest()
        for _ in range(steps):
            state["p"], loss = plain(state["p"], x, y)
            digest.add(((x,), (y,)))
        loss.block_until_ready()

    def device() -> None:
        for at in range(steps):
            state["p"], state["total"], loss = digested(state["p"], state["total"], x, y, np.uint32(at))
        loss.block_until_ready()

    ways = {"no digest": none, "BatchDigest on the host": host, "inside the step's program": device}
    times: dict[str, list[float]] = {name: [] for name in ways}
    for way in ways.values():
        way()
    for index in range(rounds):
        for name in list(ways)[index % 3 :] + list(ways)[: index % 3]:  # rotated
            times[name] += [t / steps for t in seconds(ways[name], 1)]
    base = statistics.median(times["no digest"])
    print(f"\n{'a tiny step (8 x 16 batch)':>28} {'us a step':>10} {'added us':>9}")
    for name, values in times.items():
        each = statistics.median(values)
        print(f"{name:>28} {each * 1e6:>10.2f} {(each - base) * 1e6:>9.2f}")


def a_loop_on_large_batches(rounds: int, steps: int = 100) -> None:
    """A `TrainLoop`'s record of `steps` steps on batches of 0.8 MB (256 x 784, 16 of them in turn; an MLP of
    width 64), with its fingerprints and without them (`fingerprints.ENABLED`), alternating, at K=1 and K=10."""
    from loop_overhead import MLP, flaxstate_runner, make_data

    data = make_data(256, 784, n=16)
    print(f"\n{'0.8 MB batches':>16} {'ms a record':>12} {'without':>8} {'added us a step':>16} {'added':>6}")
    for k in (1, 10):
        runners = {
            enabled: flaxstate_runner(MLP(64), data, k, steps, fingerprinted=enabled) for enabled in (True, False)
        }
        times: dict[bool, list[float]] = {True: [], False: []}
        for index in range(rounds):
            for enabled in (True, False) if index % 2 else (False, True):
                times[enabled] += seconds(lambda run=runners[enabled]: run(steps), 1)
        on, off = statistics.median(times[True]), statistics.median(times[False])
        added = (on - off) / steps * 1e6
        print(f"{f'K={k}':>16} {on * 1e3:>12.1f} {off * 1e3:>8.1f} {added:>16.1f} {on / off - 1:>6.1%}")


if __name__ == "__main__":
    main()
