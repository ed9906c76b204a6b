"""The loop's options, checked once: the schedule of records and dispatches, record memory and peak FLOP/s."""

import pytest

from flaxstate.training.options import Schedule, check_peak_flops, check_record_memory


def test_the_schedule_takes_records_every_n_steps_and_at_the_last_with_k_steps_a_dispatch():
    schedule = Schedule(n_steps=10, n_steps_per_checkpoint=4, n_steps_per_dispatch=2, n_microbatches=3)
    assert [schedule.next_record_step(step) for step in (0, 3, 4, 8, 9)] == [4, 4, 8, 10, 10]
    assert schedule.dispatch_sizes(0, 4) == [2, 2]
    assert schedule.dispatch_sizes(8, 10) == [2]
    assert schedule.dispatch_sizes(4, 7) == [2, 1]  # a remainder as single steps


@pytest.mark.parametrize(
    ("options", "named"),
    [
        ({"n_steps": -1}, "n_steps must be an int of at least 0, got -1"),
        ({"n_steps_per_checkpoint": 0}, "n_steps_per_checkpoint must be a positive int, got 0"),
        ({"n_steps_per_dispatch": True}, "n_steps_per_dispatch must be a positive int, got True"),
        ({"n_microbatches": 1.5}, "n_microbatches must be a positive int, got 1.5"),
        (
            {"n_steps_per_checkpoint": 6, "n_steps_per_dispatch": 4},
            r"\(6\) must be a multiple of n_steps_per_dispatch \(4\)",
        ),
    ],
)
def test_a_bad_schedule_is_refused_naming_the_option_and_the_value(options, named):
    with pytest.raises(ValueError, match=named):
        Schedule(**options)


def test_record_memory_and_peak_flops_are_checked_and_a_yaml_string_is_a_number():
    assert check_record_memory("device") == "device"
    with pytest.raises(ValueError, match="record_memory must be one of .*got 'gpu'"):
        check_record_memory("gpu")
    assert check_peak_flops(None) is None
    assert check_peak_flops("989e12") == 989e12  # YAML 1.1 reads 989e12 as a string
    assert check_peak_flops(5) == 5.0
    for bad in (0, -1.0, float("inf"), "fast", True):
        with pytest.raises(ValueError, match="peak_flops_per_device must be a positive FLOP/s figure"):
            check_peak_flops(bad)
