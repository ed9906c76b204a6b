"""The run that the cluster managers' tests train (`tests/cluster/`), under a manager and without one."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from flaxstate_testing import processes

CONFIG = {"n_steps": 40, "every": 10, "data": "list", "optimizer": "sgd", "keep": 2, "global_batch": 8, "width": 16}
"""The `resume` worker's run: an MLP (no batch statistics, which each process keeps of its own examples), 40 steps
of 8 examples split over the processes, a checkpoint every 10."""

WORKER = [sys.executable, "-m", "flaxstate_testing.workers.resume"]
"""The command a manager starts in each task or rank, followed by its config as JSON."""


def straight(folder: Path) -> Path:
    """Trains `CONFIG` on two processes that no cluster manager started, joined on a port of the test's, in
    `folder`; returns its final parameters' file."""
    config = dict(CONFIG, output_dir=str(folder / "run"), out=str(folder / "final.npz"), resume=False)
    processes.run("resume", config, n_processes=2, timeout=240)
    return folder / "final.npz"


def launched(config: dict, folder: Path) -> Path:
    """Trains `config` on two processes of `flaxstate launch` in `folder`; returns its final parameters' file."""
    config = dict(config, output_dir=str(folder / "launch"), out=str(folder / "launch.npz"))
    command = [sys.executable, "-m", "flaxstate", "launch", "--processes", "2", "--compilation-cache", "none"]
    done = subprocess.run(
        [*command, "--", *WORKER, json.dumps(config)],
        env=processes.worker_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return folder / "launch.npz"
