import copy
import gc

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from flax import nnx
from flaxstate_testing import nnx_models, toy

import flaxstate as fs


class NNXMLP(nnx.Module):
    """toy.MLP written in NNX."""

    def __init__(self, rngs: nnx.Rngs, width: int = 16):
        self.Dense_0 = nnx.Linear(4, width, rngs=rngs)
        self.Dense_1 = nnx.Linear(width, 1, rngs=rngs)

    def __call__(self, x):
        return self.Dense_1(nnx.tanh(self.Dense_0(x)))[:, 0]


class NNXBatchNormNet(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.dense = nnx.Linear(4, 8, rngs=rngs)
        self.norm = nnx.BatchNorm(8, momentum=0.9, rngs=rngs)
        self.dropout = nnx.Dropout(0.3, rngs=rngs)
        self.head = nnx.Linear(8, 1, rngs=rngs)

    def __call__(self, x):
        return self.head(self.dropout(self.norm(self.dense(x))))[:, 0]


def losses(init, apply, n_steps=30):
    task = fs.TrainTask(apply=apply, optimizer=optax.adam(1e-2), loss=toy.mse, data=toy.batches(n_steps, 8))
    loop = fs.TrainLoop(init, task, jax.random.key(0), n_steps=n_steps, n_steps_per_checkpoint=1, stdout=False)
    return np.array([record.loss for record in loop]), loop


def test_nnx_and_linen_versions_of_a_network_train_alike():
    linen = toy.MLP()
    linen_losses, linen_loop = losses(linen.init, linen.apply)

    model = NNXMLP(nnx.Rngs(0))
    # Start from the linen run's initial parameters, so both runs do the same arithmetic.
    initial = linen.init({"params": jax.random.fold_in(jax.random.fold_in(jax.random.key(0), 0), 0)}, jnp.ones((8, 4)))[
        "params"
    ]
    for name in ("Dense_0", "Dense_1"):
        getattr(model, name).kernel.value = initial[name]["kernel"]
        getattr(model, name).bias.value = initial[name]["bias"]
    init, apply = fs.nnx_functions(model)
    nnx_losses, nnx_loop = losses(init, apply)
    np.testing.assert_allclose(nnx_losses, linen_losses, rtol=1e-5, atol=1e-6)
    assert nnx_losses[-1] < nnx_losses[0] / 2
    np.testing.assert_allclose(
        nnx_loop.state.params["Dense_0"]["kernel"], linen_loop.state.params["Dense_0"]["kernel"], rtol=1e-4, atol=1e-6
    )


def test_nnx_batch_statistics_and_dropout_are_handled():
    init, apply = fs.nnx_functions(NNXBatchNormNet(nnx.Rngs(0)))
    variables = init(None, None)
    assert set(variables) == {"params", "batch_stats"}
    train_losses, loop = losses(init, apply, n_steps=20)
    state = loop.state
    assert float(jnp.abs(state.flax_mutables["batch_stats"]["norm"]["mean"]).sum()) > 0
    assert train_losses[-1] < train_losses[0]
    x, y = toy.batches(1, 8, seed=4)[0]
    trained = {"params": state.params, **state.flax_mutables}
    # Evaluation is deterministic (no dropout, running statistics); training draws masks from rngs.
    np.testing.assert_array_equal(apply(trained, x), apply(trained, x))
    a, _ = apply(trained, x, rngs={"dropout": jax.random.key(1)}, mutable=["batch_stats"])
    b, _ = apply(trained, x, rngs={"dropout": jax.random.key(2)}, mutable=["batch_stats"])
    assert not np.array_equal(a, b)
    evaluate = fs.EvalLoop(fs.EvalTask(apply=apply, metrics={"loss": toy.mse}, data=[(x, y)]), rng=jax.random.key(1))
    record = fs.Checkpoint(state=state, grads=None, loss=0.0, n_completed_steps=0, elapsed_time=0.0, step=20)
    expected = float(toy.mse(apply(trained, x), y))
    np.testing.assert_allclose(evaluate(record).metrics["eval"]["loss"], expected, rtol=1e-6)


# The module itself as the model: Flax's NNX MNIST tutorial's CNN, loss_fn(model, batch, rngs) and dict batches.


def cnn_loop(model, n_steps=8, rng=0, init=None, data=None, **options):
    data = nnx_models.digits(n_steps) if data is None else data
    task = fs.TrainTask(apply=model, optimizer=optax.adamw(0.005, 0.9), loss=nnx_models.loss_fn, data=data)
    return fs.TrainLoop(
        init=model if init is None else init, task=task, rng=rng, n_steps=n_steps, stdout=False, **options
    )


def test_the_tutorial_s_module_loss_and_dict_batches_train_with_its_dropout_and_every_variable_carried():
    # Its Dropout takes rngs at call time (ValueError: "'deterministic' is False, but no 'rngs' argument was
    # provided"); the Variable of the user's own was dropped; BatchNorm's statistics are carried.
    model = nnx_models.CNN(rngs=nnx.Rngs(0))
    initial = np.asarray(model.linear2.kernel[...]).copy()
    records = list(cnn_loop(model, n_steps=24))
    state = records[-1].state
    assert set(state.flax_mutables) == {"batch_stats", "calls"} and int(state.flax_mutables["calls"]["calls"]) == 24
    assert float(np.abs(state.flax_mutables["batch_stats"]["batch_norm1"]["mean"]).sum()) > 0
    losses = [record.loss for record in records]
    assert np.mean(losses[-6:]) < np.mean(losses[:6]) - 0.1, losses
    other_rng = list(cnn_loop(nnx_models.CNN(rngs=nnx.Rngs(0)), n_steps=24, rng=1, n_steps_per_checkpoint=24))[-1].state
    assert not np.array_equal(other_rng.params["linear2"]["kernel"], state.params["linear2"]["kernel"])  # dropout on
    np.testing.assert_array_equal(model.linear2.kernel[...], initial)  # the user's module is untouched until asked
    fs.nnx_update(model, records[-1])
    np.testing.assert_array_equal(model.linear2.kernel[...], state.params["linear2"]["kernel"])
    assert int(model.calls[...]) == 24
    model.conv1.kernel[...] += 1.0  # writable jax arrays, not the record's read-only host copies
    evaluate = fs.EvalLoop(
        fs.EvalTask(apply=model, metrics={"acc": nnx_models.accuracy}, data=nnx_models.digits(4, seed=1)),
        rng=1,
        n_steps=4,
    )
    assert 0.0 <= evaluate(records[-1]).metrics["eval"]["acc"] <= 1.0
    assert model.dropout1.deterministic is False and model.batch_norm1.use_running_average is False  # unchanged


def test_k_steps_a_dispatch_train_an_nnx_module_as_one_step_a_dispatch_does():
    one = list(cnn_loop(nnx_models.CNN(rngs=nnx.Rngs(0)), n_steps=4, n_steps_per_checkpoint=4))[-1].state
    two = cnn_loop(nnx_models.CNN(rngs=nnx.Rngs(0)), n_steps=4, n_steps_per_checkpoint=4, n_steps_per_dispatch=2)
    four = list(two)[-1].state
    for a, b in zip(jax.tree.leaves(one), jax.tree.leaves(four), strict=True):
        np.testing.assert_allclose(a, b, rtol=2e-5, atol=1e-6)


def test_an_nnx_run_resumes_from_its_checkpoint_bit_for_bit_with_its_own_variables(tmp_path):
    straight = list(cnn_loop(nnx_models.CNN(rngs=nnx.Rngs(0)), n_steps=8, n_steps_per_checkpoint=4))[-1].state
    model = nnx_models.CNN(rngs=nnx.Rngs(0))
    reader = fs.CheckpointFileReader(tmp_path, target=model)
    with fs.CheckpointFileWriter(tmp_path) as writer:
        first = cnn_loop(model, n_steps=8, init=reader, n_steps_per_checkpoint=4)
        writer(first.next_checkpoint())  # step 4, then the run stops
    resumed = cnn_loop(model, n_steps=8, init=fs.CheckpointFileReader(tmp_path, target=model), n_steps_per_checkpoint=4)
    assert resumed.step == 4
    state = list(resumed)[-1].state
    for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(straight), strict=True):
        np.testing.assert_array_equal(a, b)
    restored = fs.CheckpointFileReader(tmp_path).restore(nnx_models.CNN(rngs=nnx.Rngs(9)))  # into a module
    assert int(restored.calls[...]) == 4


