"""Records at the rate users log: flaxstate's TrainLoop against a hand-written loop that reads its loss as often.

Issue 100's measure. In one process, side by side, for each model, API (linen
or NNX), record interval and K steps a dispatch: a hand-written `jax.jit` loop
(the state donated, K steps a `lax.scan` where K > 1, numpy batches stacked by
the loop itself) that reads its loss back every `every` steps, what a user's
loop does to log; the same loop again (the noise of two equal contenders);
and `fs.TrainLoop` with a record every `every` steps (defaults: the records
carry the last step's gradients, a host copy of the state and the
fingerprints), each record's loss read. A round runs each contender for the
same steps, in an order rotated every round; each ratio is the median over
rounds of the two contenders' throughputs in the same round.

    python benchmarks/record_rate.py [--rounds 7] [--models compute,dispatch] [--apis linen,nnx]
        [--every 10,100] [--k 1,10] [--no-gradients]
    python benchmarks/record_rate.py --fence 30 [--models compute]

The second measures what the loop's fence costs a step (every update puts the gradients behind
`lax.optimization_barrier`, so that a record's program trains the same bits as any other): the hand-written
step with the fence against the plain one, 20 steps (2000 of the dispatch-bound model) a round, in turn.

The compute-bound model is an MLP of width 1024, 4 layers, batch 256 (a step
of about 30 ms on this project's two-core CPU); the dispatch-bound one an MLP
of width 64, 2 layers, batch 64 (about 0.2 ms). `--no-gradients` adds the
loop with `record_gradients=False`.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import time
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import numpy as np
import optax
from flax import nnx

import flaxstate as fs

MODELS = {"compute": (1024, 4, 256, 1024, 100), "dispatch": (64, 2, 64, 64, 1000)}
"""A model's width, depth, batch, input features, and steps a round."""


class LinenMLP(nn.Module):
    width: int
    depth: int

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        for _ in range(self.depth):
            x = nn.relu(nn.Dense(self.width)(x))
        return nn.Dense(10)(x)


