"""Plan a job before it is queued: compile the loop's own update for a target's devices and report memory and FLOPs.

`plan(init, task, target=...)` builds what `TrainLoop` builds (the state's
shardings from the placement, the same `Program`: step, microbatches and K
steps a dispatch) from shapes alone (`jax.eval_shape` of `init`: nothing is
allocated, so a model of any size plans on a laptop), lowers the update for
the target's devices and compiles it, without running it.

Targets:

- a TPU topology name that libtpu knows ("v5e:2x2", "v5p:4x4x4", ...): the
  devices of `jax.experimental.topologies.get_topology_desc`, compiled by
  XLA for that chip on this machine (`pip install 'flaxstate[plan]'`);
- "cpu:N": N host devices of a CPU client of their own, compiled for and
  never run (several CPU devices in one process deadlock only when they run
  collectives);
- "local": this process's devices.

The state's bytes a device are exact, from the shardings and shapes; XLA's
temporaries and generated code come from the compiled program, and the total
counts donated buffers once (XLA's alias bytes are the state's own, updated
in place).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import re
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import jax
import numpy as np
from flax.core.scope import CollectionFilter, DenyList
from jax.sharding import Mesh

from flaxstate import host_memory as host_plan
from flaxstate import private_apis, settings, sharding, tree_paths
from flaxstate.checkpoint import budget
from flaxstate.checkpoint.budget import HostMemoryBudget
from flaxstate.checkpoint.tiers import local_tier as tiers
from flaxstate.checkpoint.tiers.local_tier import LocalTier
from flaxstate.records import format_bytes
from flaxstate.sharding import AxisRules, Partitioning
from flaxstate.training import batching, placement, startup, throughput
from flaxstate.training import evaluation as evaluation_module
from flaxstate.training.options import LoopSpec
from flaxstate.training.program import Program
from flaxstate.training.task import EvalTask, TrainTask

GiB = 2**30
DEVICE_MEMORY: tuple[tuple[str, int], ...] = (
    ("TPU v4", 32 * GiB),  # Google Cloud TPU v4: 32 GiB HBM a chip
    ("TPU v5 lite", 16 * GiB),  # TPU v5e: 16 GiB HBM2 a chip
    ("TPU v5e", 16 * GiB),
    ("TPU v5p", 95 * GiB),
    ("TPU v5", 95 * GiB),  # v5p reports its kind as "TPU v5"
    ("TPU v6 lite", 32 * GiB),  # TPU v6e (Trillium)
    ("TPU v6e", 32 * GiB),
)
"""Each device kind's memory, where known (the first name that the kind contains wins)."""

CATEGORIES = ("params", "optimizer", "mutables", "batch", "temp", "code", "records", "total")


