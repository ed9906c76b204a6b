"""flaxstate's TrainLoop against hand-written loops and the seed's flax_extra loop.

Same model, data, optimizer and devices in one process; the contenders run in
rounds of the same number of steps, in an order shuffled every round,
each round ending with the host waiting for the devices; each ratio is the
median over rounds of the two contenders' times in the same round, measured
`--runs` times (the table gives the median and the spread over runs). The
table gives median microseconds a step and the throughput ratio to the hand-written pmap loop, the hand-written jit loop
and the hand-written jit loop of the same K. flaxstate makes a record a round
(a host copy of the state, the loss, the last step's gradients; in the row
"no record gradients" without them, `record_gradients=False`), or, in the
rows "run() per call", ends a run each round (`for c in loop.run(n)`, a
notebook cell's habit). The rows "a record a round" are the hand-written jit
loop doing the same copy and read, which tells the loop's own cost from a
record's (raise `--steps` to space the records out).

    python benchmarks/loop_overhead.py [--rounds 7] [--runs 3] [--steps 400] [--models tiny,small,larger]
        [--contenders "TrainLoop, K=10|a record"]  # fewer loops in the process: the baselines and these
    python benchmarks/loop_overhead.py --fingerprint-pairs 600 [--models tiny,small]

The second measures what the resume audit's fingerprints add to a record,
which the first cannot tell from its noise: two flaxstate loops of each K,
with fingerprints and without, a record of `--steps` steps each in turn
(which goes first alternates), and the median of the paired differences, in
wall-clock and in the process's CPU time.
"""

from __future__ import annotations

import argparse
import itertools
import random
import statistics
import time
from collections.abc import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

import flaxstate as fs
from flaxstate.run_record import fingerprints


class MLP(nn.Module):
    width: int
    depth: int = 2

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        for _ in range(self.depth):
            x = nn.relu(nn.Dense(self.width)(x))
        return nn.Dense(10)(x)


def loss_fn(logits: jax.Array, labels: jax.Array) -> jax.Array:
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


def make_data(batch: int, features: int, n: int = 64) -> list[tuple[np.ndarray, np.ndarray]]:
    rng = np.random.RandomState(0)
    return [
        (rng.randn(batch, features).astype(np.float32), rng.randint(0, 10, batch).astype(np.int32)) for _ in range(n)
    ]


Runner = Callable[[int], None]
"""Trains n steps and returns when the devices are done."""


def flaxstate_runner(
    model: MLP,
    data: list,
    n_steps_per_dispatch: int,
    steps: int,
    per_call: bool = False,
    fingerprinted: bool = True,
    gradients: bool = True,
) -> Runner:
    task = fs.TrainTask(apply=model.apply, optimizer=optax.adam(1e-3), loss=loss_fn, data=itertools.cycle(data))
    # One record a round: the host waits for the devices once, at its end, as the other loops do.
    loop = fs.TrainLoop(
        model.init,
        task,
        jax.random.key(0),
        input_sample=data[0][0],
        n_steps=10**9,
        n_steps_per_checkpoint=steps,
        n_steps_per_dispatch=n_steps_per_dispatch,
        record_gradients=gradients,
        stdout=False,
    )

    def run(n_steps: int) -> None:
        assert n_steps == steps
        fingerprints.ENABLED = fingerprinted  # the resume audit's fingerprints (`flaxstate.run_record.fingerprints`)
        try:
            loop.next_checkpoint()
        finally:
            fingerprints.ENABLED = True

    def run_per_call(n_steps: int) -> None:
        """`loop.run(n)` once a round, as a notebook cell (or flax_extra's habit) calls it: the run ends each time."""
        for _ in loop.run(loop.step + n_steps):
            pass

    return run_per_call if per_call else run


