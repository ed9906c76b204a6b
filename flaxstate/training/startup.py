"""Where a run starts: the data's first batch, a fresh or restored state, the run's key and id, the data's position.

`first_look` reads the data's first batch before anything is on the devices:
it is checked against the placement and gives the global batch size, the
one-step update's global batch and the model's inputs for `init`.
`TrainLoop(init=...)` takes a model's `init`, or a checkpoint reader (a
`CheckpointSource`) that restores the newest checkpoint, or says there is none
and a `target` to start fresh from. A restore reads into an abstract template
with the placement's shardings, so a resumed run never holds a fresh state
beside the restored one.
"""

from __future__ import annotations

import dataclasses
import inspect
import os
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

import jax
import jax.numpy as jnp
import numpy as np

from flaxstate import nnx
from flaxstate.global_batches import GlobalBatches
from flaxstate.records import CheckpointFile, format_bytes
from flaxstate.train_state import FlaxOptimTrainState
from flaxstate.training import batching, multihost, scaling
from flaxstate.training.data import DataStream
from flaxstate.training.placement import Placement
from flaxstate.training.progress import ProgressDisplay, count_parameters
from flaxstate.training.task import TrainTask


@runtime_checkable
class CheckpointSource(Protocol):
    """What `TrainLoop(init=...)` needs of a checkpoint reader.

    `target` is the model's `init` (or `None`). `read(template)` returns the
    checkpoint to resume from, its state restored into the tree, shapes,
    dtypes and shardings of `template.state` (a state whose leaves are
    `jax.ShapeDtypeStruct`s; `template` is `None` when `target` is), or `None`
    when there is none yet and training starts from `target`: fresh, or from a
    `ParamsSource`'s params.
    """

    target: Any

    def read(self, template: CheckpointFile | None) -> CheckpointFile | None: ...


@runtime_checkable
class ParamsSource(Protocol):
    """What `TrainLoop(init=...)` needs of a source of params alone (`fs.SafetensorsReader`).

    The loop makes a fresh state from `target` (a linen `init`, or the
    `nnx.Module`) at step 0, with `params(template, shardings)` (the params'
    tree of `jax.ShapeDtypeStruct`s, and their shardings) as its params and
    the optimizer's state made from those.
    """

    target: Any

    def params(self, template: Any, shardings: Any = None) -> Any: ...


def as_key(rng: jax.Array | int, owner: str = "TrainLoop") -> jax.Array:
    """A typed key from a key, raw key data (uint32), or an int seed (`owner` names the setting's owner in errors).

    Raises:
        TypeError: neither a key nor an int.
    """
    if isinstance(rng, int | np.integer) and not isinstance(rng, bool):
        return jax.random.key(int(rng))
    if not hasattr(rng, "dtype"):
        raise TypeError(
            f"{owner} rng must be a random key (jax.random.key(0)) or an int seed, got {type(rng).__name__}."
        )
    key: Any = rng
    if jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
        return key
    return jax.random.wrap_key_data(jnp.asarray(key, dtype=jnp.uint32))


@dataclasses.dataclass(frozen=True)
class FirstLook:
    """What the data's first batch tells, before anything is on the devices.

    Attributes:
        data: the training data, its first batch peeked at (not drawn).
        batch_size: the global batch size (every process's part).
        global_batch: the one-step update's global batch, as `jax.ShapeDtypeStruct`s.
        inputs: the model's inputs for `init`: `input_sample`, else the first batch's.
    """

    data: DataStream
    batch_size: int
    global_batch: Any
    inputs: tuple[Any, ...]
    n_microbatches: int = 1
    """The microbatches a step: as given, or as `max_device_batch` set them."""
    device_batch: int = 0
    """The examples of a step that one device (one part of the batch axes) takes."""