@dataclasses.dataclass(frozen=True)
class Plan:
    """What one update of a training job takes on each device of a target (see `plan`).

    Attributes:
        target: the target it was compiled for.
        device_kind: the target's device kind ("TPU v5 lite", "cpu", ...).
        n_devices: the target's devices.
        mesh_shape: the mesh's axis sizes.
        per_device: bytes a device: `params`, `optimizer` (the optimizer's
            state, an EMA and the rest of the train state), `mutables` (batch
            statistics and other collections), `batch` (K batches; the
            evaluation's where it sets the peak), `temp` (XLA's
            temporaries of the program that sets the peak), `code` (its generated
            code), `records` (the device copies that records hold beside it, with
            `record_memory="device"`) and `total`, the device's peak: the largest
            over `programs`.
        programs: each program the loop runs, by name, with the bytes a device
            holds while it runs (its arguments and outputs, the donated ones
            once, its temporaries and code, and the records' copies beside it):
            "the update", "a record's update" (where it is a program of its
            own), "a record's device copy" (`record_memory="device"`), "the
            evaluation" (`evaluation=`: the training state beside it) and "the
            restore" (the state a resume reads, nothing beside it); `total` is
            the largest.
        peak_program: the name of the program that sets the peak (`total`).
        device_memory: a device's memory in bytes, or `None` where unknown.
        fits: whether `total` fits in `device_memory` (`None` where unknown).
        flops_per_step: the model FLOPs of one global step (all devices): its
            matrix products, counted from the traced program, the same for
            every target (`flaxstate.training.throughput.model_flops`).
        xla_flops_per_step: XLA's count for this target's compiled program,
            or `None` (a program the target refused, or a backend with none).
        largest: the largest arrays a device holds: (state-dict path, bytes), largest first.
        advice: for a plan that does not fit, its biggest contributors and how to shard them.
        per_host: a process's host bytes by kind: `records`, `save`, `peers`,
            `restore`, `local_tier` and `total` (`flaxstate.host_memory` says
            what each counts; on a CPU target `total` includes the devices'
            own bytes, as their memory is host memory).
        host_memory: a host's memory in bytes (this machine's for "local" and
            "cpu:N"), or `None` where unknown.
        fits_host: whether `per_host["total"]` fits in `host_memory` (`None` where unknown).
        host_advice: for a process that does not fit its host, its kinds largest first and what shrinks each.
        n_microbatches: the microbatches a step that it compiled (`plan`'s, or those `max_device_batch` chose).
    """

    target: str
    device_kind: str
    n_devices: int
    mesh_shape: dict[str, int]
    per_device: dict[str, int]
    device_memory: int | None
    fits: bool | None
    flops_per_step: float | None
    largest: list[tuple[str, int]]
    advice: str | None = None
    xla_flops_per_step: float | None = None
    per_host: dict[str, int] = dataclasses.field(default_factory=dict)
    n_microbatches: int = 1
    host_memory: int | None = None
    fits_host: bool | None = None
    host_advice: str | None = None
    programs: dict[str, int] = dataclasses.field(default_factory=dict)
    peak_program: str | None = None

    def step_seconds(self, mfu: float, peak_flops_per_device: float | None = None) -> float | None:
        """The seconds a step takes at a model FLOPs utilisation `mfu` (0-1), where the peak is known.

        Args:
            mfu: the fraction of the peak the step reaches.
            peak_flops_per_device: one device's peak FLOP/s (by default the
                known dense bfloat16 peak of the device kind).
        """
        peak = peak_flops_per_device
        if peak is None:
            peak = next((value for name, value in throughput.DENSE_BF16_PEAKS if name in self.device_kind), None)
        if peak is None or self.flops_per_step is None or not mfu > 0:
            return None
        return self.flops_per_step / (mfu * peak * self.n_devices)

    def __str__(self) -> str:
        mesh = " x ".join(f"{name}={size}" for name, size in self.mesh_shape.items())
        lines = [f"plan for {self.target}: {self.n_devices} x {self.device_kind}, mesh {mesh}", ""]
        lines += [f"  {name:<10} {format_bytes(self.per_device[name]):>10}" for name in CATEGORIES]
        memory = "unknown" if self.device_memory is None else format_bytes(self.device_memory)
        verdict_of = {None: "unknown", True: "fits", False: "does NOT fit"}
        verdict = verdict_of[self.fits]
        if self.peak_program is not None:
            lines += ["", f"  the peak is {self.peak_program}'s; each program the loop runs:"]
            lines += [f"    {format_bytes(size):>10}  {name}" for name, size in self.programs.items()]
        lines += ["", f"  device memory {memory}: {verdict}"]
        if self.flops_per_step is not None:
            lines.append(f"  FLOPs a step {self.flops_per_step:.4g}")
            at_half = self.step_seconds(0.5)
            if at_half is not None:
                lines.append(f"  a step at 50% MFU: {at_half * 1e3:.3g} ms")
        lines += ["", "  largest arrays a device holds:"]
        lines += [f"    {format_bytes(size):>10}  {path}" for path, size in self.largest]
        if self.advice:
            lines += ["", f"  {self.advice}"]
        if self.per_host:
            lines += ["", "  host memory a process:"]
            lines += [f"  {name:<10} {format_bytes(self.per_host[name]):>10}" for name in host_plan.KINDS]
            memory = "unknown" if self.host_memory is None else format_bytes(self.host_memory)
            lines += ["", f"  host memory {memory}: {verdict_of[self.fits_host]}"]
        if self.host_advice:
            lines += ["", f"  {self.host_advice}"]
        return "\n".join(lines)


