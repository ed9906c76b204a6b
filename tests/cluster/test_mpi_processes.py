"""Training under Open MPI's `mpirun` (Debian's `openmpi-bin`), on loopback, against a run that no manager started.

Tier 2 (tests/README.md): tests that start, kill or signal processes of their own, or run servers or commands.

The ranks run the test worker, which joins them as any script does under mpirun: `jax.distributed.initialize()`
with no arguments, JAX's own `OmpiCluster`. Each rank runs under `flaxstate_testing.mpi`'s status wrapper, which
prints its exit status: mpirun reports one status for the whole job. A machine without Open MPI skips these tests
and says why; CI installs it (`.ci/run`).
"""

import json
import os
import re
import signal
import subprocess
import sys

import pytest
from flaxstate_testing import managed, mpi, processes
from flaxstate_testing.checkpoints import assert_equal_files, saved_steps
from flaxstate_testing.managed import CONFIG, WORKER

pytestmark = pytest.mark.skipif(mpi.missing() is not None, reason=str(mpi.missing()))


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """The final parameters' file of `managed.CONFIG`'s run on two processes that no cluster manager started."""
    return managed.straight(tmp_path_factory.mktemp("straight"))


JOIN = [sys.executable, "-m", "flaxstate_testing.workers.join"]
"""The worker that only joins the ranks and says so."""


