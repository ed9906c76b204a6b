import multiprocessing.process
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

# The tests run on the CPU. With libtpu installed (the test extra's jax[tpu], for fs.plan's TPU targets) JAX
# would also try to start a TPU on this machine and print libtpu's complaints; TPU plans need no TPU backend.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# libtpu takes /tmp/libtpu_lockfile for the life of a process: a second process that loads it (another test
# run on this machine, a worker) fails "Internal error when accessing libtpu multi-process lockfile". The
# TPU plans compile only, on no TPU, so the tests (and their workers, which inherit this) may share it.
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
# No test runs on a Google Cloud machine: gcsfs (and google-auth) would otherwise ask its metadata server for
# credentials, and wait 16 s for it to time out, wherever a gs:// filesystem is made without the emulator.
os.environ.setdefault("NO_GCE_CHECK", "true")
# The test processes and their workers share one JAX compilation cache, made for this session and removed after
# it: the workers of many tests compile the same programs again (test_resume*.py with test_preemption*.py took
# 175 s without it, 143 s with it, on 2 cores). Every program is cached, however quick its compilation.
# KEPT_CACHE names a folder kept between sessions instead (`make test-fast` gives tier 0 one a stack, so the
# edit-test loop compiles only what an edit changed: tests/README.md), pruned at the session's start.
KEPT_CACHE = "FLAXSTATE_TESTS_COMPILATION_CACHE"
KEPT_CACHE_BYTES = 512 * 2**20
"""The most a kept cache holds at a session's start: its oldest entries go first (a warm tier 0 is ~35 MiB)."""


def prune(folder: Path, most: int) -> None:
    """Removes `folder`'s oldest files (by modification time) until the rest hold at most `most` bytes.

    Each of `make test-fast`'s workers prunes at its start: a file another removed meanwhile is passed over."""
    entries = []
    for entry in folder.iterdir():
        if not entry.is_file():
            continue
        try:
            status = entry.stat()
        except FileNotFoundError:
            continue
        entries.append((status.st_mtime, status.st_size, entry))
    entries.sort()
    held = sum(size for _, size, _ in entries)
    for _, size, entry in entries:
        if held <= most:
            return
        entry.unlink(missing_ok=True)
        held -= size


_COMPILATION_CACHE = None
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    if os.environ.get(KEPT_CACHE):
        kept = Path(os.environ[KEPT_CACHE]).absolute()
        kept.mkdir(parents=True, exist_ok=True)
        prune(kept, KEPT_CACHE_BYTES)
        os.environ["JAX_COMPILATION_CACHE_DIR"] = str(kept)
    else:
        _COMPILATION_CACHE = os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="flaxstate-tests-jax-")
    os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
    os.environ["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "0"

ROOT = Path(__file__).parents[1]


def run_example(output_dir, steps, *options, timeout=300):
    result = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "digits.py"), "--steps", str(steps), "--output-dir", str(output_dir)]
        + list(options),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


@pytest.fixture(scope="session")
def digits_run(tmp_path_factory):
    """The README's example run for 20 steps, then resumed to 40: its directory and both outputs."""
    output_dir = tmp_path_factory.mktemp("digits") / "run"
    return output_dir, run_example(output_dir, 20), run_example(output_dir, 40)


TIERS = {"_joined": 1, "_processes": 2}
"""A test's tier, declared by its file's name (tests/README.md, "The tiers"): `test_X.py` runs in one process (tier
0); `test_X_joined.py` asks the shared cluster for scenarios on processes joined by `jax.distributed`
(`cluster.run`, tier 1); `test_X_processes.py` starts, kills or signals processes of its own, or servers, kernels,
cluster managers and commands (tier 2)."""


def tier(path: Path) -> int:
    """The tier a test file declares by its name's ending (`TIERS`; 0 for any other)."""
    return next((number for ending, number in TIERS.items() if path.stem.endswith(ending)), 0)


def pytest_collection_modifyitems(config, items):
    """Marks the tests of tiers 1 and 2 `processes` and those of tier 1 `joined`, by their files' names:
    `pytest -m "not processes"` is the quick loop, `-m processes` the runs to repeat under load."""
    for item in items:
        path = getattr(item, "path", None)
        if path is None or path.suffix != ".py" or tier(path) == 0:
            continue
        item.add_marker(pytest.mark.processes)
        if tier(path) == 1:
            item.add_marker(pytest.mark.joined)


LIBRARY_COMMANDS = frozenset({"git", "nvidia-smi"})
"""The commands flaxstate itself runs at its edges (the run record's commit, the GPU's model): short, and not a
test's processes, so a test in one process may run them."""