def test_wrong_nnx_objects_are_named_by_class_without_their_repr():
    model = nnx_models.CNN(rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.adamw(0.005), wrt=nnx.Param)
    data = nnx_models.digits(2)
    attempts = {
        "TrainTask(apply=...) got an nnx.Optimizer": lambda: fs.TrainTask(
            apply=optimizer, optimizer=optax.sgd(0.1), loss=nnx_models.loss_fn, data=data
        ),
        "TrainTask optimizer is an nnx.Optimizer": lambda: fs.TrainTask(
            apply=model, optimizer=optimizer, loss=nnx_models.loss_fn, data=data
        ),
        "TrainLoop(init=...) got an nnx.Optimizer": lambda: cnn_loop(model, init=optimizer),
        "takes the model first (NNX's loss_fn(model, batch))": lambda: fs.TrainTask(
            apply=lambda v, x: x, optimizer=optax.sgd(0.1), loss=nnx_models.loss_fn, data=data
        ),
        "selects none of the module's Variables": lambda: fs.TrainTask(
            apply=model, optimizer=optax.sgd(0.1), loss=nnx_models.loss_fn, data=data, wrt=nnx.LoRAParam
        ),
        "CheckpointFileReader.restore got an NNX State": lambda: fs.CheckpointFileReader("/nowhere").restore(
            nnx.state(model)
        ),
    }
    for expected, attempt in attempts.items():
        with pytest.raises((TypeError, ValueError)) as raised:
            attempt()
        message = str(raised.value)
        assert expected in message and len(message) < 400, message  # a class's name, never a 4 KB repr


