"""`fs.plan`: the loop's own update compiled for a target's devices, from shapes only, never run.

TPU targets compile through libtpu on this CPU machine (the test extra
installs `jax[tpu]`); "cpu:N" compiles for N host devices of a client of
their own, and "local" for this process's device.
"""

import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from flaxstate_testing import examples, lm

import flaxstate as fs
from flaxstate.training import batching as fs_batching

RULES = [("batch", "fsdp"), ("embed", "fsdp"), ("mlp", None)]


class MLP(nn.Module):
    """Two dense layers with logical axes on every parameter."""

    width: int = 1024

    @nn.compact
    def __call__(self, x):
        axes = nn.with_logical_partitioning
        x = nn.Dense(
            self.width,
            kernel_init=axes(nn.initializers.lecun_normal(), ("embed", "mlp")),
            bias_init=axes(nn.initializers.zeros, ("mlp",)),
        )(x)
        x = nn.Dense(
            256,
            kernel_init=axes(nn.initializers.lecun_normal(), ("mlp", "embed")),
            bias_init=axes(nn.initializers.zeros, ("embed",)),
        )(nn.relu(x))
        return x.sum(-1)


def mse(outputs, targets):
    return jnp.mean((outputs - targets) ** 2)


def task_of(model: nn.Module, batch_size: int = 16) -> fs.TrainTask:
    data = [(np.ones((batch_size, 256), np.float32), np.zeros((batch_size,), np.float32))] * 4
    return fs.TrainTask(apply=model.apply, optimizer=optax.adam(1e-3), loss=mse, data=data)


def param_bytes(model: nn.Module) -> int:
    shapes = jax.eval_shape(model.init, jax.random.key(0), jnp.zeros((1, 256)))["params"]
    return sum(
        int(np.prod(leaf.value.shape)) * 4 for leaf in jax.tree.leaves(shapes, is_leaf=lambda x: hasattr(x, "value"))
    )


@pytest.fixture(scope="module")
def fsdp_plan() -> fs.Plan:
    model = MLP()
    return fs.plan(model.init, task_of(model), target="v5e:2x2", mesh_shape={"fsdp": 4}, axis_rules=RULES)


def test_fsdp_over_a_v5e_2x2_holds_a_quarter_of_the_parameters_and_adam_twice_that(fsdp_plan):
    whole = param_bytes(MLP())
    per_device = fsdp_plan.per_device
    assert fsdp_plan.n_devices == 4 and fsdp_plan.device_kind == "TPU v5 lite"
    mlp_bias = 1024 * 4  # ("mlp",): no mesh axis, so every device holds it whole
    assert per_device["params"] == (whole - mlp_bias) // 4 + mlp_bias  # the rest a quarter each, no padding
    assert 2 * per_device["params"] <= per_device["optimizer"] <= 2 * per_device["params"] + 64  # mu, nu, count
    assert per_device["code"] > 0 and per_device["batch"] == 16 * 257 * 4 // 4
    held = per_device["params"] + per_device["optimizer"] + per_device["batch"]
    assert per_device["total"] >= held + per_device["code"]  # the donated state counted once, not twice
    assert per_device["total"] < 2 * held + per_device["temp"] + per_device["code"]
    assert fsdp_plan.fits is True and fsdp_plan.device_memory == 16 * 2**30
    # Model FLOPs of the global step: both products forward and their weights' gradients, the second's input
    # gradient (the data needs none), 2 x 16 x 256 x 1024 each.
    assert fsdp_plan.flops_per_step == 5 * 2 * 16 * 256 * 1024
    assert fsdp_plan.xla_flops_per_step > fsdp_plan.flops_per_step / 4  # XLA's count of one device's program
    assert fsdp_plan.step_seconds(0.5) > 0
    text = str(fsdp_plan)
    assert "plan for v5e:2x2: 4 x TPU v5 lite, mesh fsdp=4" in text and "fits" in text
    assert fsdp_plan.largest[0][0] == "target/Dense_0/kernel"
    # A v5e:2x2 is one host: its process holds every part of the state (a replicated bias once), and the plan
    # knows no host's memory for a topology that is not this machine.
    assert fsdp_plan.per_host["records"] == 2 * ((3 * whole + 4 + 4) + whole)  # params, mu, nu, count, step; grads
    assert fsdp_plan.host_memory is None and fsdp_plan.fits_host is None and "host memory unknown" in text


