"""`flaxstate launch`: start N processes of a command on this machine, and start them all again after a failure.

JAX has no `torchrun`. This is its one-host answer, after torchrun's elastic
agent: it starts N processes, prefixes each one's output with its index,
watches them, and when any fails (a non-zero exit, or a signal: kill -9, the
watchdog's 75, a crash, out of memory) it stops the others (SIGTERM, then
SIGKILL after `grace` seconds) and starts all N again, at most
`max_restarts` times. The restarted processes resume from the newest
checkpoint through the tiers, as any restart does.

Each process finds its peers through `jax.distributed.initialize()` with no
arguments, the call a script makes under SLURM or on a TPU pod: importing
flaxstate registers `LaunchedCluster` (`flaxstate.clusters`), one of JAX's
cluster environments, present where the launcher set `FLAXSTATE_COORDINATOR_ADDRESS`,
`FLAXSTATE_PROCESS_COUNT` and `FLAXSTATE_PROCESS_ID`. `FLAXSTATE_RESTARTS`
says how many restarts came before (torchrun's `TORCHELASTIC_RESTART_COUNT`).
With no GPU the launcher also sets `JAX_CPU_COLLECTIVES_IMPLEMENTATION=gloo`
(unless it is set), so that CPU processes can talk.

With `--min-processes K` (`min_processes`) the job goes on with fewer
processes after a process is lost: one whose index failed `LOST_AFTER`
rounds in a row, or that a cluster's health check named in the file that
`FLAXSTATE_LOST_FILE` gives (one process index a line, in the numbering of
the round that failed). At each failure the launcher takes that file: it
renames it, applies its lines, and appends them to `<file>.applied`, so a
line is applied once, and a health check may append lines to the file or
write it anew (opening it for each write, as `echo 1 >> FILE` and
`echo 1 > FILE` do: a write through a handle held open across a failure
lands in the file taken). A line that is not a process index of that round
(or bytes that are not one) is ignored, and the launcher says so in one
line. The next round
starts the largest count that divides `--processes` (so that a global
batch that split over N processes splits over them too) within the
processes left, and not below K; below K the launcher gives up with the
failing status. It says so in one line. The processes of a smaller round
are numbered 0..n-1 again (JAX's process ids) and resume through the tiers:
`TrainLoop(max_device_batch=...)` keeps the global batch, `global_batches`
the examples of each step.

The processes share one JAX persistent compilation cache, so that a
restarted process loads its programs instead of compiling them again:
`JAX_COMPILATION_CACHE_DIR` is set to `<cache>/processes-<n>` (`--compilation-cache
DIR`, default `~/.cache/flaxstate/compilation`; `--compilation-cache none`
for none), one folder a process count, so that a smaller job never takes a
larger job's programs. A `JAX_COMPILATION_CACHE_DIR` of your own wins. JAX
caches only programs that took `JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS`
(1 s by default) to compile: the ones a restart waits for. On a GPU (or with
a GPU preset) the same folder keeps XLA's autotune results, a file a process
(`autotune/process-<i>.textproto`): each process dumps its results there
(`--xla_gpu_dump_autotune_results_to`) and a restarted one that must
compile (the cache holds no programs) loads them
(`--xla_gpu_load_autotune_results_from`), so that a program compiled again
picks the kernels it picked before: autotuning is not deterministic. Where
the cache holds the programs, a restart takes the flags they were compiled
with (JAX's cache key hashes them) and loads the programs themselves. Each record's session says
whether its programs came from the cache (`Session.programs`).

`--xla-preset NAME|auto|none` (`xla_preset`, `auto` by default) applies one
of `flaxstate.xla_settings.PRESETS` to every process: XLA's flags and
variables for this machine's GPU generation (none without a GPU), the user's
own `XLA_FLAGS` and variables winning flag by flag. A preset that captures
while loops in CUDA graphs is tried once first, in a child process
(`xla_settings.capture_fails`); where capture fails, its processes run
without it, and the launcher says so in one line.

Signals to the launcher: SIGTERM (a preemption of the whole job) is
forwarded to every process of the round running or starting, which save and
exit 0; no round starts after it, processes still running `grace` seconds
after it are killed, and the launcher exits with their status. The first
Ctrl-C is forwarded as SIGINT, a second stops them all (SIGKILL).

Each process runs in a process group of its own, and the launcher signals
the whole group of every process it started, failed or not, at a restart and
at the end: a crashed trainer's data-loader workers do not outlive it.
"""

