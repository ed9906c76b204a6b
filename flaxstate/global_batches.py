"""`global_batches`: data whose global batch at step s is fixed, whatever the number of processes.

The examples of the run form one stream, epoch after epoch, each epoch a
seeded permutation of the source (`np.random.default_rng((seed, epoch))`;
the source's order with `shuffle=False`); global batch `s` is examples
`s * batch_size` to `(s + 1) * batch_size - 1` of that stream, so a batch may
span the end of an epoch and no example is dropped. Each process reads only
its part of that batch: its contiguous share of the data-parallel batch (in
process order), or under a mesh the part that `BatchLayout.process_part()`
names. Its position is the global step, the same on any process count:
`TrainLoop` starts it at the step it resumes from (`iter_from`), on any
number of processes and any batch layout, without drawing the batches
before it.

A source of arrays with a common first dimension (a numpy array, or a dict
or tuple of them) is gathered with one indexing call per array a batch. A
random-access source (`len` and `__getitem__`: a list, a grain data source
over ArrayRecord files) is read example by example, through an optional
per-example `transform`, by grain: `read_threads` threads for sources that
wait on I/O, `workers` processes for Python-heavy transforms; examples that
are tuples or dicts are stacked into a batch of the same structure.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh

from flaxstate import settings, sharding
from flaxstate.sharding import AxisRules, Partitioning

PyTree = Any
_N_STEPS = 2**40
"""The steps a random-access source's grain dataset spans (the stream is endless; grain wants a length)."""


def _is_arrays(source: Any) -> bool:
    """Whether `source` is arrays (an array, or a dict or tuple of them) rather than a sequence of examples."""
    if isinstance(source, np.ndarray | jax.Array):
        return True
    leaves = jax.tree.leaves(source) if isinstance(source, Mapping | tuple) else []
    return bool(leaves) and all(isinstance(leaf, np.ndarray | jax.Array) and leaf.ndim >= 1 for leaf in leaves)


def _on_host(source: Any) -> Any:
    """`source`'s jax arrays as numpy arrays (read once; batches are gathered on the host as numpy's are).

    Raises:
        ValueError: a jax array that this process does not hold whole (a
            global array of several processes), naming its path.
    """

    def fetch(path: Any, leaf: Any) -> Any:
        if not isinstance(leaf, jax.Array):
            return leaf
        if not leaf.is_fully_addressable:
            raise ValueError(
                f"global_batches source{jax.tree_util.keystr(path)} is a jax array spread over several processes "
                "(not fully addressable here); give every process the whole source as numpy arrays (each reads "
                "its part of each batch)."
            )
        return np.asarray(leaf)

    return jax.tree_util.tree_map_with_path(fetch, source)


def _stack(examples: Sequence[Any]) -> PyTree:
    return jax.tree.map(lambda *leaves: np.stack([np.asarray(leaf) for leaf in leaves]), *examples)


class GlobalBatches:
    """This process's part of each global batch, from a step on (see the module's docstring).

    Made by `global_batches`; iterate it (from step 0) or `iter_from(step)`.
    """

    def __init__(
        self,
        source: Any,
        *,
        batch_size: int,
        seed: int,
        shuffle: bool,
        transform: Callable[[Any], Any] | None,
        part: tuple[int, int],
        read_threads: int,
        workers: int,
    ) -> None:
        self.source = source
        self.batch_size = batch_size
        self.seed = seed
        self.shuffle = shuffle
        self.transform = transform
        self.part = part
        self.read_threads = read_threads
        self.workers = workers
        self._arrays = _is_arrays(source)
        self.n_examples = len(jax.tree.leaves(source)[0]) if self._arrays else len(source)
        self._epochs: dict[int, np.ndarray] = {}

    @property
    def local_batch_size(self) -> int:
        """The examples of this process's part of a global batch."""
        return self.batch_size // self.part[1]

    def _order(self, epoch: int) -> np.ndarray:
        if epoch not in self._epochs:
            if len(self._epochs) > 2:  # a batch spans at most two epochs
                self._epochs.pop(min(self._epochs))
            if self.shuffle:
                self._epochs[epoch] = np.random.default_rng((self.seed, epoch)).permutation(self.n_examples)
            else:
                self._epochs[epoch] = np.arange(self.n_examples)
        return self._epochs[epoch]

    def indices(self, step: int, part: tuple[int, int] = (0, 1)) -> np.ndarray:
        """The source's indices of global batch `step` (of its `part`, `(index, count)`, by default all)."""
        size = self.batch_size // part[1]
        first = step * self.batch_size + part[0] * size
        positions = np.arange(first, first + size)
        epochs, within = np.divmod(positions, self.n_examples)
        out = np.empty(size, dtype=np.int64)
        for epoch in np.unique(epochs):
            chosen = epochs == epoch
            out[chosen] = self._order(int(epoch))[within[chosen]]
        return out

    def batch(self, step: int) -> PyTree:
        """This process's part of global batch `step`."""
        ids = self.indices(step, self.part)
        if self._arrays:
            return jax.tree.map(lambda array: array[ids], self.source)
        return _stack([self._example(int(index)) for index in ids])

    def _example(self, index: int) -> Any:
        example = self.source[index]
        return self.transform(example) if self.transform is not None else example

    def iter_from(self, step: int) -> Iterator[PyTree]:
        """This process's parts of the global batches from `step` on, without reading those before."""
        if self._arrays or (self.read_threads <= 1 and self.workers == 0):
            return (self.batch(s) for s in itertools.count(step))
        import grain

        dataset = grain.MapDataset.source(_Steps(self))[step:]
        iterable = dataset.to_iter_dataset(grain.ReadOptions(num_threads=self.read_threads, prefetch_buffer_size=8))
        if self.workers:
            from absl import flags

            if not flags.FLAGS.is_parsed():  # grain's workers read an absl flag (google/grain#1355, fixed later)
                flags.FLAGS.mark_as_parsed()
            iterable = iterable.mp_prefetch(grain.MultiprocessingOptions(num_workers=self.workers))
        return iter(iterable)

    def __iter__(self) -> Iterator[PyTree]:
        return self.iter_from(0)

    def __repr__(self) -> str:
        return (
            f"global_batches({self.n_examples} examples, batch_size={self.batch_size}, seed={self.seed}, "
            f"shuffle={self.shuffle}, part={self.part})"
        )