def _arguments(args) -> list:
    """A `subprocess.Popen`'s arguments as a list (a shell command's words)."""
    return os.fsdecode(args).split() if isinstance(args, str | bytes | os.PathLike) else list(args)


def _program(args) -> str:
    """The program a `subprocess.Popen` runs: its first argument's name (a shell command's first word)."""
    arguments = _arguments(args)
    return os.path.basename(os.fsdecode(arguments[0])) if arguments else ""


@pytest.fixture(autouse=True)
def _tier_kept(request, monkeypatch):
    """Keeps the tiers true. A test of tier 0 that starts a process (a worker, a server, a command other than
    flaxstate's own `git` and `nvidia-smi`, a fork, `multiprocessing`) or asks the shared cluster fails, naming
    what it started; a test of tier 1 may start only the shared cluster's workers and the `cpu_burner` beside it.
    Tier 2 may start anything."""
    path = getattr(request.node, "path", None)
    number = tier(path) if path is not None else 0
    if number == 2:
        yield
        return

    def refused(what: str):
        fix = (
            "only asks the shared cluster, so it starts nothing of its own: move what starts, kills or signals "
            "processes to test_X_processes.py"
            if number == 1
            else "runs in one process: move the test to test_X_joined.py (scenarios on the shared cluster, "
            "`cluster.run`) or test_X_processes.py (processes, servers or commands of its own)"
        )
        raise AssertionError(f"{request.node.nodeid} starts a process ({what}), but its file {fix}: tests/README.md")

    popen_init = subprocess.Popen.__init__

    def checked_popen(self, args, *positional, **keywords):
        program = _program(args)
        served = "flaxstate_testing.workers.serve" in map(os.fsdecode, _arguments(args)) or args == BURNER
        if program not in LIBRARY_COMMANDS and not (number == 1 and served):
            refused(f"subprocess {args!r}"[:200])
        popen_init(self, args, *positional, **keywords)

    monkeypatch.setattr(subprocess.Popen, "__init__", checked_popen)
    for name in ("fork", "forkpty", "system", "posix_spawn", "posix_spawnp"):
        if hasattr(os, name):
            monkeypatch.setattr(os, name, lambda *args, _name=name, **keywords: refused(f"os.{_name}"))
    monkeypatch.setattr(multiprocessing.process.BaseProcess, "start", lambda self: refused("multiprocessing"))
    cluster = sys.modules.get("flaxstate_testing.cluster")
    if number == 0 and cluster is not None:  # a cluster already started needs no new process to be asked
        monkeypatch.setattr(cluster.Cluster, "run", lambda self, *args, **keywords: refused("the shared cluster"))
    yield


BURNER = ["bash", "-c", "for _ in $(seq $(nproc)); do (while :; do :; done) & done; wait"]
"""`cpu_burner`'s command: the load beside a test, which a test of tier 1 may start."""

UNDER_LOAD = "FLAXSTATE_TESTS_BURNER"
"""The environment variable holding the pid of the session's burner (`--under-load`), while it runs."""
_BURNER = pytest.StashKey[subprocess.Popen]()


def pytest_addoption(parser):
    parser.addoption(
        "--under-load",
        action="store_true",
        help="run the whole session beside a CPU burner on every core (BURNER), started before the first test "
        "and stopped by its pid after the last: `make test-under-load` (tests/README.md, issue 95 item 6)",
    )


def _start_burner() -> subprocess.Popen:
    return subprocess.Popen(BURNER, start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def _stop_burner(burner: subprocess.Popen) -> None:
    try:
        os.killpg(burner.pid, 9)
    except ProcessLookupError:
        pass
    burner.wait()


def pytest_sessionstart(session):
    os.environ.pop(UNDER_LOAD, None)  # a pytest started by a test of a loaded session has no burner of its own
    if session.config.getoption("--under-load", default=False):
        burner = session.config.stash[_BURNER] = _start_burner()
        os.environ[UNDER_LOAD] = str(burner.pid)


def pytest_sessionfinish(session, exitstatus):
    if "flaxstate_testing.cluster" in sys.modules:  # the shared cluster's workers, started by a test that ran
        sys.modules["flaxstate_testing.cluster"].close()
    if _COMPILATION_CACHE is not None:
        shutil.rmtree(_COMPILATION_CACHE, ignore_errors=True)
    burner = session.config.stash.get(_BURNER, None)
    if burner is not None:
        _stop_burner(burner)
        os.environ.pop(UNDER_LOAD, None)


@pytest.fixture
def cpu_burner():
    """A process spinning on every core beside the test (users' machines are loaded), stopped by its pid after it."""
    burner = _start_burner()
    try:
        yield burner
    finally:
        _stop_burner(burner)