def test_nnx_update_names_the_paths_of_a_module_that_differs_and_writes_nothing():
    record = list(cnn_loop(nnx_models.CNN(rngs=nnx.Rngs(0)), n_steps=2))[-1]
    other = nnx_models.MLP(nnx.Rngs(0))
    before = np.asarray(other.Dense_0.kernel[...]).copy()
    with pytest.raises(fs.StateMismatchError, match=r"missing .*params/Dense_0/kernel \(\[4, 16\]\).*unexpected"):
        fs.nnx_update(other, record)
    np.testing.assert_array_equal(other.Dense_0.kernel[...], before)
    with pytest.raises(fs.StateMismatchError, match=r"does not match the task's module CNN"):
        cnn_loop(nnx_models.CNN(rngs=nnx.Rngs(0)), init=other)


def test_training_calls_the_module_as_configured_and_evaluation_a_view_of_it():
    # A frozen BatchNorm (a fine-tuning view): its statistics stay; trained as built, they move.
    x, y = toy.batches(1, 8, seed=4)[0]
    data = toy.batches(6, 8)

    def trained(module, n_steps=3):
        task = fs.TrainTask(apply=module, optimizer=optax.sgd(0.1), loss=toy.mse, data=data)
        loop = fs.TrainLoop(init=module, task=task, rng=0, n_steps=n_steps, stdout=False)
        return list(loop)[-1]

    model = NNXBatchNormNet(nnx.Rngs(0))
    frozen = nnx.view(model, only=nnx.BatchNorm, use_running_average=True)
    stats = trained(frozen).state.flax_mutables["batch_stats"]["norm"]
    np.testing.assert_array_equal(stats["mean"], np.zeros(8))
    assert float(np.abs(trained(model).state.flax_mutables["batch_stats"]["norm"]["mean"]).sum()) > 0
    # EvalLoop evaluates in evaluation mode, with or without rngs for the model, and leaves the module as it was.
    record = trained(model)
    for rng_collections in ((), ("dropout",)):
        evaluate = fs.EvalLoop(
            fs.EvalTask(apply=model, metrics={"mse": toy.mse}, data=[(x, y)]), rng=1, rng_collections=rng_collections
        )
        assert evaluate(record).metrics["eval"]["mse"] == evaluate(record).metrics["eval"]["mse"]
    assert model.dropout.deterministic is False and model.norm.use_running_average is False


