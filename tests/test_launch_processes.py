"""`flaxstate launch`: N processes that find each other with `jax.distributed.initialize()`, restarted after a

Tier 2 (tests/README.md): tests that start, kill or signal processes of their own, or run servers or commands. The
others of launch are in test_launch.py.
failure, with signals sent to real processes (the launcher's and its children's).

The scripts are small Python files written by each test; every launcher runs
in a subprocess with a hard timeout, and its output is read as it comes.
"""

import json
import os
import random
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest
from flaxstate_testing import processes
from flaxstate_testing.checkpoints import data_fingerprints, saved_steps

from flaxstate.run_record import goodput, ledger


class Launched(processes.Watched):
    """`flaxstate launch ARGS -- python SCRIPT` in a subprocess, its output read line by line as it comes."""

    def __init__(self, tmp_path, script: str, *args: str, n_processes: int = 2, env: dict | None = None) -> None:
        path = tmp_path / "script.py"
        path.write_text(textwrap.dedent(script))
        cache = [] if "--compilation-cache" in args else ["--compilation-cache", str(tmp_path / "compilation")]
        command = [sys.executable, "-m", "flaxstate", "launch", "--processes", str(n_processes), *cache, *args]
        super().__init__(
            subprocess.Popen(
                [*command, "--", sys.executable, str(path)],
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                env={**processes.worker_env(), **(env or {})},
                cwd=tmp_path,
                start_new_session=True,
            )
        )

    def wait_for(self, text: str, count: int = 1, timeout: float = 120) -> list[str]:
        """Waits until `count` lines contain `text`; returns them."""
        return self.lines_with(text, count, timeout)

    def kill(self) -> None:
        processes.kill(self.process)


FIND_EACH_OTHER = """
    import os, sys
    import jax
    import flaxstate
    import numpy as np
    from jax.experimental import multihost_utils

    jax.distributed.initialize()  # no arguments: as under SLURM or on a TPU pod
    total = multihost_utils.process_allgather(np.array([jax.process_index() + 1])).sum()
    restarts = os.environ["FLAXSTATE_RESTARTS"]
    print(f"process {jax.process_index()} of {jax.process_count()}, sum {total}, restarts {restarts}", flush=True)
    if jax.process_index() == 1 and restarts == "0":
        sys.exit(3)
"""


def test_processes_find_each_other_and_all_start_again_after_one_fails(tmp_path):
    launched = Launched(tmp_path, FIND_EACH_OTHER, "--grace", "5")
    assert launched.finish() == 0, launched.output
    lines = launched.lines
    assert "[0] process 0 of 2, sum 3, restarts 0" in lines and "[1] process 1 of 2, sum 3, restarts 0" in lines
    assert "flaxstate launch: process 1 exited with status 3; restart 1 of 3: starting all 2 processes again." in lines
    assert "[0] process 0 of 2, sum 3, restarts 1" in lines and "[1] process 1 of 2, sum 3, restarts 1" in lines


def test_it_gives_up_after_max_restarts_with_the_failing_status(tmp_path):
    script = """
        import os, sys
        print("started", os.environ["FLAXSTATE_PROCESS_ID"], os.environ["FLAXSTATE_RESTARTS"], flush=True)
        sys.exit(7 if os.environ["FLAXSTATE_PROCESS_ID"] == "0" else 0)
    """
    launched = Launched(tmp_path, script, "--max-restarts", "2", "--grace", "1")
    assert launched.finish() == 7, launched.output
    assert len([line for line in launched.lines if line.startswith("[0] started 0")]) == 3  # the first, 2 restarts
    assert launched.lines[-1] == (
        "flaxstate launch: process 0 exited with status 7 after 2 restarts (--max-restarts 2); giving up."
    )


def test_a_process_that_exits_0_early_is_waited_for_not_a_failure(tmp_path):
    script = """
        import os, time
        if os.environ["FLAXSTATE_PROCESS_ID"] == "1":
            time.sleep(2)
        print("done", os.environ["FLAXSTATE_PROCESS_ID"], flush=True)
    """
    launched = Launched(tmp_path, script)
    assert launched.finish() == 0, launched.output
    assert launched.lines == ["[0] done 0", "[1] done 1"]