def test_a_tpu_plan_made_again_beside_a_compilation_cache_says_nothing_of_it_and_plans_the_same():
    # The tests' processes keep a JAX compilation cache (conftest), as `flaxstate launch`'s processes and many TPU
    # users do. JAX writes a TPU topology's programs to it, and libtpu's compile-only client that compiled them
    # cannot load them back: a second plan of the same model found them and warned "Error reading persistent
    # compilation cache entry ... PjRtCompiler must be constructed with a Client" for each program, then compiled
    # it again, as a plan without the cache does.
    # A width no other test plans: the first plan writes its programs to a session's own cache (a kept one,
    # `make test-fast`'s, may hold them from an earlier session, and the first plan warned as well).
    model = MLP(width=96)

    def made() -> fs.Plan:
        return fs.plan(model.init, task_of(model), target="v5e:2x2", mesh_shape={"fsdp": 4}, axis_rules=RULES)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        first, again = made(), made()
    assert [str(warning.message) for warning in caught if "cache" in str(warning.message)] == []
    assert again.per_device == first.per_device and again.xla_flops_per_step == first.xla_flops_per_step
    filters = list(warnings.filters)
    made()
    assert warnings.filters == filters  # the plan's own filter ends with it: the user's warnings are theirs


def test_a_model_too_large_for_a_v5e_does_not_fit_and_names_its_largest_array():
    model = MLP(width=2**22)  # 8 GiB of parameters and 16 GiB of adam, sharded over nothing but the batch
    rules = [("batch", "fsdp"), ("embed", None), ("mlp", None)]
    result = fs.plan(model.init, task_of(model), target="v5e:2x2", mesh_shape={"fsdp": 4}, axis_rules=rules)
    assert result.fits is False
    assert result.per_device["total"] > 16 * 2**30
    assert result.largest[0] == ("target/Dense_0/kernel", 256 * 2**22 * 4)
    assert "target/Dense_0/kernel" in result.advice and "'fsdp'" in result.advice, result.advice
    assert "does NOT fit" in str(result)


def test_host_devices_and_the_local_device_give_the_tpu_plans_state_bytes(fsdp_plan):
    model = MLP()
    on_cpus = fs.plan(model.init, task_of(model), target="cpu:4", mesh_shape={"fsdp": 4}, axis_rules=RULES)
    for name in ("params", "optimizer", "mutables", "batch"):
        assert on_cpus.per_device[name] == fsdp_plan.per_device[name], name
    assert on_cpus.fits is None and on_cpus.device_memory is None
    dispatched = fs.plan(
        model.init, task_of(model), target="cpu:4", mesh_shape={"fsdp": 4}, axis_rules=RULES, n_steps_per_dispatch=3
    )
    assert dispatched.per_device["batch"] == 3 * on_cpus.per_device["batch"]  # K batches a call
    assert dispatched.flops_per_step == on_cpus.flops_per_step  # a step's, whatever K
    local = fs.plan(model.init, task_of(model), target="local", mesh_shape={"fsdp": 1}, axis_rules=RULES)
    assert local.per_device["params"] == param_bytes(model)  # one device holds it all