def test_each_rng_stream_draws_its_own_key_a_step_and_a_module_s_own_streams_advance():
    class Seen(nnx.Variable):
        pass

    class Streams(nnx.Module):
        def __init__(self, rngs):
            self.linear = nnx.Linear(4, 1, rngs=rngs)
            self.seen = Seen(jnp.zeros((2, 2), jnp.uint32))

        def __call__(self, x, rngs=None):
            self.seen[...] = jnp.stack([jax.random.key_data(rngs.dropout()), jax.random.key_data(rngs.noise())])
            return self.linear(x)[:, 0]

    def seen(rng, n_steps):
        module = Streams(nnx.Rngs(0))
        task = fs.TrainTask(apply=module, optimizer=optax.sgd(0.1), loss=toy.mse, data=toy.batches(n_steps, 8))
        collections = {"apply": ["dropout", "noise"]}
        loop = fs.TrainLoop(init=module, task=task, rng=rng, n_steps=n_steps, stdout=False, collections=collections)
        return [np.asarray(record.state.flax_mutables["seen"]["seen"]) for record in loop]

    first, second = seen(0, 2)
    assert not np.array_equal(first[0], first[1])  # 'noise' is a stream of its own, not 'dropout''s key
    assert not np.array_equal(first, second)  # another step, other keys
    np.testing.assert_array_equal(seen(0, 2)[1], second)  # the same rng, the same draws
    assert not np.array_equal(seen(1, 2)[1], second)
    # A module holding its own streams (Dropout(..., rngs=)): their counts are carried, so masks differ each step.
    module = nnx_models.MLP(nnx.Rngs(0), dropout=0.5)
    task = fs.TrainTask(apply=module, optimizer=optax.sgd(0.1), loss=toy.mse, data=toy.batches(3, 8))
    records = list(fs.TrainLoop(init=module, task=task, rng=0, n_steps=3, stdout=False))
    counts = [int(record.state.flax_mutables["rng_count"]["dropout"]["rngs"]["count"]) for record in records]
    assert counts == [1, 2, 3]


def test_wrt_trains_the_variables_it_selects_and_carries_the_rest_unchanged():
    class Adapted(nnx.Module):
        def __init__(self, rngs):
            self.lora = nnx.LoRA(4, 2, 1, base_module=nnx.Linear(4, 1, rngs=rngs), rngs=rngs)

        def __call__(self, x):
            return self.lora(x)[:, 0]

    module = Adapted(nnx.Rngs(0))
    base = np.asarray(module.lora.base_module.kernel[...]).copy()
    task = fs.TrainTask(
        apply=module, optimizer=optax.adam(1e-2), loss=toy.mse, data=toy.batches(4, 8), wrt=nnx.LoRAParam
    )
    record = list(fs.TrainLoop(init=module, task=task, rng=0, n_steps=4, stdout=False))[-1]
    assert set(jax.tree.leaves(jax.tree.map(lambda _: 1, record.state.params))) == {1}
    assert sorted(record.state.params["lora"]) == ["lora_a", "lora_b"]
    np.testing.assert_array_equal(record.state.flax_mutables["frozen_params"]["lora"]["base_module"]["kernel"], base)
    assert not np.array_equal(record.state.params["lora"]["lora_b"], np.zeros((2, 1)))
    fs.nnx_update(module, record)
    np.testing.assert_array_equal(module.lora.base_module.kernel[...], base)