def test_the_process_that_failed_first_is_named_not_a_peer_that_failed_just_after(tmp_path):
    # Process 1 fails; process 0 fails 200 ms after it (as peers fail when their collectives lose one). A poll
    # of them all named the lowest index of those ended by then: process 0. A thread waits on each process, and
    # the first to see its process end names it. The gap was 20 ms, within one of a former 50 ms poll, until CI
    # ran two lanes beside other tests: the launcher's threads then ran more than 20 ms late, and the two exits
    # reached it in the other order.
    script = """
        import os, sys, time
        from pathlib import Path
        signal_file = Path("failed")
        if os.environ["FLAXSTATE_RESTARTS"] == "0":
            if os.environ["FLAXSTATE_PROCESS_ID"] == "1":
                signal_file.touch()
                sys.exit(5)
            while not signal_file.exists():
                time.sleep(0.001)
            time.sleep(0.2)
            sys.exit(9)
        print("again", os.environ["FLAXSTATE_PROCESS_ID"], flush=True)
    """
    launched = Launched(tmp_path, script, "--max-restarts", "1", "--grace", "1")
    assert launched.finish() == 0, launched.output
    said = [line for line in launched.lines if line.startswith("flaxstate launch:")]
    assert said == ["flaxstate launch: process 1 exited with status 5; restart 1 of 1: starting all 2 processes again."]
    assert {"[0] again 0", "[1] again 1"} <= set(launched.lines)


STUBBORN = """
    import os, signal, time
    index, restarts = os.environ["FLAXSTATE_PROCESS_ID"], os.environ["FLAXSTATE_RESTARTS"]
    if restarts == "0":
        if index == "0":
            signal.signal(signal.SIGTERM, signal.SIG_IGN)  # stuck: only SIGKILL ends it
        print("pid", index, os.getpid(), flush=True)
        time.sleep(600)
    print("again", index, flush=True)
"""


def test_a_process_killed_by_sigkill_stops_the_others_after_the_grace_and_all_restart(tmp_path):
    launched = Launched(tmp_path, STUBBORN, "--grace", "1")
    pids = {line.split()[2]: int(line.split()[3]) for line in launched.wait_for("] pid ", count=2)}
    os.kill(pids["1"], signal.SIGKILL)
    assert launched.finish() == 0, launched.output
    assert "flaxstate launch: process 1 was killed by SIGKILL; restart 1 of 3: starting all 2 processes again." in (
        launched.lines
    )
    assert {"[0] again 0", "[1] again 1"} <= set(launched.lines)
    with pytest.raises(ProcessLookupError):
        os.kill(pids["0"], 0)  # the one that ignored SIGTERM was killed


def test_sigterm_to_the_launcher_is_forwarded_and_nothing_restarts(tmp_path):
    script = """
        import os, signal, sys, time
        index = os.environ["FLAXSTATE_PROCESS_ID"]

        def saved_and_exit(signum, frame):
            print("saved at SIGTERM", index, flush=True)
            sys.exit(0)

        signal.signal(signal.SIGTERM, saved_and_exit)
        print("ready", index, os.environ["FLAXSTATE_RESTARTS"], flush=True)
        time.sleep(600)
    """
    launched = Launched(tmp_path, script)
    launched.wait_for("] ready ", count=2)
    launched.process.send_signal(signal.SIGTERM)
    assert launched.finish() == 0, launched.output
    assert {"[0] saved at SIGTERM 0", "[1] saved at SIGTERM 1"} <= set(launched.lines)
    assert not any("restart" in line for line in launched.lines)


AFTER_A_FAILURE = """
    import os, signal, sys, time
    index, restarts = os.environ["FLAXSTATE_PROCESS_ID"], os.environ["FLAXSTATE_RESTARTS"]
    if restarts == "0":
        if index == "1":
            sys.exit(3)
        time.sleep(600)
    signal.signal(signal.SIGTERM, lambda *_: (print("saved at SIGTERM", index, flush=True), sys.exit(0)))
    print("round", restarts, "ready", index, flush=True)
    time.sleep(20)
    print("trained to the end", index, flush=True)
"""


@pytest.mark.parametrize("delay", [0.0, 0.05, 0.3])
def test_a_sigterm_just_after_a_restart_began_reaches_the_new_round_or_stops_it_from_starting(tmp_path, delay):
    launched = Launched(tmp_path, AFTER_A_FAILURE, "--grace", "0.2")
    launched.wait_for("restart 1 of 3")
    time.sleep(delay)  # before, while or after the new round starts
    launched.process.send_signal(signal.SIGTERM)
    status = launched.finish(timeout=60)
    assert not any("trained to the end" in line for line in launched.lines), launched.output
    assert not any("restart 2" in line for line in launched.lines), launched.output
    # Each new process either saved at the notice or was ended by it before it could install its handler.
    assert status in (0, 128 + signal.SIGTERM), launched.output