def _local_tier(
    tier: LocalTier | None, local_dir: str | os.PathLike[str] | LocalTier | None, local_keep: int, peers: int
) -> LocalTier | None:
    """The local tier that `plan` counts: `local_tier=`, or the one its deprecated keywords name (`local_dir`,
    `local_keep`, `peers`), refused where the writer would refuse it; `None` without one."""
    old = [
        name
        for name, given in (
            ("local_dir=", local_dir is not None),
            ("local_keep=", not isinstance(local_keep, tiers.Unset)),
            ("peers=", not isinstance(peers, tiers.Unset)),
        )
        if given
    ]
    if tier is not None:
        if not isinstance(tier, LocalTier):
            raise ValueError(f"plan local_tier must be a fs.LocalTier or None, got {tier!r}.")
        if old:
            raise ValueError(
                f"plan got local_tier={tier!r} and {', '.join(old)}: the LocalTier says its directory, peers and "
                f"keep. Leave {', '.join(old)} out."
            )
        return tier
    if isinstance(local_dir, LocalTier):
        tiers.settings_of(local_dir, "plan", keep=local_keep, peers=peers, names=("local_keep", "peers"))
        tier = local_dir
    else:
        peers = settings.count("plan", "peers", peers, minimum=0)
        local_keep = settings.count("plan", "local_keep", local_keep)
        if local_dir is None:
            if peers:
                raise ValueError(
                    f"plan got peers={peers} without a local tier: peer copies are kept of each process's local "
                    "tier (the writer refuses them without one). Give local_tier=fs.LocalTier(directory, peers=N)."
                )
            return None
        tier = LocalTier(local_dir, peers=peers, keep=local_keep)
    settings.deprecated("plan", ", ".join(old), f"local_tier=fs.{tier!r}")
    return tier


def plan(
    init: Callable[..., Any],
    task: TrainTask,
    *,
    target: str,
    mesh_shape: Mapping[str, int] | jax.sharding.AbstractMesh | None = None,
    axis_rules: AxisRules | None = None,
    batch: Any = None,
    n_microbatches: int = 1,
    n_steps_per_dispatch: int = 1,
    input_sample: Any = None,
    device_memory: int | None = None,
    record_memory: str = "host",
    record_gradients: bool = True,
    peers: int = tiers.PEERS,
    local_dir: str | os.PathLike[str] | LocalTier | None = None,
    local_keep: int = tiers.KEEP,
    host_memory: int | None = None,
    host_memory_budget: HostMemoryBudget | int | None = None,
    max_device_batch: int | None = None,
    local_tier: LocalTier | None = None,
    collections: Mapping[str, Sequence[str]] | None = None,
    mutable_collections: CollectionFilter = DenyList("intermediates"),
    flops_per_step: float | str | Callable[[Any], float] | None = None,
    evaluation: EvalTask | None = None,
) -> Plan:
    """Compiles the update `TrainLoop` would run for `target` (never running it) and reports memory and FLOPs.

    Args:
        init: the model's init, `init(rngs, *inputs) -> variables` (as `TrainLoop` takes it), the `nnx.Module`, or
            a `fs.SafetensorsReader` (its target's state, which the files' params must fit).
        task: the task (its step, loss and optimizer; its data gives the default batch).
        target: a TPU topology name ("v5e:2x2"), "cpu:N", or "local".
        mesh_shape: axis sizes, e.g. `{"data": 2, "fsdp": 8}`, multiplying to the
            target's devices (with `axis_rules`), or a `jax.sharding.AbstractMesh`
            (its sizes and axis types: `Explicit` axes are planned as the loop
            runs them); by default the mesh of the `jax.set_mesh` around the
            call (its names, sizes and axis types, on the target's devices),
            else data parallelism over all.
        axis_rules: flax-style logical axis rules, as `TrainLoop` takes them.
        batch: one global batch (arrays or `jax.ShapeDtypeStruct`s, as the data
            yields them); by default the first batch of `task.data`, as it is.
        n_microbatches: M microbatches a step.
        n_steps_per_dispatch: K steps a compiled call.
        input_sample: the model's inputs for `init` (the batch's by default).
        device_memory: a device's memory in bytes (by default a known kind's).
        record_memory: where the loop's records hold their copy, as `TrainLoop` takes it.
        record_gradients: whether the loop's records carry gradients, as `TrainLoop` takes it (their
            host copies count in `per_host["records"]`).
        peers: deprecated: `local_tier=fs.LocalTier(directory, peers=N)`.
        local_dir: deprecated: `local_tier=fs.LocalTier(directory)`.
        local_keep: deprecated: `local_tier=fs.LocalTier(directory, keep=K)`.
        host_memory: a host's memory in bytes (by default this machine's for
            "local" and "cpu:N", unknown for a TPU topology).
        host_memory_budget: the writer's and the reader's `host_memory_budget=`
            (a `fs.HostMemoryBudget` or its bytes): a save, a peer exchange and
            a restore's reads hold at most it and `host_memory.BUDGET_ALLOWANCE`
            beyond the state.
        max_device_batch: the most examples a device may take at once, as
            `TrainLoop` takes it: the plan's microbatches are then the fewest
            that split each device's part of the global batch within it
            (`Plan.n_microbatches`), instead of `n_microbatches`.
        local_tier: the `fs.LocalTier` the writer saves (its host memory counts
            where its directory is memory-backed, as `/dev/shm` is; its peer
            copies and its `keep` with it), or `None` for no local tier.
        collections: the rng collection names at init and in training, as `TrainLoop` takes them.
        mutable_collections: which collections the update may change, as `TrainLoop` takes them.
        flops_per_step: a step's FLOPs, as `TrainLoop` takes them (`Plan.flops_per_step`); by default the
            model's count.
        evaluation: the `fs.EvalTask` an `EvalLoop` evaluates the loop's records with, in the training process:
            its program is planned on the first batch of its data, beside the training state the loop holds
            (`Plan.programs["the evaluation"]`).

    The options that shape the loop's programs (`n_steps_per_dispatch`,
    `n_microbatches`, `max_device_batch`, `collections`, `mutable_collections`,
    `record_memory`, `record_gradients`, `flops_per_step`) are one
    `flaxstate.training.options.LoopSpec`, which `TrainLoop` takes from the
    same keywords.

    Returns:
        the `Plan`.

    Raises:
        ValueError: before any compile: a `mesh_shape` (or the context's mesh)
            whose product is not the device count; a `mesh_shape` that differs
            from the context's mesh; axis rules without a mesh shape, or naming no mesh
            axis; a global batch that does not divide over the batch's parts
            and the microbatches; an unknown target or TPU topology (listing
            some known ones); `jax[tpu]` not installed (naming the extra);
            `peers` without a local tier (as the writer refuses them); `local_tier`
            not a `fs.LocalTier`, or with the deprecated keywords beside it;
            an `evaluation` that is not a `fs.EvalTask`.
    """
    spec = LoopSpec.taken("plan", locals())  # the options that `TrainLoop` takes, by the same names
    tier = _local_tier(local_tier, local_dir, local_keep, peers)
    host_memory = settings.optional_count("plan", "host_memory", host_memory, minimum=1)
    host_memory_budget = budget.of(host_memory_budget, "plan")  # the writer's and the reader's own check
    if evaluation is not None and not isinstance(evaluation, EvalTask):
        raise ValueError(f"plan's evaluation must be a fs.EvalTask (what EvalLoop takes), got {evaluation!r}.")
    devices = target_devices(target)
    where: Any = placement.create(_partitioning(devices, mesh_shape, axis_rules))  # with a batch layout
    with where.context(), _unloadable_quiet(target):  # an Explicit mesh's model is traced under it, as the loop's
        return _plan(
            init,
            task,
            spec,
            where=where,
            devices=devices,
            target=target,
            batch=batch,
            input_sample=input_sample,
            device_memory=device_memory,
            tier=tier,
            host_memory=host_memory,
            host_memory_budget=host_memory_budget,
            evaluation=evaluation,
        )


