import dataclasses
import pickle
import time

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import redex
from flax import nnx
from flaxstate_testing import loops, nnx_models, toy

import flaxstate as fs
from flaxstate.run_record import fingerprints
from flaxstate.training import copies, segment

MODEL = toy.BatchNormNet()
MLP = toy.MLP()


def make_loop(data=None, model=MLP, n_steps=12, every=4, per_dispatch=1, optimizer=None, loss=toy.mse, **kwargs):
    return loops.make_loop(
        data,
        model=model,
        optimizer=optimizer,
        loss=loss,
        n_steps=n_steps,
        every=every,
        per_dispatch=per_dispatch,
        **kwargs,
    )


def leaves(tree):
    return [np.asarray(x) for x in jax.tree.leaves(tree)]


def assert_trees_equal(a, b):
    for x, y in zip(leaves(a), leaves(b), strict=True):
        np.testing.assert_array_equal(x, y)


# On a GPU, float32 matmuls run in TF32 by default, and XLA may pick other algorithms for
# programs fused differently: results agree to about 1e-4 there, exactly on the CPU.
ON_CPU = jax.default_backend() == "cpu"
TOLERANCE = {"rtol": 1e-6, "atol": 1e-7} if ON_CPU else {"rtol": 1e-3, "atol": 1e-5}


def assert_trees_match_handwritten(a, b):
    """Bit for bit on the CPU (what CI runs); to TF32 tolerance on a GPU."""
    if ON_CPU:
        assert_trees_equal(a, b)
    else:
        for x, y in zip(leaves(a), leaves(b), strict=True):
            np.testing.assert_allclose(x, y, **TOLERANCE)


def test_one_device_equals_a_handwritten_optax_loop_bit_for_bit():
    data = toy.batches(10, 8)
    tx = optax.adam(1e-2)
    loop = make_loop(data=data, n_steps=10, every=5, optimizer=tx)
    final = list(loop)[-1]

    params = MLP.init({"params": jax.random.fold_in(jax.random.fold_in(jax.random.key(0), 0), 0)}, data[0][0][:8])[
        "params"
    ]
    opt_state = tx.init(params)

    # The plainest hand-written step: parameters, optimizer state and loss out, nothing more; and
    # the same with its gradients behind an optimization barrier, as every step of the loop has them
    # (so that a record's program, which also returns them, trains the same bits as any other).
    def grads_of(params, x, y):
        return jax.value_and_grad(lambda p: toy.mse(MLP.apply({"params": p}, x), y))(params)

    def make_step(fenced):
        @jax.jit
        def step(params, opt_state, x, y):
            loss, grads = grads_of(params, x, y)
            grads = jax.lax.optimization_barrier(grads) if fenced else grads
            updates, opt_state = tx.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state, loss

        return step

    ran = {}
    for fenced in (True, False):
        params_now, opt_now, step = params, opt_state, make_step(fenced)
        for x, y in data:
            last_params = params_now
            params_now, opt_now, loss = step(params_now, opt_now, x, y)
        ran[fenced] = params_now, last_params, loss
    assert final.step == 10
    fenced_params, last_params, loss = ran[True]
    assert_trees_match_handwritten(final.state.params, fenced_params)
    # The plain loop's XLA program fuses the gradients into adam's update its own way: an ulp apart.
    for x, y in zip(leaves(final.state.params), leaves(ran[False][0]), strict=True):
        np.testing.assert_allclose(x, y, **TOLERANCE)
    # The record's gradients are its last step's: those of the parameters before it, on its batch.
    assert_trees_match_handwritten(final.grads, jax.jit(grads_of)(last_params, *data[-1])[1])
    np.testing.assert_allclose(final.loss, float(loss), rtol=0 if ON_CPU else TOLERANCE["rtol"])