def test_the_local_plans_flops_equal_what_a_train_loops_record_reports():
    model = MLP(width=128)
    task = task_of(model)
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("fsdp",))
    loop = fs.TrainLoop(
        model.init,
        task,
        jax.random.key(0),
        n_steps=2,
        n_steps_per_checkpoint=2,
        mesh=mesh,
        axis_rules=RULES,
        stdout=False,
    )
    record = loop.next_checkpoint()
    local = fs.plan(model.init, task, target="local", mesh_shape={"fsdp": 1}, axis_rules=RULES)
    assert record.flops_per_step is not None
    assert local.flops_per_step == record.flops_per_step


def test_the_example_lm_under_fsdp_and_tensor_parallelism():
    config = lm.lm.Config(batch_size=8, seq_len=16, embed=64, heads=4, head_dim=16, mlp=256, layers=2)
    model = lm.lm.Transformer(config)
    task = fs.TrainTask(apply=model.apply, optimizer=lm.lm.optimizer(config), loss=lm.lm.loss, data=lm.data(config))
    mesh_shape = {"data": 1, "fsdp": 2, "model": 2}
    sharded = fs.plan(model.init, task, target="v5e:2x2", mesh_shape=mesh_shape, axis_rules=lm.lm.RULES)
    whole = fs.plan(
        model.init, task, target="cpu:1", mesh_shape={"data": 1, "fsdp": 1, "model": 1}, axis_rules=lm.lm.RULES
    )
    assert sharded.mesh_shape == mesh_shape and sharded.fits is True
    assert whole.per_device["params"] / 4 <= sharded.per_device["params"] < whole.per_device["params"] / 2
    n_params, n_tokens = whole.per_device["params"] // 4, 8 * 16
    for result in (sharded, whole):  # about 6 FLOPs a parameter a token (the embedding's lookup does none)
        assert 0.8 * 6 * n_params * n_tokens <= result.flops_per_step <= 3 * 6 * n_params * n_tokens
        assert result.xla_flops_per_step is not None and result.xla_flops_per_step > 0
    # The model count is of the traced program: the same for a TPU topology through libtpu and for the CPU.
    assert sharded.flops_per_step == whole.flops_per_step
    assert sharded.xla_flops_per_step == pytest.approx(whole.xla_flops_per_step, rel=0.15)  # two compilers' counts


ODD = [(np.ones((7, 256), np.float32), np.zeros((7,), np.float32))]
"""An evaluation's batch of 7: it splits over no two devices."""


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (
            {"target": "v5e:2x2", "mesh_shape": {"fsdp": 3}, "axis_rules": RULES},
            r"holds 3 devices, and the target has 4",
        ),
        ({"target": "v5e:2x2", "mesh_shape": {"fsdp": 4}, "axis_rules": [("embed", "tensor")]}, r"tensor"),
        ({"target": "v5e:2x2", "axis_rules": RULES}, r"axis_rules with a mesh_shape"),
        (
            {"target": "v5e:2x2", "mesh_shape": {"fsdp": 4}, "axis_rules": RULES, "n_microbatches": 8},
            r"plan: the global batch of size 16: 4 examples a device \(4 parts of the batch's mesh axes\), which do "
            r"not split into n_microbatches=8 equal microbatches",
        ),
        (
            {"target": "cpu:3", "mesh_shape": {"fsdp": 3}, "axis_rules": RULES},
            r"plan: the global batch of size 16, which does not divide by the 3 parts of the batch's mesh axes; "
            r"make the global batch size a multiple of 3",
        ),
        ({"target": "cpu:2", "n_microbatches": 0}, r"plan n_microbatches must be a positive int, got 0"),
        (
            {"target": "cpu:2", "n_steps_per_dispatch": "2"},
            r"plan n_steps_per_dispatch must be a positive int, got '2'",
        ),
        ({"target": "v9z:7x7"}, r"libtpu does not know the TPU topology 'v9z:7x7'.*'v5e:2x2'"),
        ({"target": "gpu"}, r"neither a TPU topology"),
        ({"target": "cpu:0"}, r"cpu:N with N a positive number"),
        ({"target": "cpu:1", "record_memory": "disk"}, r"plan record_memory must be one of \('host', 'device'\)"),
        ({"target": "cpu:1", "peers": -1}, r"plan peers must be an int of at least 0, got -1"),
        ({"target": "cpu:1", "host_memory": 0}, r"plan host_memory must be"),
        ({"target": "cpu:1", "host_memory_budget": 0}, r"plan host_memory_budget must be an int of at least 32768"),
        ({"target": "cpu:1", "evaluation": "loss"}, r"plan's evaluation must be a fs.EvalTask \(what EvalLoop takes\)"),
        (
            {"target": "cpu:2", "evaluation": fs.EvalTask(apply=MLP(width=64).apply, metrics={"mse": mse}, data=ODD)},
            r"plan: the evaluation's first batch of size 7, which does not divide by the 2 parts",
        ),
        # The writer's minimum: a budget the plan took would be refused by the writer and the reader it plans for.
        (
            {"target": "cpu:1", "host_memory_budget": 1000},
            r"plan host_memory_budget must be .*at least 32768, got 1000",
        ),
    ],
)
def test_bad_input_is_named_before_any_compile(kwargs, message):
    model = MLP(width=64)
    with pytest.raises(ValueError, match=message):
        fs.plan(model.init, task_of(model), **kwargs)