def _plan(
    init: Any,
    task: TrainTask,
    spec: LoopSpec,
    *,
    where: Any,
    devices: list[Any],
    target: str,
    batch: Any,
    input_sample: Any,
    device_memory: int | None,
    tier: LocalTier | None,
    host_memory: int | None,
    host_memory_budget: HostMemoryBudget,
    evaluation: EvalTask | None,
) -> Plan:
    """`plan` once its options are checked and its placement made."""
    global_batch = _global_batch(task, batch)
    n_microbatches, n_steps_per_dispatch = spec.n_microbatches, spec.n_steps_per_dispatch
    record_memory, record_gradients, max_device_batch = spec.record_memory, spec.record_gradients, spec.max_device_batch
    if max_device_batch is not None:
        batching.check_divisible(
            global_batch, where.batch_layout.n_parts, "plan", 1, _BATCH_PARTS, source=_BATCH, scope="global"
        )
        device_batch = batching.local_size(global_batch) // where.batch_layout.n_parts
        n_microbatches = startup.microbatches_for(device_batch, max_device_batch)
    batching.check_divisible(
        global_batch, where.batch_layout.n_parts, "plan", n_microbatches, _BATCH_PARTS, source=_BATCH, scope="global"
    )
    eval_batch = None if evaluation is None else _global_batch(evaluation, None, "EvalTask")
    if eval_batch is not None:
        parts = where.batch_layout.n_parts
        batching.check_divisible(eval_batch, parts, "plan", 1, _BATCH_PARTS, source=_EVAL_BATCH, scope="global")
    rng = jax.random.key(0)
    inputs = global_batch[0] if input_sample is None else _as_tuple(input_sample)
    sample = jax.tree.map(lambda x: jax.ShapeDtypeStruct((1, *np.shape(x)[1:]), _dtype(x)), list(inputs))
    model_init = init.target if isinstance(init, startup.ParamsSource) else init  # its files fit the target's shapes
    state = _abstract_state(*startup.fresh(model_init, task, spec.init_names, rng, sample), where)
    program = Program.build(placement=where, task=task, spec=spec, n_microbatches=n_microbatches, state=state, rng=rng)
    rng_data = jax.ShapeDtypeStruct(jax.random.key_data(rng).shape, jax.random.key_data(rng).dtype)
    batches = _abstract_batches(global_batch, where, n_steps_per_dispatch)
    one_batch = _abstract_batches(global_batch, where, 1)
    sizes = _state_bytes(state)
    memories = _programs_memory(program, state, batches, rng_data, n_steps_per_dispatch)
    records = _records_bytes(sizes, record_memory, record_gradients)
    programs = {
        name: _per_device(sizes, batches, memory, refused, records)["total"]
        for name, (memory, refused) in memories.items()
    }
    if records:  # a record's copy made while the caller holds the one before: the state and two copies
        programs[_COPY] = sum(sizes.values()) + 2 * records
    eval_batches = None
    if evaluation is not None:  # beside the training state, which it reads where it is (`EvalLoop`)
        eval_batches = _abstract_batches(eval_batch, where, 1)
        memory, refused = memories[_EVALUATION] = _evaluation_memory(evaluation, where, state, eval_batches, rng_data)
        evaluated = sum(_shard_bytes(leaf) for leaf in jax.tree.leaves(_evaluated(state)))
        held = _per_device(sizes, eval_batches, memory, refused, records)["total"]
        programs[_EVALUATION] = held + sum(sizes.values()) - evaluated
    programs[_RESTORE] = sum(sizes.values())  # read into an abstract template: the state, and nothing beside it
    peak = max(programs, key=lambda name: programs[name])
    memory, refused_temp = memories.get(peak, memories[_UPDATE])
    peak_batches = eval_batches if peak == _EVALUATION else batches
    per_device = _per_device(sizes, peak_batches, memory, refused_temp, records)
    per_device["total"] = programs[peak]
    refused_temp = next((refused for _, refused in memories.values() if refused is not None), None)
    if device_memory is None:
        device_memory = _device_memory(devices[0])
    # A program that XLA refused does not fit, as XLA itself said.
    fits = (
        False if refused_temp is not None else None if device_memory is None else per_device["total"] <= device_memory
    )
    mesh = where.mesh
    state_bytes, param_bytes, replicated = host_plan.process_bytes(state)
    on_cpu = devices[0].platform == "cpu"
    process_devices = sum(1 for device in devices if device.process_index == devices[0].process_index)
    per_host = host_plan.per_host(
        state_bytes,
        param_bytes,
        record_memory=record_memory,
        record_gradients=record_gradients,
        replicated=replicated,
        tier=tier,
        budget=host_memory_budget,
        devices=per_device["total"] * process_devices if on_cpu else None,
    )
    if host_memory is None and not _topology(target):
        host_memory = host_plan.this_machine()
    fits_host = None if host_memory is None else per_host["total"] <= host_memory
    result = Plan(
        target=target,
        device_kind=devices[0].device_kind,
        n_devices=len(devices),
        mesh_shape=dict(zip(mesh.axis_names, mesh.devices.shape, strict=True)),
        per_device=per_device,
        device_memory=device_memory,
        fits=fits,
        flops_per_step=program.flops_per_step(one_batch, rng_data),
        xla_flops_per_step=program.xla_flops_per_step(one_batch, rng_data) if refused_temp is None else None,
        largest=sorted(sizes.items(), key=lambda item: (-item[1], not item[0].startswith("target/"), item[0]))[:5],
        per_host=per_host,
        n_microbatches=n_microbatches,
        host_memory=host_memory,
        fits_host=fits_host,
        host_advice=None if host_memory is None or fits_host else host_plan.advice(per_host, host_memory),
        programs=programs,
        peak_program=peak,
    )
    return dataclasses.replace(result, advice=_advice(result, state, mesh)) if fits is False else result