@pytest.mark.parametrize("per_dispatch", [1, 2])
@pytest.mark.parametrize("api", ["linen", "nnx"])
def test_records_without_gradients_train_the_same_bits_and_compile_no_program_that_returns_them(api, per_dispatch):
    # Batch statistics in both; in NNX also dropout at call time and a Variable of the user's own.
    def run(record_gradients):
        options = {"record_gradients": record_gradients, "stdout": False}
        if api == "linen":
            loop = make_loop(model=MODEL, n_steps=6, every=2, per_dispatch=per_dispatch, **options)
        else:
            model = nnx_models.CNN(rngs=nnx.Rngs(0))
            data = nnx_models.digits(6)
            task = fs.TrainTask(apply=model, optimizer=optax.adamw(0.005, 0.9), loss=nnx_models.loss_fn, data=data)
            loop = fs.TrainLoop(
                init=model,
                task=task,
                rng=0,
                n_steps=6,
                n_steps_per_checkpoint=2,
                n_steps_per_dispatch=per_dispatch,
                **options,
            )
        return list(loop), loop

    with_gradients, with_loop = run(True)
    without, loop = run(False)
    assert [r.grads is None for r in with_gradients + without] == [False] * 3 + [True] * 3
    for a, b in zip(with_gradients, without, strict=True):
        assert (a.step, a.loss, a.state_fingerprint) == (b.step, b.loss, b.state_fingerprint)
        assert_trees_equal(a.state, b.state)
    # A record's program returns what its records carry, and no other program returns gradients: XLA's FLOPs
    # count takes a record's one-step update at K = 1 (which a run of records every step dispatches, so that its
    # first step compiles one program, and which counts what the plain one does), and a program of K steps that
    # the segment runs at K > 1. (The plain one-step update is the model's FLOPs count's, traced.)
    # (On a CPU of one process the record's fingerprint is taken when read, not by its dispatch: see below.)
    record = f"update of {per_dispatch} steps"

    def made(loop):
        return {name.removesuffix(", fingerprinted") for name in loop.program.made()}

    assert made(with_loop) == {"update of 1 steps", record, f"{record}, gradients"}
    assert made(loop) == {"update of 1 steps", record}
    with pytest.raises(ValueError, match="TrainLoop record_gradients must be True or False, got .no."):
        make_loop(record_gradients="no")


def test_records_at_multiples_of_n_and_at_the_last_step():
    loop = make_loop(n_steps=10, every=4)
    records = list(loop)
    assert [r.step for r in records] == [4, 8, 10]
    assert [r.n_completed_steps for r in records] == [4, 4, 2]
    assert [r.final for r in records] == [False, False, True]
    assert loop.step == 10
    assert loop.next_checkpoint() is None
    assert list(loop) == []


def test_next_checkpoint_cell_by_cell_equals_for_iteration():
    iterated = list(make_loop(model=MODEL))
    loop = make_loop(model=MODEL)
    stepped = []
    while (record := loop.next_checkpoint()) is not None:
        stepped.append(record)
    assert [r.step for r in stepped] == [r.step for r in iterated]
    for a, b in zip(iterated, stepped, strict=True):
        assert_trees_equal(a.state, b.state)
        assert a.loss == b.loss


def test_stopping_early_and_going_on_continues_where_it_stopped():
    reference = list(make_loop(model=MODEL))
    loop = make_loop(model=MODEL)
    for record in loop:
        if record.step == 4:
            break
    rest = list(loop)
    assert [r.step for r in rest] == [8, 12]
    assert_trees_equal(rest[-1].state, reference[-1].state)


def test_run_trains_up_to_a_total():
    reference = list(make_loop(model=MODEL, n_steps=0).run(20))
    loop = make_loop(model=MODEL, n_steps=0)
    first = list(loop.run(10))
    second = list(loop.run(20))
    assert [r.step for r in first] == [4, 8, 10]
    assert [r.step for r in second] == [12, 16, 20]
    assert loop.n_steps == 20
    assert_trees_equal(second[-1].state, reference[-1].state)


