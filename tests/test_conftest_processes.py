"""The test tiers that `tests/conftest.py` declares by file name, and keeps: a pytest of its own over small test files.

Tier 2 (tests/README.md): tests that start, kill or signal processes of their own, or run servers or commands.

Each file below is written to a temporary folder beside a copy of this suite's `conftest.py`, and that pytest runs
them (a process of its own: tier 2). What each test does is real (a command, a fork, the shared cluster asked);
what is checked is which of them the conftest lets run in which tier, and what it says to those it refuses.
"""

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

TESTS = Path(__file__).parent

ONE_PROCESS = """
import os
import subprocess

from flaxstate_testing import cluster


def test_a_command():
    subprocess.run(["true"], check=True)


def test_a_fork():
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)


def test_flaxstate_s_own_git():
    subprocess.run(["git", "--version"], check=True, capture_output=True)


def test_the_shared_cluster():
    cluster.run("probe", {}, n_processes=1)


def test_nothing_but_this_process():
    assert sum(range(4)) == 6
"""

JOINED = """
import subprocess


def test_a_command():
    subprocess.run(["true"], check=True)


def test_the_load_beside_it(cpu_burner):
    assert cpu_burner.poll() is None
"""

PROCESSES = """
import subprocess


def test_a_command():
    subprocess.run(["true"], check=True)
"""


@pytest.fixture(scope="module")
def suite(tmp_path_factory):
    """A folder holding one subject's three tiers and the conftest, and pytest run over it: its output."""
    folder = tmp_path_factory.mktemp("suite")
    (folder / "conftest.py").write_text((TESTS / "conftest.py").read_text())
    (folder / "test_subject.py").write_text(ONE_PROCESS)
    (folder / "test_subject_joined.py").write_text(JOINED)
    (folder / "test_subject_processes.py").write_text(PROCESSES)
    (folder / "pytest.ini").write_text("[pytest]\nmarkers =\n    processes: tiers 1 and 2\n    joined: tier 1\n")
    return folder


def pytest_in(folder: Path, *arguments: str) -> str:
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-rA", *arguments],
        cwd=folder,
        env={**os.environ, "PYTHONPATH": str(TESTS)},
        capture_output=True,
        text=True,
        timeout=240,
    )
    return result.stdout + result.stderr


def outcomes(output: str) -> dict[str, str]:
    """Each test's outcome, from pytest's `-rA` summary lines ("PASSED test_subject.py::test_a_command")."""
    found = {}
    for line in output.splitlines():
        words = line.split(" ", 2)
        if len(words) >= 2 and words[0] in {"PASSED", "FAILED", "ERROR"} and "::" in words[1]:
            found[words[1]] = words[0]
    return found


def test_a_tier_is_its_file_s_name_and_the_markers_select_it(suite):
    def collected(*arguments):
        output = pytest_in(suite, "--collect-only", "-q", *arguments)
        return sorted(line for line in output.splitlines() if "::" in line)

    assert collected("-m", "not processes") == [
        f"test_subject.py::{name}"
        for name in sorted(
            [
                "test_a_command",
                "test_a_fork",
                "test_flaxstate_s_own_git",
                "test_the_shared_cluster",
                "test_nothing_but_this_process",
            ]
        )
    ]
    assert collected("-m", "joined") == [
        "test_subject_joined.py::test_a_command",
        "test_subject_joined.py::test_the_load_beside_it",
    ]
    assert collected("-m", "processes and not joined") == ["test_subject_processes.py::test_a_command"]


def test_each_tier_runs_what_it_declares_and_refuses_the_rest_naming_where_it_belongs(suite):
    output = pytest_in(suite)
    assert outcomes(output) == {
        "test_subject.py::test_a_command": "FAILED",
        "test_subject.py::test_a_fork": "FAILED",
        "test_subject.py::test_flaxstate_s_own_git": "PASSED",
        "test_subject.py::test_the_shared_cluster": "FAILED",
        "test_subject.py::test_nothing_but_this_process": "PASSED",
        "test_subject_joined.py::test_a_command": "FAILED",
        "test_subject_joined.py::test_the_load_beside_it": "PASSED",
        "test_subject_processes.py::test_a_command": "PASSED",
    }, output
    assert "test_subject.py::test_a_command starts a process (subprocess ['true'])" in output, output
    assert "test_subject.py::test_a_fork starts a process (os.fork)" in output, output
    assert "test_subject.py::test_the_shared_cluster starts a process (the shared cluster)" in output, output
    assert "move the test to test_X_joined.py" in output and "or test_X_processes.py" in output, output
    assert "test_subject_joined.py::test_a_command starts a process (subprocess ['true'])" in output, output
    assert "only asks the shared cluster" in output, output


