"""The tests' shared cluster (`flaxstate_testing/cluster.py`): joined once, reused, put back, restarted on a fault.

Tier 2 (tests/README.md): tests that start, kill or signal processes of their own, or run servers or commands.

Each test starts a cluster of its own (not the session's), so that its faults and its count of starts are its own.
"""

import re

import pytest
from flaxstate_testing.cluster import Cluster


def found(output: str) -> dict[str, str]:
    line = next(line for line in output.splitlines() if line.startswith("found "))
    return dict(re.findall(r"(\w+)=(\S+)", line))


@pytest.fixture
def two():
    cluster = Cluster(2)
    try:
        yield cluster
    finally:
        cluster.close()


def test_scripts_run_on_the_same_joined_processes_and_find_what_an_earlier_one_changed_put_back(two):
    first = [found(output) for output in two.run("probe", {"dirty": True}, timeout=120)]
    second = [found(output) for output in two.run("probe", {}, timeout=120)]
    assert [each["process"] for each in first] == ["0", "1"] and {each["count"] for each in first} == {"2"}
    assert [each["pid"] for each in second] == [each["pid"] for each in first]  # the same processes
    for each in second:  # the first script's environment variable, JAX setting, handler and signal are gone
        assert each["environment"] == "None" and each["log_compiles"] == "False", each
        assert each["handlers"] == first[0]["handlers"] and each["sigterm"] == "True", each
    assert two.starts == 1


@pytest.mark.parametrize("fault", ["raise_on", "hang_on"])
def test_a_script_that_fails_or_hangs_fails_with_every_process_s_output_and_the_next_meets_new_processes(two, fault):
    before = [found(output)["pid"] for output in two.run("probe", {}, timeout=120)]
    with pytest.raises(AssertionError) as failed:
        two.run("probe", {fault: 1}, timeout=10)
    message = str(failed.value)
    assert "--- process 0 (" in message and "--- process 1 (" in message
    assert "found process=0" in message and "found process=1" in message  # as far as each came
    if fault == "raise_on":
        assert "RuntimeError: the planned failure of process 1" in message
    else:
        assert "--- process 1 (no answer)" in message
    after = [found(output) for output in two.run("probe", {}, timeout=120)]
    assert two.starts == 2 and not {each["pid"] for each in after} & set(before)
    assert [each["process"] for each in after] == ["0", "1"]