def test_next_step_runs_one_step():
    loop = make_loop(n_steps=3)
    assert loop.next_step().step == 1
    assert loop.next_step().step == 2
    assert [r.step for r in loop] == [3]


def test_state_is_available_from_construction_and_survives_donation():
    loop = make_loop(n_steps=4)
    initial = loop.state
    assert int(initial.step) == 0
    record = loop.next_checkpoint()
    list(loop)
    # Both copies remain readable after the loop donated its own state.
    assert int(initial.step) == 0 and int(record.state.step) == 4
    assert int(loop.state.step) == 4


def test_a_record_s_state_fingerprint_is_taken_when_read_and_equals_the_one_its_dispatch_gives(monkeypatch):
    # Where records hold host copies on a CPU of one process, the state fingerprint is taken at its first read;
    # elsewhere (a GPU's path, forced here) the record's dispatch returns it. The two agree for every record, and
    # with the fingerprint of the record's state read by hand; a record's fingerprints survive pickling and
    # `dataclasses.replace`.
    reading = make_loop(n_steps=8, every=2)
    lazy = list(reading)
    assert not any("fingerprinted" in name for name in reading.program.made())
    assert all(type(r.fingerprints).__name__ == "LazyFingerprints" for r in lazy)
    texts = [r.state_fingerprint for r in lazy]
    monkeypatch.setattr(copies, "reads_later", lambda mesh, memory: False)
    fused = make_loop(n_steps=8, every=2)
    eager = list(fused)
    assert "update of 1 steps, gradients, fingerprinted" in fused.program.made()
    assert [r.state_fingerprint for r in eager] == texts
    assert texts[-1] == fingerprints.text(fingerprints.of_state(jax.tree.leaves(lazy[-1].state)))
    assert len(set(texts)) == 4
    copied = pickle.loads(pickle.dumps(lazy[0].fingerprints))
    assert copied == lazy[0].fingerprints and type(copied) is fs.Fingerprints
    assert dataclasses.replace(lazy[1].fingerprints, data="x").state == texts[1]


@pytest.mark.parametrize("per_dispatch", [1, 3])
@pytest.mark.parametrize("api", ["linen", "nnx"])
def test_the_state_is_the_same_bits_wherever_records_fall(api, per_dispatch):
    # A record's dispatch runs a program of its own (it also returns the gradients and the fingerprint),
    # at one step as at K; adam turns an ulp of a near-zero gradient into a step of the learning rate's
    # size, so a record that moved the state by an ulp would show here. Records every dispatch, every
    # other dispatch, and only at the end; in NNX with dropout and batch statistics.
    def run(every):
        if api == "linen":
            loop = make_loop(model=MODEL, n_steps=6 * per_dispatch, every=every, per_dispatch=per_dispatch)
        else:
            model = nnx_models.CNN(rngs=nnx.Rngs(0))
            task = fs.TrainTask(
                apply=model,
                optimizer=optax.adam(0.005),
                loss=nnx_models.loss_fn,
                data=nnx_models.digits(6 * per_dispatch),
            )
            loop = fs.TrainLoop(
                init=model,
                task=task,
                rng=0,
                n_steps=6 * per_dispatch,
                n_steps_per_checkpoint=every,
                n_steps_per_dispatch=per_dispatch,
                stdout=False,
            )
        return list(loop)

    runs = {every: run(every) for every in (per_dispatch, 2 * per_dispatch, 6 * per_dispatch)}
    assert [len(records) for records in runs.values()] == [6, 3, 1]
    finals = [records[-1] for records in runs.values()]
    for other in finals[1:]:
        assert other.state_fingerprint == finals[0].state_fingerprint
        assert_trees_equal(other.state, finals[0].state)
        assert_trees_equal(other.grads, finals[0].grads)
    # Where two runs record the same step, they record the same state and gradients.
    each, every_other = runs[per_dispatch], runs[2 * per_dispatch]
    for a, b in zip(each[1::2], every_other, strict=True):
        assert a.step == b.step and a.loss == b.loss
        assert_trees_equal(a.grads, b.grads)


