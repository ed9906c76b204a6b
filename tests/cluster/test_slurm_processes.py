"""Training under a real SLURM: a one-node cluster of Debian's `slurm-wlm` on loopback (`flaxstate_testing.slurm`),

Tier 2 (tests/README.md): tests that start, kill or signal processes of their own, or run servers or commands.
jobs submitted with `srun` and `sbatch`, signalled with `scancel`, each against a run that SLURM had no part in.

The scripts are the test workers (`flaxstate_testing/workers/resume.py`), which join their tasks under `srun` as
any script does there: `jax.distributed.initialize()` with no arguments, JAX's own SLURM detection. A machine
without SLURM skips these tests and says why; CI installs it (`.ci/run`).
"""

import json
import os
import re
import signal
import sys
import time

import pytest
from flaxstate_testing import managed, processes, slurm
from flaxstate_testing.checkpoints import assert_equal_files, data_fingerprints, saved_steps
from flaxstate_testing.command_line import run_here
from flaxstate_testing.managed import CONFIG, WORKER

from flaxstate.run_record import goodput, ledger

pytestmark = pytest.mark.skipif(slurm.missing() is not None, reason=str(slurm.missing()))

ENDED = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY")
"""The states of a job that ended."""


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with slurm.Cluster(tmp_path_factory.mktemp("slurm")) as started:
        yield started


@pytest.fixture(autouse=True)
def no_job_left(cluster):
    """Every test's jobs end with it, passed or failed (srun's processes are killed by their `Watched`)."""
    yield
    cluster.cancel_jobs()


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """The final parameters' file of `managed.CONFIG`'s run on two processes that no cluster manager started."""
    return managed.straight(tmp_path_factory.mktemp("straight"))


def preempted_steps(output):
    return [int(step) for step in re.findall(r"record (\d+) preempted$", output, flags=re.MULTILINE)]


def test_srun_two_tasks_train_bit_for_bit_as_flaxstate_launch_and_close_to_one_process(cluster, tmp_path, straight):
    config = dict(CONFIG, output_dir=str(tmp_path / "srun"), out=str(tmp_path / "srun.npz"), resume=False)
    run = cluster.srun("-n", "2", *WORKER, json.dumps(config), cwd=tmp_path)
    assert run.finish(timeout=300) == 0, run.output + cluster.logs()
    # Both tasks trained every record, each one process of two (JAX found them through SLURM's variables).
    assert {line.split(": ")[0] for line in run.lines if line.endswith("record 40 ")} == {"0", "1"}, run.output

    assert_equal_files(tmp_path / "srun.npz", managed.launched(config, tmp_path))
    assert_equal_files(tmp_path / "srun.npz", straight)

    alone = dict(config, output_dir=str(tmp_path / "alone"), out=str(tmp_path / "alone.npz"))
    processes.run("resume", alone, n_processes=1, timeout=240)
    # One process averages the same 8 examples' gradients in one sum instead of two halves: the last bits differ.
    assert_equal_files(tmp_path / "srun.npz", tmp_path / "alone.npz", rtol=1e-5, atol=1e-6)


JOB = processes.TESTS.parent / "examples" / "slurm" / "train.sbatch"
"""The cluster guide's batch script (docs/guides/cluster.md): `sbatch train.sbatch COMMAND...`."""


def submit(cluster, tmp_path, config, *options: str) -> str:
    """Submits the guide's batch script to run the worker with `config` on two tasks; returns the job's id. Its
    output goes to `job-<id>.out` in `tmp_path`."""
    return cluster.sbatch(
        JOB, f"--output={tmp_path}/job-%j.out", *options, args=(*WORKER, json.dumps(config)), cwd=tmp_path
    )


def wait_for_lines(path_of, text, count, timeout, cluster, job_id):
    """Waits until the job's output file holds `count` lines with `text`; fails with it and the job at the deadline."""
    deadline = time.monotonic() + timeout
    while True:
        output = path_of().read_text() if path_of().exists() else ""
        if sum(text in line for line in output.splitlines()) >= count:
            return output
        if time.monotonic() > deadline:
            raise AssertionError(f"no {count} lines {text!r} within {timeout} s: {cluster.job(job_id)}\n{output}")
        time.sleep(0.2)