@pytest.mark.filterwarnings("ignore:no axis rule names")  # the data-parallel plan's: the annotations unused
def test_sharding_annotations_are_the_state_s_logical_axes_in_the_plan():
    class Annotated(nnx.Module):
        def __init__(self, rngs):
            kernel = nnx.with_partitioning(nnx.initializers.lecun_normal(), ("embed", "hidden"))
            self.linear = nnx.Linear(4, 64, kernel_init=kernel, use_bias=False, rngs=rngs)
            out = nnx.with_partitioning(nnx.initializers.lecun_normal(), ("hidden", "embed"))
            self.out = nnx.Linear(64, 1, kernel_init=out, use_bias=False, rngs=rngs)

        def __call__(self, x):
            return self.out(nnx.relu(self.linear(x)))[:, 0]

    with nnx.use_eager_sharding(False):  # the annotations as metadata (no mesh at construction)
        module = Annotated(nnx.Rngs(0))
    task = fs.TrainTask(apply=module, optimizer=optax.adam(1e-3), loss=toy.mse, data=toy.batches(2, 8))
    rules = [("batch", "fsdp"), ("hidden", "fsdp"), ("embed", None)]
    sharded = fs.plan(module, task, target="cpu:4", mesh_shape={"fsdp": 4}, axis_rules=rules)
    replicated = fs.plan(module, task, target="cpu:4")
    assert sharded.per_device["params"] * 4 == replicated.per_device["params"] == (4 * 64 + 64) * 4


def test_the_loop_holds_one_copy_of_the_parameters_once_the_module_goes():
    class Wide(nnx.Module):
        def __init__(self, rngs):
            self.linear = nnx.Linear(512, 2048, use_bias=False, rngs=rngs)

        def __call__(self, x):
            return self.linear(x).mean(axis=1)

    def live_bytes():
        gc.collect()
        return sum(array.nbytes for array in jax.live_arrays())

    before = live_bytes()
    module = Wide(nnx.Rngs(0))
    task = fs.TrainTask(
        apply=module,
        optimizer=optax.sgd(1e-3),
        loss=toy.mse,
        data=[(np.ones((8, 512), np.float32), np.ones((8,), np.float32))] * 4,
    )
    loop = fs.TrainLoop(init=module, task=task, rng=0, n_steps=2, stdout=False)
    kernel = 512 * 2048 * 4
    del module
    held = live_bytes() - before
    assert kernel <= held < 1.2 * kernel, (held, kernel)  # three copies before (96.5 MiB of a 32 MiB kernel)
    assert loop.step == 0


def test_plain_orbax_reads_an_nnx_run_s_step_with_the_documented_template(tmp_path):
    module = nnx_models.CNN(rngs=nnx.Rngs(0))
    with fs.CheckpointFileWriter(tmp_path) as writer:
        for record in cnn_loop(module, n_steps=4, n_steps_per_checkpoint=4):
            writer(record)
    # docs/guides/nnx.md: an abstract module built alike, the step's layout as the template, plain orbax.
    abstract = nnx.eval_shape(lambda: nnx_models.CNN(rngs=nnx.Rngs(0)))
    template = {
        "target": nnx.to_pure_dict(nnx.state(abstract, nnx.Param)),
        "flax_mutables": {
            "batch_stats": nnx.to_pure_dict(nnx.state(abstract, nnx.BatchStat)),
            "calls": nnx.to_pure_dict(nnx.state(abstract, nnx_models.Calls)),
        },
    }
    restored = ocp.StandardCheckpointer().restore(tmp_path / "4" / "model", template)
    expected = {"target": record.state.params, "flax_mutables": record.state.flax_mutables}
    for path, value in fs.tree_paths.flatten(expected).items():
        np.testing.assert_array_equal(fs.tree_paths.flatten(restored)[path], value, err_msg=path)


