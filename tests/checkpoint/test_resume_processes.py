"""Exact resume: a run stopped anywhere (even by kill -9) ends bit for bit as an uninterrupted one.

Tier 2 (tests/README.md): tests that start, kill or signal processes of their own, or run servers or commands. The
others of resume are in test_resume_joined.py.
"""

import json
import shutil
import signal
import time

import pytest
from flaxstate_testing import cluster, command_line, processes
from flaxstate_testing.checkpoints import assert_equal_files, saved_steps
from test_resume_joined import assert_same, run


def audit(run_dir):
    """`flaxstate audit RUN --json`: its exit status and each resume's verdict."""
    done = command_line.run_here("audit", run_dir, "--json")
    assert done.returncode in (0, 1, 3), done.stderr
    return done.returncode, json.loads(done.stdout)["resumes"]


def run_and_kill(tmp_path, name, after_record, delay, saved_first=False, **config):
    """Starts a run, waits for a record line, then kills it with SIGKILL after `delay` seconds; returns the last
    record step it printed. With `saved_first`, the kill also waits for a first step to be complete in the run's
    directory (continuous saves pass records over while one runs: on a loaded machine the first save of a
    record took longer than 40 more steps)."""
    config = {"output_dir": str(tmp_path / name), "out": str(tmp_path / f"{name}.npz"), **config}
    process = processes.start("resume.py", config)
    lines = []
    deadline = time.monotonic() + 120
    reached = False

    def saved() -> bool:
        directory = tmp_path / name
        return directory.is_dir() and any(path.name.isdigit() for path in directory.iterdir())

    try:
        for line in process.stdout:
            lines.append(line)
            reached = reached or line.strip() == f"record {after_record}"
            if reached and (not saved_first or saved()):
                time.sleep(delay)
                process.send_signal(signal.SIGKILL)
                break
            assert time.monotonic() < deadline, "".join(lines)
    finally:
        processes.kill(process)
        process.wait(timeout=30)
    assert process.returncode == -signal.SIGKILL, "".join(lines) + process.stdout.read()
    return max(int(line.split()[1]) for line in lines if line.startswith("record "))


KILLED = {"data": "grain", "n_steps": 100, "every": 10, "width": 200_000, "keep": 2}
"""100 steps: the run goes on well past every kill point, so the kill always lands mid-run. A wide model makes
each save take a while."""


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """The final arrays of `KILLED` run straight through: one run for every kill point (what is saved, and how
    often, never changes what trains)."""
    reference, _ = run(tmp_path_factory.mktemp("uninterrupted"), "reference", resume=False, **KILLED)
    return reference


# Kill points: right after a save started (its bytes still being written), a little later, and
# well into the training steps after it.
@pytest.mark.parametrize(("delay", "every"), [(0.0, None), (0.05, None), (0.3, None), (0.05, "continuous")])
def test_kill_9_then_resume_equals_an_uninterrupted_run(tmp_path, uninterrupted, delay, every):
    # With every="continuous" the writer passes over the records that come while a save runs, and its first
    # complete step is waited for: its steps take 50 ms each, so that on a loaded machine the run still goes on
    # then (the first save outlasted the other 90 steps, and the kill found the run at its end).
    config = {**KILLED, "writer_every": every, **({"data_sleep": 0.05} if every else {})}
    reference = uninterrupted
    # Continuous saves pass records over while the first one runs: the kill waits for a few more records.
    printed = run_and_kill(
        tmp_path, "killed", after_record=50 if every else 20, delay=delay, saved_first=every is not None, **config
    )
    entries = sorted(p.name for p in (tmp_path / "killed").iterdir())
    print("after kill -9:", entries)
    steps = sorted(int(name) for name in entries if name.isdigit())
    assert steps and 10 <= steps[-1] < 100, steps
    resumed, output = run(tmp_path, "killed", **config)
    start = int(output.split("start ")[1].split()[0])
    assert start == steps[-1], output
    assert_same(resumed, reference)
    # The resume audited itself: the steps it trained again gave the bits the killed session logged.
    status, (resume,) = audit(tmp_path / "killed")
    assert status == 0 and resume["from_step"] == start, resume
    if start < printed:  # the killed session logged records past the step resumed from
        assert resume["verdict"] == "bit-exact" and resume["replayed"][0] == start + 1, resume
    else:
        assert resume["verdict"] in ("bit-exact", "nothing replayed"), resume


def test_kill_9_after_a_rollback_then_resume_skips_the_same_batches_and_ends_bit_for_bit(tmp_path):
    # The batch of step 8 is poisoned: the run goes back to step 5 and skips steps 6 to 8's batches. Saved at step 5
    # only, killed after its record of step 15, it resumes from step 5, rolls back again at step 8 as the killed
    # session did, and ends as the run that was never killed; the audit finds the replay bit-exact.
    config = {"data": "list", "n_steps": 40, "every": 5, "width": 16, "keep": 2, "poison": {"batches": [7]}}
    config.update(save_steps=[5], wait_saved=True, rollback=True, data_sleep=0.05)  # the kill lands mid-run
    reference, output = run(tmp_path, "reference", resume=False, **config)
    assert "rollbacks 1 at 10" in output and "rollbacks 1 at 5" not in output, output
    run_and_kill(tmp_path, "killed", after_record=15, delay=0.05, **config)
    resumed, output = run(tmp_path, "killed", **config)
    assert int(output.split("start ")[1].split()[0]) == 5, output
    assert_same(resumed, reference)
    status, (resume,) = audit(tmp_path / "killed")
    assert status == 0 and resume["verdict"] == "bit-exact" and resume["replayed"][0] == 6, resume