def submit_then(cluster, tmp_path, config, *command: str) -> str:
    """Submits the job, and once both tasks recorded step 20 runs `command JOB` (a notice); returns the job's id."""
    job_id = submit(cluster, tmp_path, config)
    wait_for_lines(lambda: tmp_path / f"job-{job_id}.out", "record 20", 2, 240, cluster, job_id)
    cluster.command(*command, job_id)
    return job_id


def stopped_step(output) -> int:
    """The one step at which both tasks stopped and saved their preempted record."""
    stopped = {task: preempted_steps(lines_of(output, task)) for task in ("0", "1")}
    assert stopped["0"] == stopped["1"] and len(stopped["0"]) == 1, output
    return stopped["0"][0]


def test_scancel_sigterm_mid_run_saves_each_task_s_last_record_and_the_job_completes(cluster, tmp_path, straight):
    # `scancel --signal=TERM JOB` sends SIGTERM to every task of the job's steps (not to the batch shell): each
    # task's loop stops at one step with the other's, saves it, and exits 0, so srun and the job end well. The
    # job submitted again resumes from that step and ends bit for bit as the run never stopped.
    run_dir = tmp_path / "run"
    config = dict(CONFIG, output_dir=str(run_dir), out=str(tmp_path / "a.npz"), data_sleep=0.1)
    job_id = submit_then(cluster, tmp_path, config, "scancel", "--signal=TERM")
    job = cluster.wait_job(job_id, ENDED, 120)
    output = (tmp_path / f"job-{job_id}.out").read_text()
    assert job["JobState"] == "COMPLETED" and job["ExitCode"] == "0:0", f"{job}\n{output}"
    stopped_at = stopped_step(output)
    assert 20 <= stopped_at < CONFIG["n_steps"] and saved_steps(run_dir)[-1] == stopped_at, output

    job_id = submit(cluster, tmp_path, dict(config, data_sleep=0))
    job = cluster.wait_job(job_id, ENDED, 240)
    output = (tmp_path / f"job-{job_id}.out").read_text()
    assert job["JobState"] == "COMPLETED", f"{job}\n{output}"
    assert f"0: start {stopped_at}" in output and f"1: start {stopped_at}" in output, output
    assert_equal_files(tmp_path / "a.npz", straight)


def test_scontrol_requeue_of_a_running_job_runs_it_again_from_its_last_record_bit_for_bit(cluster, tmp_path, straight):
    # A requeue stops the job's tasks (SIGTERM, then SIGKILL after KillWait) and puts the job back in the queue,
    # to start again after BeginTime (120 s) unless released now. The tasks save the step they stopped at; the
    # job's second run resumes from it, SLURM_RESTART_COUNT=1, and ends bit for bit as the run never stopped.
    run_dir = tmp_path / "run"
    config = dict(CONFIG, output_dir=str(run_dir), out=str(tmp_path / "a.npz"), data_sleep=0.1)
    job_id = submit_then(cluster, tmp_path, config, "scontrol", "requeue")
    cluster.wait_job(job_id, ("PENDING",), 120)
    cluster.release(job_id)
    job = cluster.wait_job(job_id, ENDED, 300)
    output = (tmp_path / f"job-{job_id}.out").read_text()
    assert job["JobState"] == "COMPLETED" and job["Restarts"] == "1", f"{job}\n{output}"
    first, second = output.split("0: start ")[1], output.split("0: start ")[2]
    stopped_at = stopped_step(first)
    assert second.startswith(f"{stopped_at}\n") and f"1: start {stopped_at}" in output, output
    assert_equal_files(tmp_path / "a.npz", straight)

    # The ledger knows each session's run of the job; the audit finds nothing to replay: no step was lost.
    sessions = goodput.report(ledger.read_events(run_dir / ledger.FILENAME))["sessions"]
    assert [session["manager"] for session in sessions] == [
        {"name": "slurm", "job": job_id, "restarts": 0},
        {"name": "slurm", "job": job_id, "restarts": 1},
    ]
    shown = run_here("goodput", run_dir)
    assert shown.returncode == 0 and re.search(r"started by\s+slurm, restart 0\s+slurm, restart 1", shown.stdout), shown
    audited = run_here("audit", run_dir)
    assert audited.returncode == 0, audited
    assert f"nothing replayed (resumed from step {stopped_at}, the newest step reached)" in audited.stdout, audited


