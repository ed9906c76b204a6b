"""TrainTask(ema_decay=...): an EMA of the parameters inside the compiled step, saved, resumed and evaluated."""

import jax
import numpy as np
import optax
import pytest
from flax.training.dynamic_scale import DynamicScale
from flaxstate_testing import toy
from flaxstate_testing.loops import make_loop

import flaxstate as fs

DECAY = 0.9


def leaves(tree):
    return [np.asarray(leaf) for leaf in jax.tree.leaves(tree)]


def test_the_ema_is_the_hand_computed_average_of_the_parameters_after_each_step():
    loop = make_loop(n_steps=6, every=1, optimizer=optax.sgd(0.1), ema_decay=DECAY)
    expected = [np.asarray(leaf, np.float64) for leaf in leaves(loop.state.params)]  # starts at the initial params
    assert all(leaf.dtype == np.float32 for leaf in leaves(loop.state.ema))
    for record in loop:
        params = leaves(record.state.params)
        expected = [DECAY * e + (1 - DECAY) * p for e, p in zip(expected, params, strict=True)]
    for got, want in zip(leaves(record.ema_params), expected, strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)  # float32 sums near zero: an ulp of the terms
    pairs = zip(leaves(record.ema_params), leaves(record.state.params), strict=True)
    assert not all(np.array_equal(a, b) for a, b in pairs)


def test_a_schedule_of_the_step_is_a_decay_too():
    schedule = optax.linear_schedule(0.0, 0.99, 10)  # a warm-up: 0 at step 0 copies the params
    loop = make_loop(n_steps=1, every=1, optimizer=optax.sgd(0.1), ema_decay=schedule)
    record = loop.next_checkpoint()
    for got, want in zip(leaves(record.ema_params), leaves(record.state.params), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-6)


def test_k_steps_a_dispatch_and_microbatches_give_the_ema_of_one_step_a_dispatch():
    one = list(make_loop(n_steps=10, every=10, ema_decay=DECAY))[-1]
    k = list(make_loop(n_steps=10, every=10, per_dispatch=5, ema_decay=DECAY))[-1]
    micro = list(make_loop(n_steps=10, every=10, n_microbatches=2, ema_decay=DECAY))[-1]
    for a, b, c in zip(leaves(one.ema_params), leaves(k.ema_params), leaves(micro.ema_params), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-8)  # a scan fuses the update its own way: an ulp
        np.testing.assert_allclose(a, c, rtol=1e-5, atol=1e-7)


def test_a_step_that_loss_scaling_skips_leaves_the_ema_as_it_was():
    from test_loss_scaling import MODEL, START

    loop = make_loop(
        toy.batches(1, 16) * 4, model=MODEL, n_steps=1, every=1, ema_decay=DECAY, loss_scale=DynamicScale(scale=START)
    )
    before = loop.state
    record = loop.next_checkpoint()
    assert record.metrics["train"]["skipped_steps"] == 1
    for a, b in zip(leaves(record.ema_params), leaves(before.ema), strict=True):
        np.testing.assert_array_equal(a, b)


def test_the_ema_is_saved_and_a_resumed_run_ends_bit_for_bit_as_a_straight_one(tmp_path):
    straight = list(make_loop(n_steps=8, every=4, ema_decay=DECAY))[-1]
    with fs.CheckpointFileWriter(tmp_path) as writer:
        for record in make_loop(n_steps=4, every=4, ema_decay=DECAY):
            writer(record)
    resumed = make_loop(
        init=fs.CheckpointFileReader(tmp_path, target=toy.MLP().init), n_steps=8, every=4, ema_decay=DECAY
    )
    assert resumed.step == 4
    with fs.CheckpointFileWriter(tmp_path) as writer:
        last = [writer(record) for record in resumed][-1]
    for a, b in zip(leaves(last.state), leaves(straight.state), strict=True):
        np.testing.assert_array_equal(a, b)  # the EMA among them
    assert "ema" in last.state.state_dict()["state"]

    # An InferenceState restored with use_ema holds the EMA as its parameters.
    variables = toy.MLP().init(jax.random.key(0), np.zeros((1, 4), np.float32))
    template = fs.InferenceState.create(variables)
    averaged = fs.CheckpointFileReader(tmp_path).restore(template, use_ema=True)
    for a, b in zip(leaves(averaged.params), leaves(last.ema_params), strict=True):
        np.testing.assert_array_equal(a, b)
    plain = fs.CheckpointFileReader(tmp_path).restore(template)
    for a, b in zip(leaves(plain.params), leaves(last.state.params), strict=True):
        np.testing.assert_array_equal(a, b)
    with pytest.raises(fs.CheckpointError, match="takes an InferenceState"):
        fs.CheckpointFileReader(tmp_path).restore(last.state, use_ema=True)


