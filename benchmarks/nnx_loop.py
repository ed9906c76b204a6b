"""flaxstate's TrainLoop on an NNX module against Flax's own NNX loops, side by side in one process.

The model is Flax's NNX MNIST tutorial's CNN (`docs_nnx/mnist_tutorial.md`:
two convolutions with BatchNorm and Dropout, two dense layers), or an MLP of
the same tutorial's kind, with `optax.adamw(0.005, 0.9)`, dict batches
`{"image": x, "label": y}` of 32 and the tutorial's `loss_fn(model, batch,
rngs)`. Contenders:

- "nnx.jit tutorial": the tutorial's `@nnx.jit train_step(model, optimizer,
  rngs, batch)` with `nnx.value_and_grad` and `optimizer.update` (in place);
- "split-once jax.jit": the state split once (`nnx.split`), one `jax.jit`
  step of `(state, batch, key)` that merges inside and returns the new
  state (donated), K steps a call with a `lax.scan` for K > 1 (how MaxText
  and the Flax performance guide say to run NNX fast), each step of the scan
  its own key (`fold_in` of its index: with the dispatch's key for all K,
  XLA hoisted the dropout mask out of the loop, one mask for K steps);
- "flaxstate, K=...": `TrainLoop(init=model)`, a record a round.

Rounds of `--steps` steps in an order shuffled every round, each ending with
the host waiting for the devices; ratios are medians over rounds of the
baseline's time over the contender's (throughput). `--startup N` measures
instead the seconds from a fresh process's start to its first step done,
the tutorial's loop against flaxstate's (by default, and with
`record_gradients=False`: the tutorial's step returns no gradients), N fresh
processes each, in a rotating order; with `--dispatch K`, to the first K
steps done, flaxstate's in one dispatch of K steps.

    python benchmarks/nnx_loop.py [--models cnn,mlp] [--rounds 7] [--steps 200]
    python benchmarks/nnx_loop.py --startup 5 [--dispatch 10]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import subprocess
import sys
import time
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from loop_overhead import Runner, measure, ratio

import flaxstate as fs


class CNN(nnx.Module):
    """The tutorial's CNN, on 28 x 28 images."""

    def __init__(self, *, rngs: nnx.Rngs):
        self.conv1 = nnx.Conv(1, 32, kernel_size=(3, 3), rngs=rngs)
        self.batch_norm1 = nnx.BatchNorm(32, rngs=rngs)
        self.dropout1 = nnx.Dropout(rate=0.025)
        self.conv2 = nnx.Conv(32, 64, kernel_size=(3, 3), rngs=rngs)
        self.batch_norm2 = nnx.BatchNorm(64, rngs=rngs)
        self.avg_pool = partial(nnx.avg_pool, window_shape=(2, 2), strides=(2, 2))
        self.linear1 = nnx.Linear(3136, 256, rngs=rngs)
        self.dropout2 = nnx.Dropout(rate=0.025)
        self.linear2 = nnx.Linear(256, 10, rngs=rngs)

    def __call__(self, x: jax.Array, rngs: nnx.Rngs | None = None) -> jax.Array:
        x = self.avg_pool(nnx.relu(self.batch_norm1(self.dropout1(self.conv1(x), rngs=rngs))))
        x = self.avg_pool(nnx.relu(self.batch_norm2(self.conv2(x))))
        x = x.reshape(x.shape[0], -1)
        x = nnx.relu(self.dropout2(self.linear1(x), rngs=rngs))
        return self.linear2(x)


class MLP(nnx.Module):
    """A two-layer MLP on the same images, with the tutorial's BatchNorm and Dropout."""

    def __init__(self, *, rngs: nnx.Rngs):
        self.linear1 = nnx.Linear(784, 256, rngs=rngs)
        self.batch_norm = nnx.BatchNorm(256, rngs=rngs)
        self.dropout = nnx.Dropout(rate=0.025)
        self.linear2 = nnx.Linear(256, 10, rngs=rngs)

    def __call__(self, x: jax.Array, rngs: nnx.Rngs | None = None) -> jax.Array:
        x = x.reshape(x.shape[0], -1)
        return self.linear2(self.dropout(nnx.relu(self.batch_norm(self.linear1(x))), rngs=rngs))


MODELS = {"cnn": CNN, "mlp": MLP}


def loss_fn(model: nnx.Module, batch: dict, rngs: nnx.Rngs | None = None) -> tuple[jax.Array, jax.Array]:
    logits = model(batch["image"], rngs)
    loss = optax.softmax_cross_entropy_with_integer_labels(logits=logits, labels=batch["label"]).mean()
    return loss, logits