def first_look(
    task: TrainTask,
    placement: Placement,
    n_microbatches: int,
    input_sample: Any,
    on_draw: Callable[[], None] | None = None,
    max_device_batch: int | None = None,
) -> FirstLook:
    """Peeks at the data's first batch and checks it against the placement and `n_microbatches`.

    With `max_device_batch`, the microbatches are the fewest that split each
    device's part of the batch into equal microbatches of at most that many
    examples (`n_microbatches` is then 1): the same global batch on any
    process count, half the processes taking twice the microbatches.

    `on_draw` is called after each batch the run draws (the watchdog's sign of
    progress, also while a resume moves the data past the batches trained).

    Raises:
        ValueError: a batch that is empty, of the wrong structure, or that
            does not split over the devices and microbatches (see
            `Placement.check_batch`); `global_batches` whose split over the
            processes is not the placement's (tensor parallelism fed as data
            parallelism), naming both.
    """
    check_split(task.data, placement)
    data = DataStream(task.data, "TrainTask", on_draw, whole=task.whole_batches)
    batch = batching.normalize(data.peek(), "TrainTask", whole=data.whole)
    placement.check_batch(batch, "TrainTask", n_microbatches)
    local_size = batching.local_size(batch)
    device_batch = local_size // placement.n_local_parts
    if max_device_batch is not None:
        n_microbatches = microbatches_for(device_batch, max_device_batch)
        placement.check_batch(batch, "TrainTask", n_microbatches)  # every leaf's: they split alike
    batch_size = placement.global_batch_size(local_size)
    if input_sample is None:
        inputs = batch[0]
    else:
        inputs = input_sample if isinstance(input_sample, tuple) else (input_sample,)
    return FirstLook(data, batch_size, batching.global_spec(batch, batch_size), inputs, n_microbatches, device_batch)