def test_eval_loop_with_use_ema_evaluates_the_average_and_says_when_there_is_none():
    record = list(make_loop(n_steps=8, every=8, ema_decay=DECAY))[-1]
    task = fs.EvalTask(apply=toy.MLP().apply, metrics={"mse": toy.mse}, data=toy.batches(2, 8, seed=5))
    raw = fs.EvalLoop(task, jax.random.key(1), n_steps=2)(record).metrics["eval"]["mse"]
    averaged = fs.EvalLoop(task, jax.random.key(1), n_steps=2, use_ema=True)(record).metrics["eval"]["mse"]
    assert raw != averaged
    no_ema = list(make_loop(n_steps=4, every=4))[-1]
    with pytest.raises(ValueError, match="holds no EMA"):
        fs.EvalLoop(task, jax.random.key(1), use_ema=True)(no_ema)


def test_an_inference_state_restored_with_use_ema_reads_none_of_the_optimizer_state(tmp_path):
    import tensorstore as ts

    with fs.CheckpointFileWriter(tmp_path) as writer:
        last = [writer(record) for record in make_loop(n_steps=4, every=4, ema_decay=DECAY)][-1]
    # Every optimizer-state chunk is overwritten with bytes that are no array: reading any of them fails.
    optimizer = ts.KvStore.open({"driver": "ocdbt", "base": f"file://{tmp_path}/4/optimizer/"}).result()
    chunks = [key for key in optimizer.list().result() if key.startswith(b"param_states.")]
    assert chunks
    for key in chunks:
        if not key.endswith(b".zarray"):
            optimizer.write(key, b"not an array").result()
    variables = toy.MLP().init(jax.random.key(0), np.zeros((1, 4), np.float32))
    averaged = fs.CheckpointFileReader(tmp_path).restore(fs.InferenceState.create(variables), use_ema=True)
    for a, b in zip(leaves(averaged.params), leaves(last.ema_params), strict=True):
        np.testing.assert_array_equal(a, b)
    training = fs.FlaxOptimTrainState.create(optax.adam(1e-2), variables, ema_decay=DECAY)
    with pytest.raises(fs.CheckpointError, match="damaged"):
        fs.CheckpointFileReader(tmp_path).restore(training)  # the same files, read whole


@pytest.mark.parametrize("decay", [1.5, 1.0, -0.1, float("nan"), float("inf"), "0.9", True])
def test_a_constant_decay_outside_0_1_is_refused_at_construction_naming_the_setting(decay):
    with pytest.raises(ValueError, match=r"TrainTask ema_decay must"):
        fs.TrainTask(apply=toy.MLP().apply, optimizer=optax.sgd(0.1), loss=toy.mse, data=[], ema_decay=decay)
    fs.TrainTask(apply=toy.MLP().apply, optimizer=optax.sgd(0.1), loss=toy.mse, data=[], ema_decay=0.0)


@pytest.mark.parametrize(
    ("schedule", "message"),
    [
        (optax.constant_schedule(1.5), r"lie in \[0, 1\), got .*1.5.* at step 0"),
        (lambda step: step * 0.0 + float("nan"), r"lie in \[0, 1\), got .*nan.* at step 0"),
        (lambda step: "high", "must be a number"),
    ],
)
def test_a_schedule_bad_at_the_first_step_is_refused_before_training(schedule, message):
    with pytest.raises(ValueError, match=message):
        make_loop(n_steps=2, every=1, ema_decay=schedule)


