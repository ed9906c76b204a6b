"""Each resume's verdict from a ledger's records: bit for bit, or the first step that differs and why."""

from flaxstate.run_record import audit


def session(n, restored=None, restored_fp=None):
    return {
        "event": "session",
        "time": float(n),
        "pid": n,
        "startup": 0.0,
        "restored_step": restored,
        "restored_fp": restored_fp,
        "run_id": "run",
    }


def record(step, state, data, steps=5):
    return {
        "event": "record",
        "step": step,
        "steps": steps,
        "from": step - steps,
        "state_fp": state,
        "data_fp": data,
        "time": float(step),
        "run_id": "run",
    }


FIRST = [session(1), *(record(step, f"s{step}", f"d{step}") for step in (5, 10, 15, 20))]


def test_a_replay_of_the_same_bits_is_bit_exact_and_a_resume_from_the_newest_step_replays_nothing():
    events = [
        *FIRST,
        session(2, 10, "s10"),
        record(15, "s15", "d15"),
        record(20, "s20", "d20"),
        record(25, "s25", "d25"),
        session(3, 25, "s25"),
        record(30, "s30", "d30"),
    ]
    first, second = audit.resumes(events)
    assert first.to_json() == {
        "session": 2,
        "from_step": 10,
        "replayed": [11, 20],
        "verdict": "bit-exact",
        "first_different_step": None,
        "against": None,
        "compared": 2,
        "not_compared": 0,
        "programs": None,
    }
    assert first.line() == "resume audit: steps 11-20 replayed bit for bit" and not first.differs
    assert second.verdict == "nothing replayed" and second.replayed is None
    assert audit.resumes(FIRST) == []  # never resumed


def test_a_resume_that_compiled_its_programs_anew_says_so_after_its_verdict():
    def resumed(programs):
        start = {**session(2, 10, "s10"), "programs": programs}
        return audit.resumes([*FIRST, start, record(15, "s15", "d15"), record(20, "s21", "d20")])[0]

    compiled, cached = resumed("compiled"), resumed("cache")
    assert compiled.line() == (
        "resume audit: step 20 differs from session 1: the batches are the same and the state differs "
        "(a changed program, settings or nondeterminism); its programs were compiled anew, not loaded from the "
        "compilation cache"
    )
    assert compiled.to_json()["programs"] == "compiled" and compiled.verdict == cached.verdict == "state differs"
    assert "compiled anew" not in cached.line() and cached.to_json()["programs"] == "cache"
    nothing = audit.resumes([*FIRST, {**session(2, 20, "s20"), "programs": "compiled"}])[0]
    assert nothing.verdict == "nothing replayed" and "compiled anew" not in nothing.line()


def test_the_first_differing_step_is_named_with_the_data_before_the_state():
    data = audit.resumes([*FIRST, session(2, 10, "s10"), record(15, "s15", "d15"), record(20, "other", "other")])
    assert (data[0].verdict, data[0].first_different_step, data[0].against) == ("data differs", 20, 1)
    assert data[0].line() == "resume audit: step 20 differs from session 1: the batches differ (data position)"
    state = audit.resumes([*FIRST, session(2, 10, "s10"), record(15, "x15", "d15"), record(20, "x20", "d20")])
    assert (state[0].verdict, state[0].first_different_step, state[0].replayed) == ("state differs", 15, (11, 15))
    assert "the batches are the same and the state differs" in state[0].line() and state[0].differs


def test_a_restored_state_that_differs_from_the_one_saved_is_named_before_any_step():
    (resume,) = audit.resumes([*FIRST, session(2, 10, "partial"), record(15, "x15", "d15")])
    assert (resume.verdict, resume.first_different_step) == ("state differs", 10)
    assert "the restored state differs from the one saved" in resume.line()


def test_records_over_other_steps_compare_the_state_only_and_the_newest_earlier_session_is_the_reference():
    # Session 2 records every 10 steps: its record of step 20 covers 11-20, session 1's 16-20.
    events = [*FIRST, session(2, 10, "s10"), record(20, "s20", "other", steps=10)]
    assert audit.resumes(events)[0].verdict == "bit-exact"
    (resume,) = audit.resumes([*FIRST, session(2, 10, "s10"), record(20, "x20", "d20", steps=10)])
    assert resume.verdict == "state differs" and "were not compared" in resume.line()
    # Session 3 replays what session 2 retrained (differently): it is compared with session 2's records.
    events = [*FIRST, session(2, 10, "s10"), record(15, "y15", "d15"), session(3, 10, "s10"), record(15, "y15", "d15")]
    second, third = audit.resumes(events)
    assert second.verdict == "state differs" and third.verdict == "bit-exact" and third.replayed == (11, 15)


def test_records_without_state_fingerprints_leave_a_replay_unverified_never_bit_exact():
    # The previous version's records (no fingerprints), resumed by this one: nothing to compare with, whatever
    # this session's fingerprints are (here another learning rate and data order would give other ones).
    without = ("state_fp", "data_fp")
    old = [session(1), *({k: v for k, v in record(step, "", "").items() if k not in without} for step in (5, 10, 15))]
    (resume,) = audit.resumes([*old, session(2, 5, "s5"), record(10, "x10", "y10"), record(15, "x15", "y15")])
    assert (resume.verdict, resume.replayed, resume.compared, resume.not_compared) == ("unverified", (6, 15), 0, 2)
    assert not resume.differs and not resume.verified
    assert resume.line() == (
        "resume audit: steps 6-15 replayed, not verified: 2 of 2 records had no state fingerprint to compare with "
        "(records of an earlier flaxstate, or fingerprints off); 0 compared equal"
    )
    # Some records compared equal and one not: still not verified, and the count says which part was.
    events = [*FIRST, session(2, 10, "s10"), record(15, "s15", "d15"), {**record(20, "s20", "d20"), "state_fp": None}]
    (resume,) = audit.resumes(events)
    assert (resume.verdict, resume.compared, resume.not_compared) == ("unverified", 1, 1)
    assert resume.to_json()["not_compared"] == 1
    # A difference the batches show is still a difference without a state fingerprint.
    events = [*FIRST, session(2, 10, "s10"), {**record(15, "s15", "other"), "state_fp": None}]
    assert audit.resumes(events)[0].verdict == "data differs"


def test_a_replay_whose_states_compared_equal_is_bit_exact_without_data_fingerprints():
    old = [session(1), *({**record(step, f"s{step}", "d"), "data_fp": None} for step in (5, 10))]
    (resume,) = audit.resumes([*old, session(2, 5, "s5"), record(10, "s10", "d")])
    assert (resume.verdict, resume.compared, resume.not_compared) == ("bit-exact", 1, 0) and resume.verified