_BATCH, _BATCH_PARTS = "plan: the global batch", "parts of the batch's mesh axes"
"""A plan's global batch, and what it splits over, as `batching.check_divisible`'s errors name them."""
_EVAL_BATCH = "plan: the evaluation's first batch"
"""A plan's evaluation batch (`plan(evaluation=)`), as the same errors name it."""


def _abstract_state(create: Callable[..., Any], arguments: Sequence[Any], where: Any) -> Any:
    """The state that `create(*arguments)` makes, as `jax.ShapeDtypeStruct`s placed by `where`."""
    abstract = jax.eval_shape(create, *arguments)
    shardings = where.state_shardings(abstract)
    return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, shardings)


def _abstract_batches(global_batch: Any, where: Any, n_steps: int) -> Any:
    """One dispatch's batches as the update takes them: `n_steps` of `global_batch` stacked (one: as it is)."""
    stacked = n_steps > 1
    sharding = where.batch_layout.sharding(stacked)
    lead = (n_steps,) if stacked else ()
    return jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(lead + tuple(np.shape(x)), _dtype(x), sharding=sharding), global_batch
    )


_UPDATE, _COPY = "the update", "a record's device copy"
"""The names of the loop's update of K steps, and of the moment a record's device copy is made, in `Plan.programs`."""
_EVALUATION, _RESTORE = "the evaluation", "the restore"
"""The names of an `EvalLoop`'s program (`plan(evaluation=)`) and of a resume's restore, in `Plan.programs`."""