def mpirun(tmp_path, config, *, worker=WORKER, sigkill_timeout=None, **variables) -> processes.Watched:
    """Starts two ranks of `worker` under mpirun, in a session of its own, its output read as it comes.

    JAX's coordinator (in rank 0) listens on 127.0.0.1 only, on a free port: JAX's own default binds every
    interface, on a port of mpirun's job id.
    """
    port = processes.free_port()
    started = subprocess.Popen(
        mpi.command(2, *worker, json.dumps(config), sigkill_timeout=sigkill_timeout),
        cwd=tmp_path,
        env={
            **processes.worker_env(),
            "JAX_COORDINATOR_PORT": str(port),
            "JAX_COORDINATOR_BIND_ADDRESS": f"127.0.0.1:{port}",
            **variables,
        },
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    return processes.Watched(started)


@pytest.fixture
def ranks():
    """The mpirun runs of a test, killed by their process groups when it ends, passed or failed."""
    with processes.reaped() as started:
        yield started


def statuses(output) -> list[str]:
    """Each rank's exit status as its wrapper printed it, rank 0 first."""
    ended = [[line for line in mpi.rank_lines(output, rank) if re.match(r"exit|killed", line)] for rank in (0, 1)]
    return [" ".join(lines) for lines in ended]


def stopped_step(output) -> int:
    """The one step at which both ranks stopped and saved their preempted record."""
    stopped = [
        [int(m[1]) for line in mpi.rank_lines(output, rank) if (m := re.fullmatch(r"record (\d+) preempted", line))]
        for rank in (0, 1)
    ]
    assert stopped[0] == stopped[1] and len(stopped[0]) == 1, output
    return stopped[0][0]


def test_mpirun_two_ranks_train_bit_for_bit_as_flaxstate_launch(tmp_path, straight, ranks):
    config = dict(CONFIG, output_dir=str(tmp_path / "mpi"), out=str(tmp_path / "mpi.npz"), resume=False)
    ranks.append(run := mpirun(tmp_path, config))
    assert run.finish(timeout=300) == 0, run.output
    assert statuses(run.output) == ["exit 0", "exit 0"], run.output
    # Both ranks trained every record, each one process of two (JAX found them through Open MPI's variables).
    assert all("record 40 " in mpi.rank_lines(run.output, rank) for rank in (0, 1)), run.output

    assert_equal_files(tmp_path / "mpi.npz", managed.launched(config, tmp_path))
    assert_equal_files(tmp_path / "mpi.npz", straight)


def resumed_to_the_end(tmp_path, config, stopped_at, straight, ranks) -> None:
    """Runs the job again: it resumes from `stopped_at` and ends bit for bit as the run that never stopped."""
    ranks.append(again := mpirun(tmp_path, dict(config, data_sleep=0)))
    assert again.finish(timeout=300) == 0, again.output
    assert all(f"start {stopped_at}" in mpi.rank_lines(again.output, rank) for rank in (0, 1)), again.output
    assert_equal_files(tmp_path / "a.npz", straight)


def test_a_sigterm_to_mpirun_reaches_every_rank_after_its_sigkill_timeout_and_each_saves_and_exits_0(
    tmp_path, straight, ranks
):
    # Signalled, mpirun waits `odls_base_sigkill_timeout` seconds, sends every rank SIGTERM, and SIGKILL as long
    # again after (Open MPI's default is 1 s: too short for a save). With 10 s the ranks stop at one step, save
    # it and exit 0. mpirun itself exits 1 whatever its ranks did: it ended the job (Open MPI 4.1).
    run_dir = tmp_path / "run"
    config = dict(CONFIG, output_dir=str(run_dir), out=str(tmp_path / "a.npz"), resume=True, data_sleep=0.5)
    ranks.append(run := mpirun(tmp_path, config, sigkill_timeout=10))
    run.lines_with("record 10", count=2, timeout=240)
    run.process.send_signal(signal.SIGTERM)
    assert run.finish(timeout=120) == 1, run.output
    assert statuses(run.output) == ["exit 0", "exit 0"], run.output
    stopped_at = stopped_step(run.output)
    assert 10 < stopped_at < CONFIG["n_steps"] and saved_steps(run_dir)[-1] == stopped_at, run.output
    resumed_to_the_end(tmp_path, config, stopped_at, straight, ranks)


def test_a_sigterm_to_every_rank_saves_each_one_s_last_record_and_mpirun_exits_0(tmp_path, straight, ranks):
    # What a cluster's notice does (a container's stop, a scheduler that signals every process of the job): each
    # rank gets SIGTERM itself, stops at the step the other stops at, saves it and exits 0, and so does mpirun.
    run_dir = tmp_path / "run"
    config = dict(CONFIG, output_dir=str(run_dir), out=str(tmp_path / "a.npz"), resume=True, data_sleep=0.1)
    ranks.append(run := mpirun(tmp_path, config))
    pids = [int(line.split()[-1]) for line in run.lines_with("<stdout>:pid ", count=2, timeout=240)]
    run.lines_with("record 20", count=2, timeout=240)
    for pid in pids:
        os.kill(pid, signal.SIGTERM)
    assert run.finish(timeout=120) == 0, run.output
    assert statuses(run.output) == ["exit 0", "exit 0"], run.output
    stopped_at = stopped_step(run.output)
    assert 20 <= stopped_at < CONFIG["n_steps"] and saved_steps(run_dir)[-1] == stopped_at, run.output
    resumed_to_the_end(tmp_path, config, stopped_at, straight, ranks)


def test_a_join_that_waits_says_how_long_and_for_whom_and_a_wrong_count_is_refused_at_once(tmp_path, ranks):
    # Rank 1 starts its join 4 s after rank 0: rank 0, which serves the coordinator, says it waits for the other
    # process; started 4 s after rank 1, it leaves rank 1 waiting for the coordinator, which says so.
    for late, waits in (
        (1, r"in jax\.distributed\.initialize for the other 1 process to join at the coordinator "),
        (0, r"for the coordinator at 127\.0\.0\.1:\d+ \(process 0's\): nothing answers there"),
    ):
        ranks.append(
            run := mpirun(
                tmp_path,
                {"late": late, "delay": 4, "ready": str(tmp_path / f"ready-{late}")},
                worker=JOIN,
                FLAXSTATE_JOIN_REPORT_SECONDS="1",
            )
        )
        assert run.finish(timeout=120) == 0, run.output
        assert statuses(run.output) == ["exit 0", "exit 0"], run.output
        assert [line for rank in (0, 1) for line in mpi.rank_lines(run.output, rank) if "joined" in line] == [
            "joined 0 of 2",
            "joined 1 of 2",
        ], run.output
        waiting = [line for line in mpi.rank_lines(run.output, 1 - late) if line.startswith("flaxstate: ")]
        pattern = rf"flaxstate: process {1 - late} of 2 \(started by mpirun\) has waited \d+ s {waits}"
        assert len(waiting) >= 2 and all(re.match(pattern, line) for line in waiting), run.output
        assert len(set(waiting)) == len(waiting), run.output  # one watch a process: each second said once

    # JAX alone would wait 300 s for 4 processes; each rank says why at once, before any client is made.
    ranks.append(run := mpirun(tmp_path, {"initialize": {"num_processes": 4}}, worker=JOIN))
    assert run.finish(timeout=120) != 0, run.output
    refused = "would wait for 4 processes, and mpirun started 2 (OMPI_COMM_WORLD_SIZE=2)"
    assert all(any(refused in line for line in mpi.rank_lines(run.output, rank)) for rank in (0, 1)), run.output