class NnxMLP(nnx.Module):
    """Two linear layers, as NNX writes them (no logical axes)."""

    def __init__(self, rngs: nnx.Rngs):
        self.first = nnx.Linear(256, 64, rngs=rngs)
        self.second = nnx.Linear(64, 8, rngs=rngs)

    def __call__(self, x):
        return self.second(nnx.relu(self.first(x))).sum(-1)


@pytest.mark.parametrize("kind", ["linen", "nnx"])
def test_max_device_batch_plans_the_microbatches_the_loop_would_choose(kind):
    # A global batch of 16 over 2 devices: 8 examples a device, at most 3 at once: 4 microbatches of 2 (the
    # fewest that divide 8 within 3), and the same compiled step as n_microbatches=4.
    if kind == "linen":
        model = MLP(width=64)
        init, task = model.init, task_of(model)
    else:
        model = NnxMLP(nnx.Rngs(0))
        data = [(np.ones((16, 256), np.float32), np.zeros((16,), np.float32))] * 4
        init, task = model, fs.TrainTask(apply=model, optimizer=optax.adam(1e-3), loss=mse, data=data)
    chosen = fs.plan(init, task, target="cpu:2", max_device_batch=3)
    given = fs.plan(init, task, target="cpu:2", n_microbatches=4)
    whole = fs.plan(init, task, target="cpu:2")
    assert chosen.n_microbatches == given.n_microbatches == 4 and whole.n_microbatches == 1
    assert chosen.per_device == given.per_device
    with pytest.raises(ValueError, match="plan got n_microbatches=2 and max_device_batch=3: both set the microbatches"):
        fs.plan(init, task, target="cpu:2", n_microbatches=2, max_device_batch=3)
    with pytest.raises(ValueError, match="plan max_device_batch must be a positive int, got 0"):
        fs.plan(init, task, target="cpu:2", max_device_batch=0)


class Resharded(nnx.Module):
    """A model written the explicit way: its activations resharded by a bare `PartitionSpec`, which needs the mesh
    context (under an Auto mesh without one, `reshard` refuses)."""

    def __init__(self, rngs: nnx.Rngs):
        self.up = nnx.Linear(
            256, 1024, kernel_init=nnx.with_partitioning(nnx.initializers.lecun_normal(), ("embed", "mlp")), rngs=rngs
        )
        self.down = nnx.Linear(
            1024, 256, kernel_init=nnx.with_partitioning(nnx.initializers.lecun_normal(), ("mlp", "embed")), rngs=rngs
        )

    def __call__(self, x):
        h = jax.sharding.reshard(nnx.relu(self.up(x)), jax.sharding.PartitionSpec(None, "model"))
        return self.down(h, out_sharding=jax.sharding.PartitionSpec()).sum(-1)