CHILDREN = """
    import os, subprocess, sys, time
    index, restarts = os.environ["FLAXSTATE_PROCESS_ID"], os.environ["FLAXSTATE_RESTARTS"]
    if restarts == "0":
        worker = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])  # a data loader's worker
        print("child", index, worker.pid, flush=True)
        time.sleep(0.5)
        if index == "1":
            os._exit(3)  # crashes, its worker left running
        time.sleep(600)
    print("again", index, flush=True)
"""


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has ended
    except FileNotFoundError:
        return False


def test_the_children_of_a_crashed_process_and_of_the_others_are_stopped_at_a_restart(tmp_path):
    launched = Launched(tmp_path, CHILDREN, "--grace", "1")
    children = [int(line.split()[3]) for line in launched.wait_for("] child ", count=2)]
    assert launched.finish() == 0, launched.output
    assert {"[0] again 0", "[1] again 1"} <= set(launched.lines)
    deadline = time.monotonic() + 10
    while any(alive(pid) for pid in children) and time.monotonic() < deadline:
        time.sleep(0.05)  # SIGKILL is delivered at once; the reaping by init may lag
    assert not [pid for pid in children if alive(pid)], launched.output


def test_a_process_that_ignores_the_forwarded_sigterm_is_killed_after_the_grace(tmp_path):
    script = """
        import os, signal, time
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        print("ready", os.environ["FLAXSTATE_PROCESS_ID"], flush=True)
        time.sleep(600)
    """
    launched = Launched(tmp_path, script, "--grace", "1")
    launched.wait_for("] ready ", count=2)
    launched.process.send_signal(signal.SIGTERM)
    assert launched.finish(timeout=60) == 128 + signal.SIGKILL, launched.output
    assert any("still running 1 s after the preemption: killed" in line for line in launched.lines), launched.output


def test_ctrl_c_is_forwarded_once_and_a_second_stops_them_all(tmp_path):
    script = """
        import os, signal, time
        index = os.environ["FLAXSTATE_PROCESS_ID"]
        signal.signal(signal.SIGINT, lambda *_: print("interrupted", index, flush=True))  # goes on: saving, say
        print("ready", index, flush=True)
        while True:
            time.sleep(0.1)
    """
    launched = Launched(tmp_path, script)
    launched.wait_for("] ready ", count=2)
    launched.process.send_signal(signal.SIGINT)
    launched.wait_for("] interrupted ", count=2)
    launched.process.send_signal(signal.SIGINT)
    assert launched.finish() == 128 + signal.SIGKILL, launched.output
    assert "after Ctrl-C; not restarting." in launched.lines[-1], launched.output


BROKEN_HOST = """
    import os, sys
    index, count = os.environ["FLAXSTATE_PROCESS_ID"], os.environ["FLAXSTATE_PROCESS_COUNT"]
    print("started", index, "of", count, "restarts", os.environ["FLAXSTATE_RESTARTS"], flush=True)
    sys.exit(5 if index == "{broken}" and count == "4" else 0)  # one index fails as long as the job is 4 wide
"""


def test_a_process_index_that_keeps_failing_is_lost_and_the_job_goes_on_with_fewer(tmp_path):
    launched = Launched(
        tmp_path, BROKEN_HOST.format(broken=3), "--min-processes", "2", "--max-restarts", "5", "--grace", "1",
        n_processes=4,
    )  # fmt: skip
    assert launched.finish() == 0, launched.output
    said = [line for line in launched.lines if line.startswith("flaxstate launch:")]
    assert said == [
        "flaxstate launch: process 3 exited with status 5; restart 1 of 5: starting all 4 processes again.",
        "flaxstate launch: process 3 exited with status 5; [3] lost: restart 2 of 5 goes on with 2 processes "
        "(of 4; --min-processes 2).",
    ]  # 3 left: the largest count that divides 4 within them is 2
    assert {line for line in launched.lines if "of 2" in line} == {
        "[0] started 0 of 2 restarts 2",
        "[1] started 1 of 2 restarts 2",
    }