def test_whole_batches_are_fingerprinted_leaf_by_leaf_tuples_and_dicts_alike():
    # `loss_fn(model, batch)` gets the batch whole: a tuple `(x, y)` crashed the data's digest at step 1, and a dict's
    # digest read its leaves as Python objects (another copy of the same data fingerprinted differently).
    def tuple_loss(model, batch):
        x, y = batch
        return toy.mse(model(x), y)

    def fingerprints(data, **options):
        model = nnx_models.MLP(nnx.Rngs(0))
        task = fs.TrainTask(apply=model, optimizer=optax.sgd(0.1), loss=tuple_loss, data=data)
        loop = fs.TrainLoop(model, task, 0, n_steps=4, n_steps_per_checkpoint=2, stdout=False, **options)
        return [record.data_fingerprint for record in loop]

    data = toy.batches(4, 8)
    assert fingerprints(data) == fingerprints(copy.deepcopy(data)) == fingerprints(data, n_steps_per_dispatch=2)
    assert None not in fingerprints(data)
    changed = copy.deepcopy(data)
    changed[2][0][0, 0] += 1.0  # the first batch of the second record's span
    assert fingerprints(changed)[0] == fingerprints(data)[0] and fingerprints(changed)[1] != fingerprints(data)[1]
    dicts = nnx_models.digits(4)
    dict_prints = [record.data_fingerprint for record in cnn_loop(nnx_models.CNN(rngs=nnx.Rngs(0)), 4, data=dicts)]
    again = [r.data_fingerprint for r in cnn_loop(nnx_models.CNN(rngs=nnx.Rngs(0)), 4, data=copy.deepcopy(dicts))]
    assert dict_prints == again and None not in dict_prints


class Bag(nnx.Variable):
    """A Variable of the user's own that holds a dict of arrays."""


class Counting(nnx.Module):
    def __init__(self, rngs):
        self.linear = nnx.Linear(4, 1, rngs=rngs)
        self.bag = Bag({"mean": jnp.zeros((4,)), "n": jnp.zeros((), jnp.int32)})

    def __call__(self, x):
        self.bag.value = {"mean": self.bag.value["mean"] + x.mean(axis=0), "n": self.bag.value["n"] + 1}
        return self.linear(x)[:, 0]


def test_nnx_update_writes_a_variable_that_holds_a_dict_and_names_its_shapes_where_they_differ():
    model = Counting(nnx.Rngs(0))
    task = fs.TrainTask(apply=model, optimizer=optax.sgd(0.1), loss=toy.mse, data=toy.batches(3, 8))
    record = list(fs.TrainLoop(model, task, 0, n_steps=3, n_steps_per_checkpoint=3, stdout=False))[-1]
    fs.nnx_update(model, record)
    assert int(model.bag.value["n"]) == 3
    np.testing.assert_array_equal(model.bag.value["mean"], record.state.flax_mutables["bag"]["bag"]["mean"])
    np.testing.assert_array_equal(model.linear.kernel[...], record.state.params["linear"]["kernel"])
    other = Counting(nnx.Rngs(1))
    other.bag.value = {"mean": jnp.zeros((5,)), "n": jnp.zeros((), jnp.int32)}
    with pytest.raises(fs.StateMismatchError, match=r"bag/bag \(expected \{'mean': \[5\], 'n': \[\]\}, found"):
        fs.nnx_update(other, record)