def handwritten_pmap_runner(model: MLP, data: list, n_steps_per_dispatch: int) -> Runner:
    """The minimal data-parallel loop a careful user writes by hand with jax.pmap."""
    devices = jax.local_devices()
    n = len(devices)
    tx = optax.adam(1e-3)
    params = model.init(jax.random.key(0), data[0][0])["params"]

    def one_step(params, opt_state, x, y):
        loss, grads = jax.value_and_grad(lambda p: loss_fn(model.apply({"params": p}, x), y))(params)
        grads, loss = jax.lax.pmean((grads, loss), "batch")
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    if n_steps_per_dispatch == 1:
        step = one_step
    else:

        def step(params, opt_state, xs, ys):
            def body(carry, batch):
                params, opt_state, _ = one_step(*carry[:2], *batch)
                return (params, opt_state, _), None

            return jax.lax.scan(body, (params, opt_state, jnp.zeros(())), (xs, ys))[0]

    p_step = jax.pmap(step, axis_name="batch", donate_argnums=(0, 1))
    state = jax.pmap(lambda _: (params, tx.init(params)))(jnp.arange(n))
    batches = itertools.cycle(data)

    def split(batch, k):
        return tuple(a.reshape(n, a.shape[0] // n, *a.shape[1:]) if k == 1 else a for a in batch)

    def run(n_steps: int) -> None:
        nonlocal state
        loss = None
        for _ in range(n_steps // n_steps_per_dispatch):
            if n_steps_per_dispatch == 1:
                x, y = split(next(batches), 1)
            else:
                group = [next(batches) for _ in range(n_steps_per_dispatch)]
                x = np.stack([b[0].reshape(n, -1, b[0].shape[1]) for b in group], axis=1)
                y = np.stack([b[1].reshape(n, -1) for b in group], axis=1)
            params_, opt_state_, loss = p_step(*state, x, y)
            state = (params_, opt_state_)
        jax.block_until_ready(loss)

    return run


def handwritten_jit_runner(model: MLP, data: list, n_steps_per_dispatch: int, record: bool = False) -> Runner:
    """The tougher hand-written baseline: jit over shard_map (plain jit on one device).

    With `record`, each round ends as a hand-written loop that keeps a record
    of its state does: a host copy of the state (numpy, leaf by leaf) and the
    last loss read back, the part of a flaxstate record that costs the most.
    """
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    mesh = Mesh(np.asarray(jax.local_devices()), ("batch",))
    tx = optax.adam(1e-3)
    params = model.init(jax.random.key(0), data[0][0])["params"]

    def one_step(params, opt_state, x, y):
        loss, grads = jax.value_and_grad(lambda p: loss_fn(model.apply({"params": p}, x), y))(params)
        if mesh.size > 1:
            grads, loss = jax.lax.pmean((grads, loss), "batch")
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    spec = PartitionSpec("batch") if n_steps_per_dispatch == 1 else PartitionSpec(None, "batch")
    if n_steps_per_dispatch == 1:
        step = one_step
    else:

        def step(params, opt_state, xs, ys):
            def body(carry, batch):
                return one_step(*carry[:2], *batch), None

            return jax.lax.scan(body, (params, opt_state, jnp.zeros(())), (xs, ys))[0]

    mapped = jax.shard_map(
        step,
        mesh=mesh,
        in_specs=(PartitionSpec(), PartitionSpec(), spec, spec),
        out_specs=PartitionSpec(),
        check_vma=False,
    )
    shardings = (NamedSharding(mesh, PartitionSpec()),) * 2 + (NamedSharding(mesh, spec),) * 2
    jitted = jax.jit(mapped, in_shardings=shardings, donate_argnums=(0, 1))
    state = jax.device_put((params, tx.init(params)), shardings[0])
    batches = itertools.cycle(data)
    kept: list = []

    def run(n_steps: int) -> None:
        nonlocal state
        loss = None
        for _ in range(n_steps // n_steps_per_dispatch):
            if n_steps_per_dispatch == 1:
                x, y = next(batches)
            else:
                group = [next(batches) for _ in range(n_steps_per_dispatch)]
                x, y = np.stack([b[0] for b in group]), np.stack([b[1] for b in group])
            *state, loss = jitted(*state, x, y)
        jax.block_until_ready(loss)
        if record:
            kept.append(([np.array(leaf) for leaf in jax.tree.leaves(state)], float(loss)))
            del kept[:-1]  # the newest record is held, as a loop's caller holds its newest

    return run


def flax_extra_runner(model: MLP, data: list, n_steps_per_dispatch: int) -> Runner:
    """The seed's TrainLoop step, shimmed for today's JAX (device_put_replicated is gone).

    Per step, as flax_extra did: a host-side key split, a per-device key
    split, a batch reshaped per device, and a pmap'ed update that returns the
    optimizer state, params, model state, grads and loss.
    """
    devices = jax.local_devices()
    n = len(devices)
    tx = optax.adam(1e-3)
    variables = model.init(jax.random.key(0), data[0][0])
    params, model_state = variables["params"], {}

    def update(opt_state, params, model_state, batch, rng):
        x, y = batch

        def forward(params):
            logits = model.apply({"params": params, **model_state}, x, rngs={"dropout": rng})
            return loss_fn(logits, y)

        loss, grads = jax.value_and_grad(forward)(params)
        grads, loss = jax.lax.pmean((grads, loss), "batch")
        updates, opt_state = tx.update(grads, opt_state, params)
        return opt_state, optax.apply_updates(params, updates), model_state, grads, loss

    p_update = jax.pmap(update, axis_name="batch")

    def replicate(tree):
        return jax.pmap(lambda _: tree)(jnp.arange(n))

    state = [replicate(tx.init(params)), replicate(params), replicate(model_state)]
    key = jax.random.key(1)
    batches = itertools.cycle(data)

    def run(n_steps: int) -> None:
        nonlocal key
        loss = None
        for _ in range(n_steps):
            key, step_key = jax.random.split(key)
            device_keys = jax.random.split(step_key, n)
            x, y = next(batches)
            batch = (jnp.reshape(x, (n, -1, x.shape[1])), jnp.reshape(y, (n, -1)))
            opt_state, params_, model_state_, _, loss = p_update(*state, batch, device_keys)
            state[:] = [opt_state, params_, model_state_]
        jax.block_until_ready(loss)

    return run


def measure(runners: dict[str, Runner], rounds: int, steps: int, seed: int = 0) -> dict[str, list[float]]:
    """Microseconds a step of each runner, a value a round, after a warm-up.

    The order is shuffled every round (by `seed`), so no contender always
    runs first, nor always after the same one: a contender's place in a
    fixed order moved its ratio by up to 15% in a crowded process. A
    rotation of the order (round r starting with the r-th runner) still kept
    each one's predecessor, whose code leaves the caches cold for it: the
    flaxstate loop that followed a hand-written one ran 5 to 15% slower a
    step than the same loop without fingerprints, which followed a flaxstate
    loop, although fingerprints cost it 1% (RESULTS.md, issue 61).
    """
    for run in runners.values():
        run(steps)
    names = list(runners)
    times: dict[str, list[float]] = {name: [] for name in runners}
    shuffler = random.Random(seed)
    for _ in range(rounds):
        for name in shuffler.sample(names, len(names)):
            start = time.perf_counter()
            runners[name](steps)
            times[name].append((time.perf_counter() - start) / steps * 1e6)
    return times


def fingerprint_cost(model: MLP, data: list, n_steps_per_dispatch: int, steps: int, pairs: int) -> tuple[float, ...]:
    """What fingerprints add to a record: `(record_ms, added_us, record_cpu_ms, added_cpu_us)`, medians.

    The record's time without them, and the median over `pairs` of the
    difference between two loops' records made one right after the other,
    with fingerprints and without (the one with them first every other pair).
    """
    on = flaxstate_runner(model, data, n_steps_per_dispatch, steps)
    off = flaxstate_runner(model, data, n_steps_per_dispatch, steps, fingerprinted=False)
    for run in (on, off, on, off):
        run(steps)
    walls: dict[Runner, list[float]] = {on: [], off: []}
    cpus: dict[Runner, list[float]] = {on: [], off: []}
    for index in range(pairs):
        for run in (on, off) if index % 2 == 0 else (off, on):
            start, start_cpu = time.perf_counter(), time.process_time()
            run(steps)
            walls[run].append(time.perf_counter() - start)
            cpus[run].append(time.process_time() - start_cpu)

    def added(times: dict[Runner, list[float]]) -> float:
        return statistics.median(a - b for a, b in zip(times[on], times[off], strict=True))

    return (
        statistics.median(walls[off]) * 1e3,
        added(walls) * 1e6,
        statistics.median(cpus[off]) * 1e3,
        added(cpus) * 1e6,
    )


def fingerprint_table(configs: list[tuple[str, MLP, list, int]], pairs: int) -> None:
    """Prints what fingerprints add to a record of each model, at K=1 and K=10 (`fingerprint_cost`)."""
    print(
        f"{pairs} pairs of records a row, alternated; medians\n\n"
        "| model | K | record without | added a record | % | record's CPU time without | added CPU time | % |"
        "\n|---|---:|---:|---:|---:|---:|---:|---:|"
    )
    for title, model, data, steps in configs:
        for k in (1, 10):
            wall, added, cpu, added_cpu = fingerprint_cost(model, data, k, steps, pairs)
            print(
                f"| {title} | {k} | {wall:.2f} ms | {added:.0f} us | {100 * added / (wall * 1e3):.1f}% "
                f"| {cpu:.2f} ms | {added_cpu:.0f} us | {100 * added_cpu / (cpu * 1e3):.1f}% |"
            )


def ratio(baseline: list[float], times: list[float]) -> float:
    """The median over rounds of the baseline's time over this runner's (its throughput relative to the baseline)."""
    return statistics.median(b / t for b, t in zip(baseline, times, strict=True))


def spread(values: list[float]) -> str:
    """'median (min-max)' of a ratio over runs."""
    if values == ["-"]:
        return "-"
    if len(values) == 1:
        return f"{values[0]:.2f}x"
    return f"{statistics.median(values):.2f}x ({min(values):.2f}-{max(values):.2f})"


BASELINES = ("hand-written pmap, K=1", "hand-written jit, K=1", "hand-written jit + scan, K=10")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=400, help="steps a round, small model (larger: a tenth)")
    parser.add_argument("--models", default="tiny,small,larger", help="which of tiny, small, larger to run")
    parser.add_argument("--runs", type=int, default=3, help="measurements of every ratio (their spread is shown)")
    parser.add_argument(
        "--contenders",
        default="",
        help="only the loops naming one of these |-separated words (a word ending in $: the whole name), "
        "and the baselines",
    )
    parser.add_argument(
        "--fingerprint-pairs",
        type=int,
        default=0,
        help="instead of the table of loops: what fingerprints add to a record, over this many pairs of records",
    )
    args = parser.parse_args()
    configs = {
        # Host-bound: the step's own work is a few microseconds, so this row measures what each
        # loop costs around the compiled call, as a small model on a GPU does.
        "tiny": ("tiny MLP (width 8, batch 8)", MLP(8), make_data(8, 16), args.steps),
        "small": ("small MLP (width 64, batch 64)", MLP(64), make_data(64, 64), args.steps),
        "larger": ("larger MLP (width 1024, batch 256)", MLP(1024), make_data(256, 512), max(10, args.steps // 10)),
    }
    if args.fingerprint_pairs:
        print(f"jax {jax.__version__}, {jax.device_count()} x {jax.devices()[0].device_kind}, ", end="")
        fingerprint_table([configs[name] for name in args.models.split(",")], args.fingerprint_pairs)
        return
    print(
        f"jax {jax.__version__}, {jax.device_count()} x {jax.devices()[0].device_kind}, "
        f"{args.runs} runs of {args.rounds} rounds, the order shuffled every round; ratios: the median over runs "
        "of each run's median over rounds (min-max over runs)"
    )
    rows = []
    for title, model, data, steps in (configs[name] for name in args.models.split(",")):
        runners = {
            "hand-written pmap, K=1": handwritten_pmap_runner(model, data, 1),
            "hand-written jit, K=1": handwritten_jit_runner(model, data, 1),
            "hand-written jit, K=1, a record a round": handwritten_jit_runner(model, data, 1, record=True),
            "flaxstate TrainLoop, K=1": flaxstate_runner(model, data, 1, steps),
            "flaxstate TrainLoop, K=1, no fingerprints": flaxstate_runner(model, data, 1, steps, fingerprinted=False),
            "flaxstate TrainLoop, K=1, run() per call": flaxstate_runner(model, data, 1, steps, per_call=True),
            "flaxstate TrainLoop, K=1, no record gradients": flaxstate_runner(model, data, 1, steps, gradients=False),
            "flax_extra TrainLoop (shim)": flax_extra_runner(model, data, 1),
            "hand-written pmap + scan, K=10": handwritten_pmap_runner(model, data, 10),
            "hand-written jit + scan, K=10": handwritten_jit_runner(model, data, 10),
            "hand-written jit + scan, K=10, a record a round": handwritten_jit_runner(model, data, 10, record=True),
            "flaxstate TrainLoop, K=10": flaxstate_runner(model, data, 10, steps),
            "flaxstate TrainLoop, K=10, no fingerprints": flaxstate_runner(model, data, 10, steps, fingerprinted=False),
            "flaxstate TrainLoop, K=10, run() per call": flaxstate_runner(model, data, 10, steps, per_call=True),
        }
        if args.contenders:
            words = args.contenders.split("|")
            runners = {
                name: run for name, run in runners.items()
                if name in BASELINES or any(name == word[:-1] if word.endswith("$") else word in name for word in words)
            }  # fmt: skip
        runs = [measure(runners, args.rounds, steps, seed) for seed in range(args.runs)]
        for name in runners:
            same_k = "hand-written jit + scan, K=10" if "K=10" in name else "hand-written jit, K=1"
            us = statistics.median(statistics.median(run[name]) for run in runs)
            ratios = [
                [ratio(run[baseline], run[name]) for run in runs] if baseline in runners else ["-"]
                for baseline in BASELINES[:2] + (same_k,)
            ]
            rows.append((title, name, us, *(spread(values) for values in ratios)))
    print(
        "\n| model | loop | us/step (median) | throughput vs hand-written pmap K=1 | vs hand-written jit K=1 "
        "| vs hand-written jit, same K |"
        "\n|---|---|---:|---:|---:|---:|"
    )
    for title, name, us, pmap_ratio, jit_ratio, same_k_ratio in rows:
        print(f"| {title} | {name} | {us:.1f} | {pmap_ratio} | {jit_ratio} | {same_k_ratio} |")


if __name__ == "__main__":
    main()