def test_a_host_declared_lost_goes_at_once_and_fewer_than_min_processes_gives_up(tmp_path, monkeypatch):
    # A health check's file names process 1: the first failure drops it. With --min-processes 3 the 2 processes
    # that 4 allows within the 3 left are too few: the launcher gives up with the failing status, in one line.
    (tmp_path / "lost").write_text("1\n")
    monkeypatch.setenv("FLAXSTATE_LOST_FILE", str(tmp_path / "lost"))
    launched = Launched(tmp_path, BROKEN_HOST.format(broken=1), "--min-processes", "2", "--grace", "1", n_processes=4)
    assert launched.finish() == 0, launched.output
    assert (
        "flaxstate launch: process 1 exited with status 5; [1] lost: restart 1 of 3 goes on with 2 processes "
        "(of 4; --min-processes 2)." in launched.lines
    )
    launched = Launched(tmp_path, BROKEN_HOST.format(broken=1), "--min-processes", "3", "--grace", "1", n_processes=4)
    assert launched.finish() == 5, launched.output
    assert launched.lines[-1] == (
        "flaxstate launch: process 1 exited with status 5; [1] lost: 2 processes could go on (the most that divide "
        "--processes 4 within the 3 left), below --min-processes 3; giving up."
    )


FAILS_AGAIN = """
    import os, sys
    index, count, restarts = (os.environ[f"FLAXSTATE_{name}"] for name in ("PROCESS_ID", "PROCESS_COUNT", "RESTARTS"))
    print("started", index, "of", count, "restarts", restarts, flush=True)
    if index == "1" and restarts == "2":  # the health check declares the new round's process 1 lost too
        with open(os.environ["FLAXSTATE_LOST_FILE"], "{mode}") as lost:
            lost.write("1\\n")
    sys.exit(5 if index == "1" and restarts in ("0", "1", "2") else 0)
"""


@pytest.mark.parametrize("mode", ["a", "w"])  # a line appended, or the file written anew (truncated, then written)
def test_each_line_of_the_lost_file_is_applied_once_in_the_numbering_of_the_round_that_failed(
    tmp_path, monkeypatch, mode
):
    # The file names process 1 of 4: the job goes on with 2. Their process 1 (another host) then fails once: the
    # old line must not drop it, so all 2 start again. It fails again and the health check writes "1": now 1 is
    # lost, and 1 process goes on. Written anew, the line was read from the old offset and missed.
    (tmp_path / "lost").write_text("1\n")
    monkeypatch.setenv("FLAXSTATE_LOST_FILE", str(tmp_path / "lost"))
    script = FAILS_AGAIN.replace("{mode}", mode)
    launched = Launched(tmp_path, script, "--min-processes", "1", "--grace", "1", n_processes=4)
    assert launched.finish() == 0, launched.output
    said = [line for line in launched.lines if line.startswith("flaxstate launch:")]
    assert said == [
        "flaxstate launch: process 1 exited with status 5; [1] lost: restart 1 of 3 goes on with 2 processes "
        "(of 4; --min-processes 1).",
        "flaxstate launch: process 1 exited with status 5; restart 2 of 3: starting all 2 processes again.",
        "flaxstate launch: process 1 exited with status 5; [1] lost: restart 3 of 3 goes on with 1 processes "
        "(of 4; --min-processes 1).",
    ], launched.output
    assert launched.lines[-1] == "[0] started 0 of 1 restarts 3"
    assert (tmp_path / "lost.applied").read_text() == "1\n1\n" and not (tmp_path / "lost").exists()


def test_a_lost_file_s_damaged_bytes_and_lines_that_name_no_process_are_ignored_in_a_line_each(tmp_path, monkeypatch):
    # Bytes that are not UTF-8 (a torn write, a flipped bit), a host name, an index beyond the round: each ignored
    # with one line; the launcher goes on with the one index the file names (it exited 2 on the bytes).
    (tmp_path / "lost").write_bytes(b"\xff\xfe\nhost-7\n9\n2\n")
    monkeypatch.setenv("FLAXSTATE_LOST_FILE", str(tmp_path / "lost"))
    launched = Launched(tmp_path, BROKEN_HOST.format(broken=1), "--min-processes", "2", "--grace", "1", n_processes=4)
    assert launched.finish() == 0, launched.output
    said = [line for line in launched.lines if line.startswith("flaxstate launch:")]
    assert said == [
        *(
            f"flaxstate launch: FLAXSTATE_LOST_FILE line {number} {text} is not a process index of this round "
            "(0 to 3); ignored."
            for number, text in ((1, '"\\xff\\xfe"'), (2, '"host-7"'), (3, '"9"'))
        ),
        "flaxstate launch: process 1 exited with status 5; [2] lost: restart 1 of 3 goes on with 2 processes "
        "(of 4; --min-processes 2).",
    ], launched.output