@pytest.mark.parametrize("notice", [("scancel", "--signal=TERM"), ("scontrol", "requeue")])
def test_a_notice_while_the_tasks_evaluate_between_records_stops_both_at_that_record_and_saves_it(
    cluster, tmp_path, notice
):
    # The notice lands between records: both tasks evaluate for 10 s after their writer saved step 20 (orbax's
    # save was each task's last call into JAX's preemption sync point). Both stop at the first boundary after it,
    # step 20, save it and exit 0. (When orbax's save and the loop both asked the sync point, with two counters,
    # both tasks trained on to the end: issue 94.)
    run_dir = tmp_path / "run"
    config = dict(CONFIG, n_steps=100, per_dispatch=5, output_dir=str(run_dir), out=str(tmp_path / "a.npz"))
    config.update(slow_eval=0.25, eval_after_save=True)
    job_id = submit(cluster, tmp_path, config)
    wait_for_lines(lambda: tmp_path / f"job-{job_id}.out", "eval batch 2", 2, 240, cluster, job_id)
    cluster.command(*notice, job_id)
    job = cluster.wait_job(job_id, ("PENDING",) if notice[0] == "scontrol" else ENDED, 120)
    output = (tmp_path / f"job-{job_id}.out").read_text()
    if notice[0] == "scancel":
        assert job["JobState"] == "COMPLETED" and job["ExitCode"] == "0:0", f"{job}\n{output}"
    assert stopped_step(output) == 20 and saved_steps(run_dir)[-1] == 20, output
    assert "record 25" not in output and "record 30" not in output, output


def lines_of(output, task):
    return "\n".join(line for line in output.splitlines() if line.startswith(f"{task}: "))


def test_a_time_limit_s_signal_saves_each_task_s_last_record_before_the_kill(cluster, tmp_path):
    # `--time=2 --signal=TERM@70`: SIGTERM to every task 70 s before the 2 minutes' end, SIGKILL at the end.
    # slurmctld checks time limits every 30 s, so the signal comes 20 to 80 s after the start (seen: 27 s for a
    # notice due at 5 s); due earlier, it could land in the imports, before any handler. The run would take
    # longer than the limit; the tasks stop at one step, save it, and exit 0: the job completes, not TIMEOUT.
    run_dir = tmp_path / "run"
    config = dict(CONFIG, n_steps=1000, output_dir=str(run_dir), out=str(tmp_path / "a.npz"), data_sleep=0.1)
    job_id = submit(cluster, tmp_path, config, "--time=2", "--signal=TERM@70")
    job = cluster.wait_job(job_id, ENDED, 240)
    output = (tmp_path / f"job-{job_id}.out").read_text()
    assert job["JobState"] == "COMPLETED" and job["ExitCode"] == "0:0", f"{job}\n{output}"
    assert saved_steps(run_dir)[-1] == stopped_step(output) < 1000, output


def test_a_task_killed_by_sigkill_ends_the_step_and_the_job_requeued_by_its_script_resumes_bit_for_bit(
    cluster, tmp_path, straight
):
    # One task dies as the kernel's out-of-memory killer ends it (SIGKILL, no handler runs). `--kill-on-bad-exit`
    # ends the step's other task; the batch script requeues its own job when srun fails (a user's usual
    # `srun ... || scontrol requeue $SLURM_JOB_ID`). Only step 10 is saved before the kill, after the record of
    # step 20: the second run resumes from step 10, trains steps 11-20 again (the audit finds them bit for bit
    # as the first run's records) and ends as the straight run.
    run_dir = tmp_path / "run"
    config = dict(CONFIG, output_dir=str(run_dir), out=str(tmp_path / "a.npz"), data_sleep=0.1)
    config.update(save_steps=[10], wait_saved=True)
    job_id = submit(cluster, tmp_path, config)
    output_of = lambda: tmp_path / f"job-{job_id}.out"  # noqa: E731
    output = wait_for_lines(output_of, "record 20", 2, 240, cluster, job_id)
    [pid] = [int(line.split()[-1]) for line in output.splitlines() if line.startswith("1: pid ")]
    os.kill(pid, signal.SIGKILL)
    cluster.wait_job(job_id, ("PENDING",), 120)  # requeued: waits for BeginTime
    cluster.release(job_id)
    job = cluster.wait_job(job_id, ENDED, 300)
    output = output_of().read_text()
    assert job["JobState"] == "COMPLETED" and job["Restarts"] == "1", f"{job}\n{output}\n{cluster.logs()}"
    assert_equal_files(tmp_path / "a.npz", straight)
    sessions = goodput.report(ledger.read_events(run_dir / ledger.FILENAME))["sessions"]
    assert [session["manager"]["restarts"] for session in sessions] == [0, 1]
    audited = run_here("audit", run_dir)
    assert audited.returncode == 0 and "resume audit: steps 11-20 replayed bit for bit" in audited.stdout, audited


