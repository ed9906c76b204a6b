"""A scenario of the shared cluster's own tests (`tests/test_shared_cluster_processes.py`): says what it finds,
then does harm.

It prints its process's id and count, its pid, and what an earlier script may have left changed (`FLAXSTATE_PROBE`
in the environment, JAX's `jax_log_compiles`, the handlers of the `flaxstate` logger, SIGTERM's handler). Then,
as `config` asks: changes all of them (`dirty`), raises on one process (`raise_on`), or waits forever on one
(`hang_on`).
"""

from __future__ import annotations

import logging
import os
import signal
import time

from flaxstate_testing.workers.common import setup

config = setup()

import jax  # noqa: E402

found = {
    "process": config["process_id"],
    "count": config["n_processes"],
    "pid": os.getpid(),
    "environment": os.environ.get("FLAXSTATE_PROBE"),
    "log_compiles": bool(jax.config.jax_log_compiles),
    "handlers": len(logging.getLogger("flaxstate").handlers),
    "sigterm": signal.getsignal(signal.SIGTERM) == signal.SIG_DFL,
}
print("found", " ".join(f"{key}={value}" for key, value in found.items()), flush=True)
if config.get("dirty"):
    os.environ["FLAXSTATE_PROBE"] = "left"
    jax.config.update("jax_log_compiles", True)
    logging.getLogger("flaxstate").addHandler(logging.NullHandler())
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
if config.get("raise_on") == config["process_id"]:
    raise RuntimeError(f"the planned failure of process {config['process_id']}")
if config.get("hang_on") == config["process_id"]:
    time.sleep(3600)
