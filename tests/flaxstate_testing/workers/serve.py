"""A worker of the tests' shared cluster (`flaxstate_testing.cluster`): joined once, it runs worker scripts on request.

Started as every worker is (`python -m flaxstate_testing.workers.serve CONFIG`, joined over gloo by `setup`), it
imports JAX and flaxstate once, then reads one request a line on stdin (`{"script": NAME, "config": {...},
"environment": {...}}`) and runs that script of `flaxstate_testing.workers` as its own process would (`python -m
flaxstate_testing.workers.NAME CONFIG` with the test's environment variables): a fresh module, `setup()`
returning the config with this process's id and count, what it prints (stdout and stderr, Python's) kept. The
processes pass a barrier before each script and after it. Each answer is one line on the protocol channel (the
process's original stdout; what C++ prints goes to stderr): `{"ok": ..., "output": ...}`, with the traceback in
the output of a script that raised. What a script prints goes to stderr too, as it comes, so that one that hangs
shows how far it came. What a script changes in the process's environment variables, working directory, loggers,
warning filters, signal handlers and JAX's configuration is put back after it. End of input ends the worker.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import os
import runpy
import signal
import sys
import traceback
import warnings
from collections.abc import Iterator

from flaxstate_testing.workers import common

READY = "ready"
"""The first line on the protocol channel, once the process has joined and imported what the scripts import."""

SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)


@contextlib.contextmanager
def restored() -> Iterator[None]:
    """Puts back what a script may change in the process, whatever it did."""
    import jax

    environ, cwd, argv = dict(os.environ), os.getcwd(), list(sys.argv)
    loggers = [logging.getLogger()] + [
        logger for logger in logging.root.manager.loggerDict.values() if isinstance(logger, logging.Logger)
    ]
    logged = {logger: (list(logger.handlers), logger.level, logger.propagate, logger.disabled) for logger in loggers}
    filters = list(warnings.filters)
    handlers = {signum: signal.getsignal(signum) for signum in SIGNALS}
    configured = dict(jax.config.values)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(environ)
        os.chdir(cwd)
        sys.argv[:] = argv
        for logger in [logging.getLogger()] + list(logging.root.manager.loggerDict.values()):
            if isinstance(logger, logging.Logger):
                handlers_, level, propagate, disabled = logged.get(logger, ([], logging.NOTSET, True, False))
                logger.handlers[:] = handlers_
                logger.setLevel(level)
                logger.propagate, logger.disabled = propagate, disabled
        warnings.filters[:] = filters
        for signum, handler in handlers.items():
            if handler is not None:
                signal.signal(signum, handler)
        for name, value in configured.items():
            if jax.config.values.get(name) != value:
                jax.config.update(name, value)


def barrier(name: str) -> None:
    """Every process of the cluster reaches `name` (a collective over their devices) before any goes on."""
    import jax
    from jax.experimental import multihost_utils

    if jax.process_count() > 1:
        multihost_utils.sync_global_devices(name)


class Tee(io.TextIOBase):
    """Text written to several streams at once."""

    def __init__(self, *streams: io.TextIOBase) -> None:
        self.streams = streams

    def write(self, text: str) -> int:
        for stream in self.streams:
            stream.write(text)
        return len(text)

    def flush(self) -> None:
        for stream in self.streams:
            stream.flush()


def run(script: str, config: dict, environment: dict[str, str]) -> tuple[bool, str]:
    """Runs one worker script as its own process would; returns whether it succeeded and what it printed (which
    goes to stderr too, as it comes: a script that hangs shows there how far it came)."""
    printed = io.StringIO()
    shown = Tee(printed, sys.__stderr__)
    print(f"=== {script} {json.dumps(config)[:500]}", file=sys.__stderr__, flush=True)
    ok = True
    with restored(), contextlib.redirect_stdout(shown), contextlib.redirect_stderr(shown):
        sys.argv[:] = [script, json.dumps(config)]
        os.environ.clear()  # the test's, as a worker started now would get (a bucket emulator's variables)
        os.environ.update(environment)
        try:
            runpy.run_module(f"flaxstate_testing.workers.{script}", run_name="__main__")
        except SystemExit as exit:
            ok = exit.code in (None, 0)
            if not ok:
                print(f"SystemExit: {exit.code}", flush=True)
        except BaseException:
            ok = False
            traceback.print_exc()
    return ok, printed.getvalue()


def main() -> None:
    protocol = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # what the libraries print below Python goes to stderr, not into the answers
    common.setup()
    import jax

    import flaxstate  # noqa: F401  (what every script imports, once)

    common.SERVED = {"process_id": jax.process_index(), "n_processes": jax.process_count()}
    barrier("serve ready")
    protocol.write(READY + "\n")
    for count, line in enumerate(sys.stdin):
        request = json.loads(line)
        barrier(f"serve {count} before")
        ok, output = run(request["script"], request["config"], request["environment"])
        if ok:
            barrier(f"serve {count} after")
        protocol.write(json.dumps({"ok": ok, "output": output}) + "\n")
        if not ok:  # the others may wait in a collective of the script: the cluster is restarted
            break


if __name__ == "__main__":
    main()
