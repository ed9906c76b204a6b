"""What the workers share: joining the processes, models, deterministic data."""

from __future__ import annotations

import json
import sys

import jax


def setup() -> dict:
    """Reads the worker's config and joins the other processes (gloo on the CPU)."""
    config = json.loads(sys.argv[1])
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
