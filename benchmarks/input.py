"""Input pipelines for the digits example, alone and under TrainLoop: is the run input-bound?

One process, the example's data (scikit-learn's digits, 1,500 training rows
of 64 features) and model (`examples/digits.py`). Four tables, each from
alternating rounds, medians:

1. A pipeline alone: microseconds to draw a batch of 64 (after warm-up).
   "before" is the example's pipeline until issue 14, element by element in
   grain; "after" its `shuffled_batches` until issue 29 (one permutation an
   epoch, one numpy gather a batch, on grain); `fs.global_batches`, the
   example's since (the same, addressed by the global step).
2. TrainLoop on each pipeline (K steps a dispatch, a record every `--steps`
   steps, no writers): microseconds a step and the record's share of time
   that the devices waited for data (`Checkpoint.data_fraction`). Also a
   pipeline that waits on I/O (the fast pipeline plus a sleep, which
   releases the GIL) with and without a background thread that draws
   batches ahead (grain's `ThreadPrefetchIterDataset`), and read by 8 of
   grain's threads in parallel (`ReadOptions(num_threads=8)`).
3. `fs.global_batches` resumed at steps 10 to 10^9: the time to its first batch.
4. `make demo`'s loop as the example runs it (K=10, an evaluation and
   both writers every 100 steps; no console output): the records' steps a
   second, median of the records after the first (which compiles), one
   fresh run a round.

    python benchmarks/input.py [--rounds 5] [--steps 200] [--io-ms 1.0]
"""

from __future__ import annotations

import argparse
import functools
import importlib.metadata
import itertools
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import grain
import jax
import numpy as np
import optax
import redex

import flaxstate as fs

sys.path.insert(0, str(Path(__file__).parents[1] / "examples"))
import digits as example  # noqa: E402

BATCH = 64


def elementwise(x: np.ndarray, y: np.ndarray, read_options: grain.ReadOptions | None = None) -> Iterable:
    """The example's pipeline before issue 14: grain's shuffle, repeat and batch, element by element."""
    dataset = grain.MapDataset.source(list(zip(x, y, strict=True))).shuffle(seed=0).repeat()
    dataset = dataset.batch(BATCH, drop_remainder=True)
    return dataset if read_options is None else dataset.to_iter_dataset(read_options)


def shuffled_indices(x: np.ndarray, y: np.ndarray) -> Iterable:
    """grain shuffles and batches indices, then one numpy gather a batch."""
    indices = grain.MapDataset.range(len(x)).shuffle(seed=0).repeat().batch(BATCH, drop_remainder=True)
    return indices.map(lambda rows: (x[rows], y[rows])).to_iter_dataset(grain.ReadOptions(num_threads=0))


def shuffled_batches(x: np.ndarray, y: np.ndarray, batch_size: int, seed: int) -> grain.MapDataset:
    """The example's pipeline from issue 14 to issue 29: a permutation an epoch, one gather a batch, on grain.

    Batch i is rows [k*batch_size, (k+1)*batch_size) of epoch e's permutation
    (e, k = divmod(i, batches an epoch)); the examples left over at an epoch's
    end are dropped.
    """
    n_batches = len(x) // batch_size

    @functools.lru_cache(maxsize=2)
    def permutation(epoch: int) -> np.ndarray:
        return np.random.default_rng([seed, epoch]).permutation(len(x))

    def gather(index: int, _: int) -> tuple[np.ndarray, np.ndarray]:
        epoch, k = divmod(index, n_batches)
        rows = permutation(epoch)[k * batch_size : (k + 1) * batch_size]
        return x[rows], y[rows]

    return grain.MapDataset.range(n_batches).repeat().map_with_index(gather)


READ_OPTIONS = grain.ReadOptions(num_threads=0)
"""Batches made in the loop's thread (grain's default 16 read threads cost more than the 30 us of work)."""


def after(x: np.ndarray, y: np.ndarray, read_options: grain.ReadOptions = READ_OPTIONS) -> grain.IterDataset:
    """The example's pipeline from issue 14 to 29: one permutation an epoch, one numpy gather a batch."""
    return shuffled_batches(x, y, BATCH, seed=0).to_iter_dataset(read_options)


def global_data(x: np.ndarray, y: np.ndarray) -> fs.GlobalBatches:
    """The example's pipeline since issue 29: `fs.global_batches`, addressed by the global step."""
    return fs.global_batches((x, y), BATCH, seed=0)


