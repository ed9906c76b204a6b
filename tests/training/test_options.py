"""The loop's options, checked once: the schedule of records and dispatches, record memory and peak FLOP/s."""

import inspect

import numpy as np
import pytest

import flaxstate as fs
from flaxstate.training.options import LoopSpec, Schedule, check_peak_flops, check_record_memory, rng_names


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


def test_rng_collections_default_to_params_and_dropout_and_unknown_keys_are_named():
    assert rng_names(None) == (("params", "dropout"), ("dropout",))
    assert rng_names({"apply": ["noise"]}) == (("params",), ("noise",))
    with pytest.raises(ValueError, match=r"plan collections has keys \['train'\]"):
        rng_names({"train": ["dropout"]}, "plan")


def test_every_option_of_the_loop_spec_is_a_keyword_of_the_loop_and_of_the_plan_with_the_same_default():
    # One list: an option added to the spec is a keyword of both doors, or this fails (MaxText plans its dry run
    # from the run's own config; a plan that missed a loop option would compile another program).
    doors = {"TrainLoop": inspect.signature(fs.TrainLoop).parameters, "plan": inspect.signature(fs.plan).parameters}
    defaults = LoopSpec()
    for name in LoopSpec.names():
        for door, parameters in doors.items():
            assert name in parameters, f"{door} has no keyword {name!r} of the loop's spec"
            assert parameters[name].default == getattr(defaults, name), (door, name)


@pytest.mark.parametrize("owner", ["TrainLoop", "plan"])
@pytest.mark.parametrize(
    ("options", "named"),
    [
        ({"n_steps_per_dispatch": 0}, "n_steps_per_dispatch must be a positive int, got 0"),
        ({"n_microbatches": "2"}, "n_microbatches must be a positive int, got '2'"),
        ({"n_microbatches": 2, "max_device_batch": 4}, "got n_microbatches=2 and max_device_batch=4"),
        ({"collections": {"train": ["dropout"]}}, "collections has keys ['train']"),
        ({"record_memory": "disk"}, "record_memory must be one of ('host', 'device'), got 'disk'"),
        ({"record_gradients": "no"}, "record_gradients must be True or False, got 'no'"),
        ({"flops_per_step": -1}, "flops_per_step"),
    ],
)
def test_the_spec_is_checked_once_naming_the_door_that_took_it(owner, options, named):
    with pytest.raises(ValueError) as refused:
        LoopSpec(**options, owner=owner)
    assert named in str(refused.value)
    if named != "flops_per_step":  # throughput's check names the loop's keyword
        assert str(refused.value).startswith(owner), str(refused.value)


def test_a_spec_s_numbers_from_a_config_are_python_ints_and_a_yaml_flops_string_a_float():
    spec = LoopSpec(n_steps_per_dispatch=np.int64(10), n_microbatches=np.int32(2), flops_per_step="1e9")
    assert (spec.n_steps_per_dispatch, spec.n_microbatches, spec.flops_per_step) == (10, 2, 1e9)
    assert type(spec.n_steps_per_dispatch) is int and spec == LoopSpec(
        n_steps_per_dispatch=10, n_microbatches=2, flops_per_step=1e9
    )
    assert spec.init_names == ("params", "dropout") and spec.apply_names == ("dropout",)
