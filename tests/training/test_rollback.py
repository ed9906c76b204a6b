"""`TrainLoop(rollback=fs.Rollback())`: on a bad loss every process goes back to the last good state, skips the bad
batches and trains on, as a run that never saw them."""

import dataclasses

import grain
import jax
import numpy as np
import optax
import pytest
from flax import nnx
from flaxstate_testing import nnx_models, toy

import flaxstate as fs
from flaxstate.run_record import goodput, ledger

KINDS = ["linen", "nnx"]


def model_of(kind):
    if kind == "linen":
        model = toy.MLP()
        return model.init, model.apply
    model = nnx_models.MLP(nnx.Rngs(0))
    return model, model


def loop_of(kind, data, n_steps, every=5, optimizer=None, **options):
    init, apply = model_of(kind)
    task = fs.TrainTask(apply=apply, optimizer=optimizer or optax.adam(1e-2), loss=toy.mse, data=data)
    return fs.TrainLoop(init, task, 0, n_steps=n_steps, n_steps_per_checkpoint=every, stdout=False, **options)


def poisoned(n_batches, bad, seed=0):
    """`toy.batches` with inf inputs at the (0-based) batches `bad`."""
    data = toy.batches(n_batches, 8, seed=seed)
    for index in bad:
        x, y = data[index]
        data[index] = (np.full_like(x, np.inf), y)
    return data


def leaves(state):
    return [np.asarray(leaf) for leaf in jax.tree.leaves(state.params)]


def assert_same_bits(a, b):
    for left, right in zip(leaves(a), leaves(b), strict=True):
        np.testing.assert_array_equal(left, right)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(
    "options",
    [{}, {"n_steps_per_dispatch": 5}, {"n_microbatches": 2}],
    ids=["one step a dispatch", "5 steps a dispatch", "2 microbatches"],
)
def test_a_poisoned_batch_rolls_back_to_the_last_record_and_trains_as_a_run_without_the_bad_span(kind, options):
    # Records every 5 steps; the batch of step 8 is poisoned (inf inputs): the run goes back to step 5, skips the
    # batches of steps 6 to 8, and ends as a run that never had them, bit for bit.
    data = poisoned(40, bad=[7])
    records = list(loop_of(kind, data, n_steps=20, rollback=fs.Rollback(), **options))
    assert [record.step for record in records] == [5, 10, 15, 20]
    rolled = {"at_step": 8, "to_step": 5, "reason": "nonfinite", "skipped_steps": [6, 7, 8]}
    assert [list(record.rollbacks) for record in records] == [[], [rolled], [rolled], [rolled]]
    assert records[-1].data_position["n_batches"] == 23 and records[-1].data_position["rollbacks"] == [rolled]
    assert all(np.isfinite(record.loss) for record in records)
    assert records[1].timing.rolled_back_time > 0 and records[2].timing.rolled_back_time == 0
    without = [batch for index, batch in enumerate(data) if index not in (5, 6, 7)]
    reference = list(loop_of(kind, without, n_steps=20, **options))
    assert_same_bits(records[-1].state, reference[-1].state)
    again = list(loop_of(kind, data, n_steps=20, rollback=fs.Rollback(), **options))
    assert_same_bits(again[-1].state, records[-1].state)  # a deterministic rerun: the same bits


def arrays_without(rows_of_batches, x, y):
    keep = np.ones(len(x), bool)
    for index in rows_of_batches:
        keep[index * 8 : (index + 1) * 8] = False
    return x[keep], y[keep]


DATA = {
    "global_batches": lambda x, y: fs.global_batches((x, y), batch_size=8, shuffle=False),
    "grain": lambda x, y: grain.MapDataset.source(list(zip(x, y, strict=True))).batch(8),
}


@pytest.mark.parametrize("source", sorted(DATA))
def test_data_addressed_by_step_or_with_an_iterator_state_skips_exactly_the_bad_span(source):
    x = np.concatenate([batch[0] for batch in toy.batches(40, 8)])
    y = np.concatenate([batch[1] for batch in toy.batches(40, 8)])
    poisoned_x = x.copy()
    poisoned_x[7 * 8 : 8 * 8] = np.inf  # the batch of step 8
    records = list(loop_of("linen", DATA[source](poisoned_x, y), n_steps=20, rollback=fs.Rollback()))
    assert records[-1].rollbacks == ({"at_step": 8, "to_step": 5, "reason": "nonfinite", "skipped_steps": [6, 7, 8]},)
    reference = list(loop_of("linen", DATA[source](*arrays_without([5, 6, 7], x, y)), n_steps=20))
    assert_same_bits(records[-1].state, reference[-1].state)


def test_without_a_rollback_the_bad_step_still_ends_the_run():
    loop = loop_of("linen", poisoned(20, bad=[7]), n_steps=20)
    assert loop.next_checkpoint().step == 5
    with pytest.raises(FloatingPointError, match="non-finite .* at step 8"):
        loop.next_checkpoint()