def _evaluated(state: Any) -> Any:
    """What an evaluation reads of the abstract training state (`evaluation.evaluated_part`)."""
    return evaluation_module.evaluated_part(state, state.params)


def _evaluation_memory(task: EvalTask, where: Any, state: Any, batch: Any, rng_data: Any) -> tuple[Any, int | None]:
    """XLA's memory analysis of `EvalLoop`'s program for `task` on the plan's devices (`_compiled_memory`), on
    `batch` (the first of its data, placed)."""
    evaluated = _evaluated(state)
    shardings = jax.tree.map(lambda leaf: leaf.sharding, evaluated)
    compiled: Any = where.compile_eval(evaluation_module.evaluation_step(task, where), shardings)
    return _compiled_memory(lambda: compiled.lower(evaluated, batch, rng_data))


def _programs_memory(
    program: Program, state: Any, batches: Any, rng_data: Any, n_steps: int
) -> dict[str, tuple[Any, int | None]]:
    """XLA's memory analysis of each program the loop runs, by name (`_compiled_memory`): the update of K steps, and
    a record's update where it is a program of its own (with the last step's gradients and the state's fingerprint:
    `flaxstate.training.program`)."""
    leaves = jax.tree.leaves(state)
    update: Any = program.update(n_steps)  # jax.jit objects: `lower` gives XLA's program
    lowered: dict[str, Callable[[], Any]] = {_UPDATE: lambda: update.lower(leaves, batches, rng_data)}
    record: Any = program.record_update(n_steps)
    if record is not update:
        lowered["a record's update"] = lambda: record.lower(leaves, batches, rng_data)
    return {name: _compiled_memory(lower) for name, lower in lowered.items()}


def _compiled_memory(lower: Callable[[], Any], lowered: bool = True) -> tuple[Any, int | None]:
    """XLA's memory analysis of a compiled program (`lower()`'s, compiled; or, not `lowered`, compiled already),
    or `None` and the temporary bytes of a program XLA refused.

    XLA for a TPU refuses to compile a program larger than the chip; its error names the size.
    """
    try:
        return (lower().compile() if lowered else lower()).memory_analysis(), None
    except jax.errors.JaxRuntimeError as error:
        return None, _refused_temp(error)


def _records_bytes(sizes: Mapping[str, int], record_memory: str, record_gradients: bool) -> int:
    """The bytes a device holds for a record beside the loop's programs: with `record_memory="device"`, a copy of
    the state (and of its gradients, a parameter's size each); none in host memory."""
    if record_memory != "device":
        return 0
    return sum(sizes.values()) + (_sum(sizes, ("target/",)) if record_gradients else 0)


def _per_device(
    sizes: Mapping[str, int], batches: Any, memory: Any, refused_temp: int | None, records: int = 0
) -> dict[str, int]:
    """A device's bytes while a program runs: the state's parts, one dispatch's batches, XLA's temporaries and
    code, the records' copies beside it, and the total."""
    per_device = {"params": _sum(sizes, ("target/",)), "mutables": _sum(sizes, ("flax_mutables/",))}
    per_device["optimizer"] = sum(sizes.values()) - per_device["params"] - per_device["mutables"]
    per_device["batch"] = sum(_shard_bytes(leaf) for leaf in jax.tree.leaves(batches))
    per_device["temp"] = int(memory.temp_size_in_bytes) if memory is not None else (refused_temp or 0)
    per_device["code"] = int(memory.generated_code_size_in_bytes) if memory is not None else 0
    per_device["records"] = records
    if memory is not None:  # arguments and outputs, the donated (aliased) ones once
        held = memory.argument_size_in_bytes + memory.output_size_in_bytes - memory.alias_size_in_bytes
    else:
        held = sum(per_device[name] for name in ("params", "optimizer", "mutables", "batch"))
    per_device["total"] = int(held + per_device["temp"] + per_device["code"] + records)
    return per_device