@pytest.mark.parametrize("model", [MLP, MODEL], ids=["mlp", "batchnorm_dropout"])
def test_steps_per_dispatch_equals_one_step_per_dispatch(model):
    # SGD: adam's update m / sqrt(v) turns an ulp of a near-zero gradient into a step of
    # the learning rate's size, which would test XLA's fusion rather than the loop.
    sgd = optax.sgd(0.05, momentum=0.9)
    one = list(make_loop(model=model, n_steps=10, every=4, per_dispatch=1, optimizer=sgd))
    four = list(make_loop(model=model, n_steps=10, every=4, per_dispatch=4, optimizer=sgd))
    assert [r.step for r in four] == [4, 8, 10]
    for a, b in zip(one, four, strict=True):
        for x, y in zip(leaves(a.state), leaves(b.state), strict=True):
            np.testing.assert_allclose(x, y, **TOLERANCE)
        # The record's gradients are its last step's either way: computed beside a single step
        # (K=1, and K=4's last two steps), or returned by the scan (K=4 at steps 4 and 8).
        for x, y in zip(leaves(a.grads), leaves(b.grads), strict=True):
            np.testing.assert_allclose(x, y, **TOLERANCE)
        np.testing.assert_allclose(a.loss, b.loss, rtol=TOLERANCE["rtol"])


def test_dropout_rngs_make_the_run_reproducible_from_its_seed():
    a = list(make_loop(model=MODEL, n_steps=3, every=3))[-1]
    b = list(make_loop(model=MODEL, n_steps=3, every=3))[-1]
    assert_trees_equal(a.state, b.state)


def test_record_holds_unstacked_state_and_properties():
    record = list(make_loop(model=MODEL, n_steps=2, every=2))[-1]
    kernel = record.model_params["Dense_0"]["kernel"]
    assert kernel.shape == (4, 8)
    assert "batch_stats" in record.model_state
    assert record.optimizer_state is record.state.param_states
    assert jax.tree.structure(record.grads) == jax.tree.structure(record.state.params)
    assert record.elapsed_time > 0


def test_eval_loop_returns_metrics_of_the_record():
    loop = make_loop(model=MODEL, n_steps=4, every=4)
    record = loop.next_checkpoint()
    eval_data = toy.batches(3, 8, seed=5)
    evaluate = fs.EvalLoop(
        fs.EvalTask(apply=MODEL.apply, metrics={"loss": toy.mse}, data=eval_data), rng=jax.random.key(1), n_steps=3
    )
    summary = evaluate(record)
    assert isinstance(summary, fs.Summary)
    assert summary.step == 4 and summary.metrics["train"] == {"loss": record.loss}
    variables = {"params": record.state.params, **record.state.flax_mutables}
    expected = np.mean([float(toy.mse(MODEL.apply(variables, x), y)) for x, y in eval_data])
    np.testing.assert_allclose(summary.metrics["eval"]["loss"], expected, rtol=1e-5)


def test_eval_loop_weights_each_batch_by_its_examples(capsys):
    """1,797 digits in batches of 64 end in a batch of 5: it counts as 5 examples, not as 64."""
    loop = make_loop(model=MODEL, n_steps=2, every=2)
    record = loop.next_checkpoint()
    x, y = (np.concatenate(parts) for parts in zip(*toy.batches(3, 8, seed=5), strict=True))
    eval_data = [(x[:8], y[:8]), (x[8:16], y[8:16]), (x[16:19], y[16:19])]  # 8, 8 and a ragged 3
    metrics = {"loss": toy.mse, "close": lambda outputs, targets: (abs(outputs - targets) < 1.0).mean()}
    evaluate = fs.EvalLoop(fs.EvalTask(apply=MODEL.apply, metrics=metrics, data=eval_data), rng=0, n_steps=3)
    summary = evaluate(record)
    outputs = MODEL.apply({"params": record.state.params, **record.state.flax_mutables}, x[:19])
    np.testing.assert_allclose(summary.metrics["eval"]["loss"], float(toy.mse(outputs, y[:19])), rtol=1e-5)
    np.testing.assert_allclose(summary.metrics["eval"]["close"], float((abs(outputs - y[:19]) < 1.0).mean()))