def test_nnx_update_from_safetensors_files_puts_their_params_into_the_module_and_keeps_the_rest(tmp_path):
    import safetensors.numpy

    model = nnx_models.MLP(nnx.Rngs(0), calls=True)
    model.calls[...] = 7
    tensors = {"Dense_0.weight": np.full((16, 4), 0.5, np.float32), "Dense_0.bias": np.arange(16, dtype=np.float32),
               "Dense_1.weight": np.ones((1, 16), np.float32), "Dense_1.bias": np.zeros((1,), np.float32)}  # fmt: skip
    safetensors.numpy.save_file(tensors, str(tmp_path / "model.safetensors"))
    reader = fs.SafetensorsReader(
        tmp_path, target=model, rename=[(r"\.weight$", "/kernel"), (r"\.bias$", "/bias")], transpose="kernel"
    )
    assert fs.nnx_update(model, reader) is model
    np.testing.assert_array_equal(model.Dense_0.kernel[...], tensors["Dense_0.weight"].T)
    np.testing.assert_array_equal(model.Dense_0.bias[...], tensors["Dense_0.bias"])
    assert int(model.calls[...]) == 7  # not in the files: kept
    with pytest.raises(ValueError, match="safetensors hold no EMA"):
        fs.nnx_update(model, reader, use_ema=True)


def test_a_plan_of_the_guide_s_task_takes_nnx_s_loss_over_dict_batches():
    # The NNX guide's first code block: `loss_fn(model, batch)` over dict batches, each batch whole.
    model = nnx_models.CNN(rngs=nnx.Rngs(0))
    task = fs.TrainTask(apply=model, optimizer=optax.adamw(0.005, 0.9), wrt=nnx.Param, loss=nnx_models.loss_fn,
                        data=nnx_models.digits(2))  # fmt: skip
    plan = fs.plan(model, task, target="cpu:4")
    params = sum(leaf.size * leaf.dtype.itemsize for leaf in jax.tree.leaves(nnx.state(model, nnx.Param)))
    assert plan.per_device["params"] == params and plan.flops_per_step > 0


def test_plain_orbax_reads_a_step_of_a_module_whose_dropout_holds_its_own_rngs_with_the_guide_s_template(tmp_path):
    # docs/guides/nnx.md: the streams' counts as they are, their keys as the raw data the state holds.
    module = nnx_models.MLP(nnx.Rngs(0, dropout=1), dropout=0.25)
    task = fs.TrainTask(apply=module, optimizer=optax.sgd(0.1), loss=toy.mse, data=toy.batches(4, 8))
    with fs.CheckpointFileWriter(tmp_path) as writer:
        for record in fs.TrainLoop(module, task, 0, n_steps=4, n_steps_per_checkpoint=4, stdout=False):
            writer(record)
    abstract = nnx.eval_shape(lambda: nnx_models.MLP(nnx.Rngs(0, dropout=1), dropout=0.25))

    def raw(keys):  # a random key is stored as its raw data (jax.random.key_data)
        return jax.tree.map(lambda key: jax.eval_shape(jax.random.key_data, key), keys)

    template = {
        "target": nnx.to_pure_dict(nnx.state(abstract, nnx.Param)),
        "flax_mutables": {
            "rng_count": nnx.to_pure_dict(nnx.state(abstract, nnx.RngCount)),
            "rng_key": raw(nnx.to_pure_dict(nnx.state(abstract, nnx.RngKey))),
        },
    }
    restored = ocp.StandardCheckpointer().restore(tmp_path / "4" / "model", template)
    expected = {"target": record.state.params, "flax_mutables": record.state.flax_mutables}
    assert fs.tree_paths.flatten(restored).keys() == fs.tree_paths.flatten(expected).keys()
    for path, value in fs.tree_paths.flatten(expected).items():
        np.testing.assert_array_equal(fs.tree_paths.flatten(restored)[path], value, err_msg=path)
    counts = [v for k, v in fs.tree_paths.flatten(restored).items() if k.startswith("flax_mutables/rng_count/")]
    assert counts and all(int(count) == 4 for count in counts), counts