from __future__ import annotations

import dataclasses
import math
import os
import queue
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from typing import IO

from flaxstate import clusters, settings, xla_settings
from flaxstate.clusters import (  # noqa: F401  (the launcher's variables, which its processes read)
    COORDINATOR,
    LOCAL_PROCESS_ID,
    LOST_FILE,
    PROCESS_COUNT,
    PROCESS_ID,
    RESTARTS,
)

LOST_AFTER = 2
"""Rounds in a row that one process index fails before `--min-processes` counts it lost."""


CACHE = "JAX_COMPILATION_CACHE_DIR"


def default_compilation_cache() -> str:
    """`$XDG_CACHE_HOME/flaxstate/compilation` (`~/.cache/...` without it): the launcher's compilation caches."""
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(root, "flaxstate", "compilation")


def local_gpus() -> int:
    """The GPUs of this machine that `nvidia-smi -L` lists (0 where there is none, or no driver)."""
    if shutil.which("nvidia-smi") is None:
        return 0
    try:
        listed = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return 0
    return sum(line.startswith("GPU ") for line in listed.stdout.splitlines()) if listed.returncode == 0 else 0


def autotune_flags(cache: str, index: int) -> tuple[str, ...]:
    """XLA's flags that keep process `index`'s autotune results in the compilation cache folder `cache`: its dump,
    and its load where an earlier round dumped them, as the round that filled the cache had them.

    JAX's cache key hashes `XLA_FLAGS`: a round with a flag more or less than the round that compiled the cached
    programs finds none of them (on an H200, a restart that added the load compiled everything again). So where
    the cache holds programs, a round takes the flags they were compiled with (`process-<i>.loaded` marks that
    they were compiled with the load); where it holds none (a first round, or the cache cleared or moved), a
    round loads the results if there are any, and says so for the rounds after it.
    """
    folder = os.path.join(cache, "autotune")
    results = os.path.join(folder, f"process-{index}.textproto")
    marker = os.path.join(folder, f"process-{index}.loaded")
    os.makedirs(folder, exist_ok=True)
    with os.scandir(cache) as entries:
        programs = any(entry.name != "autotune" for entry in entries)
    if programs:
        load = os.path.exists(marker)
    else:
        load = os.path.exists(results)
        if load:
            open(marker, "w").close()
        elif os.path.exists(marker):
            os.remove(marker)
    dump = f"--xla_gpu_dump_autotune_results_to={results}"
    return (dump, f"--xla_gpu_load_autotune_results_from={results}") if load else (dump,)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def describe_status(returncode: int) -> str:
    """`exited with status 3`, or `was killed by SIGKILL`."""
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = f"signal {-returncode}"
        return f"was killed by {name}"
    return f"exited with status {returncode}"


def exit_status(returncode: int) -> int:
    """A child's status as a shell gives it: its exit status, or 128 + the signal that killed it."""
    return 128 - returncode if returncode < 0 else returncode


@dataclasses.dataclass(frozen=True)
class Failure:
    """How a round of processes ended when one failed: the first process to end with a non-zero status.

    Attributes:
        index: the failed process's index in its round.
        returncode: its status (`Popen.returncode`: negative for a signal).
    """

    index: int
    returncode: int

    def __str__(self) -> str:
        return f"process {self.index} {describe_status(self.returncode)}"

    @property
    def exit_status(self) -> int:
        """The launcher's exit status for it (`exit_status`)."""
        return exit_status(self.returncode)