def test_stdout_shows_size_and_progress(capsys, monkeypatch):
    # rich's width without a terminal: 80 columns truncated the line before its "4/4" under pytest-xdist
    monkeypatch.setenv("COLUMNS", "160")
    data = toy.batches(4, 8)
    task = fs.TrainTask(apply=MLP.apply, optimizer=optax.sgd(0.1), loss=toy.mse, data=data)
    list(fs.TrainLoop(MLP.init, task, jax.random.key(0), n_steps=4, n_steps_per_checkpoint=2, stdout=True))
    out = capsys.readouterr().out
    assert "Total number of trainable weights: 97" in out
    assert "4/4" in out and "loss" in out
    task = fs.TrainTask(apply=MLP.apply, optimizer=optax.sgd(0.1), loss=toy.mse, data=data)
    list(fs.TrainLoop(MLP.init, task, jax.random.key(0), n_steps=4, stdout=False))
    assert capsys.readouterr().out == ""


# Bad input: each raises a clear error before any work is lost.


def test_checkpoint_interval_must_be_a_multiple_of_steps_per_dispatch():
    with pytest.raises(
        ValueError, match=r"n_steps_per_checkpoint \(6\) must be a multiple of n_steps_per_dispatch \(4\)"
    ):
        make_loop(every=6, per_dispatch=4)


def test_empty_data_names_the_task():
    with pytest.raises(ValueError, match="TrainTask.data is empty"):
        make_loop(data=[])


def test_data_that_runs_out_names_the_step():
    loop = make_loop(data=toy.batches(3, 8), n_steps=5, every=1)
    assert [loop.next_checkpoint().step for _ in range(3)] == [1, 2, 3]
    with pytest.raises(ValueError, match="ran out after 3 batches, at step 4"):
        loop.next_checkpoint()
    # Batches fetched ahead of use, and several steps a dispatch, still name the step that lacks one.
    loop = make_loop(data=toy.batches(7, 8), n_steps=12, every=12, per_dispatch=2)
    with pytest.raises(ValueError, match="ran out after 7 batches, at step 8"):
        loop.next_checkpoint()


def test_wrong_batch_structure_shows_the_accepted_forms():
    x = np.ones((8, 4), np.float32)
    with pytest.raises(ValueError, match=r"wrong structure: \(array\[8, 4\], array\[8, 4\], array\[8, 4\]\).*\(x, y\)"):
        make_loop(data=[(x, x, x)])
    with pytest.raises(ValueError, match=r"wrong structure: \(array\[8, 4\], \(array\[8, 4\], str\)\)"):
        make_loop(data=[(x, (x, "y"))])


def test_loss_that_is_not_a_scalar():
    loop = make_loop(loss=lambda o, y: (o - y) ** 2)
    with pytest.raises(ValueError, match=r"TrainTask.loss returned an array of shape \(8,\)"):
        loop.next_checkpoint()


def test_non_finite_loss_names_the_step_and_yields_nothing_after_it():
    data = toy.batches(12, 8)
    x, y = data[5]
    data[5] = (x, np.full_like(y, np.nan))
    loop = make_loop(data=data, n_steps=12, every=4, optimizer=optax.sgd(0.01))
    assert loop.next_checkpoint().step == 4
    with pytest.raises(FloatingPointError, match="non-finite .* at step 6"):
        loop.next_checkpoint()


