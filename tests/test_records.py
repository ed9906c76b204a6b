"""The records a loop yields: times, memory and fingerprints as sub-records, made and read by their old names."""

import dataclasses

import pytest

import flaxstate as fs


def record(**changes):
    base = fs.Checkpoint(state=None, grads=None, loss=0.5, n_completed_steps=10, elapsed_time=2.0, step=10)
    return dataclasses.replace(base, **changes)


def test_a_record_s_times_and_throughput_are_one_sub_record_and_read_by_their_old_names_too():
    timing = fs.Timing(data_time=0.5, idle_time=0.8, compile_time=1.0, flops_per_step=1e9, n_devices=2)
    made = record(timing=timing, batch_size=32, peak_flops=4e9)
    assert made.timing == dataclasses.replace(timing, batch_size=32, peak_flops=4e9)
    assert (made.data_time, made.idle_time, made.compile_time) == (0.5, 0.8, 1.0)
    assert (made.batch_size, made.peak_flops, made.n_devices) == (32, 4e9, 2)
    assert made.training_time == 1.0 and made.steps_per_second == 10.0 and made.examples_per_second == 320.0
    assert made.mfu == pytest.approx(1e9 * 10 / 4e9)
    assert made.data_fraction == 0.25
    assert {field.name for field in dataclasses.fields(fs.Timing)} == set(fs.records.TIMING_FIELDS)
    assert not set(fs.records.TIMING_FIELDS) & {field.name for field in dataclasses.fields(fs.Checkpoint)}


def test_code_written_before_the_grouping_still_makes_and_replaces_records_by_the_old_names():
    old_style = fs.Checkpoint(
        state=None, grads=None, loss=0.5, n_completed_steps=10, elapsed_time=2.0, step=10, data_time=0.25
    )
    assert old_style.timing.data_time == 0.25 and old_style.timing.idle_time == 0.0
    replaced = dataclasses.replace(old_style, idle_time=1.5)
    assert (replaced.data_time, replaced.idle_time) == (0.25, 1.5)  # the other times kept
    summary = replaced.with_metrics({"eval": {"acc": 0.9}})
    assert isinstance(summary, fs.Summary) and summary.timing == replaced.timing
    assert (
        fs.Summary(
            state=None, grads=None, loss=0.1, n_completed_steps=1, elapsed_time=1.0, step=1, n_devices=4
        ).n_devices
        == 4
    )
    with pytest.raises(TypeError):
        record(data_tme=1.0)  # a misspelt name is refused, not dropped
    with pytest.raises(dataclasses.FrozenInstanceError):
        replaced.timing.data_time = 3.0  # type: ignore[misc]


FLAT = {
    "memory": (fs.Memory, {"device_memory_peak": 2**33, "host_memory": 3 * 2**30, "host_memory_peak": 4 * 2**30}),
    "fingerprints": (fs.Fingerprints, {"state_fingerprint": "00ff" * 4, "data_fingerprint": "abcd" * 4}),
}


@pytest.mark.parametrize("group", sorted(FLAT))
def test_a_record_s_memory_and_fingerprints_are_sub_records_made_and_read_by_their_flat_names(group):
    kind, flat = FLAT[group]
    by_flat_name = fs.Checkpoint(
        state=None, grads=None, loss=0.5, n_completed_steps=10, elapsed_time=2.0, step=10, **flat
    )
    grouped = record(**{group: kind(*flat.values())})
    assert by_flat_name == grouped and getattr(grouped, group) == kind(*flat.values())
    assert {name: getattr(grouped, name) for name in flat} == flat
    assert not set(flat) & {field.name for field in dataclasses.fields(fs.Checkpoint)}
    first, *rest = flat
    replaced = dataclasses.replace(grouped, **{first: None})
    assert getattr(replaced, first) is None and all(getattr(replaced, name) == flat[name] for name in rest)
    summary = replaced.with_metrics({"eval": {"acc": 0.9}})
    assert getattr(summary, group) == getattr(replaced, group)
    assert record() == record(**{group: kind()}) and all(getattr(record(), name) is None for name in flat)
    with pytest.raises(dataclasses.FrozenInstanceError):
        setattr(getattr(grouped, group), dataclasses.fields(kind)[0].name, None)
