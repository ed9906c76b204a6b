"""A one-node SLURM cluster on loopback, from Debian's `slurm-wlm` and `munge`, started and stopped by the tests.

`Cluster` starts `munged`, `slurmctld` and `slurmd` in a folder of its own (their sockets, state, logs and pid
files), on free ports of 127.0.0.1, with `tests/cluster/slurm.conf`; it stops each daemon it started by its pid.
A cluster already running (`SLURM_CONF` set, `sinfo` answering) is used as it is and left alone. The commands
(`srun`, `sbatch`, `scancel`, `scontrol`) find the cluster through `SLURM_CONF` in `env`.

By hand, to try a script under SLURM: `PYTHONPATH=tests python -m flaxstate_testing.slurm [FOLDER]` starts one,
prints the `export SLURM_CONF=...` to paste, and stops it on Ctrl-C.
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from flaxstate_testing import processes

CONF = Path(__file__).parents[1] / "cluster" / "slurm.conf"
"""The cluster's configuration, its folder, ports and sizes left as `@NAMES@` for `Cluster` to fill in."""

DAEMONS = ("munged", "slurmctld", "slurmd")
COMMANDS = ("srun", "sbatch", "scancel", "scontrol", "squeue", "sinfo")


def missing() -> str | None:
    """Why no cluster can be started here (the programs not installed, or not root), or `None`."""
    absent = [
        name for name in DAEMONS + COMMANDS if shutil.which(name) is None and not Path("/usr/sbin", name).exists()
    ]
    if absent:
        return f"SLURM is not installed ({', '.join(absent)} missing): apt-get install slurm-wlm munge"
    if os.geteuid() != 0:
        return "the test cluster's daemons run as root (SlurmUser=root), and this is not root"
    return None


def _daemon(name: str) -> str:
    return shutil.which(name) or str(Path("/usr/sbin", name))


