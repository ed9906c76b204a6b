import dataclasses
import logging

import pytest
from flaxstate_testing import deprecations
from flaxstate_testing.checkpoints import records, saved_steps

import flaxstate as fs
from flaxstate.checkpoint import policies
from flaxstate.run_record import ledger


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: fs.EverySeconds(0), "EverySeconds seconds must be a positive number of seconds, got 0"),
        (lambda: fs.EverySeconds("60"), "EverySeconds seconds must be a positive number of seconds, got '60'"),
        (lambda: fs.EverySeconds(float("inf")), "EverySeconds seconds must be a positive number"),
        (lambda: fs.Continuous(-1), "Continuous min_seconds must be a number of seconds, 0 or more, got -1"),
        (lambda: fs.Continuous(True), "Continuous min_seconds must be a number of seconds, 0 or more, got True"),
        (lambda: fs.AutoInterval(mtbf=0), "AutoInterval mtbf must be a positive number of seconds or None, got 0"),
        (lambda: fs.AutoInterval(min_seconds=float("nan")), "AutoInterval min_seconds must be a number of seconds"),
        (lambda: fs.AutoInterval(history=(1, 60.0)), "AutoInterval history must be a RunHistory, a function"),
        (lambda: fs.RunHistory(-1, 0.0), "RunHistory failures must be an int of at least 0, got -1"),
        (lambda: fs.RunHistory(1, -5.0), "RunHistory seconds must be a finite number of seconds, 0 or more"),
    ],
)
def test_a_bad_policy_is_refused_where_it_is_made(make, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        make()


def test_policies_are_frozen_values_with_their_seconds_as_floats():
    policy = fs.AutoInterval(min_seconds=30, mtbf=3600)
    assert (policy.min_seconds, policy.mtbf) == (30.0, 3600.0) and isinstance(policy.min_seconds, float)
    assert policy == fs.AutoInterval(30.0, 3600.0) and hash(policy) == hash(fs.AutoInterval(30.0, 3600.0))
    with pytest.raises(dataclasses.FrozenInstanceError):
        policy.mtbf = 60.0  # type: ignore[misc]
    assert fs.EveryRecord() == fs.EveryRecord() and fs.Continuous() == fs.Continuous(0)


@pytest.mark.parametrize(
    ("keywords", "policy"),
    [
        ({}, fs.EveryRecord()),
        ({"every_seconds": 60}, fs.EverySeconds(60)),
        ({"every": "continuous"}, fs.Continuous()),
        ({"every": "continuous", "min_seconds": 5}, fs.Continuous(5)),
        ({"every": "auto", "min_seconds": 0, "mtbf": 3600}, fs.AutoInterval(0, 3600)),
        ({"every": fs.AutoInterval(mtbf=60)}, fs.AutoInterval(mtbf=60)),
    ],
)
def test_the_old_keywords_build_the_policy_at_the_door(keywords, policy):
    given = {"every": None, "every_seconds": None, "min_seconds": None, "mtbf": None} | keywords
    assert policies.from_keywords("W", **given) == policy


@pytest.mark.parametrize(
    ("given", "named"),
    [
        ({"every": fs.Continuous(), "min_seconds": 5}, "min_seconds=5"),
        ({"every": fs.AutoInterval(), "mtbf": 60}, "mtbf=60"),
        ({"every": fs.EverySeconds(60), "every_seconds": 60}, "every_seconds=60"),
    ],
)
def test_a_policy_with_the_old_keywords_beside_it_is_refused_before_the_directory_is_touched(tmp_path, given, named):
    with pytest.raises(ValueError, match=f"and {named}: the policy says when to save"):
        fs.CheckpointFileWriter(tmp_path / "run", **given)
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    "history", [fs.RunHistory(3, 500.0), lambda: fs.RunHistory(3, 500.0)], ids=["figures", "function"]
)
def test_auto_chooses_from_a_history_handed_over_instead_of_the_ledger_s(tmp_path, caplog, history):
    # A fresh run directory: its ledger knows no failure. The policy's history (3 failures in 500 s before this
    # session) is what the interval comes from, and the ledger's cadence event says so.
    recs = records(n_steps=8, every=2)
    clock = Clock()
    writer = fs.CheckpointFileWriter(tmp_path, keep=10, every=fs.AutoInterval(history=history), clock=clock)
    with caplog.at_level(logging.INFO, logger="flaxstate"):
        writer(recs[0])
        writer.wait()
        clock.now += 10
        writer(recs[1])
        writer(recs[-1])  # the final record: always saved
    writer.close()
    (line,) = [record.message for record in caplog.records if "saving every" in record.message]
    assert "3 in 510 s of running" in line, line
    assert writer.run_history() == fs.RunHistory(0, 0.0)  # the writer's own ledger: no earlier session
    (change,) = [event for event in ledger.read_events(tmp_path / ledger.FILENAME) if event["event"] == "cadence"]
    assert change["failures"] == 3 and change["observed"] == pytest.approx(510.0)
    assert saved_steps(tmp_path)[0] == 2 and saved_steps(tmp_path)[-1] == 8


@pytest.mark.parametrize(
    ("keywords", "old", "new"),
    [
        ({"every_seconds": 60}, "every_seconds= is", fs.EverySeconds(60)),
        ({"every": "continuous"}, "every='continuous' is", fs.Continuous()),
        ({"every": "continuous", "min_seconds": 5}, "every='continuous', min_seconds= are", fs.Continuous(5)),
        ({"every": "auto", "mtbf": 3600}, "every='auto', mtbf= are", fs.AutoInterval(mtbf=3600)),
    ],
)
def test_the_old_keywords_warn_once_a_process_naming_the_policy_that_replaces_them(tmp_path, keywords, old, new):
    with deprecations.fresh() as warned:
        fs.CheckpointFileWriter(tmp_path / "first", **keywords).close()
        fs.CheckpointFileWriter(tmp_path / "second", **keywords).close()  # once a process
        fs.CheckpointFileWriter(tmp_path / "third", every=new).close()  # the policy: no warning
        fs.CheckpointFileWriter(tmp_path / "fourth", every=None).close()  # every record, as ever: no warning
    assert [str(warning.message) for warning in warned] == [
        f"CheckpointFileWriter's {old} deprecated and will be removed in a later release: give every=fs.{new!r} "
        "instead."
    ]
    assert warned[0].filename == __file__  # the user's line, not flaxstate's
    assert eval(f"fs.{new!r}", {"fs": fs}) == new  # what it says to give is the policy the keywords built