@pytest.mark.parametrize("kind", KINDS)
def test_more_bad_spans_than_max_rollbacks_raise_naming_the_rollbacks_made(kind):
    loop = loop_of(kind, poisoned(40, bad=[2, 13]), n_steps=20, rollback=fs.Rollback(max_rollbacks=1))
    assert loop.next_checkpoint().rollbacks == (
        {"at_step": 3, "to_step": 0, "reason": "nonfinite", "skipped_steps": [1, 2, 3]},
    )
    assert loop.next_checkpoint().step == 10
    # Step 11 trains batch 14 (0-based 13): the second bad span.
    with pytest.raises(
        FloatingPointError, match=r"at step 11, after 1 rollbacks .*max_rollbacks=1.*at step 3 to step 0"
    ):
        loop.next_checkpoint()


def test_a_spike_rolls_back_and_scales_the_learning_rate_where_the_optimizer_injects_it():
    data = toy.batches(40, 8)
    x, y = data[11]
    data[11] = (x, y * 1e4)  # step 12: a finite loss far above the median of the 8 before it
    optimizer = optax.inject_hyperparams(optax.adam)(learning_rate=1e-2)
    policy = fs.Rollback(spike=10.0, window=8, lr_scale=0.5)
    records = list(loop_of("linen", data, n_steps=20, optimizer=optimizer, rollback=policy))
    assert records[-1].rollbacks == ({"at_step": 12, "to_step": 10, "reason": "spike", "skipped_steps": [11, 12]},)
    rate = records[-1].state.param_states.hyperparams["learning_rate"]
    assert rate == np.float32(0.5e-2) and records[0].state.param_states.hyperparams["learning_rate"] == np.float32(1e-2)
    unarmed = list(loop_of("linen", data, n_steps=20, optimizer=optimizer, rollback=fs.Rollback()))
    assert unarmed[-1].rollbacks == ()  # a finite spike is not bad without spike=


def test_a_one_shot_iterator_cannot_go_back_so_the_record_s_whole_span_is_skipped(caplog):
    data = poisoned(40, bad=[7])
    records = list(loop_of("linen", iter(data), n_steps=15, rollback=fs.Rollback()))
    assert records[-1].rollbacks == (
        {"at_step": 8, "to_step": 5, "reason": "nonfinite", "skipped_steps": [6, 7, 8, 9, 10]},
    )
    assert "one-shot iterator, which cannot go back" in caplog.text
    without = data[:5] + data[10:]
    assert_same_bits(records[-1].state, list(loop_of("linen", without, n_steps=15))[-1].state)


def test_a_resume_from_a_checkpoint_after_a_rollback_skips_the_same_batches_and_ends_bit_for_bit(tmp_path):
    data = poisoned(40, bad=[7])
    uninterrupted = list(loop_of("linen", data, n_steps=20, rollback=fs.Rollback()))
    with fs.CheckpointFileWriter(tmp_path / "run") as writer:
        for record in loop_of("linen", data, n_steps=20, rollback=fs.Rollback()):
            writer(record)
            if record.step == 15:
                break  # the process stops after the rollback's records were saved
    init, apply = model_of("linen")
    task = fs.TrainTask(apply=apply, optimizer=optax.adam(1e-2), loss=toy.mse, data=data)
    reader = fs.CheckpointFileReader(tmp_path / "run", target=init)
    resumed = fs.TrainLoop(reader, task, 0, n_steps=20, n_steps_per_checkpoint=5, stdout=False, rollback=fs.Rollback())
    (last,) = list(resumed)
    assert last.rollbacks == uninterrupted[-1].rollbacks
    assert_same_bits(last.state, uninterrupted[-1].state)
    # The ledger keeps the rollback (once, though later records list it too) and goodput its thrown-away time.
    events = ledger.read_events(tmp_path / "run" / ledger.FILENAME)
    assert [event["at_step"] for event in events if event["event"] == "rollback"] == [8]
    first = goodput.report(events)["sessions"][0]
    assert first["rolled_back"] > 0
    assert first["productive"] + sum(first[name] for name in goodput.BUCKETS) == pytest.approx(first["wall_time"])


def test_a_resume_judges_its_first_steps_against_the_losses_before_it_as_the_run_did(tmp_path):
    # A spike at step 12 with a window of 8: a run resumed at step 10 knows the 8 losses before it (saved with the
    # checkpoint), so it finds the same spike and ends where the uninterrupted run ends.
    data = toy.batches(40, 8)
    x, y = data[11]
    data[11] = (x, y * 1e4)
    policy = fs.Rollback(spike=10.0, window=8)
    uninterrupted = list(loop_of("linen", data, n_steps=20, rollback=policy))
    assert uninterrupted[-1].rollbacks[0]["reason"] == "spike"
    with fs.CheckpointFileWriter(tmp_path / "run") as writer:
        for record in loop_of("linen", data, n_steps=10, rollback=policy):
            writer(record)
    assert len(record.data_position["loss_window"]) == 8 and None not in record.data_position["loss_window"]
    init, apply = model_of("linen")
    task = fs.TrainTask(apply=apply, optimizer=optax.adam(1e-2), loss=toy.mse, data=data)
    reader = fs.CheckpointFileReader(tmp_path / "run", target=init)
    resumed = list(fs.TrainLoop(reader, task, 0, n_steps=20, n_steps_per_checkpoint=5, stdout=False, rollback=policy))
    assert resumed[-1].rollbacks == uninterrupted[-1].rollbacks
    assert_same_bits(resumed[-1].state, uninterrupted[-1].state)