def test_a_ragged_last_batch_with_several_steps_a_dispatch_names_the_steps_and_shapes():
    data = toy.batches(7, 8) + toy.batches(1, 5, seed=9)
    loop = make_loop(data=data, n_steps=8, every=4, per_dispatch=4)
    assert loop.next_checkpoint().step == 4
    with pytest.raises(ValueError) as error:
        loop.next_checkpoint()
    message = str(error.value)
    assert "steps 5-8" in message and "step 5 has [[8, 4], [8]]" in message and "step 8 has [[5, 4], [5]]" in message
    assert "drop_remainder=True" in message and "n_steps_per_dispatch=1" in message


def test_an_int_rng_is_a_seed_and_anything_else_is_refused():
    task = fs.TrainTask(apply=MODEL.apply, optimizer=optax.adam(1e-2), loss=toy.mse, data=toy.batches(4, 8))
    by_seed = fs.TrainLoop(MODEL.init, task, rng=0, n_steps=4, n_steps_per_checkpoint=4, stdout=False)
    by_key = fs.TrainLoop(MODEL.init, task, rng=jax.random.key(0), n_steps=4, n_steps_per_checkpoint=4, stdout=False)
    assert_trees_equal(list(by_seed)[-1].state, list(by_key)[-1].state)
    with pytest.raises(TypeError, match="rng must be a random key .* or an int seed, got str"):
        fs.TrainLoop(MODEL.init, task, rng="0", n_steps=4, stdout=False)


def test_every_record_carries_the_runs_id_and_a_new_run_gets_a_new_one():
    first, second = make_loop(n_steps=4), make_loop(n_steps=4)
    assert first.run_id != second.run_id and len(first.run_id) == 12
    assert {record.run_id for record in first} == {first.run_id}


def test_next_step_and_iteration_share_one_position():
    loop = make_loop(n_steps=8, every=2)
    iterator = iter(loop)
    assert next(iterator).step == 2
    loop.next_step()
    assert loop.step == 3
    assert [record.step for record in loop] == [4, 6, 8]  # plain methods: no private generator to break


def slow_batches(batches, seconds):
    """Yields the batches in a cycle, sleeping `seconds` before each (a slow input pipeline)."""
    while True:
        for batch in batches:
            time.sleep(seconds)
            yield batch


@pytest.mark.parametrize("per_dispatch", [1, 3])
def test_records_carry_the_time_waiting_for_data_and_the_bar_says_input_bound(capsys, per_dispatch):
    data = slow_batches(toy.batches(4, 8), 0.05)
    task = fs.TrainTask(apply=MLP.apply, optimizer=optax.sgd(0.1), loss=toy.mse, data=data)
    loop = fs.TrainLoop(
        MLP.init, task, rng=0, n_steps=12, n_steps_per_checkpoint=6, n_steps_per_dispatch=per_dispatch, stdout=True
    )
    records = list(loop)
    # Six batches a record, each drawn after a 50 ms sleep (the first record's first was drawn by the
    # constructor, to see the data's shapes: not within the record's time).
    for record, n_drawn in zip(records, [5, 6], strict=True):
        assert n_drawn * 0.05 <= record.data_time <= record.idle_time <= record.elapsed_time
    assert records[-1].data_fraction > 0.5  # the first record's time has the compilation in it
    assert "input-bound: " in capsys.readouterr().out
    fast = fs.TrainTask(apply=MLP.apply, optimizer=optax.sgd(0.1), loss=toy.mse, data=toy.batches(12, 8))
    records = list(fs.TrainLoop(MLP.init, fast, rng=0, n_steps=12, n_steps_per_checkpoint=6, stdout=True))
    assert all(0 < record.data_time < record.elapsed_time for record in records)
    assert "input-bound" not in capsys.readouterr().out