def test_a_schedule_is_checked_at_the_step_a_run_resumes_from_before_anything_is_saved(tmp_path):
    with fs.CheckpointFileWriter(tmp_path) as writer:
        for record in make_loop(n_steps=4, every=4, ema_decay=DECAY):
            writer(record)
    saved = sorted(path.name for path in tmp_path.iterdir())
    late = optax.piecewise_constant_schedule(0.9, {3: 2.0})  # fine at step 0, 1.8 from step 3 on
    reader = fs.CheckpointFileReader(tmp_path, target=toy.MLP().init)
    with pytest.raises(ValueError, match=r"got .*1.8.* at step 4"):
        make_loop(init=reader, n_steps=8, every=4, ema_decay=late)
    assert sorted(path.name for path in tmp_path.iterdir()) == saved


def test_a_schedule_not_finite_at_any_later_step_is_refused_before_training_and_when_a_run_goes_past_it():
    def spike(step):  # fine up to step 4, NaN from step 5 on
        return jax.numpy.where(step >= 5, jax.numpy.nan, 0.9)

    with pytest.raises(ValueError, match=r"got .*nan.* at step 5"):
        make_loop(n_steps=8, every=4, ema_decay=spike)
    loop = make_loop(n_steps=4, every=4, ema_decay=spike)
    assert [record.step for record in loop] == [4]
    with pytest.raises(ValueError, match=r"got .*nan.* at step 5"):
        list(loop.run(8))
    assert loop.step == 4  # nothing trained past the steps checked
    assert np.isfinite(np.concatenate([np.ravel(x) for x in jax.tree.leaves(loop.state.ema)])).all()


def test_use_ema_through_the_tiers_reads_the_ema_of_the_step_the_local_tier_restored(tmp_path):
    local_dir, persistent_dir = tmp_path / "local", tmp_path / "persistent"
    with (
        fs.CheckpointFileWriter(local_dir, keep=2, per_process=True) as local,
        fs.CheckpointFileWriter(persistent_dir) as persistent,
    ):
        for record in make_loop(n_steps=12, every=4, ema_decay=DECAY):
            local(record)
            if record.step == 4:
                persistent(record)  # the persistent tier holds step 4 only
            last = leaves(record.ema_params)
    variables = toy.MLP().init(jax.random.key(0), np.zeros((1, 4), np.float32))
    reader = fs.CheckpointFileReader([local_dir, persistent_dir])
    averaged = reader.restore(fs.InferenceState.create(variables), use_ema=True)  # the local tier's step 12
    for a, b in zip(leaves(averaged.params), last, strict=True):
        np.testing.assert_array_equal(a, b)


def test_use_ema_with_rename_reads_the_ema_under_its_old_paths(tmp_path):
    with fs.CheckpointFileWriter(tmp_path) as writer:
        last = [writer(record) for record in make_loop(n_steps=4, every=4, ema_decay=DECAY)][-1]
    params = toy.MLP().init(jax.random.key(0), np.zeros((1, 4), np.float32))["params"]
    renamed = {"params": {"Encoder_0": params["Dense_0"], "Dense_1": params["Dense_1"]}}  # a later layout
    reader = fs.CheckpointFileReader(tmp_path, rename={"Dense_0/": "Encoder_0/"})
    averaged = reader.restore(fs.InferenceState.create(renamed), use_ema=True)
    for new, old in (("Encoder_0", "Dense_0"), ("Dense_1", "Dense_1")):
        for name in ("kernel", "bias"):
            np.testing.assert_array_equal(averaged.params[new][name], last.ema_params[old][name])
    assert not np.array_equal(averaged.params["Encoder_0"]["kernel"], last.state.params["Dense_0"]["kernel"])