class NumpyGather:
    """The floor: 64 rows of an epoch permutation gathered by numpy, no grain (re-iterable)."""

    def __init__(self, x: np.ndarray, y: np.ndarray) -> None:
        self._x, self._y = x, y
        self._order = np.random.default_rng(0).permutation(len(x))

    def __iter__(self) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        for k in itertools.cycle(range(len(self._x) // BATCH)):
            rows = self._order[k * BATCH : (k + 1) * BATCH]
            yield self._x[rows], self._y[rows]


def thread_prefetch(data: grain.IterDataset, n_batches: int) -> grain.IterDataset:
    """grain's background thread that draws `n_batches` ahead (its state is the consumer's position)."""
    return grain.experimental.ThreadPrefetchIterDataset(data, prefetch_buffer_size=n_batches)


def pipelines(x: np.ndarray, y: np.ndarray) -> dict[str, Iterable]:
    return {
        "before: grain per element, default reads (16 threads)": elementwise(x, y),
        "before, grain ReadOptions(num_threads=2)": elementwise(x, y, grain.ReadOptions(num_threads=2)),
        "before, grain ReadOptions(num_threads=0)": elementwise(x, y, grain.ReadOptions(num_threads=0)),
        "grain shuffles indices, one numpy gather a batch": shuffled_indices(x, y),
        "after: a permutation an epoch, one gather a batch (num_threads=0)": after(x, y),
        "since issue 29: fs.global_batches (the same, by global step)": global_data(x, y),
        "after, grain's default reads (16 threads)": after(x, y, grain.ReadOptions()),
        "numpy gather alone": NumpyGather(x, y),
    }


class Closing:
    """A re-iterable that closes every iterator it made: a grain iterator's read threads stop with it."""

    def __init__(self, data: Iterable) -> None:
        self._data = data
        self._iterators: list[Any] = []

    def __iter__(self) -> Iterator[Any]:
        self._iterators.append(iter(self._data))
        return self._iterators[-1]

    def close(self) -> None:
        for iterator in self._iterators:
            if hasattr(iterator, "close"):
                iterator.close()
        self._iterators.clear()


def time_batches(data: Iterable, n_batches: int) -> float:
    """Seconds a batch, drawing `n_batches` after 20 to warm up, from a fresh iterator closed after."""
    data = Closing(data)
    iterator = iter(data)
    for _ in range(20):
        next(iterator)
    start = time.perf_counter()
    for _ in range(n_batches):
        next(iterator)
    seconds = (time.perf_counter() - start) / n_batches
    data.close()
    return seconds


def loop_round(data: Callable[[], Iterable], per_dispatch: int, steps: int) -> tuple[float, float, float]:
    """A fresh TrainLoop on fresh data with the example's model: seconds a step over its second record, and
    the shares of time the devices waited for data and for the host. The first record compiles and fills any
    read buffer."""
    model = example.MLP()
    closing = Closing(data())
    task = fs.TrainTask(apply=model.apply, optimizer=optax.adam(1e-3), loss=example.loss, data=closing)
    loop = fs.TrainLoop(
        model.init,
        task,
        jax.random.key(0),
        n_steps=2 * steps,
        n_steps_per_checkpoint=steps,
        n_steps_per_dispatch=per_dispatch,
        stdout=False,
    )
    loop.next_checkpoint()
    start = time.perf_counter()
    record = loop.next_checkpoint()
    seconds = (time.perf_counter() - start) / steps
    closing.close()
    return seconds, record.data_fraction, record.idle_fraction


def demo_round(data: Callable[[], Iterable], workdir: Path) -> float:
    """`make demo`'s loop, 600 steps from scratch: the median steps/s of its records after the first."""
    output_dir = Path(tempfile.mkdtemp(dir=workdir))
    train, evaluation = Closing(data()), example.digits(BATCH)[1]
    model = example.MLP()
    loop = fs.TrainLoop(
        init=fs.CheckpointFileReader(output_dir, target=model.init),
        task=fs.TrainTask(apply=model.apply, optimizer=optax.adam(1e-3), loss=example.loss, data=train),
        rng=jax.random.key(0),
        n_steps=600,
        n_steps_per_checkpoint=100,
        n_steps_per_dispatch=10,
        stdout=False,
    )
    metrics = {"loss": example.loss, "acc": example.accuracy}
    process = redex.combinator.serial(
        fs.EvalLoop(fs.EvalTask(apply=model.apply, metrics=metrics, data=evaluation), rng=jax.random.key(1)),
        fs.SummaryWriter(output_dir),
        fs.CheckpointFileWriter(output_dir, keep=3),
        fs.LowestCheckpointFileWriter(output_dir, metric="loss", group="eval"),
    )
    rates = []
    for record in loop:
        rates.append(record.n_completed_steps / record.elapsed_time)
        process(record)
    train.close()
    return statistics.median(rates[1:])


def alternate(names: list[str], rounds: int) -> Iterable[str]:
    for index in range(rounds):
        yield from (names if index % 2 == 0 else reversed(names))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=200, help="steps a TrainLoop round")
    parser.add_argument("--batches", type=int, default=100, help="batches a pipeline round")
    parser.add_argument("--io-ms", type=float, default=1.0, help="the simulated I/O wait a batch")
    parser.add_argument("--demo-rounds", type=int, default=3)
    args = parser.parse_args()
    grain_version = importlib.metadata.version("grain")
    print(f"jax {jax.__version__}, grain {grain_version}, {jax.devices()[0].device_kind}, {args.rounds} rounds")
    train, _ = example.digits(BATCH)
    x, y = (np.concatenate(parts) for parts in zip(*itertools.islice(iter(train), 23), strict=True))

    # 1. Pipelines alone.
    datasets = pipelines(x, y)
    alone: dict[str, list[float]] = {name: [] for name in datasets}
    for name in alternate(list(datasets), args.rounds):
        alone[name].append(time_batches(datasets[name], args.batches))
    print(f"\n| pipeline | us a batch of {BATCH} (median) |\n|---|---:|")
    for name, times in alone.items():
        print(f"| {name} | {statistics.median(times) * 1e6:,.1f} |")

    # 2. Under TrainLoop.
    io = args.io_ms / 1e3
    in_memory = list(itertools.islice(iter(after(x, y)), 23))  # an epoch of batches
    loops: dict[str, tuple[Callable[[], Iterable], int]] = {
        "before: grain per element, K=10": (lambda: elementwise(x, y), 10),
        "after: one gather a batch, K=10": (lambda: after(x, y), 10),
        "fs.global_batches, K=10": (lambda: global_data(x, y), 10),
        "after + grain thread prefetch (20 batches), K=10": (lambda: thread_prefetch(after(x, y), 20), 10),
        "after, K=1": (lambda: after(x, y), 1),
        "batches in memory, K=10": (lambda: itertools.cycle(in_memory), 10),
        "batches in memory, K=1": (lambda: itertools.cycle(in_memory), 1),
        f"after + {args.io_ms:g} ms I/O a batch, K=10": (lambda: io_dataset(x, y, io), 10),
        f"after + {args.io_ms:g} ms I/O + grain thread prefetch, K=10": (
            lambda: thread_prefetch(io_dataset(x, y, io), 20),
            10,
        ),
        f"after + {args.io_ms:g} ms I/O, grain ReadOptions(num_threads=8), K=10": (
            lambda: io_dataset(x, y, io, n_threads=8),
            10,
        ),
    }
    step_times: dict[str, list[float]] = {name: [] for name in loops}
    data_fractions: dict[str, list[float]] = {name: [] for name in loops}
    idle_fractions: dict[str, list[float]] = {name: [] for name in loops}
    for name in alternate(list(loops), args.rounds):
        seconds, data_fraction, idle_fraction = loop_round(*loops[name], args.steps)
        step_times[name].append(seconds)
        data_fractions[name].append(data_fraction)
        idle_fractions[name].append(idle_fraction)
    reference = statistics.median(step_times["batches in memory, K=10"])
    print(
        f"\n| TrainLoop, {args.steps} steps a record | us a step (median) | x in memory K=10 "
        "| waiting for data | devices idle |"
    )
    print("|---|---:|---:|---:|---:|")
    for name, times in step_times.items():
        median = statistics.median(times)
        data, idle = statistics.median(data_fractions[name]), statistics.median(idle_fractions[name])
        print(f"| {name} | {median * 1e6:,.0f} | {median / reference:.2f}x | {data:.0%} | {idle:.0%} |")

    # 3. Resuming global batches: the first batch at a step, by the step (the batches before are not drawn).
    print("\n| fs.global_batches resumed at step | us to the first batch (median of 20) |\n|---:|---:|")
    for step in (10, 1_000, 1_000_000, 1_000_000_000):
        times = []
        for _ in range(20):
            start = time.perf_counter()
            next(global_data(x, y).iter_from(step))
            times.append(time.perf_counter() - start)
        print(f"| {step:,} | {statistics.median(times) * 1e6:,.0f} |")

    # 4. make demo's loop, with its evaluation and writers.
    if not args.demo_rounds:
        return
    demos = {
        "before: grain per element": lambda: elementwise(x, y),
        "after: one gather a batch": lambda: after(x, y),
        "fs.global_batches": lambda: global_data(x, y),
    }
    rates: dict[str, list[float]] = {name: [] for name in demos}
    with tempfile.TemporaryDirectory(prefix="flaxstate-input-") as workdir:
        for name in alternate(list(demos), args.demo_rounds):
            rates[name].append(demo_round(demos[name], Path(workdir)))
    print("\n| make demo's loop (K=10, eval and two writers every 100 steps) | records' steps/s (median) |")
    print("|---|---:|")
    for name, values in rates.items():
        print(f"| {name} | {statistics.median(values):,.0f} |")
    first, last = (statistics.median(values) for values in list(rates.values())[:2])
    print(f"\nafter / before: {last / first:.1f}x")


def io_dataset(x: np.ndarray, y: np.ndarray, seconds: float, n_threads: int = 0) -> grain.IterDataset:
    """The fast pipeline with an I/O wait a batch in its map (a sleep), read by `n_threads` of grain's threads."""

    def wait(batch: Any) -> Any:
        time.sleep(seconds)
        return batch

    batches = shuffled_batches(x, y, BATCH, seed=0).map(wait)
    return batches.to_iter_dataset(grain.ReadOptions(num_threads=n_threads, prefetch_buffer_size=4 * max(n_threads, 1)))


if __name__ == "__main__":
    main()
