"""TraceWriter: a profiler trace of one record's steps, with the loop's step annotations; no result changes."""

import gzip
import json

import numpy as np
import pytest
from flaxstate_testing.loops import make_loop

import flaxstate as fs


def params_of(loop, chain):
    for record in loop:
        chain(record)
    return fs.tree_paths.flatten(loop.state.state_dict())


def test_a_trace_covers_the_chosen_records_steps_and_changes_no_parameter(tmp_path):
    untraced = params_of(make_loop(n_steps=12, every=4, per_dispatch=2), lambda record: record)
    with fs.TraceWriter(tmp_path, at_step=4) as tracer:
        traced = params_of(make_loop(n_steps=12, every=4, per_dispatch=2), tracer)
    assert tracer.traced_steps == (5, 8) and not tracer.tracing
    assert untraced.keys() == traced.keys()
    for key in untraced:
        np.testing.assert_array_equal(np.asarray(traced[key]), np.asarray(untraced[key]), err_msg=key)
    assert list(tmp_path.glob("plugins/profile/*/*.xplane.pb"))  # where TensorBoard's profile plugin reads
    (perfetto,) = tmp_path.glob("plugins/profile/*/perfetto_trace.json.gz")
    with gzip.open(perfetto, "rt") as trace_file:
        events = json.load(trace_file)
    events = events["traceEvents"] if isinstance(events, dict) else events
    steps = sorted(
        {
            int(event["args"]["step_num"])
            for event in events
            if event.get("name") == "train" and "args" in event and "step_num" in event["args"]
        }
    )
    assert steps == [6, 8]  # the record's two dispatches of two steps, named by the step each ends at


def test_no_trace_starts_at_the_last_record_and_a_bad_step_is_refused(tmp_path):
    with fs.TraceWriter(tmp_path, at_step=12) as tracer:
        params_of(make_loop(n_steps=12, every=4), tracer)
    assert tracer.traced_steps is None and not list(tmp_path.rglob("*.xplane.pb"))
    with pytest.raises(ValueError, match="at_step"):
        fs.TraceWriter(tmp_path, at_step=-1)
