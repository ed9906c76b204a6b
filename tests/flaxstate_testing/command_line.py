"""The `flaxstate` command line run in the test's own process, as `subprocess.run` reports a command.

A `python -m flaxstate` process costs 1.6 s to start (JAX's and orbax's imports); the tests that check what a
command says of a run call `flaxstate.cli.main` here instead, and keep one real process where the process is
what they check.
"""

from __future__ import annotations

import contextlib
import io
import subprocess

from flaxstate import cli


def run_here(*args: str) -> subprocess.CompletedProcess:
    """Runs `flaxstate ARGS` in this process: its exit status and what it printed on stdout and stderr."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        status = cli.main([str(arg) for arg in args])
    return subprocess.CompletedProcess(["flaxstate", *map(str, args)], status, out.getvalue(), err.getvalue())