@dataclasses.dataclass(frozen=True)
class LaunchConfig:
    """What `flaxstate launch` runs.

    Attributes:
        command: the command of each process.
        n_processes: how many processes (default: one a local GPU, else 1).
        max_restarts: how many times all are started again after a failure.
        grace: seconds between the SIGTERM and the SIGKILL that stop the others.
        min_processes: the fewest processes the job may go on with after
            processes are lost (`None`: `n_processes`, never fewer).
        compilation_cache: the folder of the processes' JAX compilation
            caches, one a process count (`None`: none).
        xla_preset: the XLA preset of the processes (`flaxstate.xla_settings`: a
            name, `"auto"` or `"none"`).
    """

    command: tuple[str, ...]
    n_processes: int
    max_restarts: int = 3
    grace: float = 30.0
    min_processes: int | None = None
    compilation_cache: str | None = dataclasses.field(default_factory=default_compilation_cache)
    xla_preset: str = "auto"

    def __post_init__(self) -> None:
        if not self.command:
            raise ValueError("flaxstate launch needs a command: flaxstate launch --processes N -- python train.py")
        if self.xla_preset != "auto" and self.xla_preset not in xla_settings.PRESETS:
            raise ValueError(
                f"--xla-preset must be one of {', '.join(['auto', *xla_settings.PRESETS])}, got {self.xla_preset!r}."
            )
        if not settings.is_integer(self.n_processes) or self.n_processes < 1:
            raise ValueError(f"--processes must be at least 1, got {self.n_processes!r}.")
        if not settings.is_integer(self.max_restarts) or self.max_restarts < 0:
            raise ValueError(f"--max-restarts must be 0 or more, got {self.max_restarts!r}.")
        if not settings.is_real(self.grace) or not math.isfinite(self.grace) or self.grace < 0:
            raise ValueError(f"--grace must be 0 or more seconds, got {self.grace!r}.")
        if self.min_processes is not None and (
            not settings.is_integer(self.min_processes) or not 1 <= self.min_processes <= self.n_processes
        ):
            raise ValueError(
                f"--min-processes must be between 1 and --processes ({self.n_processes}), got {self.min_processes}."
            )
        for name in ("n_processes", "max_restarts", "min_processes"):  # Python numbers (numpy's from a config)
            if getattr(self, name) is not None:
                object.__setattr__(self, name, int(getattr(self, name)))
        object.__setattr__(self, "grace", float(self.grace))
        program = self.command[0]
        found = os.access(program, os.X_OK) if os.sep in program else shutil.which(program) is not None
        if not found:
            raise ValueError(f"no such program: {program}")