@pytest.fixture(scope="module")
def straight_4(tmp_path_factory):
    """An uninterrupted data-parallel run of 4 processes on `fs.global_batches` (8 examples a step), 20 steps: its
    run folder and its final parameters."""
    folder = tmp_path_factory.mktemp("straight")
    config = {**SHRINKING, "output_dir": str(folder / "run"), "out": str(folder / "final.npz")}
    processes.run("global_data", config, n_processes=4, timeout=240)
    with np.load(folder / "final.npz") as final:
        return folder / "run", dict(final)


SHRINKING = {"n_steps": 20, "max_device_batch": 2}


def test_a_job_that_loses_a_process_goes_on_with_half_and_trains_the_same_examples_to_the_same_parameters(
    tmp_path, straight_4
):
    # 4 processes on fs.global_batches (8 examples a step) with max_device_batch=2: process 3 fails after the
    # record of step 10 and again at once when the 4 start again, so the launcher goes on with 2, whose devices
    # take 4 examples a step in 2 microbatches. Under FSDP the hidden layer is split over the processes too (4
    # shares, then 2, resharded on restore). Every record's examples are the uninterrupted 4-process run's, and
    # the parameters equal its within float32 rounding: each step's gradient is the mean of the same 8 examples'
    # gradients, summed in another order (2 microbatches of 2 devices' means against 4 devices', and under FSDP
    # the hidden layer's sums split otherwise), so the last bits may differ (rtol 1e-5, as
    # tests/training/test_accumulation.py allows). The data-parallel reference serves: FSDP trains as data
    # parallelism does, to the same rounding (tests/training/test_sharded_loop_joined.py). Under FSDP only: a
    # data-parallel run resumed on fewer processes is tests/test_global_batches_joined.py's, and FSDP's restore
    # reshards besides.
    straight, expected = straight_4
    shrunk = tmp_path / "shrunk"
    worker = {**SHRINKING, "output_dir": str(shrunk), "out": str(tmp_path / "shrunk.npz"), "resume": True}
    worker.update(fsdp=True, lost={"index": 3, "count": 4, "after": 10})
    script = f"""
        import runpy, sys
        sys.argv = ["global_data", {json.dumps(worker)!r}]
        runpy.run_module("flaxstate_testing.workers.global_data", run_name="__main__")
    """
    launched = Launched(tmp_path, script, "--min-processes", "2", "--max-restarts", "4", "--grace", "2", n_processes=4)
    assert launched.finish(timeout=480) == 0, launched.output
    assert any("[3] lost: restart 2 of 4 goes on with 2 processes" in line for line in launched.lines), launched.output
    assert "[0] record 20 microbatches 2" in launched.lines and "[1] record 20 microbatches 2" in launched.lines
    # Each device held a quarter of the hidden units, then half.
    assert {line.split("] ")[1] for line in launched.lines if "hidden kernel shard" in line} == {
        "hidden kernel shard (4, 4)",
        "hidden kernel shard (4, 8)",
    }, launched.output
    assert data_fingerprints(shrunk) == data_fingerprints(straight)  # the same examples at every step
    with np.load(tmp_path / "shrunk.npz") as got:
        assert got.keys() == expected.keys()
        for key, want in expected.items():
            np.testing.assert_allclose(got[key], want, rtol=1e-5, atol=1e-6, err_msg=key)
    sessions = goodput.report(ledger.read_events(shrunk / ledger.FILENAME))["sessions"]
    assert [(each["processes"], each["microbatches"]) for each in sessions][-1] == (2, 2)
    assert (sessions[0]["processes"], sessions[0]["microbatches"]) == (4, 1)


CACHED = """
    import os, sys, time
    index, restarts = os.environ["FLAXSTATE_PROCESS_ID"], os.environ["FLAXSTATE_RESTARTS"]
    if index == "1" and restarts == "0":  # process 0 compiles alone first: a fresh cache, all its programs missed
        for _ in range(600):  # (side by side, each could hit one the other had just written, on a loaded host)
            if os.path.exists("compiled-0-0"):
                break
            time.sleep(0.1)
    import jax, jax.numpy as jnp
    import flaxstate
    hits = []
    jax.monitoring.register_event_listener(lambda event, **kwargs: hits.append(event))
    jax.jit(lambda x: jnp.sin(x) * 3)(jnp.ones(5)).block_until_ready()
    cache = os.path.relpath(os.environ["JAX_COMPILATION_CACHE_DIR"])
    hit = "/jax/compilation_cache/cache_hits" in hits
    print("process", index, "restarts", restarts, "cache", cache, "hit", hit, flush=True)
    open(f"compiled-{index}-{restarts}", "w").close()
    if index == "1" and restarts == "0":  # fails once process 0 has cached its programs: all restart
        sys.exit(3)
"""