def test_an_nnx_module_killed_mid_save_resumes_bit_for_bit_with_its_streams_and_own_variables(tmp_path):
    # The module itself (TrainLoop(init=module), CheckpointFileReader(dir, target=module)): its parameters, the
    # counts of its own dropout stream and a Variable of the user's own are saved and restored.
    config = {"data": "grain", "n_steps": 40, "every": 10, "width": 100_000, "keep": 2, "nnx": True}
    reference, _ = run(tmp_path, "reference", resume=False, **config)
    assert (
        int(reference["flax_mutables/calls/calls"]) == 40
        and int(reference["flax_mutables/rng_count/dropout/rngs/count"]) == 40
    )
    run_and_kill(tmp_path, "killed", after_record=20, delay=0.05, **config)
    resumed, output = run(tmp_path, "killed", **config)
    assert 10 <= int(output.split("start ")[1].split()[0]) < 40, output
    assert_same(resumed, reference)
    status, (resume,) = audit(tmp_path / "killed")
    assert status == 0 and resume["verdict"] in ("bit-exact", "nothing replayed"), resume


def test_a_resume_audit_names_the_first_step_that_differs_and_why(tmp_path):
    # Killed after its record of step 20 (or of 25, where the kill came late), with step 10 its newest checkpoint:
    # each resume replays 11-20 at least, from a copy of the killed run. The same settings replay bit for bit;
    # data whose iterator does not restore its position, and a changed learning rate, are named at step 15, the
    # first record replayed.
    config = {"data": "positioned", "n_steps": 25, "every": 5, "save_steps": [10], "wait_saved": True, "keep": 5}
    run_and_kill(tmp_path, "killed", after_record=20, delay=0.0, **config)
    # A run of the flaxstate before fingerprints (its ledger's records without them), resumed with another
    # learning rate and data that forgets its position: nothing to compare, so not verified, never bit-exact.
    resumes = {
        "same": {},
        "forgetful": {"data": "forgetful"},
        "lr": {"lr": 2e-2},
        "old": {"data": "forgetful", "lr": 2e-2},
    }
    found = {}
    for name, change in resumes.items():
        shutil.copytree(tmp_path / "killed", tmp_path / name)
        if name == "old":
            ledger = tmp_path / name / "goodput.jsonl"
            events = [json.loads(line) for line in ledger.read_text().splitlines()]
            old_keys = {"state_fp", "data_fp", "restored_fp"}
            ledger.write_text(
                "".join(json.dumps({k: v for k, v in e.items() if k not in old_keys}) + "\n" for e in events)
            )
        _, output = run(tmp_path, name, **{**config, **change})
        assert "start 10" in output, output
        status, (resume,) = audit(tmp_path / name)
        found[name] = (status, resume["verdict"], resume["first_different_step"], resume["replayed"], output)
    status, verdict, first_different, (first, last), _ = found["same"]
    assert (status, verdict, first_different, first) == (0, "bit-exact", None, 11) and last >= 20  # to its last record
    assert found["forgetful"][:4] == (1, "data differs", 15, [11, 15])
    assert "resume audit: step 15 differs from session 1: the batches differ (data position)" in found["forgetful"][4]
    assert found["lr"][:4] == (1, "state differs", 15, [11, 15])
    assert "step 15 differs from session 1: the batches are the same and the state differs" in found["lr"][4]
    status, verdict, first_different, (first, last), output = found["old"]
    assert (status, verdict, first_different, first) == (3, "unverified", None, 11) and last >= 20
    assert "bit for bit" not in output and "resume audit: steps 11-" in output and "replayed, not verified" in output


EXPLICIT = {"data": "list", "n_steps": 60, "every": 10, "width": 64, "sharded": True, "explicit": True, "keep": 3}
"""An FSDP run over 2 processes on `jax.make_mesh`'s mesh (Explicit axes): each holds half of the hidden units."""


def test_kill_9_of_both_processes_on_an_explicit_mesh_then_resume_ends_bit_for_bit_and_audits_bit_exact(tmp_path):
    straight = dict(EXPLICIT, output_dir=str(tmp_path / "straight"), out=str(tmp_path / "straight.npz"), resume=False)
    cluster.run("resume", straight, n_processes=2, timeout=240)
    killed = dict(EXPLICIT, output_dir=str(tmp_path / "killed"), out=str(tmp_path / "killed.npz"))
    with processes.watched("resume.py", dict(killed, data_sleep=0.05), 2) as workers:  # slow: still training then
        processes.kill_all_after(workers, "record 30", timeout=180)
    printed = max(int(line.split()[1]) for line in workers[0].output.splitlines() if line.startswith("record "))
    steps = saved_steps(tmp_path / "killed")
    assert steps and 10 <= steps[-1] < EXPLICIT["n_steps"], (steps, workers[0].output)

    resumed = cluster.run("resume", killed, n_processes=2, timeout=240)
    assert all(f"start {steps[-1]}" in output for output in resumed), resumed
    assert_equal_files(tmp_path / "killed.npz", tmp_path / "straight.npz")
    status, (resume,) = audit(tmp_path / "killed")
    assert status == 0 and resume["from_step"] == steps[-1], resume
    if steps[-1] < printed:  # the killed session logged records past the step resumed from
        assert resume["verdict"] == "bit-exact" and resume["replayed"][0] == steps[-1] + 1, resume
    else:
        assert resume["verdict"] in ("bit-exact", "nothing replayed"), resume