def microbatches_for(device_batch: int, max_device_batch: int) -> int:
    """The fewest microbatches that split `device_batch` examples into equal parts of at most `max_device_batch`
    (a divisor of `device_batch`: a prime batch larger than the limit goes one example at a time)."""
    fits = (m for m in range(1, device_batch + 1) if device_batch % m == 0 and device_batch // m <= max_device_batch)
    return next(fits)


def check_split(data: Any, placement: Placement) -> None:
    """Checks that `global_batches` feed this process the part of each global batch that the placement puts here.

    Raises:
        ValueError: another part (e.g. half a batch each, where a
            tensor-parallel mesh gives every process the whole batch), naming both.
    """
    if not isinstance(data, GlobalBatches):
        return  # another iterable: its batches' sizes are checked (check_batch), its rows cannot be
    made, placed = data.part, placement.process_part()
    if tuple(made) != tuple(placed):
        raise ValueError(
            f"TrainTask data is {data!r}: it feeds this process part {made[0]} of {made[1]} of each global batch, "
            f"but the loop places part {placed[0]} of {placed[1]} on this process's devices, so the processes "
            "would train on other rows than the loop's (with tensor parallelism over processes, each holds the "
            "whole batch). Make the data with the loop's own mesh= and axis_rules=, global_batches(..., "
            "mesh=mesh, axis_rules=axis_rules), or with neither for a data-parallel loop."
        )


@dataclasses.dataclass(frozen=True)
class Start:
    """A run's start: its state (on the placement), key and id, and what it was restored from.

    Attributes:
        state: the state to train, placed on the devices.
        rng: the run's key (the checkpoint's on resume).
        run_id: the run's id (new for a fresh run, the checkpoint's on resume).
        restored: the checkpoint restored, or `None` for a fresh run.
        restore_seconds: the time spent reading checkpoints (0 without a reader).
    """

    state: FlaxOptimTrainState
    rng: jax.Array
    run_id: str
    restored: CheckpointFile | None
    restore_seconds: float = 0.0

    @property
    def restored_step(self) -> int | None:
        """The restored checkpoint's step, or `None` for a fresh run."""
        return None if self.restored is None else int(self.restored.step)


def start(
    *,
    init: Callable[..., Any] | CheckpointSource | ParamsSource,
    task: TrainTask,
    rng: jax.Array | int,
    placement: Placement,
    look: FirstLook,
    init_names: tuple[str, ...],
    progress: ProgressDisplay,
) -> Start:
    """Creates or restores the state, moves the data to the restored position, and says the model's size.

    Raises:
        TypeError: `rng` is neither a key nor an int.
        ValueError: no way to make a state (no `init`, a reader with neither
            a checkpoint nor a target), a data position that cannot be kept, or
            an EMA schedule whose decay at the first step is outside [0, 1).
    """
    key = as_key(rng)
    state, restored, restore_seconds = _state(init, task, key, placement, look.inputs, init_names, progress)
    if restored is None:
        begun = Start(state, key, multihost.agree(uuid.uuid4().hex[:12]), None, restore_seconds)
    else:
        position = multihost.local_position(restored.data_position)
        message = look.data.restore(position, int(restored.step), look.batch_size)
        progress.log(f"Resumed from the checkpoint at step {restored.step}." + (f" {message}" if message else ""))
        key = as_key(restored.rng) if restored.rng is not None else key
        run_id = restored.run_id or multihost.agree(uuid.uuid4().hex[:12])
        begun = Start(state, key, run_id, restored, restore_seconds)
    n_params, n_bytes = count_parameters(state.params)
    progress.log(f"Total number of trainable weights: {n_params:,} ({format_bytes(n_bytes)}).")
    return begun


def check_init_call(model_init: Callable[..., Any], rngs: dict[str, Any], sample: tuple[Any, ...]) -> None:
    """Refuses an `init` that cannot take the loop's call, `init(rngs, *the first batch's inputs)`, naming both.

    Raises:
        TypeError: the call and what `init` takes.
    """
    try:
        signature = inspect.signature(model_init)
    except (TypeError, ValueError):  # a callable without a signature (a C function): let the call speak
        return
    try:
        signature.bind(rngs, *sample)
    except TypeError as error:
        inputs = ", ".join(f"an array of shape {tuple(np.shape(x))}" for x in sample)
        raise TypeError(
            f"TrainLoop calls init(rngs, *the first batch's inputs), here init({{{', '.join(map(repr, rngs))}}}, "
            f"{inputs}), but {getattr(model_init, '__qualname__', model_init)!r} takes {signature}: {error}. Give a "
            "linen module's init (model.init), the init of fs.nnx_functions(model), or a function of "
            "(rngs, *inputs); input_sample= sets the inputs."
        ) from None


def state_maker(
    model_init: Callable[..., Any], task: TrainTask, init_names: tuple[str, ...]
) -> Callable[..., FlaxOptimTrainState]:
    """`create(rng, *sample)`: a fresh train state of `model_init`'s variables and `task`'s optimizer, scale and EMA."""

    def create(rng: jax.Array, *sample: Any) -> FlaxOptimTrainState:
        rngs = {name: jax.random.fold_in(rng, index) for index, name in enumerate(init_names)}
        check_init_call(model_init, rngs, sample)
        return FlaxOptimTrainState.create(task.optimizer, model_init(rngs, *sample), _loss_scale(task), task.ema_decay)

    return create


def fresh(
    model_init: Any, task: TrainTask, init_names: tuple[str, ...], rng: jax.Array, sample: Sequence[Any]
) -> tuple[Callable[..., FlaxOptimTrainState], tuple[Any, ...]]:
    """How a fresh state is made: `create(*arguments)`, to compile where the state is placed.

    A linen `init`: `create(rng, *sample)` (`state_maker`). An `nnx.Module`:
    `create(variables)` of the module's values, passed in (never closed
    over, so no compiled program keeps a copy of them).

    Raises:
        TypeError: a module with a task whose apply is not that module's graph, or the reverse, naming both.
        StateMismatchError: a module whose Variables differ from the task's module.
    """
    model = task.nnx_model
    nnx.refuse_nnx_object(model_init, "TrainLoop(init=...)")
    if nnx.is_module(model_init):
        if model is None:
            raise TypeError(
                f"TrainLoop(init=) is an nnx.Module ({type(model_init).__name__}), but TrainTask(apply=) is not: "
                "give the module to both, TrainTask(apply=model) and TrainLoop(init=model)."
            )
        variables = model.variables_of(model_init)

        def create(variables: Any) -> FlaxOptimTrainState:
            return FlaxOptimTrainState.create(task.optimizer, variables, _loss_scale(task), task.ema_decay)

        return create, (variables,)
    if model is not None:
        raise TypeError(
            f"TrainTask(apply=) is an nnx.Module ({model.module_type.__name__}): give the module as "
            "TrainLoop(init=model) (or as CheckpointFileReader(dir, target=model)), not an init function."
        )
    return state_maker(model_init, task, init_names), (jax.random.fold_in(rng, 0), *sample)


def _loss_scale(task: TrainTask) -> scaling.LossScale | None:
    return None if task.loss_scale is None else scaling.LossScale.create(task.loss_scale)


def _state(
    init: Any,
    task: TrainTask,
    rng: jax.Array,
    placement: Placement,
    inputs: tuple[Any, ...],
    init_names: tuple[str, ...],
    progress: ProgressDisplay,
) -> tuple[FlaxOptimTrainState, CheckpointFile | None, float]:
    reader = init if isinstance(init, CheckpointSource) else None
    start = reader.target if reader is not None else init  # what a run without a checkpoint starts from
    params_source = start if isinstance(start, ParamsSource) else None
    model_init = params_source.target if params_source is not None else start
    began = time.perf_counter()
    if model_init is None:
        restored = reader.read(None) if reader is not None else None
        if restored is None:
            raise ValueError("TrainLoop needs init: a model's init, or a reader with a checkpoint or a target.")
        return _from_state_dict(task, placement, restored.state), restored, time.perf_counter() - began
    per_device = jax.tree.map(lambda x: np.asarray(x)[: max(1, len(x) // placement.n_local_devices)], list(inputs))
    create, arguments = fresh(model_init, task, init_names, rng, per_device)
    abstract = jax.eval_shape(create, *arguments)
    shardings = placement.state_shardings(abstract)
    made = jax.jit(create, out_shardings=shardings)
    if reader is None and params_source is None:
        return made(*arguments), None, 0.0
    if reader is not None:
        # The template is abstract: a resumed run never holds a fresh state beside the restored one.
        began = time.perf_counter()
        restored = reader.read(CheckpointFile(state=made.eval_shape(*arguments), step=0, rng=rng))
        if restored is not None:
            return restored.state, restored, time.perf_counter() - began
    read_seconds = time.perf_counter() - began  # the reader's look and the files' params, as a restore's
    if params_source is None:
        progress.log(f"No checkpoint found by {reader!r}: training starts from step 0.")
        return made(*arguments), None, read_seconds
    if reader is not None:
        progress.log(f"No checkpoint found by {reader!r}: training starts from {params_source!r} at step 0.")
    began = time.perf_counter()
    state = _from_params(params_source, create, arguments, abstract, shardings)
    return state, None, read_seconds + time.perf_counter() - began


def _from_params(
    source: ParamsSource,
    create: Callable[..., FlaxOptimTrainState],
    arguments: tuple[Any, ...],
    abstract: Any,
    shardings: Any,
) -> FlaxOptimTrainState:
    """The fresh state `create(*arguments)` makes (`abstract`, placed by `shardings`), with the source's params
    placed where the state's go and the optimizer's state (and EMA) made from them: the target's own params are
    never made on the devices."""
    params = source.params(abstract.params, getattr(shardings, "params", shardings))

    def start(params: Any, *arguments: Any) -> FlaxOptimTrainState:
        made = create(*arguments)  # its params and their optimizer state are dropped by XLA: only the rest is kept
        ema = None if made.ema is None else jax.tree.map(lambda p: jnp.asarray(p, jnp.float32), params)
        return made.replace(params=params, param_states=made.tx.init(params), ema=ema)

    return jax.jit(start, out_shardings=shardings, donate_argnums=0)(params, *arguments)


def _from_state_dict(task: TrainTask, placement: Placement, state_dict: Mapping[str, Any]) -> FlaxOptimTrainState:
    def create() -> FlaxOptimTrainState:
        variables = {"params": state_dict["target"], **state_dict.get("flax_mutables", {})}
        return FlaxOptimTrainState.create(task.optimizer, variables, _loss_scale(task), task.ema_decay).restore_state(
            state_dict
        )

    return jax.jit(create, out_shardings=placement.state_shardings(jax.eval_shape(create)))()


_IMPORTED = time.time()
"""When flaxstate was imported: the process's start where the system does not say it."""


def process_start_time() -> float:
    """When this process started (wall clock, seconds since the epoch): from `/proc` on Linux.

    Elsewhere, when flaxstate was imported (later than the process's start by the imports before it).
    """
    try:
        with open(f"/proc/{os.getpid()}/stat") as stat_file:
            fields = stat_file.read().rsplit(")", 1)[1].split()
        ticks_since_boot = int(fields[19])  # field 22 of proc(5), counted after the command name
        boot_time = time.time() - time.clock_gettime(time.CLOCK_BOOTTIME)  # /proc/stat's btime is whole seconds
        return boot_time + ticks_since_boot / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, AttributeError):
        return _IMPORTED