class Launcher:
    """Runs a `LaunchConfig` (see the module); `run()` returns the launcher's exit status.

    Args:
        config: what to run.
        out: where the processes' prefixed lines and the launcher's own go.
    """

    def __init__(self, config: LaunchConfig, out: IO[str] | None = None) -> None:
        self.config = config
        self._out = out if out is not None else sys.stdout
        self._lock = threading.Lock()
        self._processes: list[subprocess.Popen[str]] = []
        self._readers: list[threading.Thread] = []
        self._preempted = False
        self._preempted_at: float | None = None
        """When the preemption notice came (monotonic), for the grace after it."""
        self._interrupts = 0
        self._gpus = local_gpus()
        self._preset = xla_settings.preset(config.xla_preset).name
        """The processes' XLA preset (`auto` chosen once, for every round)."""
        why = xla_settings.capture_fails(self._preset, os.environ)
        self._capture = why is None
        """Whether the preset's while loops go into CUDA graphs (tried once, in a child process)."""
        if why is not None:
            self.say(xla_settings.fallback_line(self._preset, why))
        self.n_running = config.n_processes
        """The processes of a round: `--processes`, fewer after processes were lost (`--min-processes`)."""
        self._failed_in_a_row: tuple[int, int] = (-1, 0)
        """The index that failed the last rounds, and how many rounds in a row."""
        self._lost_read_in_place: bytes | None = None
        """What `FLAXSTATE_LOST_FILE` held when it was last read where it could not be taken (its folder read-only):
        the same bytes again name no new loss."""

    def say(self, line: str) -> None:
        """One line of the launcher's own."""
        with self._lock:
            self._out.write(f"flaxstate launch: {line}\n")
            self._out.flush()

    def run(self) -> int:
        """Starts the processes, restarts them after failures, and returns the exit status (see the module)."""
        previous = {
            signal.SIGTERM: signal.signal(signal.SIGTERM, self._on_sigterm),
            signal.SIGINT: signal.signal(signal.SIGINT, self._on_sigint),
        }
        try:
            restarts = 0
            while True:
                if self._preempted:  # a notice between two rounds: none starts
                    self.say("preempted before the processes started again; not restarting.")
                    return 0
                failed = self._run_once(restarts)
                if failed is None:
                    return 0
                if self._preempted or self._interrupts:
                    why = "after the preemption" if self._preempted else "after Ctrl-C"
                    self.say(f"{failed} {why}; not restarting.")
                    return failed.exit_status
                if restarts >= self.config.max_restarts:
                    self.say(
                        f"{failed} after {restarts} restarts (--max-restarts {self.config.max_restarts}); giving up."
                    )
                    return failed.exit_status
                restarts += 1
                lost = self._lost(failed.index)
                if lost:
                    fewer = self._fewer(len(lost))
                    if fewer < (self.config.min_processes or self.config.n_processes):
                        self.say(
                            f"{failed}; {lost} lost: {fewer} processes could go "
                            f"on (the most that divide --processes {self.config.n_processes} within the "
                            f"{self.n_running - len(lost)} left), below --min-processes {self.config.min_processes}; "
                            "giving up."
                        )
                        return failed.exit_status
                    self.say(
                        f"{failed}; {lost} lost: restart {restarts} of "
                        f"{self.config.max_restarts} goes on with {fewer} processes (of {self.config.n_processes}; "
                        f"--min-processes {self.config.min_processes})."
                    )
                    self.n_running, self._failed_in_a_row = fewer, (-1, 0)
                    continue
                self.say(
                    f"{failed}; restart {restarts} of "
                    f"{self.config.max_restarts}: starting all {self.n_running} processes again."
                )
        finally:
            self._stop_all(0.0)
            for number, handler in previous.items():
                signal.signal(number, handler)

    def _lost(self, index: int) -> list[int]:
        """The processes lost after `index` failed (none without `--min-processes`): it, where it failed
        `LOST_AFTER` rounds in a row, and those the health check's file names."""
        if self.config.min_processes is None:
            return []
        last, times = self._failed_in_a_row
        self._failed_in_a_row = (index, times + 1 if last == index else 1)
        lost = {index} if self._failed_in_a_row[1] >= LOST_AFTER else set()
        path = os.environ.get(LOST_FILE)
        return sorted(lost | (self._declared_lost(path) if path else set()))

    def _declared_lost(self, path: str) -> set[int]:
        """The process indices that the health check's file names (see the module): the launcher takes the file
        (renames it, reads it, and appends what it read to `<file>.applied`), so that each line is applied once
        whether the health check appends lines or writes the file anew. A line that is not an index of the round
        that failed is ignored, in one line each."""
        taking = f"{path}.taking"
        try:
            os.replace(path, taking)
        except FileNotFoundError:  # nothing declared since the last failure
            return set()
        except OSError as error:  # a folder the launcher cannot write: read in place, new bytes only
            try:
                with open(path, "rb") as named:
                    data = named.read()
            except OSError:
                return set()
            if data == self._lost_read_in_place:
                return set()
            self.say(f"{LOST_FILE} {path} could not be taken ({error}); read in place.")
            self._lost_read_in_place = data
        else:
            try:
                with open(taking, "rb") as named:
                    data = named.read()
                with open(f"{path}.applied", "ab") as applied:
                    applied.write(data if data.endswith(b"\n") or not data else data + b"\n")
                os.remove(taking)
            except OSError as error:
                self.say(f"{LOST_FILE} {path} could not be read ({error}); no process declared lost.")
                return set()
        declared = set()
        for number, line in enumerate(data.splitlines(), start=1):
            text = line.strip()
            if not text:
                continue
            index = int(text) if text.isdigit() else None
            if index is None or index >= self.n_running:
                self.say(
                    f'{LOST_FILE} line {number} "{text.decode("utf-8", "backslashreplace")}" is not a process index '
                    f"of this round (0 to {self.n_running - 1}); ignored."
                )
                continue
            declared.add(index)
        return declared

    def _fewer(self, n_lost: int) -> int:
        """The processes of the next round after `n_lost` were lost: the largest count that divides `--processes`
        within those left (0 where none is left)."""
        left = self.n_running - n_lost
        return next((n for n in range(left, 0, -1) if self.config.n_processes % n == 0), 0)

    def _environment(self, index: int, port: int, restarts: int) -> dict[str, str]:
        env = dict(os.environ)
        env.update(
            {
                COORDINATOR: f"127.0.0.1:{port}",
                PROCESS_COUNT: str(self.n_running),
                PROCESS_ID: str(index),
                RESTARTS: str(restarts),
                "PYTHONUNBUFFERED": "1",
            }
        )
        cache = None
        if self.config.compilation_cache is not None:
            cache = os.path.join(self.config.compilation_cache, f"processes-{self.n_running}")
            if not os.environ.get(CACHE):  # the user's own wins
                env[CACHE] = cache
        preset = self._preset
        env.update(xla_settings.environment(preset, env, self._capture))
        if cache is not None and (self._gpus or preset != "none"):
            env["XLA_FLAGS"] = xla_settings.compose(autotune_flags(cache, index), env.get("XLA_FLAGS", ""))
        if self._gpus:
            env[LOCAL_PROCESS_ID] = str(index % self._gpus)
        else:
            env.setdefault("JAX_CPU_COLLECTIVES_IMPLEMENTATION", "gloo")
        return env

    def _run_once(self, restarts: int) -> Failure | None:
        """Starts every process and watches them: `None` when all exit 0, else the first `Failure`.

        The first failure is the first process to end with a non-zero status, as a thread waiting on each saw it
        end: a failing process's peers fail within milliseconds (their collectives lose it), and a poll of all
        of them took the lowest index among those ended by then, a peer's index and not the lost one's.
        """
        port = _free_port()
        self._processes, self._readers = [], []
        ended: queue.SimpleQueue[tuple[int, int]] = queue.SimpleQueue()
        for index in range(self.n_running):
            process = subprocess.Popen(
                list(self.config.command),
                env=self._environment(index, port, restarts),
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                errors="replace",
                start_new_session=True,  # the terminal's Ctrl-C reaches the launcher only, which forwards it
            )
            reader = threading.Thread(target=self._prefix, args=(index, process), daemon=True)
            reader.start()
            threading.Thread(target=lambda i=index, p=process: ended.put((i, p.wait())), daemon=True).start()
            self._processes.append(process)
            self._readers.append(reader)
            if self._preempted:  # the notice came while this round started: it reaches this process too
                self._signal_group(process, signal.SIGTERM)
        failed: Failure | None = None
        n_ended = 0
        while failed is None and n_ended < len(self._processes):
            try:
                index, code = ended.get(timeout=0.05)
            except queue.Empty:
                pass
            else:
                n_ended += 1
                failed = Failure(index, code) if code != 0 else None
            if self._preempted_at is not None and time.monotonic() > self._preempted_at + self.config.grace:
                self.say(f"processes still running {self.config.grace:g} s after the preemption: killed.")
                self._signal_all(signal.SIGKILL)
                self._preempted_at = None  # once
        if failed is not None and not self._preempted:
            self._stop_all(self.config.grace)
        elif self._preempted_at is not None:  # the others have until the notice's grace ends
            self._stop_all(max(self._preempted_at + self.config.grace - time.monotonic(), 0.0), term=False)
        for process in self._processes:
            process.wait()
        self._signal_all(signal.SIGKILL)  # what the processes left behind in their groups
        for reader in self._readers:
            reader.join(timeout=10)
        return failed

    def _prefix(self, index: int, process: subprocess.Popen[str]) -> None:
        assert process.stdout is not None
        for line in process.stdout:
            with self._lock:
                self._out.write(f"[{index}] {line}" if line.endswith("\n") else f"[{index}] {line}\n")
                self._out.flush()

    def _signal_all(self, number: int) -> None:
        """Signals the process group of every process of the round, those that ended too (their children)."""
        for process in self._processes:
            self._signal_group(process, number)

    @staticmethod
    def _signal_group(process: subprocess.Popen[str], number: int) -> None:
        try:
            os.killpg(process.pid, number)
        except (ProcessLookupError, PermissionError):  # the group is gone
            pass

    def _stop_all(self, grace: float, term: bool = True) -> None:
        """SIGTERM to every process (`term`), SIGKILL to those still running after `grace` seconds."""
        if grace > 0:
            if term:
                self._signal_all(signal.SIGTERM)
            deadline = time.monotonic() + grace
            while any(process.poll() is None for process in self._processes) and time.monotonic() < deadline:
                time.sleep(0.05)
        self._signal_all(signal.SIGKILL)
        for process in self._processes:
            process.wait()

    def _on_sigterm(self, signum: int, frame: object) -> None:
        self._preempted = True
        if self._preempted_at is None:
            self._preempted_at = time.monotonic()
        self._signal_all(signal.SIGTERM)

    def _on_sigint(self, signum: int, frame: object) -> None:
        self._interrupts += 1
        self._signal_all(signal.SIGINT if self._interrupts == 1 else signal.SIGKILL)


