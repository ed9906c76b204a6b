"""What the workers share: joining the processes, models, deterministic data."""

from __future__ import annotations

import json
import os
import sys

import jax


def setup() -> dict:
    """Reads the worker's config and joins the other processes (gloo on the CPU).

    Under `flaxstate launch`, it joins them as a script under SLURM does,
    with `jax.distributed.initialize()` and no arguments, and prints its
    process id (`pid <n>`) for the tests that send it signals.
    """
    config = json.loads(sys.argv[1])
    if os.environ.get("FLAXSTATE_COORDINATOR_ADDRESS"):
        import flaxstate  # noqa: F401  (registers the launcher's processes with JAX)

        jax.distributed.initialize()
        print("pid", os.getpid(), flush=True)
        return {**config, "process_id": jax.process_index(), "n_processes": jax.process_count()}
    if config["n_processes"] > 1:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(
            f"127.0.0.1:{config['port']}",
            num_processes=config["n_processes"],
            process_id=config["process_id"],
            initialization_timeout=60,
            heartbeat_timeout_seconds=config.get("heartbeat_timeout", 100),
        )
    return config