def _topology(target: str) -> bool:
    """Whether `target` names a TPU topology: devices of no host here, neither "local" nor "cpu:N"."""
    return not (target == "local" or target.startswith("cpu:"))


UNLOADABLE = r"Error reading persistent compilation cache entry .*PjRtCompiler must be constructed with a Client"
"""JAX's warning for a TPU topology's program found in its persistent compilation cache: libtpu's compile-only
client, which compiled and wrote it, cannot load it back, so JAX compiles it again (what a plan does without a
cache). The cache stays the user's: `jax_compilation_cache_dir`, as `flaxstate launch` sets it."""


@contextlib.contextmanager
def _unloadable_quiet(target: str) -> Iterator[None]:
    """Ignores `UNLOADABLE` while a plan for a TPU topology compiles (a second plan of a model warned once a
    program); any other warning reaches the user, and the filters are theirs again after the plan."""
    if not _topology(target):
        yield
        return
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=UNLOADABLE, category=UserWarning)
        yield


ALLOW_MULTIPLE = "ALLOW_MULTIPLE_LIBTPU_LOAD"
"""libtpu's variable that lets a process load it while another holds its lockfile."""


def target_devices(target: str) -> list[Any]:
    """The devices of a target (see the module).

    Raises:
        ValueError: an unknown target, a TPU topology that libtpu does not know
            (listing some it does), or `jax[tpu]` not installed.
    """
    if target == "local":
        return list(jax.devices())
    if target.startswith("cpu:"):
        count = target.removeprefix("cpu:")
        if not count.isdigit() or int(count) < 1:
            raise ValueError(f"plan target {target!r}: give cpu:N with N a positive number of host devices.")
        return private_apis.cpu_devices(int(count))
    if ":" not in target or not target.split(":")[0].startswith("v"):
        raise ValueError(
            f"plan target {target!r} is neither a TPU topology ('v5e:2x2', 'v5p:2x2x1', 'v4:2x2x1'), "
            "'cpu:N' nor 'local'."
        )
    try:
        import libtpu  # noqa: F401
    except ImportError as error:
        raise ValueError(
            f"planning for the TPU topology {target!r} needs libtpu (jax[tpu]): pip install 'flaxstate[plan]'."
        ) from error
    from jax.experimental import topologies

    # A plan only compiles: it never opens a chip. libtpu's lockfile guards the chips, and any JAX process that
    # loaded libtpu holds it for life, so without this a plan beside a training process (or a notebook that
    # imported jax[tpu]) failed. A value the user set is kept.
    os.environ.setdefault(ALLOW_MULTIPLE, "1")
    try:
        return list(topologies.get_topology_desc(platform="tpu", topology_name=target).devices)
    except Exception as error:  # libtpu's own error: its lockfile held, or an unknown name or shape
        if "lockfile" in str(error):
            raise ValueError(
                f"another process holds libtpu (its multi-process lockfile: {str(error).splitlines()[0][:160]}), "
                f"so the plan for {target!r} cannot load it. A plan only compiles: set {ALLOW_MULTIPLE}=1 in this "
                f"process before JAX starts (it is {os.environ.get(ALLOW_MULTIPLE)!r} here), or run the other "
                "process with JAX_PLATFORMS=cpu if it needs no TPU."
            ) from error
        raise ValueError(
            f"libtpu does not know the TPU topology {target!r} ({str(error).splitlines()[0][:200]}); "
            "known ones look like 'v5e:2x2', 'v5e:4x4', 'v5e:16x16', 'v5p:2x2x1', 'v5p:4x4x4', 'v4:2x2x1', "
            "'v6e:2x2'."
        ) from error