def make_data(n: int = 32, batch: int = 32) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(0)
    return [
        {
            "image": rng.random((batch, 28, 28, 1), dtype=np.float32),
            "label": rng.integers(0, 10, batch).astype(np.int32),
        }
        for _ in range(n)
    ]


def tutorial_runner(make: type, data: list) -> Runner:
    model = make(rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.adamw(0.005, 0.9), wrt=nnx.Param)
    rngs = nnx.Rngs(0)

    @nnx.jit
    def train_step(model: nnx.Module, optimizer: nnx.Optimizer, rngs: nnx.Rngs, batch: dict) -> jax.Array:
        (loss, _), grads = nnx.value_and_grad(loss_fn, has_aux=True)(model, batch, rngs)
        optimizer.update(model, grads)
        return loss

    batches = itertools.cycle(data)

    def run(n_steps: int) -> None:
        for _ in range(n_steps):
            loss = train_step(model, optimizer, rngs, next(batches))
        jax.block_until_ready(loss)

    return run


def split_once_runner(make: type, data: list, n_steps_per_dispatch: int) -> Runner:
    model = make(rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.adamw(0.005, 0.9), wrt=nnx.Param)
    graphdef, state = nnx.split((model, optimizer))

    def one_step(state: nnx.State, batch: dict, key: jax.Array) -> tuple[nnx.State, jax.Array]:
        model, optimizer = nnx.merge(graphdef, state)
        (loss, _), grads = nnx.value_and_grad(loss_fn, has_aux=True)(model, batch, nnx.Rngs(dropout=key))
        optimizer.update(model, grads)
        return nnx.state((model, optimizer)), loss

    def steps(state: nnx.State, batches: dict, key: jax.Array) -> tuple[nnx.State, jax.Array]:
        if n_steps_per_dispatch == 1:
            return one_step(state, batches, key)

        def body(carry: nnx.State, batch_and_index: tuple[dict, jax.Array]) -> tuple[nnx.State, jax.Array]:
            batch, index = batch_and_index  # each step its own key: one key for the K steps gave them one mask
            return one_step(carry, batch, jax.random.fold_in(key, index))

        state, losses = jax.lax.scan(body, state, (batches, jnp.arange(n_steps_per_dispatch)))
        return state, losses[-1]

    jitted = jax.jit(steps, donate_argnums=0)
    batches = itertools.cycle(data)
    key = jax.random.key(0)

    def run(n_steps: int) -> None:
        nonlocal state, key
        for _ in range(n_steps // n_steps_per_dispatch):
            if n_steps_per_dispatch == 1:
                batch = next(batches)
            else:
                group = [next(batches) for _ in range(n_steps_per_dispatch)]
                batch = {name: np.stack([b[name] for b in group]) for name in group[0]}
            key = jax.random.fold_in(key, 1)
            state, loss = jitted(state, batch, key)
        jax.block_until_ready(loss)

    return run


def flaxstate_runner(make: type, data: list, n_steps_per_dispatch: int, steps: int) -> Runner:
    model = make(rngs=nnx.Rngs(0))
    task = fs.TrainTask(apply=model, optimizer=optax.adamw(0.005, 0.9), loss=loss_fn, data=itertools.cycle(data))
    loop = fs.TrainLoop(
        init=model,
        task=task,
        rng=0,
        n_steps=10**9,
        n_steps_per_checkpoint=steps,
        n_steps_per_dispatch=n_steps_per_dispatch,
        stdout=False,
    )
    del model  # the loop holds the state: one copy of the parameters

    def run(n_steps: int) -> None:
        assert n_steps == steps
        loop.next_checkpoint()

    return run


def throughput(models: list[str], rounds: int, steps: int, runs: int) -> None:
    data = make_data()
    print(f"{'model':<6} {'contender':<26} {'us/step':>9}  vs nnx.jit  vs split-once K=1  vs split-once same K")
    for name in models:
        make = MODELS[name]
        runners = {
            "nnx.jit tutorial, K=1": tutorial_runner(make, data),
            "split-once jax.jit, K=1": split_once_runner(make, data, 1),
            "split-once jax.jit, K=10": split_once_runner(make, data, 10),
            "flaxstate, K=1": flaxstate_runner(make, data, 1, steps),
            "flaxstate, K=10": flaxstate_runner(make, data, 10, steps),
        }
        results: dict[str, list[list[float]]] = {contender: [] for contender in runners}
        for run in range(runs):
            times = measure(runners, rounds, steps, seed=run)
            for contender, values in times.items():
                results[contender].append(values)
        for contender, per_run in results.items():
            k = contender.split("K=")[1]
            same = f"split-once jax.jit, K={k}"
            us = statistics.median(statistics.median(values) for values in per_run)
            cells = [
                statistics.median(ratio(base, mine) for base, mine in zip(results[b], per_run, strict=True))
                for b in ("nnx.jit tutorial, K=1", "split-once jax.jit, K=1", same)
            ]
            print(f"{name:<6} {contender:<26} {us:>9.1f}  " + "  ".join(f"{cell:>9.2f}x" for cell in cells))


STARTUP = r"""
import os, sys, time, json
def process_start_time():  # from /proc, as flaxstate.training.startup reads it (the tutorial imports no flaxstate)
    with open(f"/proc/{{os.getpid()}}/stat") as stat:
        ticks = int(stat.read().rsplit(")", 1)[1].split()[19])
    return time.time() - time.clock_gettime(time.CLOCK_BOOTTIME) + ticks / os.sysconf("SC_CLK_TCK")
sys.path.insert(0, {folder!r})
import jax, numpy as np, optax
from flax import nnx
sys.modules["loop_overhead"] = type(sys)("loop_overhead")  # nnx_loop's import of the throughput helpers, unused
sys.modules["loop_overhead"].__dict__.update(Runner=None, measure=None, ratio=None)
if {which!r} == "tutorial":
    sys.modules["flaxstate"] = type(sys)("flaxstate")  # nnx_loop imports it at its top; the tutorial does not
import nnx_loop
data = nnx_loop.make_data(max(4, {k}))
model = nnx_loop.MODELS[{model!r}](rngs=nnx.Rngs(0))
if {which!r} == "tutorial":
    run = nnx_loop.tutorial_runner(nnx_loop.MODELS[{model!r}], data)
    run({k})
else:
    import flaxstate as fs
    task = fs.TrainTask(apply=model, optimizer=optax.adamw(0.005, 0.9), loss=nnx_loop.loss_fn, data=data)
    gradients = {which!r} == "flaxstate"  # "flaxstate, no gradients": records without (the tutorial returns none)
    loop = fs.TrainLoop(
        init=model, task=task, rng=0, n_steps={k}, n_steps_per_checkpoint={k}, n_steps_per_dispatch={k},
        stdout=False, record_gradients=gradients,
    )
    loop.next_checkpoint()
print(json.dumps(time.time() - process_start_time()))
"""


STARTERS = ("tutorial", "flaxstate", "flaxstate, no gradients")
"""Start-up's contenders: flaxstate as it starts by default, and with `record_gradients=False`."""


def startup(models: list[str], n: int, k: int = 1) -> None:
    """Seconds from a fresh process's start to its first step done, each contender `n` times, in a rotating order.

    With `k` > 1: to its first `k` steps done, flaxstate's in one dispatch (the tutorial's one a call)."""
    folder = str(__import__("pathlib").Path(__file__).parent)
    # As a user's second run finds them: Python's bytecode cached (an environment that sets
    # PYTHONDONTWRITEBYTECODE, as this project's machines do, compiled flaxstate's 90 modules from source
    # at every import, 0.18 s), which one untimed run of each contender writes.
    env = {name: value for name, value in os.environ.items() if name != "PYTHONDONTWRITEBYTECODE"}
    print(f"{'model':<6} {'contender':<24} {'seconds':>8}  vs the tutorial (median of pairs)")
    for name in models:
        seconds: dict[str, list[float]] = {which: [] for which in STARTERS}
        for index in range(-1, n):
            order = STARTERS[index % 3 :] + STARTERS[: index % 3]
            for which in order:
                code = STARTUP.format(folder=folder, model=name, which=which, k=k)
                done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env)
                if index >= 0:
                    seconds[which].append(json.loads(done.stdout.strip().splitlines()[-1]))
        for which in STARTERS:
            pairs = [f / t for f, t in zip(seconds[which], seconds["tutorial"], strict=True)]
            spread = f"{statistics.median(pairs):.2f}x ({min(pairs):.2f}-{max(pairs):.2f})"
            print(f"{name:<6} {which:<24} {statistics.median(seconds[which]):>8.2f}  {spread}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="cnn,mlp")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--startup", type=int, default=0, help="fresh processes of each contender, for start-up")
    parser.add_argument("--dispatch", type=int, default=1, help="start-up to K steps done, flaxstate's at K a dispatch")
    args = parser.parse_args()
    models = args.models.split(",")
    print(f"jax {jax.__version__}, {jax.devices()[0].device_kind}, {time.strftime('%Y-%m-%d')}")
    if args.startup:
        startup(models, args.startup, args.dispatch)
    else:
        throughput(models, args.rounds, args.steps, args.runs)


if __name__ == "__main__":
    main()
