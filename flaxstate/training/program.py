"""A loop's compiled programs: the update of K steps in one call, and a record's update.

Built from the pure step functions of `flaxstate.training.step` and compiled
by the loop's placement, once each (the update once per K used). The update
of any K returns one structure, `(state_leaves, losses)`; a record's dispatch
runs the same steps in a program that also gives its last step's gradients
and the new state's fingerprint (see `step.update_program`), at K = 1 as at K > 1.
"""

from __future__ import annotations

import concurrent.futures
import re
from collections.abc import Callable
from typing import Any, cast

import jax

from flaxstate.run_record import fingerprints
from flaxstate.training import step, throughput
from flaxstate.training.options import LoopSpec
from flaxstate.training.placement import Placement
from flaxstate.training.task import TrainTask

PyTree = Any
_UNKNOWN = object()
TRIPS = r'known_trip_count":\{{"n":"{n_steps}"'
"""How XLA's compiled HLO names a loop of `n_steps` trips (its `backend_config`): the steps' loop, kept."""


class Program:
    """The compiled updates of one loop's state, on its placement.

    Args:
        placement: where the loop runs.
        fenced_step: `step.make_train_step(..., fenced=True)`, with the placement's `across`: every update's,
            so that a record's program (which also returns the gradients) and any other give the same state bit
            for bit, wherever records fall.
        shardings: the state's shardings (`placement.state_shardings(state)`).
        state: the state (the programs take its flat leaves; only its
            structure, shapes, dtypes and shardings are kept).
        rng_impl: the loop key's implementation (the programs take its raw data).
        counted_step: with microbatches, the step with their loop written
            out (`unrolled`), whose lowering counts every microbatch's FLOPs.
        given_flops: the user's count of a step's FLOPs (`TrainLoop(flops_per_step=...)`):
            a number, or a function of the global batch's shapes; `None` to count the model's.
        record_gradients: whether a record's dispatch also gives its last step's gradients
            (`TrainLoop(record_gradients=...)`), from its own update program (`record_update`).
        fingerprinted_records: whether a record's dispatch also gives the state's fingerprint; else the
            recorder takes it from the record's state when it is first read (`flaxstate.training.recording`).
    """

    def __init__(
        self,
        placement: Placement,
        fenced_step: Callable[..., Any],
        shardings: PyTree,
        state: PyTree,
        rng_impl: Any,
        counted_step: Callable[..., Any] | None = None,
        given_flops: float | Callable[[PyTree], float] | None = None,
        record_gradients: bool = True,
        fingerprinted_records: bool = True,
    ) -> None:
        self._placement = placement
        self.record_gradients = record_gradients
        self.fingerprinted_records = fingerprinted_records
        self._fenced_step = fenced_step
        self._counted_step = counted_step
        self._shardings = shardings
        leaves, self._treedef = jax.tree.flatten(state)
        self._abstract_leaves = [
            jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=leaf.sharding) for leaf in leaves
        ]
        self._rng_impl = rng_impl
        self._updates: dict[tuple[int, bool, bool], Callable[..., Any]] = {}
        self._given_flops = given_flops
        self._flops: Any = _UNKNOWN
        self._xla_flops: Any = _UNKNOWN

    @classmethod
    def build(
        cls,
        *,
        placement: Placement,
        task: TrainTask,
        spec: LoopSpec,
        n_microbatches: int,
        state: PyTree,
        rng: jax.Array,
        fingerprinted_records: bool = True,
    ) -> Program:
        """The programs of `task`'s step on `placement`, for `state` (placed) and the run's key `rng`.

        Args:
            spec: the loop's options (its rng collections in training, the collections the update may change,
                a given count of a step's FLOPs, whether records carry gradients: see the class).
            n_microbatches: M microbatches a step (see `step.microbatched`): the spec's, or those its
                `max_device_batch` chose from the data's batch.
            fingerprinted_records: see the class.
        """
        apply, loss = task.step_functions()
        fenced_step, counted_step = (
            step.make_train_step(
                apply,
                loss,
                rng_names=spec.apply_names,
                mutable=spec.mutable_collections,
                across=placement.across,
                n_microbatches=n_microbatches,
                fenced=fenced,
                unrolled=unrolled,
            )
            for fenced, unrolled in ((True, False), (False, True))
        )
        shardings = placement.state_shardings(state)
        return cls(
            placement,
            fenced_step,
            shardings,
            state,
            jax.random.key_impl(rng),
            counted_step if n_microbatches > 1 else None,
            cast(Any, spec.flops_per_step),  # checked: a number or a function
            spec.record_gradients,
            fingerprinted_records,
        )

    @property
    def shardings(self) -> PyTree:
        """The state's shardings."""
        return self._shardings

    def update(self, n_steps: int, gradients: bool = False, fingerprinted: bool = False) -> Callable[..., Any]:
        """The compiled `(state_leaves, batches, rng_data) -> (state_leaves, losses)` of `n_steps` steps.

        The state is donated; `batches` are stacked along a leading axis of
        `n_steps` when it is more than one. With `gradients` the last step's
        gradients come out too, a record's; with `fingerprinted` (where
        records are fingerprinted: `fingerprints.ENABLED`) then the new
        state's fingerprint (see `step.update_program`; a record's dispatch
        runs `record_update`). Every update runs the fenced step, so the state
        is the same bit for bit whichever of them ran a step. A `jax.jit`
        object: its `lower(...).compile()` gives XLA's cost and memory analyses.
        """
        fingerprinted = fingerprinted and fingerprints.ENABLED
        key = n_steps, gradients, fingerprinted
        if key not in self._updates:
            program = step.update_program(
                self._fenced_step, n_steps, self._treedef, self._rng_impl, gradients, fingerprinted
            )
            stacked = n_steps > 1
            self._updates[key] = self._placement.compile_update(
                program, self._shardings, stacked, gradients, fingerprinted
            )
        return self._updates[key]

    def record_update(self, n_steps: int) -> Callable[..., Any]:
        """The compiled update of a record's dispatch of `n_steps` steps: `(state_leaves, losses[, grads]
        [, fingerprint])`, its last step's gradients where records carry them (`record_gradients`), the new
        state's fingerprint where records are fingerprinted (`fingerprinted_records`). At one step as at K:
        no second forward and backward pass for the gradients, no call of its own for the fingerprint."""
        return self.update(n_steps, gradients=self.record_gradients, fingerprinted=self._records_fingerprinted)

    @property
    def _records_fingerprinted(self) -> bool:
        """Whether a record's update also gives the state's fingerprint: `fingerprinted_records`, where
        fingerprints are taken at all (`fingerprints.ENABLED`). A pass over the state that no plain update makes,
        so XLA's FLOPs count is not taken from that program (`_counted_update`, `compile_ahead`)."""
        return self.fingerprinted_records and fingerprints.ENABLED

    def flops_per_step(self, batch: Any, rng_data: Any) -> float | None:
        """The model FLOPs of one global step (computed once): the user's count, else the model's.

        The model's count is `throughput.model_flops` of the one-step update
        as traced (not compiled, so the same on every backend): every
        microbatch, every device's part.

        Args:
            batch, rng_data: what the update takes beside the state (arrays or
                `jax.ShapeDtypeStruct`s: only their shapes and dtypes count).
                A `given_flops` function is called with the batch's
                `jax.ShapeDtypeStruct`s.

        Raises:
            ValueError: a `given_flops` function that returns no positive finite number, naming what it returned.
        """
        if self._flops is _UNKNOWN:
            if self._given_flops is None:
                update: Any = self.update(1)  # a jax.jit object
                self._flops = throughput.model_flops(update.trace(self._abstract_leaves, batch, rng_data).jaxpr)
            elif callable(self._given_flops):
                shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), batch)
                self._flops = throughput.checked_flops(self._given_flops(shapes), "TrainLoop flops_per_step(batch)")
            else:
                self._flops = float(self._given_flops)
        return self._flops

    def xla_flops_per_step(self, batch: Any, rng_data: Any) -> float | None:
        """XLA's FLOPs of one global step, from its cost analysis of the compiled one-step update (computed once).

        XLA counts a loop's body once, so with microbatches the count is
        scaled by the ratio of two lowerings' counts (not compiled): the
        step with the microbatches' loop written out, over the step as it
        runs. Compiles the one-step update (`_counted_update`), as its first
        dispatch would, unless a first segment's dispatches of K steps gave
        the count already (`compile_ahead`).

        Args:
            batch, rng_data: as `flops_per_step` takes them.

        Returns:
            the one-device program's count times the devices, or `None`
            where XLA gives none (see `flaxstate.training.throughput`).
        """
        if self._xla_flops is _UNKNOWN:
            update: Any = self._counted_update()  # a jax.jit object
            lowered = update.lower(self._abstract_leaves, batch, rng_data)
            gradients = update is not self.update(1)
            self._xla_flops = self._global_count(
                throughput.flops_of(lowered.compile()), lowered, gradients, batch, rng_data
            )
        return self._xla_flops

    def _global_count(
        self, per_device: float | None, lowered: Any, gradients: bool, batch: Any, rng_data: Any
    ) -> float | None:
        """A global step's count from one device's count of a step's program (its microbatches' loop counted
        once): times the microbatches' loop factor, the lowered step with their loop written out over `lowered`
        (the one-step update, with or without `gradients`), times the devices."""
        if per_device is not None and self._counted_step is not None:
            program = step.update_program(self._counted_step, 1, self._treedef, self._rng_impl, gradients)
            counted: Any = self._placement.compile_update(program, self._shardings, False, gradients, False)
            per_device *= throughput.loop_factor(lowered, counted.lower(self._abstract_leaves, batch, rng_data))
        return None if per_device is None else per_device * self._placement.mesh.size

    def _count_from_steps(self, compiled: Any, n_steps: int, batch: Any, rng_data: Any) -> None:
        """XLA's count of a step from `compiled`, a program of `n_steps` > 1 steps without a fingerprint, where
        XLA kept the steps' loop (its HLO has a loop of `n_steps` trips): XLA counts a loop's body once, the same
        kernels as the one-step update's (37,500,616 FLOPs in either for an MLP here).

        Where XLA wrote the loop out, or says nothing of its trips, the one-step update is compiled for the
        count instead (`xla_flops_per_step`).
        """
        text = compiled.as_text() or ""
        if not re.search(TRIPS.format(n_steps=n_steps), text):
            self.xla_flops_per_step(batch, rng_data)
            return
        per_device = throughput.flops_of(compiled)
        if per_device is not None and self._counted_step is not None:  # the loop factor's rolled program
            lowered = cast(Any, self.update(1)).lower(self._abstract_leaves, batch, rng_data)
        else:
            lowered = None
        self._xla_flops = self._global_count(per_device, lowered, False, batch, rng_data)

    def _counted_update(self) -> Callable[..., Any]:
        """The one-step program whose XLA count `xla_flops_per_step` takes: a record's update where it adds
        only outputs (its gradients: the same kernels, counted alike to 1e-6 for the NNX tutorial's models), so
        that a record's dispatch of one step, a run's first where records come every step, compiles one program
        for both; else the plain update (a fingerprint adds a pass over the state)."""
        return self.update(1) if self._records_fingerprinted else self.record_update(1)

    def made(self) -> dict[str, Callable[..., Any]]:
        """The programs made so far (each `jax.jit` object compiles at its first call), by what they are:
        `"update of N steps"`, with `", gradients"` and `", fingerprinted"` where a record's. What `fs.plan`
        counts is checked against them."""
        found: dict[str, Callable[..., Any]] = {}
        for (n_steps, gradients, fingerprinted), update in self._updates.items():
            name = f"update of {n_steps} steps" + ", gradients" * gradients + ", fingerprinted" * fingerprinted
            found[name] = update
        return found

    def compile_ahead(self, batch: Any, rng_data: Any, sizes: list[int]) -> None:
        """Compiles, at once on threads of their own, the programs a segment of dispatches of `sizes` steps calls
        (its record's update the last), and XLA's FLOPs count of a step.

        XLA's count comes from a program of K > 1 steps that the segment runs without a fingerprint (a plain
        update, else the record's), whose steps' loop XLA counts once; where the segment has none, from the
        one-step update (`xla_flops_per_step`: where records come every step, the record's update, so that a
        run's first step compiles one program). Either way no program is compiled for the count alone where a
        dispatch runs one that gives it: at K = 10 the first segment compiled a one-step update that no dispatch
        ran beside the programs it dispatches, and now compiles those alone (`benchmarks/nnx_loop.py --startup 3
        --dispatch 10`, this project's idle 2-core CPU: the NNX tutorial's MLP and CNN to their first 10 steps at
        1.19x and 1.22x the tutorial's loop, against 1.36x and 1.45x).

        One program after another, a run's first segment compiled the update and then its record's (the same
        forward and backward pass, which also returns the gradients): Flax's NNX tutorial's CNN took 1.45 times
        the tutorial's own loop to its first step. XLA compiles outside Python's lock, so the compiles overlap on
        the host's cores; a program's first call then finds it compiled. A compile that fails raises here, as its
        call would.

        Args:
            batch, rng_data: one step's global batch and the key's data (arrays or `jax.ShapeDtypeStruct`s).
            sizes: the segment's dispatches, in steps (`Schedule.dispatch_sizes`).
        """

        def stacked(n_steps: int) -> Any:
            if n_steps == 1:
                return batch
            return jax.tree.map(lambda x: jax.ShapeDtypeStruct((n_steps, *x.shape), x.dtype), batch)

        record = sizes[-1] if sizes else 1
        programs: list[tuple[Any, int]] = [(self.update(n), n) for n in sorted(set(sizes[:-1]))]
        programs.append((self.record_update(record), record))  # the one-step update itself where it adds nothing
        counting = [
            (p, n) for p, n in programs if n > 1 and (p is not programs[-1][0] or not self._records_fingerprinted)
        ]
        counted, counted_steps = counting[0] if counting and self._xla_flops is _UNKNOWN else (None, 1)

        def compiled(program: Any, n_steps: int) -> Callable[[], Any]:
            return lambda: program.lower(self._abstract_leaves, stacked(n_steps), rng_data).compile()

        jobs: list[tuple[Any, Callable[[], Any]]] = []
        if counted is None:  # the one-step update's count: compiles its program
            jobs.append((None, lambda: self.xla_flops_per_step(batch, rng_data)))
        for p, n in programs:
            if counted is None and p is self._counted_update() and n == 1:
                continue  # compiled by the FLOPs count's job
            jobs.append((p, compiled(p, n)))

        def in_context(job: Callable[[], Any]) -> Any:
            with self._placement.context():  # `jax.set_mesh` is the thread's own: the caller's is not here
                return job()

        with concurrent.futures.ThreadPoolExecutor(
            max_workers=len(jobs), thread_name_prefix="flaxstate-compile"
        ) as pool:
            done = [(p, pool.submit(in_context, job)) for p, job in jobs]
            results = [(p, future.result()) for p, future in done]
        if counted is not None:  # XLA's count from the program of K steps, as the segment compiled it
            with self._placement.context():
                self._count_from_steps(next(c for p, c in results if p is counted), counted_steps, batch, rng_data)