class Cluster:
    """A one-node SLURM cluster: started on entering, stopped on leaving (only what it started).

    Args:
        folder: where its daemons keep their sockets, state, spool, logs and pid files.
        kill_wait: seconds between a cancelled job's SIGTERM and its SIGKILL (`KillWait`).
    """

    def __init__(self, folder: Path, kill_wait: int = 10) -> None:
        self.folder = Path(folder)
        self.kill_wait = kill_wait
        self.started: dict[str, subprocess.Popen] = {}
        self.conf = self.folder / "slurm.conf"

    @property
    def env(self) -> dict[str, str]:
        """The environment for a command of this cluster's (and for a test's workers: `processes.worker_env`)."""
        return {**processes.worker_env(), "SLURM_CONF": str(self.conf)}

    def __enter__(self) -> Cluster:
        existing = os.environ.get("SLURM_CONF")
        if existing and self._answers(existing):
            self.conf = Path(existing)
            return self
        reason = missing()
        if reason:
            raise RuntimeError(reason)
        try:
            self._start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def _start(self) -> None:
        for name in ("state", "spool"):
            (self.folder / name).mkdir(parents=True, exist_ok=True)
        key = self.folder / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o600)
        filled = {
            "@FOLDER@": str(self.folder),
            "@CTLD_PORT@": str(processes.free_port()),
            "@SLURMD_PORT@": str(processes.free_port()),
            "@KILL_WAIT@": str(self.kill_wait),
            "@FIRST_JOB_ID@": str(random.randrange(1, 1_000_000)),
            "@CPUS@": str(os.cpu_count() or 2),
        }
        text = CONF.read_text()
        for name, value in filled.items():
            text = text.replace(name, value)
        self.conf.write_text(text)
        folder = str(self.folder)
        self._daemon(
            "munged",
            "-F",
            "--force",  # as root
            f"--socket={folder}/munge.socket",
            f"--key-file={key}",
            f"--pid-file={folder}/munged.pid",
            f"--seed-file={folder}/munged.seed",
            f"--log-file={folder}/munged.log",
        )
        self._wait(lambda: (self.folder / "munge.socket").exists(), "munged's socket")
        self._daemon("slurmctld", "-D", "-i", "-f", str(self.conf))
        self._daemon("slurmd", "-D", "-N", "localhost", "-f", str(self.conf))
        self._wait(lambda: self.node_state() in ("idle", "mixed", "allocated"), "the node to be up (sinfo)", 60)

    def _daemon(self, name: str, *args: str) -> None:
        log = open(self.folder / f"{name}.out", "w")  # noqa: SIM115 (the daemon's, closed with it)
        self.started[name] = subprocess.Popen(
            [_daemon(name), *args],
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, "SLURM_CONF": str(self.conf)},
            start_new_session=True,
        )
        log.close()

    def _wait(self, ready, what: str, timeout: float = 30) -> None:
        deadline = time.monotonic() + timeout
        while not ready():
            ended = {name: p.returncode for name, p in self.started.items() if p.poll() is not None}
            if ended or time.monotonic() > deadline:
                raise RuntimeError(
                    f"the test cluster did not start: no {what} within {timeout} s (ended: {ended})\n{self.logs()}"
                )
            time.sleep(0.2)

    def _answers(self, conf: str) -> bool:
        done = subprocess.run(
            ["sinfo", "-h"], env={**os.environ, "SLURM_CONF": conf}, capture_output=True, text=True, timeout=20
        )
        return done.returncode == 0

    def logs(self) -> str:
        """The daemons' own logs and outputs, their last lines each."""
        parts = []
        for name in ("munged.out", "slurmctld.out", "slurmctld.log", "slurmd.out", "slurmd.log"):
            path = self.folder / name
            if path.exists():
                parts.append(f"--- {name} ---\n" + "\n".join(path.read_text(errors="replace").splitlines()[-30:]))
        return "\n".join(parts)

    def stop(self) -> None:
        """Stops the daemons this cluster started, by pid: SIGTERM, then SIGKILL after 10 s; the jobs' tasks with
        them: every job of the cluster is cancelled first, its steps killed by slurmd."""
        if "slurmctld" in self.started and self.started["slurmctld"].poll() is None:
            self.cancel_jobs()
        for name in reversed(DAEMONS):
            process = self.started.pop(name, None)
            if process is None:
                continue
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
                try:
                    process.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    processes.kill(process)
                    process.wait(timeout=10)

    def cancel_jobs(self, timeout: float = 15) -> None:
        """Kills every job of the cluster's (a test's that failed half-way, too) and waits until the queue is empty,
        so that the next test's jobs find the node's CPUs free."""
        subprocess.run(["scancel", "--user", "root", "--signal", "KILL"], env=self.env, capture_output=True)
        deadline = time.monotonic() + timeout
        while (
            time.monotonic() < deadline
            and subprocess.run(["squeue", "-h"], env=self.env, capture_output=True, text=True).stdout.strip()
        ):
            time.sleep(0.5)

    def command(self, *args: str, timeout: float = 30) -> str:
        """Runs a SLURM command (`scontrol ...`, `scancel ...`) and returns its output; fails naming it if it does."""
        done = subprocess.run(list(args), env=self.env, capture_output=True, text=True, timeout=timeout)
        if done.returncode != 0:
            raise AssertionError(f"{' '.join(args)} exited {done.returncode}: {done.stdout}{done.stderr}")
        return done.stdout

    def node_state(self) -> str:
        done = subprocess.run(
            ["sinfo", "-h", "-N", "-o", "%t"], env=self.env, capture_output=True, text=True, timeout=20
        )
        return {"idle": "idle", "mix": "mixed", "alloc": "allocated"}.get(done.stdout.strip(), done.stdout.strip())

    def release(self, job_id: str, timeout: float = 60) -> None:
        """Starts a requeued job now instead of after its `BeginTime` (120 s), once the node is idle and 2 s after
        the requeue: slurmd revokes the job's credential at the requeue with a time in whole seconds, and a run
        whose credential is of the same second is refused ("Killing non-startable batch job: Job credential
        revoked", the job FAILED with exit 1 and no output)."""
        self._wait(lambda: self.node_state() == "idle", "idle node for the requeued job", timeout)
        time.sleep(2)
        self.command("scontrol", "update", f"JobId={job_id}", "StartTime=now")

    def srun(self, *args: str, cwd: Path | None = None) -> processes.Watched:
        """`srun ARGS` started in a session of its own, its output (every task's, labelled) read as it comes."""
        return processes.Watched(
            subprocess.Popen(
                ["srun", "--label", *args],
                env=self.env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                cwd=cwd,
                start_new_session=True,
            )
        )

    def sbatch(self, script: Path, *options: str, args: tuple[str, ...] = (), cwd: Path | None = None) -> str:
        """`sbatch OPTIONS SCRIPT ARGS`, run in `cwd`; returns the job's id."""
        done = subprocess.run(
            ["sbatch", "--parsable", *options, str(script), *args],
            env=self.env,
            cwd=cwd,
            capture_output=True,
            text=True,
            timeout=30,
        )
        if done.returncode != 0:
            raise AssertionError(f"sbatch {script} exited {done.returncode}: {done.stdout}{done.stderr}")
        return done.stdout.strip().split(";")[0]

    def job(self, job_id: str) -> dict[str, str]:
        """The job's fields as `scontrol show job` gives them (`JobState`, `Restarts`, `ExitCode`, ...)."""
        text = self.command("scontrol", "show", "job", "-o", job_id)
        return dict(field.split("=", 1) for field in text.split() if "=" in field)

    def wait_job(self, job_id: str, states: tuple[str, ...], timeout: float) -> dict[str, str]:
        """Waits until the job is in one of `states`; fails with its fields and the daemons' logs at the deadline."""
        deadline = time.monotonic() + timeout
        while (job := self.job(job_id))["JobState"] not in states:
            if time.monotonic() > deadline:
                raise AssertionError(f"job {job_id} not {states} within {timeout} s: {job}\n{self.logs()}")
            time.sleep(0.5)
        return job


def main() -> None:
    folder = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(tempfile.mkdtemp(prefix="flaxstate-slurm-"))
    with Cluster(folder) as cluster:
        print(f"export SLURM_CONF={cluster.conf}  # a one-node cluster in {folder}; Ctrl-C stops it", flush=True)
        try:
            signal.pause()
        except KeyboardInterrupt:
            pass


if __name__ == "__main__":
    main()