class _Steps:
    """A grain source whose element `s` is this process's part of global batch `s`."""

    def __init__(self, batches: GlobalBatches) -> None:
        self._batches = batches

    def __len__(self) -> int:
        return _N_STEPS

    def __getitem__(self, step: int) -> PyTree:
        return self._batches.batch(int(step))


def global_batches(
    source: Any,
    batch_size: int,
    *,
    seed: int = 0,
    shuffle: bool = True,
    transform: Callable[[Any], Any] | None = None,
    mesh: Mesh | None = None,
    axis_rules: AxisRules | None = None,
    read_threads: int = 1,
    workers: int = 0,
    partitioning: Partitioning | None = None,
) -> GlobalBatches:
    """Data for `TrainTask(data=...)` whose global batch at step s is fixed whatever the process count.

    Example:
        >>> import numpy as np
        >>> x, y = np.arange(10.0).reshape(5, 2), np.arange(5)
        >>> data = global_batches((x, y), batch_size=2, shuffle=False)
        >>> [batch[1].tolist() for batch in itertools.islice(data, 3)]
        [[0, 1], [2, 3], [4, 0]]

    Args:
        source: arrays with a common first dimension (a numpy or jax array,
            or a dict or tuple of them; jax arrays are read to the host once),
            or a random-access source of examples
            (`len` and `__getitem__`).
        batch_size: the global batch size (all processes together).
        seed: the seed of each epoch's permutation.
        shuffle: a new order each epoch; `False`: the source's order.
        transform: applied to each example of a random-access source.
        mesh, axis_rules: the sharded loop's, so that each process reads the
            part of the batch that its devices hold along the batch axes
            (`BatchLayout.process_part()`); without them, its contiguous share
            of a data-parallel batch.
        read_threads: threads reading a random-access source (grain's
            `ReadOptions`), for sources that wait on I/O.
        workers: processes running `transform` (grain's `mp_prefetch`), for
            Python-heavy transforms.
        partitioning: `fs.Partitioning`, the loop's (instead of `mesh=` and `axis_rules=`).

    Returns:
        a re-iterable of this process's parts of the global batches, from step 0.

    Raises:
        ValueError: a negative seed, an empty source, arrays of different lengths, fewer
            examples than one global batch (naming both), a `batch_size` that the processes (or the mesh's batch parts)
            do not divide, naming both, or only one of `mesh` and `axis_rules`.
    """
    if not settings.is_integer(batch_size) or batch_size < 1:
        raise ValueError(f"global_batches batch_size must be a positive int, got {batch_size!r}.")
    if not settings.is_integer(seed) or seed < 0:
        raise ValueError(
            f"global_batches seed must be an int of at least 0 (numpy's permutations take no negative seed), "
            f"got {seed!r}."
        )
    batch_size, seed = int(batch_size), int(seed)  # numpy's from a config: plain ints in the data's JSON state
    if _is_arrays(source):
        source = _on_host(source)
        lengths = {len(leaf) for leaf in jax.tree.leaves(source)}
        if len(lengths) > 1:
            raise ValueError(f"global_batches source arrays differ in length: {sorted(lengths)}; give one per example.")
    elif not (hasattr(source, "__len__") and hasattr(source, "__getitem__")):
        raise ValueError(
            f"global_batches source must be numpy arrays (or a dict or tuple of them) or a random-access source "
            f"(len and __getitem__), got {type(source).__name__}."
        )
    n_examples = len(jax.tree.leaves(source)[0]) if _is_arrays(source) else len(source)
    if n_examples == 0:
        raise ValueError("global_batches source is empty.")
    if n_examples < batch_size:
        raise ValueError(
            f"global_batches source has {n_examples} examples, fewer than one global batch of {batch_size}: a "
            f"batch would hold some examples twice. Give a batch_size of at most {n_examples}, or more examples."
        )
    where_to = sharding.resolve("global_batches", partitioning, None, mesh, axis_rules)
    part = where_to.process_part()
    where = f"the mesh's {part[1]} batch parts" if where_to.sharded else f"the {part[1]} processes"
    if batch_size % part[1]:
        raise ValueError(
            f"global_batches batch_size {batch_size} does not divide among {where}: give a batch size that "
            f"{part[1]} divides, e.g. {batch_size - batch_size % part[1] or part[1]}."
        )
    return GlobalBatches(
        source,
        batch_size=batch_size,
        seed=int(seed),
        shuffle=shuffle,
        transform=transform,
        part=part,
        read_threads=read_threads,
        workers=workers,
    )