def test_a_job_submitted_again_with_fewer_tasks_trains_the_same_examples_with_the_same_global_batch(cluster, tmp_path):
    # Two tasks, 8 examples a step (4 a device, max_device_batch=4); task 1 fails after the checkpoint of step
    # 10 (a node lost) and the job ends. SLURM requeues a job with its task count, so the user submits it again
    # with one task: it resumes from step 10, its one device taking the 8 examples in 2 microbatches of 4. Every
    # step trains the examples of a straight two-task run, to the same parameters within float32 rounding.
    settings = {"n_steps": 20, "max_device_batch": 4}
    straight = dict(settings, output_dir=str(tmp_path / "straight"), out=str(tmp_path / "straight.npz"))
    processes.run("global_data", straight, n_processes=2, timeout=240)

    run_dir = tmp_path / "run"
    config = dict(settings, output_dir=str(run_dir), out=str(tmp_path / "a.npz"), resume=True)
    lost = dict(config, lost={"index": 1, "count": 2, "after": 10})
    worker = [sys.executable, "-m", "flaxstate_testing.workers.global_data"]
    run = cluster.srun("-n", "2", "--kill-on-bad-exit=1", *worker, json.dumps(lost), cwd=tmp_path)
    assert run.finish(timeout=300) != 0, run.output
    assert saved_steps(run_dir)[-1] == 10, run.output
    run = cluster.srun("-n", "1", *worker, json.dumps(config), cwd=tmp_path)
    assert run.finish(timeout=300) == 0, run.output + cluster.logs()
    assert "0: start 10" in run.lines and "0: record 20 microbatches 2" in run.lines, run.output
    assert data_fingerprints(run_dir) == data_fingerprints(tmp_path / "straight")
    assert_equal_files(tmp_path / "a.npz", tmp_path / "straight.npz", rtol=1e-5, atol=1e-6)
    sessions = goodput.report(ledger.read_events(run_dir / ledger.FILENAME))["sessions"]
    assert [(each["processes"], each["microbatches"]) for each in sessions] == [(2, 1), (1, 2)]


def test_the_readme_example_s_two_writers_save_every_step_on_srun_two_tasks(cluster, tmp_path):
    # The example's run writer and best writer save the same steps at once on both tasks (each its own orbax
    # barriers): every save is committed in both folders, and both tasks exit 0. (Issue 94's collision: one
    # writer's barrier names met the other's, in 1 of 2 runs under srun.)
    run_dir = tmp_path / "run"
    example = [sys.executable, str(processes.TESTS.parent / "examples" / "digits.py"), "--steps", "300"]
    run = cluster.srun("-n", "2", *example, "--output-dir", str(run_dir), cwd=tmp_path)
    assert run.finish(timeout=300) == 0, run.output + cluster.logs()
    assert "0: step 300: eval/acc" in run.output.replace("\r", ""), run.output
    assert saved_steps(run_dir) == [100, 200, 300], run.output
    assert saved_steps(run_dir / "lowest-eval-loss"), run.output