class ReshardedLinen(nn.Module):
    """`Resharded` as linen writes it: parameters with logical axes, the same bare `PartitionSpec`s."""

    @nn.compact
    def __call__(self, x):
        init = nn.initializers.lecun_normal()
        up = self.param("up", nn.with_logical_partitioning(init, ("embed", "mlp")), (256, 1024))
        down = self.param("down", nn.with_logical_partitioning(init, ("mlp", "embed")), (1024, 256))
        h = jax.sharding.reshard(nn.relu(x @ up), jax.sharding.PartitionSpec(None, "model"))
        return jnp.matmul(h, down, out_sharding=jax.sharding.PartitionSpec()).sum(-1)


TENSOR_PARALLEL = [("batch", None), ("mlp", "model"), ("embed", None)]
"""The hidden units split over `model`, the batch whole: `Resharded`'s layout."""


def test_an_explicit_mesh_plans_the_sharded_bytes_of_an_auto_one_and_traces_under_its_context():
    explicit = jax.sharding.AbstractMesh((4,), ("model",), axis_types=(jax.sharding.AxisType.Explicit,))
    with nnx.use_eager_sharding(False):
        model = Resharded(nnx.Rngs(0))
    task = fs.TrainTask(apply=model, optimizer=optax.adam(1e-3), loss=mse, data=task_of(MLP()).data)
    sharded = fs.plan(model, task, target="cpu:4", mesh_shape=explicit, axis_rules=TENSOR_PARALLEL)
    assert sharded.per_device["params"] < sharded.per_device["optimizer"] and sharded.flops_per_step > 0
    assert sharded.per_device["params"] == 2 * 256 * 1024 * 4 // 4 + (1024 + 256) * 4  # kernels a quarter, biases whole
    with pytest.raises(ValueError, match="not under a mesh context"):  # on an Auto mesh, its bare spec has no context
        fs.plan(model, task, target="cpu:4", mesh_shape={"model": 4}, axis_rules=TENSOR_PARALLEL)

    with jax.set_mesh(jax.make_mesh((1,), ("model",))):  # the caller's context: its axes, on the target's devices
        local = fs.plan(model, task, target="local", axis_rules=TENSOR_PARALLEL)
        assert local.mesh_shape == {"model": 1} and local.fits is not False
        with pytest.raises(ValueError, match=r"mesh_shape \{'model': 1\} \(the mesh of the jax.set_mesh around it\)"):
            fs.plan(model, task, target="cpu:4", axis_rules=TENSOR_PARALLEL)
        with pytest.raises(ValueError, match=r"plan's mesh_shape \{'model': 4\} is not the mesh of the jax.set_mesh"):
            fs.plan(model, task, target="cpu:4", mesh_shape={"model": 4}, axis_rules=TENSOR_PARALLEL)


def compiled_peak(compiled) -> int:
    """The bytes a device holds while a compiled program runs, by XLA's own analysis of it: its arguments and
    outputs (the donated ones once), temporaries and code."""
    memory = compiled.memory_analysis()
    held = memory.argument_size_in_bytes + memory.output_size_in_bytes - memory.alias_size_in_bytes
    return held + memory.temp_size_in_bytes + memory.generated_code_size_in_bytes


def peaks_of_what_the_loop_made(loop: fs.TrainLoop, record: fs.Checkpoint, batch) -> dict[str, int]:
    """Each program the loop compiled (`Program.made`), compiled for the shapes and shardings of the record's
    state, with XLA's peak of each."""
    leaves = [jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding) for x in jax.tree.leaves(record.state)]
    one = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), fs_batching.normalize(batch, "test"))
    key = jax.random.key_data(jax.random.key(0))
    key = jax.ShapeDtypeStruct(key.shape, key.dtype)
    peaks = {}
    for name, made in loop.program.made().items():
        n_steps = int(name.split()[2]) if name.startswith("update") else 1
        stacked = jax.tree.map(lambda x, n=n_steps: jax.ShapeDtypeStruct((n, *x.shape), x.dtype), one)
        peaks[name] = compiled_peak(made.lower(leaves, one if n_steps == 1 else stacked, key).compile())
    return peaks