def test_bad_rollback_settings_are_refused_before_any_training():
    for made, message in [
        (lambda: fs.Rollback(spike=1.0), "Rollback spike must be a factor above 1"),
        (lambda: fs.Rollback(max_rollbacks=-1), "Rollback max_rollbacks"),
        (lambda: fs.Rollback(window=0), "Rollback window"),
        (lambda: fs.Rollback(lr_scale=2.0), r"Rollback lr_scale must be a number in \(0, 1\]"),
        (lambda: loop_of("linen", toy.batches(4, 8), 4, rollback=3), "TrainLoop rollback must be a fs.Rollback"),
        (
            lambda: loop_of("linen", toy.batches(4, 8), 4, rollback=fs.Rollback(lr_scale=0.5)),
            r"Build the optimizer with optax.inject_hyperparams",
        ),
    ]:
        with pytest.raises(ValueError, match=message):
            made()
    assert dataclasses.replace(fs.Rollback(), spike=2).spike == 2.0


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("source", ["list", "global_batches"])
def test_a_second_bad_batch_before_the_next_record_skips_on_from_the_first_rollback_s_skip(kind, source):
    # Records every 10 steps from step 4 on... every 4: a nan at batch 5 (step 6) goes back to step 4 and skips
    # batches 4-5; step 8 then trains batch 9, also bad: back to step 4 again, skipping batches 6-9 of the data as
    # it stands after the first skip. The run ends as one on data without batches 4-9, bit for bit.
    x = np.concatenate([batch[0] for batch in toy.batches(40, 8)])
    y = np.concatenate([batch[1] for batch in toy.batches(40, 8)])
    poisoned_x = x.copy()
    for bad in (5, 9):
        poisoned_x[bad * 8 : (bad + 1) * 8] = np.inf
    make = {
        "list": lambda x, y: [(x[i : i + 8], y[i : i + 8]) for i in range(0, len(x), 8)],
        "global_batches": lambda x, y: fs.global_batches((x, y), batch_size=8, shuffle=False),
    }[source]
    records = list(loop_of(kind, make(poisoned_x, y), n_steps=16, every=4, rollback=fs.Rollback(max_rollbacks=2)))
    assert [record.step for record in records] == [4, 8, 12, 16]
    assert records[-1].rollbacks == (
        {"at_step": 6, "to_step": 4, "reason": "nonfinite", "skipped_steps": [5, 6]},
        {"at_step": 8, "to_step": 4, "reason": "nonfinite", "skipped_steps": [5, 6, 7, 8]},
    )
    assert records[-1].data_position["n_batches"] == 16 + 6
    reference = list(loop_of(kind, make(*arrays_without(range(4, 10), x, y)), n_steps=16, every=4))
    assert_same_bits(records[-1].state, reference[-1].state)


def test_a_spike_is_a_rise_above_the_median_whatever_the_loss_s_sign():
    # A smooth loss of mse - 100 (all < 0) never spikes; the same loss with one batch's targets far off does, at
    # the step a positive loss with the same rise would.
    def shifted(predictions, targets):
        return toy.mse(predictions, targets) - 100.0

    def loop(data):
        init, apply = model_of("linen")
        task = fs.TrainTask(apply=apply, optimizer=optax.adam(1e-2), loss=shifted, data=data)
        policy = fs.Rollback(spike=3.0, window=4)
        return fs.TrainLoop(init, task, 0, n_steps=20, n_steps_per_checkpoint=5, stdout=False, rollback=policy)

    data = toy.batches(40, 8)
    assert list(loop(data))[-1].rollbacks == ()
    x, y = data[11]
    data[11] = (x, y + 1e3)  # step 12: a rise of about 1e6 above a median near -99
    assert list(loop(data))[-1].rollbacks == (
        {"at_step": 12, "to_step": 10, "reason": "spike", "skipped_steps": [11, 12]},
    )


def test_data_that_runs_out_after_a_rollback_names_the_loop_s_step_and_the_batches_skipped():
    loop = loop_of("linen", poisoned(12, bad=[7]), n_steps=20, rollback=fs.Rollback())
    ran_out = (
        r"ran out after 12 batches \(3 of them skipped by rollbacks\), at step 10 \(drawn ahead: the loop stands at"
    )
    with pytest.raises(ValueError, match=ran_out + r" step 8\);"):
        list(loop)
    assert loop.step == 8
