import ast
import functools
import multiprocessing.process
import os
import re
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
# it: the workers of many tests compile the same programs again (test_resume.py with test_preemption.py took
# 175 s without it, 143 s with it, on 2 cores). Every program is cached, however quick its compilation.
_COMPILATION_CACHE = None
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
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


STARTS_PROCESSES = re.compile(
    r"processes\.(run|start|watched)\(|cluster\.run\(|subprocess\.|Launched\(|run_example\(|moto_s3\(|fake_gcs|gcs_emulator|"
    r"KernelManager|start_new_kernel|os\.kill\(|\.send_signal\(|\bdigits_run\b|"
    r"\"workers\": [1-9]|capture_fails\("
)
"""What in a test's code starts a process (a worker, a server, a kernel, a command) or sends a signal: among them
`fs.global_batches(workers=N)`'s grain worker processes and `xla_settings.capture_fails`'s probe process."""


def _sources(path: Path) -> dict[str, str]:
    """The source of each module-level function and class of a module, by name."""
    text = path.read_text()
    return {
        node.name: ast.get_source_segment(text, node) or ""
        for node in ast.parse(text).body
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef)
    }


@functools.cache
def _shared_helpers() -> re.Pattern[str]:
    """What in a test's code calls a shared helper (`flaxstate_testing`) that starts processes."""
    names = set()
    for module in (ROOT / "tests" / "flaxstate_testing").glob("*.py"):
        if module.name != "processes.py":  # its calls are `processes.run(...)`, which STARTS_PROCESSES names
            names |= {
                name
                for name, source in _sources(module).items()
                if not name.startswith("_") and STARTS_PROCESSES.search(source)
            }
    return re.compile(r"\b(" + "|".join(sorted(map(re.escape, names))) + r")\(") if names else re.compile("$^")


@functools.cache
def _starting(path: str) -> frozenset[str]:
    """The module-level functions and classes (tests, helpers, fixtures) of a test module that start processes,
    directly, through another of them, or through a shared helper."""
    sources = _sources(Path(path))
    starts = (STARTS_PROCESSES, _shared_helpers())
    starting = {name for name, source in sources.items() if any(each.search(source) for each in starts)}
    while True:
        calls = re.compile(r"\b(" + "|".join(map(re.escape, starting)) + r")\b") if starting else None
        more = {name for name, source in sources.items() if calls and name not in starting and calls.search(source)}
        if not more:
            return frozenset(starting)
        starting |= more


def pytest_collection_modifyitems(config, items):
    """Marks `processes` every test that starts a process or sends a signal, or asks for a fixture that does:
    `pytest -m "not processes"` is the quick loop, `-m processes` the runs to repeat under load."""
    for item in items:
        path = getattr(item, "path", None)
        if path is None or path.suffix != ".py":
            continue
        starting = _starting(str(path))
        name = getattr(item, "originalname", item.name)
        if name in starting or set(getattr(item, "fixturenames", ())) & (starting | {"digits_run"}):
            item.add_marker(pytest.mark.processes)


LIBRARY_COMMANDS = frozenset({"git", "nvidia-smi"})
"""The commands flaxstate itself runs at its edges (the run record's commit, the GPU's model): short, and not a
test's processes, so a test in one process may run them."""


def _program(args) -> str:
    """The program a `subprocess.Popen` runs: its first argument's name (a shell command's first word)."""
    first = os.fsdecode(args if isinstance(args, str | bytes | os.PathLike) else next(iter(args), ""))
    return os.path.basename(first.split()[0]) if first.strip() else ""


@pytest.fixture(autouse=True)
def _one_process_unless_marked(request, monkeypatch):
    """Keeps the tiers true: a test not marked `processes` that starts a process (a worker, a server, a command
    other than flaxstate's own `git` and `nvidia-smi`, a fork) fails, naming what it started, instead of running
    in the quick tier as a test that only looks quick. `STARTS_PROCESSES` then needs the name of what it used."""
    if request.node.get_closest_marker("processes") is not None:
        yield
        return

    def refused(what: str):
        raise AssertionError(
            f"{request.node.nodeid} starts a process ({what}) but is not marked `processes`: tests/conftest.py "
            "marks a test that calls a helper named in STARTS_PROCESSES (or a fixture that does); name yours there"
        )

    popen_init = subprocess.Popen.__init__

    def checked_popen(self, args, *positional, **keywords):
        if _program(args) not in LIBRARY_COMMANDS:
            refused(f"subprocess {args!r}"[:200])
        popen_init(self, args, *positional, **keywords)

    monkeypatch.setattr(subprocess.Popen, "__init__", checked_popen)
    for name in ("fork", "forkpty", "system", "posix_spawn", "posix_spawnp"):
        if hasattr(os, name):
            monkeypatch.setattr(os, name, lambda *args, _name=name, **keywords: refused(f"os.{_name}"))
    monkeypatch.setattr(multiprocessing.process.BaseProcess, "start", lambda self: refused("multiprocessing"))
    yield


def pytest_sessionfinish(session, exitstatus):
    if "flaxstate_testing.cluster" in sys.modules:  # the shared cluster's workers, started by a test that ran
        sys.modules["flaxstate_testing.cluster"].close()
    if _COMPILATION_CACHE is not None:
        shutil.rmtree(_COMPILATION_CACHE, ignore_errors=True)


@pytest.fixture
def cpu_burner():
    """A process spinning on every core beside the test (users' machines are loaded), stopped by its pid after it."""
    burner = subprocess.Popen(
        ["bash", "-c", "for _ in $(seq $(nproc)); do (while :; do :; done) & done; wait"],
        start_new_session=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        yield burner
    finally:
        os.killpg(burner.pid, 9)
        burner.wait()