def launch(
    command: Sequence[str],
    n_processes: int | None = None,
    max_restarts: int = 3,
    grace: float = 30.0,
    out: IO[str] | None = None,
    min_processes: int | None = None,
    compilation_cache: str | None = "",
    xla_preset: str = "auto",
) -> int:
    """Runs `command` in `n_processes` processes, restarting all after a failure (see the module).

    Args:
        command: the command of each process (`["python", "train.py", ...]`).
        n_processes: how many; default one a local GPU, else 1.
        max_restarts: restarts after failures before the launcher gives up.
        grace: seconds from the SIGTERM that stops the others to the SIGKILL.
        out: where the output goes (stdout by default).
        min_processes: go on with fewer processes, not fewer than this,
            after processes are lost (see the module); `None`: never fewer.
        compilation_cache: the folder of the processes' compilation caches
            (`""`: `default_compilation_cache()`; `None`: none).
        xla_preset: the processes' XLA preset (`flaxstate.xla_settings`): a name, `"auto"` (this machine's
            GPU's; none without a GPU) or `"none"`.

    Returns:
        0 when every process exited 0 (or saved and exited at a SIGTERM);
        else the failing process's status (128 + a signal's number).

    Raises:
        ValueError: no command, a count, restarts, grace or least count out of range, or an unknown preset;
            or a SLURM job where the launcher cannot start the job's processes (`clusters.launcher_refusal`).
    """
    refusal = clusters.launcher_refusal()
    if refusal is not None:
        raise ValueError(refusal)
    if n_processes is None:
        n_processes = max(1, local_gpus())
    cache = default_compilation_cache() if compilation_cache == "" else compilation_cache
    config = LaunchConfig(tuple(command), n_processes, max_restarts, grace, min_processes, cache, xla_preset)
    return Launcher(config, out).run()