def _partitioning(
    devices: list[Any], mesh_shape: Mapping[str, int] | jax.sharding.AbstractMesh | None, axis_rules: AxisRules | None
) -> Partitioning:
    context = sharding.context_mesh()
    if context is not None:
        given = mesh_shape if isinstance(mesh_shape, Mapping) or mesh_shape is None else dict(mesh_shape.shape)
        if given is not None and dict(given) != dict(context.shape):
            raise ValueError(
                f"plan's mesh_shape {dict(given)} is not the mesh of the jax.set_mesh around it "
                f"({sharding.describe_mesh(context)}): leave mesh_shape out to plan the context's mesh (on the "
                "target's devices), or give the same axes to both."
            )
        mesh_shape = mesh_shape if isinstance(mesh_shape, jax.sharding.AbstractMesh) else context.abstract_mesh
    if mesh_shape is None:
        if axis_rules is not None:
            raise ValueError("plan takes axis_rules with a mesh_shape (the mesh axes the rules name).")
        return Partitioning(mesh=Mesh(np.array(devices), ("data",)), axis_rules=[("batch", "data")])
    kinds = mesh_shape.axis_types if isinstance(mesh_shape, jax.sharding.AbstractMesh) else None
    sizes = dict(mesh_shape.shape) if isinstance(mesh_shape, jax.sharding.AbstractMesh) else dict(mesh_shape)
    if math.prod(sizes.values()) != len(devices):
        where = " (the mesh of the jax.set_mesh around it)" if context is not None else ""
        raise ValueError(
            f"mesh_shape {sizes}{where} holds {math.prod(sizes.values())} devices, and the target has "
            f"{len(devices)}: give axis sizes that multiply to the device count."
        )
    mesh = Mesh(np.array(devices).reshape(tuple(sizes.values())), tuple(sizes), axis_types=kinds)
    rules = axis_rules if axis_rules is not None else [("batch", tuple(sizes))]
    return Partitioning(mesh=mesh, axis_rules=rules)


_UNITS = {"B": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def _refused_temp(error: Exception) -> int:
    """The temporaries' bytes that XLA named when it refused a program too large for the chip.

    Raises:
        the error itself, when it is no such refusal.
    """
    found = re.search(r"RESOURCE_EXHAUSTED.*?HLO temporaries \(([\d.]+)([BKMGT])\)", str(error))
    if found is None:
        raise error
    return int(float(found.group(1)) * _UNITS[found.group(2)])


def _as_tuple(value: Any) -> tuple[Any, ...]:
    return value if isinstance(value, tuple) else (value,)


def _dtype(x: Any) -> Any:
    return x.dtype if hasattr(x, "dtype") else np.asarray(x).dtype


def _global_batch(task: TrainTask | EvalTask, batch: Any, name: str = "plan") -> Any:
    if batch is None:
        batch = next(iter(task.data))
    return batching.normalize(batch, name, whole=task.whole_batches)  # NNX's loss_fn(model, batch): whole


def _shard_bytes(leaf: jax.ShapeDtypeStruct) -> int:
    shape = leaf.sharding.shard_shape(leaf.shape) if leaf.sharding is not None else leaf.shape
    return int(math.prod(shape)) * np.dtype(leaf.dtype).itemsize


def _state_bytes(state: Any) -> dict[str, int]:
    """Each state leaf's bytes a device, by state-dict path."""
    flat = tree_paths.flatten(state.state_dict())
    return {path: _shard_bytes(leaf) for path, leaf in flat.items() if hasattr(leaf, "sharding")}


def _sum(sizes: Mapping[str, int], prefixes: Sequence[str]) -> int:
    return sum(size for path, size in sizes.items() if path.startswith(tuple(prefixes)))


def _device_memory(device: Any) -> int | None:
    known = next((memory for name, memory in DEVICE_MEMORY if name in device.device_kind), None)
    if known is not None:
        return known
    try:
        stats = device.memory_stats()
    except Exception:  # CPUs and topology devices have none
        return None
    return None if not stats else stats.get("bytes_limit")


def _advice(result: Plan, state: Any, mesh: Mesh) -> str:
    path, size = result.largest[0]
    flat = tree_paths.flatten(state.state_dict())
    spec = getattr(flat[path].sharding, "spec", ())
    used = {axis for entry in spec if entry for axis in _as_tuple(entry)}
    free = [name for name in mesh.axis_names if name not in used and mesh.shape[name] > 1]
    shard = (
        f"shard it over the mesh axis {free[0]!r} (map one of its logical axes to it in axis_rules)"
        if free
        else ("give the mesh more devices, or a larger axis to shard it over")
    )
    return (
        f"it does not fit: {format_bytes(result.per_device['total'])} a device against "
        f"{format_bytes(result.device_memory or 0)}. The largest array is {path} ({format_bytes(size)} a device): "
        f"{shard}."
    )