UNDER_LOAD = """
import os
from pathlib import Path


def test_the_load_runs_beside_it():
    pid = os.environ.get("FLAXSTATE_TESTS_BURNER")
    Path("burner.pid").write_text(pid or "")
    assert pid is not None
    command = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\\0")
    assert command[:2] == [b"bash", b"-c"] and b"while :; do :; done" in command[2], command
    spinning = [
        child
        for child in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
        if Path(f"/proc/{child}/stat").read_text().split(") ")[1][0] in "RS"
    ]
    assert len(spinning) == os.cpu_count(), spinning
"""


def group_running(pgid: int, wait: float = 10.0) -> list[str]:
    """The processes of a process group still running (not zombies) after up to `wait` seconds: a process killed
    by SIGKILL is gone once its parent or init has reaped it."""
    deadline = time.monotonic() + wait
    while True:
        rows = subprocess.run(["ps", "-eo", "pid=,pgid=,stat="], capture_output=True, text=True).stdout.splitlines()
        running = [row for row in rows if row.split()[1] == str(pgid) and not row.split()[2].startswith("Z")]
        if not running or time.monotonic() > deadline:
            return running
        time.sleep(0.1)


def test_under_load_a_burner_runs_from_the_first_test_to_the_last_and_is_stopped_by_its_pid(tmp_path):
    (tmp_path / "conftest.py").write_text((TESTS / "conftest.py").read_text())
    (tmp_path / "test_loaded_processes.py").write_text(UNDER_LOAD)

    loaded = pytest_in(tmp_path, "--under-load")
    assert outcomes(loaded) == {"test_loaded_processes.py::test_the_load_runs_beside_it": "PASSED"}, loaded
    pid = int((tmp_path / "burner.pid").read_text())
    assert not Path(f"/proc/{pid}").exists(), f"the burner {pid} still runs after its session"
    assert not group_running(pid), f"the burner's processes {group_running(pid)} still run after its session"

    plain = pytest_in(tmp_path)
    assert outcomes(plain) == {"test_loaded_processes.py::test_the_load_runs_beside_it": "FAILED"}, plain


KEPT = """
import os
from pathlib import Path

import jax
import jax.numpy as jnp

from flaxstate.training import compiling


def test_a_program():
    compiling.seconds()  # starts the counts
    jax.jit(lambda x: jnp.sin(x) * 3.25)(jnp.ones(5)).block_until_ready()
    requests, hits = compiling.cached()
    Path("session").write_text(f"{os.environ['JAX_COMPILATION_CACHE_DIR']} {requests} {hits}")
"""


def test_a_kept_cache_outlives_its_session_and_the_next_loads_its_programs_a_session_s_own_is_removed(tmp_path):
    (tmp_path / "conftest.py").write_text((TESTS / "conftest.py").read_text())
    (tmp_path / "test_kept.py").write_text(KEPT)
    outer = {name: value for name, value in os.environ.items() if not name.startswith(("JAX_", "FLAXSTATE_TESTS"))}

    def session(**environment: str) -> tuple[Path, int, int]:
        result = subprocess.run(
            [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q"],
            cwd=tmp_path,
            env={**outer, "PYTHONPATH": str(TESTS), "JAX_PLATFORMS": "cpu", **environment},
            capture_output=True,
            text=True,
            timeout=240,
        )
        assert result.returncode == 0, result.stdout + result.stderr
        folder, requests, hits = (tmp_path / "session").read_text().split()
        return Path(folder), int(requests), int(hits)

    kept = tmp_path / "kept"
    first = session(FLAXSTATE_TESTS_COMPILATION_CACHE=str(kept))
    assert first[0] == kept and first[1] >= 1 and first[2] == 0, first
    assert any(kept.iterdir()), "the first session wrote no program to the kept cache"
    second = session(FLAXSTATE_TESTS_COMPILATION_CACHE=str(kept))
    assert second[0] == kept and second[2] == second[1] >= 1, f"{second}: the kept cache answered no request"

    own = session()
    assert own[0] != kept and own[1] >= 1 and own[2] == 0, own
    assert not own[0].exists(), f"the session's own cache {own[0]} outlived it"