def test_a_restarted_process_loads_its_programs_from_the_launcher_s_compilation_cache(tmp_path, monkeypatch):
    # JAX caches programs that took this long to compile (1 s by default: a test's compile in milliseconds).
    monkeypatch.setenv("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    monkeypatch.delenv("JAX_COMPILATION_CACHE_DIR", raising=False)
    launched = Launched(tmp_path, CACHED, "--grace", "1")
    assert launched.finish() == 0, launched.output
    assert set(launched.lines) >= {
        "[0] process 0 restarts 1 cache compilation/processes-2 hit True",
        "[1] process 1 restarts 1 cache compilation/processes-2 hit True",
    }, launched.output
    assert "[0] process 0 restarts 0 cache compilation/processes-2 hit False" in launched.lines, launched.output
    # One process: a cache of its own, so that no job takes programs compiled for another process count.
    launched = Launched(tmp_path, CACHED, n_processes=1)
    assert launched.finish() == 0 and launched.lines == [
        "[0] process 0 restarts 0 cache compilation/processes-1 hit False"
    ]
    # A cache of the user's own wins.
    monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", str(tmp_path / "mine"))
    launched = Launched(tmp_path, CACHED, n_processes=1)
    assert launched.finish() == 0 and launched.lines == ["[0] process 0 restarts 0 cache mine hit False"]


PRESET = """
    import json, os, pathlib, sys, time
    flags = os.environ.get("XLA_FLAGS", "")
    preset, restarts = os.environ["FLAXSTATE_XLA_PRESET"], os.environ["FLAXSTATE_RESTARTS"]
    print(json.dumps({"preset": preset, "restarts": restarts, "flags": flags.split(),
                      "connections": os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS")}), flush=True)
    dump = [flag.split("=", 1)[1] for flag in flags.split() if flag.startswith("--xla_gpu_dump_autotune_results_to=")]
    if restarts == "0" and dump:  # XLA writes it on a GPU after autotuning: here, the script does
        pathlib.Path(dump[0]).write_text("version: 3")
        if dump[0].endswith("process-0.textproto"):  # the failure comes once every process has had its say
            others = pathlib.Path(dump[0]).with_name("process-1.textproto")
            deadline = time.monotonic() + 60
            while not others.exists() and time.monotonic() < deadline:
                time.sleep(0.05)
            sys.exit(3)
"""


def test_a_preset_s_flags_reach_every_process_with_the_user_s_winning_and_a_restart_loads_the_autotune_results(
    tmp_path,
):
    user = {"XLA_FLAGS": "--xla_gpu_enable_triton_gemm=true"}
    launched = Launched(tmp_path, PRESET, "--xla-preset", "hopper", "--max-restarts", "1", "--grace", "1", env=user)
    assert launched.finish() == 0, launched.output
    seen = [json.loads(line.split("] ", 1)[1]) for line in launched.lines if line.startswith("[")]
    assert len(seen) == 4 and {each["preset"] for each in seen} == {"hopper"}, launched.output
    for each in seen:
        flags = dict(flag.split("=", 1) for flag in each["flags"])
        assert flags["--xla_gpu_enable_triton_gemm"] == "true"  # the user's own, kept
        assert flags["--xla_gpu_enable_latency_hiding_scheduler"] == "true" and each["connections"] == "1"
        index = [i for i in range(2) if flags["--xla_gpu_dump_autotune_results_to"].endswith(f"process-{i}.textproto")]
        results = str(tmp_path / "compilation" / "processes-2" / "autotune" / f"process-{index[0]}.textproto")
        assert flags["--xla_gpu_dump_autotune_results_to"] == results
        # The first round finds no results; the restarted one loads those its first round left.
        assert flags.get("--xla_gpu_load_autotune_results_from") == (results if each["restarts"] == "1" else None)
    # `auto` on this machine (no GPU): no preset, no flag added, no autotune file.
    launched = Launched(tmp_path, PRESET, n_processes=1)
    assert launched.finish() == 0, launched.output
    assert json.loads(launched.lines[0].split("] ", 1)[1]) == {
        "preset": "none",
        "restarts": "0",
        "flags": [],
        "connections": None,
    }, launched.output


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--xla-preset", "volta", "--", "true"], "--xla-preset must be one of auto, hopper, blackwell, ampere, none"),
        (["--processes", "2", "--min-processes", "3", "--", "true"], "--min-processes must be between 1 and"),
        (["--processes", "0", "--", "true"], "--processes must be at least 1, got 0"),
        (["--processes", "2"], "flaxstate launch needs a command"),
        (["--max-restarts", "-1", "--", "true"], "--max-restarts must be 0 or more"),
        (["--", "no-such-program", "--flag"], "flaxstate launch: no such program: no-such-program\n"),
        (["--", "./not-here.py"], "flaxstate launch: no such program: ./not-here.py\n"),
    ],
)
def test_bad_arguments_are_named_before_anything_starts(args, message):
    done = subprocess.run(
        [sys.executable, "-m", "flaxstate", "launch", *args], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 2 and message in done.stderr, done.stderr


CHAOS_STEPS = 300
LOCAL_EVERY = 10


def chaos_config(tmp_path, name: str, n_processes: int) -> dict:
    """A data-parallel run of `n_processes` on gloo: a local tier every 10 steps, the persistent one at 100 and 200."""
    return {
        "data": "list",
        "width": 32,
        "optimizer": "sgd",
        "every": LOCAL_EVERY,
        "global_batch": 8,
        "n_steps": CHAOS_STEPS,
        "output_dir": str(tmp_path / name / "persistent"),
        "local_dirs": [str(tmp_path / name / f"local-{i}") for i in range(n_processes)],
        "out": str(tmp_path / name / "final.npz"),
        "save_steps": [100, 200],
        "hang_timeout": 5,
        "data_sleep": 0.01,
        "poison": {"process": 1, "batches": [14]},  # process 1's part of step 15's batch: all four roll back
        "rollback": True,
    }


def launch_worker(tmp_path, config: dict, n_processes: int) -> Launched:
    """`flaxstate launch` of the resume worker (which calls `jax.distributed.initialize()` with no arguments)."""
    folder = tmp_path / config["out"].split("/")[-2]
    folder.mkdir(parents=True, exist_ok=True)
    script = f"""
        import runpy, sys
        sys.argv = ["resume", {json.dumps(json.dumps(config))}]
        runpy.run_module("flaxstate_testing.workers.resume", run_name="__main__")
    """
    return Launched(folder, script, "--grace", "3", "--max-restarts", "5", n_processes=n_processes)


class Chaos:
    """Reads a launched run's lines from a mark on, to act at its records: the test's chaos driver."""

    def __init__(self, launched: Launched, n_processes: int, seed: int) -> None:
        self.launched, self.n_processes = launched, n_processes
        self.random = random.Random(seed)
        self.restarts = 0

    def pids(self) -> list[int]:
        """The process ids of the current start (each worker prints `pid <n>` first)."""
        lines = self.launched.wait_for("] pid ", count=self.n_processes * (self.restarts + 1), timeout=180)
        current = lines[self.n_processes * self.restarts :]
        by_index = {int(line[1 : line.index("]")]): int(line.split()[-1]) for line in current}
        return [by_index[index] for index in range(self.n_processes)]

    def start_step(self) -> int:
        """The step the current start resumed from (its processes print `start <step>`)."""
        (line, *_) = self.launched.wait_for("] start ", count=self.n_processes * (self.restarts + 1))[
            self.n_processes * self.restarts :
        ]
        return int(line.split()[-1])

    def at_record(self, step: int) -> None:
        """Waits for this start's record of `step` (printed once its saves have started)."""
        self.launched.wait_for(f"] record {step} ", count=self.restarts + 1, timeout=180)

    def restarted(self) -> None:
        self.restarts += 1
        self.launched.wait_for(f"restart {self.restarts} of 5", timeout=180)

    def later_step(self, low: int, high: int) -> int:
        """A random record step (a multiple of the local tier's interval) `low` to `high` steps after this start."""
        start = self.start_step()
        return start + LOCAL_EVERY * self.random.randint(low // LOCAL_EVERY, high // LOCAL_EVERY)


def test_chaos_kill_stop_and_kill_in_a_save_the_run_finishes_bit_for_bit(tmp_path):
    n_processes = 4
    straight = launch_worker(tmp_path, chaos_config(tmp_path, "straight", n_processes), n_processes)
    assert straight.finish(timeout=300) == 0, straight.output[-4000:]
    assert straight.output.count("rolled back to step") == 1, straight.output[-4000:]  # once: process 0 logs
    expected = dict(np.load(tmp_path / "straight" / "final.npz"))

    seed = int(time.time())
    print("chaos seed", seed)
    launched = launch_worker(tmp_path, chaos_config(tmp_path, "chaos", n_processes), n_processes)
    chaos = Chaos(launched, n_processes, seed)
    try:
        # 1. kill -9 of one process.
        pids = chaos.pids()
        chaos.at_record(chaos.later_step(30, 80))
        os.kill(chaos.random.choice(pids), signal.SIGKILL)
        chaos.restarted()
        # 2. SIGSTOP of another: its peers' watchdogs end them with 75, the launcher kills it after the grace.
        pids = chaos.pids()
        chaos.at_record(chaos.later_step(20, 60))
        stopped = chaos.random.choice(pids)
        os.kill(stopped, signal.SIGSTOP)
        chaos.restarted()
        # 3. kill -9 of one during a save: its record is printed once the save has started.
        pids = chaos.pids()
        chaos.at_record(chaos.later_step(20, 60))
        os.kill(chaos.random.choice(pids), signal.SIGKILL)
        chaos.restarted()
        assert launched.finish(timeout=300) == 0, launched.output[-4000:]
    finally:
        launched.kill()
    lines = launched.lines
    restarts = [line for line in lines if line.startswith("flaxstate launch: process")]
    assert len(restarts) == 3, restarts
    assert "was killed by SIGKILL" in restarts[0] and "exited with status 75" in restarts[1], restarts
    assert "was killed by SIGKILL" in restarts[2], restarts
    with pytest.raises(ProcessLookupError):
        os.kill(stopped, 0)
    final = dict(np.load(tmp_path / "chaos" / "final.npz"))
    assert final.keys() == expected.keys()
    for key, value in expected.items():
        np.testing.assert_array_equal(final[key], value, err_msg=key)
    sessions = goodput.report(ledger.run_events(tmp_path / "chaos" / "persistent"))["sessions"]
    assert len(sessions) == 4, sessions
    assert [session["restored_step"] is None for session in sessions] == [True, False, False, False]
    assert all(session["lost_steps"] <= LOCAL_EVERY for session in sessions[:3]), sessions
    # Each restarted round loaded its programs from the launcher's compilation cache (the ledger's sessions say so).
    assert [session["programs"] for session in sessions[1:]] == ["cache"] * 3, sessions
    # The rollback happened once, in the first session, and every later session restored it with the data's position
    # from either tier: none rolled back again (the bad batch stays skipped).
    events = ledger.run_events(tmp_path / "chaos" / "persistent")
    assert [event["at_step"] for event in events if event["event"] == "rollback"] == [15], events


def test_a_notice_between_records_after_a_save_stops_the_launched_processes_at_one_step_and_saves_it(tmp_path):
    """SIGTERM to the launcher (forwarded to both processes, as a cluster manager's notice) while they evaluate after
    their writer saved step 20: both stop at step 20, save it, exit 0, and nothing restarts."""
    config = {"n_steps": 100, "every": 10, "data": "list", "optimizer": "sgd", "keep": 2, "global_batch": 8,
              "per_dispatch": 5, "slow_eval": 0.25, "eval_after_save": True, "output_dir": str(tmp_path / "run"),
              "out": str(tmp_path / "a.npz"), "n_processes": 2}  # fmt: skip
    script = f"""
        import runpy, sys
        sys.argv = ["resume", {json.dumps(config)!r}]
        runpy.run_module("flaxstate_testing.workers.resume", run_name="__main__")
    """
    launched = Launched(tmp_path, script)
    try:
        launched.wait_for("eval batch 2", count=2, timeout=240)
        launched.process.send_signal(signal.SIGTERM)
        assert launched.finish(timeout=120) == 0, launched.output
    finally:
        launched.kill()
    assert {"[0] record 20 preempted", "[1] record 20 preempted"} <= set(launched.lines), launched.output
    assert not any("record 25" in line or "record 30" in line for line in launched.lines), launched.output
    assert saved_steps(tmp_path / "run")[-1] == 20