@pytest.mark.parametrize("n_steps_per_dispatch", [1, 10])
@pytest.mark.parametrize("kind", ["linen", "nnx", "lm"])
def test_the_plan_s_peak_holds_every_program_the_loop_ran_and_the_records_beside_it(kind, n_steps_per_dispatch):
    # A run with records in device memory, each with its gradients: a record's dispatch runs a record's update
    # that gives both its gradients and its fingerprint, at K=1 as at K=10. The plan compiled from
    # shapes alone must hold the largest program the loop made plus the copies a record keeps on the device.
    if kind == "linen":
        model = MLP(width=128)
        init, batch = model.init, (np.ones((16, 256), np.float32), np.zeros((16,), np.float32))
        task = fs.TrainTask(apply=model.apply, optimizer=optax.adam(1e-3), loss=mse, data=[batch] * 40)
    elif kind == "nnx":
        model = NnxMLP(nnx.Rngs(0))
        init, batch = model, (np.ones((16, 256), np.float32), np.zeros((16,), np.float32))
        task = fs.TrainTask(apply=model, optimizer=optax.adam(1e-3), loss=mse, data=[batch] * 40)
    else:
        config = lm.lm.Config(batch_size=8, seq_len=16, embed=64, heads=4, head_dim=16, mlp=256, layers=2)
        model = lm.lm.Transformer(config)
        init, task = model.init, fs.TrainTask(model.apply, lm.lm.optimizer(config), lm.lm.loss, data=lm.data(config))
        batch = next(iter(task.data))
    held_out = [jax.tree.map(lambda x: np.concatenate([x, x]), batch)]  # evaluated on twice the training batch
    evaluation = fs.EvalTask(apply=task.apply, metrics={"loss": task.loss}, data=held_out)
    planned = fs.plan(
        init,
        task,
        target="local",
        n_steps_per_dispatch=n_steps_per_dispatch,
        record_memory="device",
        evaluation=evaluation,
    )
    per_record = max(2, n_steps_per_dispatch)
    loop = fs.TrainLoop(
        init,
        task,
        jax.random.key(0),
        n_steps=2 * per_record,
        n_steps_per_checkpoint=per_record,
        n_steps_per_dispatch=n_steps_per_dispatch,
        record_memory="device",
        stdout=False,
    )
    record = loop.next_checkpoint()
    beside = sum(leaf.nbytes for leaf in jax.tree.leaves((record.state, record.grads)))  # the record's copies
    peaks = peaks_of_what_the_loop_made(loop, record, batch)
    assert record.grads is not None
    assert planned.per_device["records"] == beside
    assert planned.per_device["total"] >= max(peaks.values()) + beside, (peaks, beside, planned.programs)
    assert planned.per_device["total"] == max(planned.programs.values())
    assert planned.programs[planned.peak_program] == planned.per_device["total"]
    assert f"the peak is {planned.peak_program}'s" in str(planned)
    assert {"the update", "a record's update", "a record's device copy"} <= set(planned.programs), planned.programs
    # The evaluation runs beside the loop's state and the record's copies, and reads the parameters where they are.
    evaluator = fs.EvalLoop(evaluation, rng=0)
    assert np.isfinite(evaluator(record).metrics["eval"]["loss"])
    ((_, evaluate),) = evaluator._compiled.values()
    evaluated = fs.InferenceState(
        step=record.state.step, params=record.state.params, flax_mutables=record.state.flax_mutables
    )
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), evaluated)
    key = jax.random.key_data(jax.random.key(0))
    eval_batch = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), fs_batching.normalize(held_out[0], "test")
    )
    eval_peak = compiled_peak(evaluate.lower(abstract, eval_batch, key).compile())
    state_bytes = sum(leaf.nbytes for leaf in jax.tree.leaves(record.state))
    not_read = state_bytes - sum(leaf.nbytes for leaf in jax.tree.leaves(evaluated))  # the optimizer's state
    assert planned.programs["the evaluation"] >= eval_peak + not_read + beside, (eval_peak, planned.programs)
    assert planned.programs["the restore"] == state_bytes  # read into an abstract template: nothing beside it
    host = fs.plan(init, task, target="local", n_steps_per_dispatch=n_steps_per_dispatch)  # records in host memory
    assert "the evaluation" not in host.programs
    assert host.per_device["records"] == 0 and host.per_device["total"] < planned.per_device["total"]


