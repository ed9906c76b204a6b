"""SIGTERM (a preemption notice): the loop stops at a dispatch boundary, the step is saved, the script exits 0.

Tier 2 (tests/README.md): tests that start, kill or signal processes of their own, or run servers or commands. The
others of preemption are in test_preemption.py.

Real signals to real worker processes (`workers/resume.py`: `for c in loop:
writer(c)`), each with a hard timeout; the restart must end bit-equal to a run
that was never stopped.
"""

import os
import re
import signal
import time

import pytest
from flaxstate_testing import cluster, processes
from flaxstate_testing.checkpoints import assert_equal_files, saved_steps

CONFIG = {"n_steps": 60, "every": 10, "data": "list", "optimizer": "sgd", "keep": 2}
"""Signalled after the record of step 20, with data 50 ms a batch: 2 s of training left to stop in."""


def newest_step(directory):
    return saved_steps(directory)[-1]


def preempted_steps(output):
    return [int(step) for step in re.findall(r"^record (\d+) preempted$", output, flags=re.MULTILINE)]


def reference_run(tmp_path, n_processes=1, **settings):
    out = tmp_path / "reference.npz"
    config = dict(CONFIG, output_dir=str(tmp_path / "reference"), out=str(out), resume=False, **settings)
    cluster.run("resume", config, n_processes=n_processes)
    return out


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The parameters of a run never stopped, by settings (made once a module)."""
    made = {}

    def make(n_processes=1, **settings):
        key = (n_processes, tuple(sorted(settings.items())))
        if key not in made:
            made[key] = reference_run(tmp_path_factory.mktemp("reference"), n_processes, **settings)
        return made[key]

    return make


def restart(tmp_path, run_dir, stopped_at, n_processes=1, **settings):
    out = tmp_path / "restarted.npz"
    config = dict(CONFIG, output_dir=str(run_dir), out=str(out), **settings)
    outputs = cluster.run("resume", config, n_processes=n_processes)
    for output in outputs:
        assert f"start {stopped_at}" in output
    return out


@pytest.mark.parametrize("per_dispatch", [1, 5])
def test_sigterm_while_training_saves_the_step_it_stopped_at_exits_0_and_resumes_bit_equal(
    tmp_path, reference, per_dispatch
):
    run_dir = tmp_path / "run"
    config = dict(CONFIG, output_dir=str(run_dir), out=str(tmp_path / "a.npz"), per_dispatch=per_dispatch)
    worker = processes.Watched(processes.start("resume", dict(config, data_sleep=0.05)))
    worker.wait_for("record 20", timeout=120)
    worker.process.send_signal(signal.SIGTERM)
    signalled = time.monotonic()
    assert worker.finish(timeout=60) == 0, worker.output
    print(f"SIGTERM to exit: {time.monotonic() - signalled:.2f} s")
    [stopped_at] = preempted_steps(worker.output)
    assert 20 <= stopped_at < CONFIG["n_steps"] and stopped_at % per_dispatch == 0
    assert newest_step(run_dir) == stopped_at
    restarted = restart(tmp_path, run_dir, stopped_at, per_dispatch=per_dispatch)
    assert_equal_files(restarted, reference(per_dispatch=per_dispatch))


def test_sigterm_during_a_background_save_waits_for_it_and_exits_0(tmp_path, reference):
    run_dir = tmp_path / "run"
    config = dict(CONFIG, output_dir=str(run_dir), out=str(tmp_path / "a.npz"), sigterm_after_save=20)
    [output] = processes.run("resume", config)
    # The notice came between records: the loop trained no further, and the save in flight was waited for.
    assert preempted_steps(output) == [20] and "record 30" not in output
    assert newest_step(run_dir) == 20
    assert_equal_files(restart(tmp_path, run_dir, 20), reference(per_dispatch=1))


def test_a_notice_after_the_final_record_ends_the_process_once_the_loop_has_ended(tmp_path):
    run_dir = tmp_path / "run"
    config = dict(CONFIG, output_dir=str(run_dir), out=str(tmp_path / "a.npz"), sigterm_after_save=60)
    worker = processes.Watched(processes.start("resume", config))
    # Nothing was left to train: SIGTERM does what it did before, once the loop has put its handler back.
    assert worker.finish(timeout=120) == -signal.SIGTERM
    assert "record 60 \n" in worker.output and preempted_steps(worker.output) == [] and "done" not in worker.output
    assert newest_step(run_dir) == 60  # the final record's save was waited for


def test_a_time_based_writer_still_saves_the_preempted_step(tmp_path):
    run_dir = tmp_path / "run"
    config = dict(CONFIG, output_dir=str(run_dir), out=str(tmp_path / "a.npz"), every_seconds=3600)
    worker = processes.Watched(processes.start("resume", dict(config, data_sleep=0.05)))
    worker.wait_for("record 20", timeout=120)
    worker.process.send_signal(signal.SIGTERM)
    assert worker.finish(timeout=60) == 0, worker.output
    [stopped_at] = preempted_steps(worker.output)
    assert saved_steps(run_dir) == [stopped_at]


def test_handle_preemption_false_leaves_sigterm_to_end_the_process(tmp_path):
    config = dict(CONFIG, output_dir=str(tmp_path / "run"), out=str(tmp_path / "a.npz"), handle_preemption=False)
    worker = processes.Watched(processes.start("resume", dict(config, data_sleep=0.05)))
    worker.wait_for("record 20", timeout=120)
    worker.process.send_signal(signal.SIGTERM)
    assert worker.finish(timeout=60) == -signal.SIGTERM
    assert preempted_steps(worker.output) == []


def test_sigterm_to_one_of_two_processes_stops_both_at_one_step_and_both_resume_bit_equal(tmp_path, reference):
    # The notice reaches the other process through JAX's coordination service (its SIGTERM listener polls
    # once a second, then a barrier): 1-2 s here, once more than 4 s. The run is long enough to still be
    # training then (80 steps of 100 ms after the signal at step 20).
    settings = {"global_batch": 8, "n_steps": 100}
    run_dir = tmp_path / "run"
    config = dict(CONFIG, output_dir=str(run_dir), out=str(tmp_path / "a.npz"), **settings)
    with processes.watched("resume", dict(config, data_sleep=0.1), 2) as workers:
        for worker in workers:
            worker.wait_for("record 20", timeout=180)
        os.kill(workers[1].process.pid, signal.SIGTERM)  # process 1 only
        signalled = time.monotonic()
        codes = [worker.finish(timeout=90) for worker in workers]
    print(f"SIGTERM to the last exit: {time.monotonic() - signalled:.2f} s")
    assert codes == [0, 0], "\n".join(worker.output for worker in workers)
    stopped = [preempted_steps(worker.output) for worker in workers]
    assert stopped[0] == stopped[1] and len(stopped[0]) == 1, "\n".join(worker.output for worker in workers)
    stopped_at = stopped[0][0]
    assert 20 <= stopped_at < settings["n_steps"]
    assert newest_step(run_dir) == stopped_at
    restarted = restart(tmp_path, run_dir, stopped_at, n_processes=2, **settings)
    assert_equal_files(restarted, reference(n_processes=2, **settings))


def test_sigterm_during_a_slow_evaluation_stops_it_at_its_next_batch_and_saves_the_preempted_step(tmp_path):
    """A notice during an evaluation of 40 batches of 0.5 s: at most the batch in flight runs, then the writers save."""
    run_dir = tmp_path / "run"
    config = dict(CONFIG, output_dir=str(run_dir), out=str(tmp_path / "a.npz"), slow_eval=0.5)
    worker = processes.Watched(processes.start("resume", config))
    worker.wait_for("eval batch 2", timeout=120)
    worker.process.send_signal(signal.SIGTERM)  # during the evaluation at step 20, before the record is saved
    assert worker.finish(timeout=60) == 0, worker.output
    batches = [int(n) for n in re.findall(r"^eval batch (\d+)$", worker.output, flags=re.MULTILINE)]
    assert max(batches) <= 4, batches  # the batch drawn when the notice came, and at most one more
    cut = re.findall(r"^evaluation of (\d+) cut short: (\d+) of 40$", worker.output, flags=re.MULTILINE)
    # The record of step 20: the batches drawn were evaluated (the last may be drawn, not evaluated); then the
    # preempted record at the same step, not evaluated at all.
    assert [step for step, _ in cut] == ["20", "20"] and len(batches) - 1 <= int(cut[0][1]) <= len(batches), cut
    assert cut[1][1] == "0"
    assert preempted_steps(worker.output) == [20] and "record 30" not in worker.output
    assert newest_step(run_dir) == 20


def test_a_notice_between_records_after_a_save_stops_two_processes_at_one_step_and_both_resume_bit_equal(
    tmp_path, reference
):
    """The notice comes while both processes evaluate after their writer saved (orbax's save was each process's
    last call into JAX's preemption sync point): both stop at one step, save it and exit 0."""
    settings = {"global_batch": 8, "n_steps": 100, "per_dispatch": 5}
    run_dir = tmp_path / "run"
    config = dict(CONFIG, output_dir=str(run_dir), out=str(tmp_path / "a.npz"), **settings)
    config.update(slow_eval=0.25, eval_after_save=True)  # 10 s to evaluate: the notice reaches both meanwhile
    with processes.watched("resume", config, 2) as workers:
        for worker in workers:
            worker.wait_for("eval batch 2", timeout=180)
        for worker in workers:
            os.kill(worker.process.pid, signal.SIGTERM)  # during the evaluation at step 20, after its save
        codes = [worker.finish(timeout=120) for worker in workers]
    report = "\n".join(worker.output for worker in workers)
    assert codes == [0, 0], report
    stopped = [preempted_steps(worker.output) for worker in workers]
    assert stopped[0] == stopped[1] and len(stopped[0]) == 1, report
    [stopped_at] = stopped[0]
    # At the first boundary after the evaluation: the loop's own count is the one JAX's sync point follows (with
    # orbax's save asking it too, with the step's number, these stopped at step 70 or trained to the end).
    assert stopped_at == 20, report
    assert newest_step(run_dir) == stopped_at
    restarted = restart(tmp_path, run_dir, stopped_at, n_processes=2, **settings)
    assert_equal_files(restarted, reference(n_processes=2, **settings))