class HeavyMLP(nn.Module):
    """toy.MLP with a chain of 512x512 matmuls beside it: a step that keeps the devices busy."""

    @nn.compact
    def __call__(self, x):
        w = self.param("w", nn.initializers.normal(0.05), (512, 512))
        h = w
        for _ in range(8):
            h = jnp.tanh(h @ w)
        return toy.MLP()(x) + 1e-6 * jnp.mean(h)


def test_batches_drawn_while_the_devices_compute_are_not_counted_as_waiting(capsys):
    """Draws a fifth as long as a step overlap the devices' work: not counted, not input-bound."""
    model = HeavyMLP()

    def records(data, n_steps):
        task = fs.TrainTask(apply=model.apply, optimizer=optax.sgd(0.1), loss=toy.mse, data=data)
        loop = fs.TrainLoop(model.init, task, rng=0, n_steps=n_steps, n_steps_per_checkpoint=12, stdout=True)
        return list(loop)

    step_time = records(toy.batches(4, 8) * 6, 24)[-1].elapsed_time / 12  # compiled: the devices' time a step
    draw_time = step_time / 5
    slow = records(slow_batches(toy.batches(4, 8), draw_time), 24)
    # Of a record's 12 draws, only those before its first dispatch (PREFETCH: two) find the devices idle.
    assert all(record.data_time < 6 * draw_time for record in slow)
    assert all(record.data_fraction < 0.25 and record.idle_fraction < 0.25 for record in slow)
    assert "input-bound" not in capsys.readouterr().out


def test_a_records_time_runs_until_the_devices_finish_its_steps():
    """The host dispatches ahead of busy devices; the record's time still covers their work."""
    model = HeavyMLP()
    task = fs.TrainTask(apply=model.apply, optimizer=optax.sgd(0.1), loss=toy.mse, data=toy.batches(4, 8) * 12)
    loop = fs.TrainLoop(model.init, task, rng=0, n_steps=48, n_steps_per_checkpoint=24, n_steps_per_dispatch=4)
    loop.next_checkpoint()  # compiled
    start = time.perf_counter()
    record = loop.next_checkpoint()
    wall = time.perf_counter() - start
    assert 0.8 * wall <= record.elapsed_time <= wall


@pytest.mark.parametrize("per_dispatch", [1, 4])
def test_the_host_never_waits_for_the_devices_between_records(tmp_path, per_dispatch):
    """With a slow step, the host draws each batch while the devices still compute the last dispatch.

    A loop that waited on the devices anywhere between two records (a loss read, a flag, a copy) would
    find its newest state ready at every draw. Writers and an evaluation run at the records.
    """
    model = HeavyMLP()
    holder = {}
    computing = []

    def watched(batches):
        while True:
            for batch in batches:
                loop = holder.get("loop")
                if loop is not None and loop._runner.leaves:
                    computing.append(not loop._runner.leaves[0].is_ready())
                yield batch

    task = fs.TrainTask(apply=model.apply, optimizer=optax.sgd(0.1), loss=toy.mse, data=watched(toy.batches(4, 8)))
    loop = fs.TrainLoop(
        model.init, task, rng=0, n_steps=72, n_steps_per_checkpoint=24, n_steps_per_dispatch=per_dispatch, stdout=False
    )
    chain = redex.combinator.serial(
        fs.EvalLoop(fs.EvalTask(apply=model.apply, metrics={"mse": toy.mse}, data=toy.batches(2, 8)), rng=0, n_steps=2),
        fs.CheckpointFileWriter(tmp_path / "run"),
    )
    chain(loop.next_checkpoint())  # compiled
    holder["loop"] = loop
    for record in loop:
        chain(record)
    assert len(computing) == 48
    # Only the draws before a segment's first dispatch (PREFETCH dispatches' batches) find the record's state,
    # which the record waited for; every later draw overlaps the devices' work.
    ready = computing.count(False)
    assert ready <= 2 * segment.PREFETCH * per_dispatch, f"{ready} of 48 draws found the devices done"