@pytest.mark.parametrize("n_steps_per_dispatch", [1, 10])
@pytest.mark.parametrize("kind", ["digits", "lm"])
def test_a_max_device_batch_the_plan_picks_for_a_memory_runs_within_it(kind, n_steps_per_dispatch):
    # A user's choice: the largest max_device_batch whose plan fits a device's memory (here: the plan of a
    # quarter of the batch, which the whole batch's does not fit). The loop run with it chooses the plan's
    # microbatches, and every program it compiled, with the records' copies beside it, fits that memory.
    if kind == "digits":
        digits = examples.load("digits")
        model, data = digits.MLP(), digits.digits(batch_size=512)[0]
        init, task = (
            model.init,
            fs.TrainTask(apply=model.apply, optimizer=optax.adam(1e-3), loss=digits.loss, data=data),
        )
        collections = {"init": ["params", "dropout"], "apply": ["dropout"]}
    else:
        config = lm.lm.Config(batch_size=16, seq_len=16, embed=64, heads=4, head_dim=16, mlp=256, layers=1)
        model = lm.lm.Transformer(config)
        init, task = model.init, fs.TrainTask(model.apply, lm.lm.optimizer(config), lm.lm.loss, data=lm.data(config))
        collections = None
    batch = next(iter(task.data))
    size = len(jax.tree.leaves(batch)[0])
    options = {"n_steps_per_dispatch": n_steps_per_dispatch, "record_memory": "device", "collections": collections}
    plans = {m: fs.plan(init, task, target="local", max_device_batch=m, **options) for m in (size, size // 4)}
    memory = plans[size // 4].per_device["total"]
    assert plans[size].per_device["total"] > memory, {m: p.programs for m, p in plans.items()}
    picked = max(m for m, p in plans.items() if p.per_device["total"] <= memory)
    planned = plans[picked]
    per_record = max(2, n_steps_per_dispatch)
    loop = fs.TrainLoop(
        init,
        task,
        jax.random.key(0),
        n_steps=per_record,
        n_steps_per_checkpoint=per_record,
        max_device_batch=picked,
        stdout=False,
        **options,
    )
    record = loop.next_checkpoint()
    assert record.session.n_microbatches == planned.n_microbatches > 1 and np.isfinite(record.loss)
    beside = sum(leaf.nbytes for leaf in jax.tree.leaves((record.state, record.grads)))
    peaks = peaks_of_what_the_loop_made(loop, record, batch)
    assert max(peaks.values()) + beside <= memory, (peaks, beside, memory, planned.programs)


@pytest.mark.parametrize("kind", ["linen", "nnx"])
def test_an_evaluation_of_large_batches_sets_the_peak_and_the_plan_names_it(kind):
    # Training on 16 examples, evaluating on 8192: the evaluation's activations are the largest program's.
    model = MLP(width=64) if kind == "linen" else NnxMLP(nnx.Rngs(0))
    init, apply = (model.init, model.apply) if kind == "linen" else (model, model)
    task = fs.TrainTask(apply=apply, optimizer=optax.adam(1e-3), loss=mse, data=task_of(MLP()).data)
    large = [(np.ones((8192, 256), np.float32), np.zeros((8192,), np.float32))]
    planned = fs.plan(init, task, target="cpu:2", evaluation=fs.EvalTask(apply=apply, metrics={"mse": mse}, data=large))
    assert (
        planned.peak_program == "the evaluation" and planned.per_device["total"] == planned.programs["the evaluation"]
    )
    assert planned.per_device["batch"] == 4096 * (256 + 1) * 4  # a device's half of the evaluation's batch
    assert "the peak is the evaluation's" in str(planned)
    assert planned.programs["the evaluation"] > planned.programs["the update"] > planned.programs["the restore"]


def test_the_loop_s_options_reach_the_plan_a_given_flops_count_and_the_rng_collections():
    # The loop's options are one spec the plan takes too: a user's FLOPs count is the plan's, as the loop's
    # records report it; rng collections that the model needs in training are the plan's, or its trace fails.
    model = MLP(width=64)
    task = task_of(model)
    given = fs.plan(model.init, task, target="cpu:1", flops_per_step=1e9)
    loop = fs.TrainLoop(model.init, task, jax.random.key(0), n_steps=1, flops_per_step=1e9, stdout=False)
    assert given.flops_per_step == loop.next_checkpoint().flops_per_step == 1e9

    class Noisy(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(1)(x + jax.random.normal(self.make_rng("noise"), x.shape))[:, 0]

    noisy = Noisy()
    data = [(np.ones((16, 256), np.float32), np.zeros((16,), np.float32))] * 2
    task = fs.TrainTask(apply=noisy.apply, optimizer=optax.adam(1e-3), loss=mse, data=data)
    collections = {"init": ["params", "noise"], "apply": ["noise"]}
    assert fs.plan(noisy.init, task, target="cpu:1", collections=collections).flops_per_step > 0
    with pytest.raises(Exception, match="noise"):  # without them the step asks for an rng it is not given
        fs.plan(noisy.init, task, target="cpu:1")


@pytest.mark.parametrize("kind", ["linen", "nnx"])
def test_an_evaluation_on_an_explicit_mesh_is_planned_under_its_context_and_sets_the_peak(kind):
    # The evaluation's program is traced under the Explicit mesh, as the update's is: `Resharded` reshards its
    # activations by bare specs, which refuse outside that context. With the hidden units split over `model` and
    # the batch whole, each device holds the evaluation's whole batch, and its activations are the peak.
    explicit = jax.sharding.AbstractMesh((4,), ("model",), axis_types=(jax.sharding.AxisType.Explicit,))
    if kind == "linen":
        linen = ReshardedLinen()
        init, apply = linen.init, linen.apply
    else:
        with nnx.use_eager_sharding(False):
            model = Resharded(nnx.Rngs(0))
        init = apply = model
    task = fs.TrainTask(apply=apply, optimizer=optax.adam(1e-3), loss=mse, data=task_of(MLP()).data)
    large = [(np.ones((2048, 256), np.float32), np.zeros((2048,), np.float32))]
    evaluation = fs.EvalTask(apply=apply, metrics={"mse": mse}, data=large)
    options = {"target": "cpu:4", "mesh_shape": explicit, "axis_rules": TENSOR_PARALLEL}
    planned = fs.plan(init, task, evaluation=evaluation, **options)
    trained = fs.plan(init, task, **options)
    assert planned.peak_program == "the evaluation" and "the peak is the evaluation's" in str(planned)
    assert planned.per_device["batch"] == 2048 * (256 + 1) * 4  # the whole batch: nothing splits it over `model`
    assert {k: v for k, v in planned.programs.items() if k != "the evaluation"} == trained.programs  # training's
    assert planned.programs["the evaluation"] > planned.programs["the update"] > planned.programs["the restore"]
    assert planned.per_device["params"] == trained.per_device["params"] < trained.per_device["optimizer"]