class NnxMLP(nnx.Module):
    def __init__(self, features: int, width: int, depth: int, rngs: nnx.Rngs) -> None:
        sizes = [features] + [width] * depth
        self.layers = nnx.List([nnx.Linear(a, b, rngs=rngs) for a, b in itertools.pairwise(sizes)])
        self.out = nnx.Linear(width, 10, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        for layer in self.layers:
            x = nnx.relu(layer(x))
        return self.out(x)


def loss_fn(logits: jax.Array, labels: jax.Array) -> jax.Array:
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


def make_data(batch: int, features: int) -> list[tuple[np.ndarray, np.ndarray]]:
    rng = np.random.RandomState(0)
    return [
        (rng.randn(batch, features).astype(np.float32), rng.randint(0, 10, batch).astype(np.int32)) for _ in range(16)
    ]


def model_of(api: str, name: str) -> tuple[Any, Callable[..., Any], Any]:
    """The model (what `TrainLoop` takes as `init` and `apply`) and a pure `(params, x) -> logits` with its params."""
    width, depth, batch, features, _ = MODELS[name]
    if api == "linen":
        model = LinenMLP(width, depth)
        params = model.init(jax.random.key(0), np.zeros((batch, features), np.float32))["params"]
        return model, lambda p, x: model.apply({"params": p}, x), params
    module = NnxMLP(features, width, depth, nnx.Rngs(0))
    graphdef, params = nnx.split(module)
    return module, lambda p, x: nnx.merge(graphdef, p)(x), params


def handwritten(api: str, name: str, every: int, k: int) -> Callable[[int], None]:
    """A hand-written loop (the state split once, donated) that reads its loss every `every` steps."""
    _, forward, params = model_of(api, name)
    _, _, batch, features, _ = MODELS[name]
    tx = optax.adam(1e-3)

    def one_step(params: Any, opt_state: Any, x: jax.Array, y: jax.Array) -> tuple[Any, Any, jax.Array]:
        loss, grads = jax.value_and_grad(lambda p: loss_fn(forward(p, x), y))(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    def k_steps(params: Any, opt_state: Any, xs: jax.Array, ys: jax.Array) -> tuple[Any, Any, jax.Array]:
        def body(carry: Any, batch: Any) -> Any:
            params, opt_state, loss = one_step(*carry, *batch)
            return (params, opt_state), loss

        (params, opt_state), losses = jax.lax.scan(body, (params, opt_state), (xs, ys))
        return params, opt_state, losses[-1]

    step = jax.jit(one_step if k == 1 else k_steps, donate_argnums=(0, 1))
    state = [params, tx.init(params)]
    batches = itertools.cycle(make_data(batch, features))
    losses: list[float] = []

    def run(n_steps: int) -> None:
        for index in range(n_steps // k):
            if k == 1:
                x, y = next(batches)
            else:
                group = [next(batches) for _ in range(k)]
                x, y = np.stack([b[0] for b in group]), np.stack([b[1] for b in group])
            state[0], state[1], loss = step(state[0], state[1], x, y)
            if ((index + 1) * k) % every == 0:
                losses.append(float(loss))  # what a loop that logs does: waits for the step's loss
        del losses[:-1]

    return run


def flaxstate(api: str, name: str, every: int, k: int, **options: Any) -> Callable[[int], None]:
    """`fs.TrainLoop` with a record every `every` steps, each record's loss read (the record held, as a caller's)."""
    model, _, _ = model_of(api, name)
    _, _, batch, features, _ = MODELS[name]
    init, apply = (model.init, model.apply) if api == "linen" else (model, model)
    task = fs.TrainTask(
        apply=apply, optimizer=optax.adam(1e-3), loss=loss_fn, data=itertools.cycle(make_data(batch, features))
    )
    loop = fs.TrainLoop(
        init, task, 0, n_steps=10**9, n_steps_per_checkpoint=every, n_steps_per_dispatch=k, stdout=False, **options
    )
    losses: list[float] = []

    def run(n_steps: int) -> None:
        for _ in range(n_steps // every):
            record = loop.next_checkpoint()
            assert record is not None  # the loop runs 10**9 steps
            losses.append(float(record.loss))
        del losses[:-1]

    return run


def fence_cost(name: str, rounds: int) -> str:
    """The fenced hand-written step's throughput over the plain one's: median and range over rounds in turn."""
    _, forward, params = model_of("linen", name)
    _, _, batch, features, _ = MODELS[name]
    tx = optax.adam(1e-3)
    data = make_data(batch, features)

    def make(fenced: bool) -> Callable[[], float]:
        def one_step(params: Any, opt_state: Any, x: jax.Array, y: jax.Array) -> tuple[Any, Any, jax.Array]:
            loss, grads = jax.value_and_grad(lambda p: loss_fn(forward(p, x), y))(params)
            grads = jax.lax.optimization_barrier(grads) if fenced else grads
            updates, opt_state = tx.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state, loss

        step = jax.jit(one_step, donate_argnums=(0, 1))
        state = [jax.tree.map(np.array, params), tx.init(params)]
        n_steps = 20 if name == "compute" else 2000

        def run() -> float:
            start = time.perf_counter()
            for index in range(n_steps):
                state[0], state[1], loss = step(state[0], state[1], *data[index % len(data)])
            float(loss)
            return time.perf_counter() - start

        return run

    runs = {fenced: make(fenced) for fenced in (False, True)}
    for run in runs.values():
        run()
    ratios = []
    for index in range(rounds):
        times = {fenced: runs[fenced]() for fenced in ((False, True) if index % 2 else (True, False))}
        ratios.append(times[False] / times[True])
    return f"{statistics.median(ratios):.3f}x ({min(ratios):.2f}-{max(ratios):.2f})"


def measure(runners: dict[str, Callable[[int], None]], rounds: int, steps: int) -> dict[str, list[float]]:
    """Seconds of each runner's round of `steps` steps, every round in a rotated order (one round first compiles)."""
    for run in runners.values():
        run(steps)
    names = list(runners)
    times: dict[str, list[float]] = {name: [] for name in names}
    for index in range(rounds):
        for name in names[index % len(names) :] + names[: index % len(names)]:
            start = time.perf_counter()
            runners[name](steps)
            times[name].append(time.perf_counter() - start)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--models", default="compute,dispatch")
    parser.add_argument("--apis", default="linen,nnx")
    parser.add_argument("--every", default="10,100")
    parser.add_argument("--k", default="1,10")
    parser.add_argument("--no-gradients", action="store_true", help="also the loop with record_gradients=False")
    parser.add_argument("--fence", type=int, default=0, help="rounds of the fence's cost alone (see the docstring)")
    args = parser.parse_args()
    if args.fence:
        for name in args.models.split(","):
            print(f"{name}: the fenced step's throughput over the plain one's, {fence_cost(name, args.fence)}")
        return
    print(f"jax {jax.__version__}, {jax.devices()[0].device_kind}, {args.rounds} rounds")
    print("| model | API | every | K | hand-written ms a step | again / hand-written |", end="")
    print(" flaxstate / hand-written |", end="")
    print(" no gradients / hand-written |" if args.no_gradients else "")
    print("|---|---|---:|---:|---:|---:|---:|" + ("---:|" if args.no_gradients else ""))
    for name, api, every, k in itertools.product(
        args.models.split(","),
        args.apis.split(","),
        [int(e) for e in args.every.split(",")],
        [int(k) for k in args.k.split(",")],
    ):
        steps = max(MODELS[name][4], every)
        runners = {
            "hand-written": handwritten(api, name, every, k),
            "again": handwritten(api, name, every, k),
            "flaxstate": flaxstate(api, name, every, k),
        }
        if args.no_gradients:
            runners["no gradients"] = flaxstate(api, name, every, k, record_gradients=False)
        times = measure(runners, args.rounds, steps)
        base = times["hand-written"]

        def ratio(contender: str, base: list[float] = base, times: dict[str, list[float]] = times) -> str:
            ratios = [b / t for b, t in zip(base, times[contender], strict=True)]
            return f"{statistics.median(ratios):.3f}x ({min(ratios):.2f}-{max(ratios):.2f})"

        row = f"| {name} | {api} | {every} | {k} | {statistics.median(base) / steps * 1e3:.2f} | {ratio('again')} |"
        row += f" {ratio('flaxstate')} |" + (f" {ratio('no gradients')} |" if args.no_gradients else "")
        print(row, flush=True)


if __name__ == "__main__":
    main()