def test_a_batch_script_without_srun_is_told_to_run_the_training_under_srun(cluster, tmp_path):
    # jax#30073: `sbatch` of a script that runs python itself. JAX alone says "coordinator_address should be
    # defined"; with flaxstate imported, one line names the cause and the fix, and nothing is compiled.
    script = tmp_path / "no_srun.sh"
    join = "import flaxstate, jax; jax.distributed.initialize()"
    script.write_text(f"#!/bin/bash\n#SBATCH --ntasks=2\n{sys.executable} -c '{join}'\n")
    job_id = cluster.sbatch(script, f"--output={tmp_path}/job-%j.out", cwd=tmp_path)
    job = cluster.wait_job(job_id, ENDED, 120)
    output = (tmp_path / f"job-{job_id}.out").read_text()
    assert job["JobState"] == "FAILED", f"{job}\n{output}"
    assert (
        f"RuntimeError: jax.distributed.initialize() was called in the shell of a SLURM batch script (job {job_id})"
        in output
    )
    assert "the job's 2 tasks are started by srun alone" in output, output


def test_srun_tasks_that_ask_for_another_count_are_refused_at_once_and_a_late_task_s_wait_is_reported(
    cluster, tmp_path
):
    # `jax.distributed.initialize(num_processes=4)` under `srun -n 2`: JAX alone waits 300 s for processes that
    # never come; each task says why at once, before any client is made. Then task 1 joins 4 s late: task 0
    # says, while it waits in JAX's join, how long it has waited and for whom.
    join = [sys.executable, "-m", "flaxstate_testing.workers.join"]
    run = cluster.srun("-n", "2", *join, json.dumps({"initialize": {"num_processes": 4}}), cwd=tmp_path)
    assert run.finish(timeout=120) != 0, run.output
    refused = "would wait for 4 processes, and srun started 2 (SLURM_NTASKS=2)"
    assert all(refused in lines_of(run.output, task) for task in ("0", "1")), run.output

    late = json.dumps({"late": 1, "delay": 4, "ready": str(tmp_path / "ready")})
    run = cluster.srun("-n", "2", "--export=ALL,FLAXSTATE_JOIN_REPORT_SECONDS=1", *join, late, cwd=tmp_path)
    assert run.finish(timeout=120) == 0, run.output
    assert "0: joined 0 of 2" in run.output and "1: joined 1 of 2" in run.output, run.output
    waited = re.findall(
        r"^0: flaxstate: process 0 of 2 \(started by srun\) has waited (\d+) s in jax\.distributed\.initialize for "
        r"the other 1 process to join at the coordinator localhost:\d+;",
        run.output,
        flags=re.MULTILINE,
    )
    assert len(waited) >= 2 and len(set(waited)) == len(waited), run.output  # one watch: each second said once


def test_flaxstate_launch_in_a_one_node_job_trains_and_in_a_step_of_two_tasks_is_refused_naming_srun(
    cluster, tmp_path, straight
):
    # The launcher's decision under SLURM (flaxstate.clusters.launcher_refusal): in a one-node job's batch script
    # it starts its processes and restarts them as on any machine (its sessions say "flaxstate launch"); in each
    # task of `srun -n 2` it would start processes of its own, and says so before it starts any.
    run_dir = tmp_path / "run"
    config = dict(CONFIG, output_dir=str(run_dir), out=str(tmp_path / "a.npz"))
    launcher = [sys.executable, "-m", "flaxstate", "launch", "--processes", "2", "--compilation-cache", "none", "--"]
    script = tmp_path / "launch.sh"
    script.write_text(f"#!/bin/bash\n#SBATCH --ntasks=2\n{' '.join(launcher + WORKER)} '{json.dumps(config)}'\n")
    job_id = cluster.sbatch(script, f"--output={tmp_path}/job-%j.out", cwd=tmp_path)
    job = cluster.wait_job(job_id, ENDED, 300)
    output = (tmp_path / f"job-{job_id}.out").read_text()
    assert job["JobState"] == "COMPLETED", f"{job}\n{output}"
    assert_equal_files(tmp_path / "a.npz", straight)
    sessions = goodput.report(ledger.read_events(run_dir / ledger.FILENAME))["sessions"]
    assert [session["manager"] for session in sessions] == [{"name": "flaxstate launch", "restarts": 0}]

    refused = cluster.srun("-n", "2", *launcher, "true", cwd=tmp_path)
    assert refused.finish(timeout=120) != 0, refused.output
    message = "flaxstate launch runs in each of the 2 tasks of a SLURM job step"
    assert {line.split(": ")[0] for line in refused.lines if message in line} == {"0", "1"}, refused.output
    assert "srun -n 2 python train.py" in refused.output and "[0]" not in refused.output, refused.output
