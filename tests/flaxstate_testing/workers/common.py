"""What the workers share: joining the processes, models, deterministic data."""

from __future__ import annotations

import json
import os
import sys

import jax

SERVED: dict | None = None
"""This process's id and count where it serves the shared cluster (`serve.py`), which has joined already."""


def setup() -> dict:
    """Reads the worker's config and joins the other processes (gloo on the CPU).

    Under `flaxstate launch`, under `srun` (SLURM sets `SLURM_STEP_ID` in a
    job step's tasks), under Open MPI's `mpirun` (`OMPI_COMM_WORLD_SIZE`) and
    in a Kubernetes JobSet's pods (`JOBSET_NAME`), it joins them as a script under a cluster manager does, with
    `jax.distributed.initialize()` and no arguments, and prints its process
    id (`pid <n>`) for the tests that send it signals. Run by a worker of the
    shared cluster (`serve.py`), it returns the config with that worker's id
    and count.
    """
    config = json.loads(sys.argv[1])
    if SERVED is not None:
        return {**config, **SERVED}
    managers = ("FLAXSTATE_COORDINATOR_ADDRESS", "SLURM_STEP_ID", "OMPI_COMM_WORLD_SIZE", "JOBSET_NAME")
    if any(name in os.environ for name in managers):
        import flaxstate  # noqa: F401  (registers the launcher's processes with JAX)

        jax.distributed.initialize()
        if jax.process_index() > 0:
            cache_every_process()
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
    if jax.process_index() > 0:
        cache_every_process()
    return config


def cache_every_process() -> None:
    """Lets this process (not process 0) write JAX's persistent compilation cache, as process 0 does.

    JAX writes cache entries from process 0 only, and on the CPU a program's key holds its device assignment,
    so the other processes never find theirs: process 1 of every two-process test compiled every program of
    every run (7.3 s of the FSDP fixture's 10.9 s for a phase the cache held). The tests' cache is a local
    folder of the test session's (conftest.py), and the processes' keys differ, so nothing contends. With a
    JAX that no longer has the private function, the processes compile as before. (jax 0.12's has no
    `host_callbacks`.)
    """
    from jax._src import compilation_cache, compiler

    if not hasattr(compiler, "_cache_write"):
        return

    def write(cache_key, compile_time_secs, module_name, backend, executable, host_callbacks=()) -> None:
        if not host_callbacks and compile_time_secs >= jax.config.jax_persistent_cache_min_compile_time_secs:
            compilation_cache.put_executable_and_time(
                cache_key, module_name, executable, backend, int(compile_time_secs)
            )

    compiler._cache_write = write


def print_sharded_result(kernel: jax.Array, gathered: dict, **more) -> None:
    """Prints, from process 0, one `result {json}` line: the bytes of `kernel`'s shards this process holds against
    the kernel's, its partition spec, its mesh's axis types, the whole (gathered) arrays of `gathered` by path, and
    `more`."""
    import numpy as np

    from flaxstate import tree_paths

    held = sum(shard.data.nbytes for shard in kernel.addressable_shards)
    if jax.process_index() == 0:
        result = {
            "held": int(held),
            "kernel": int(kernel.nbytes),
            "spec": [str(axis) for axis in kernel.sharding.spec],
            "axis_types": [kind.name for kind in kernel.sharding.mesh.axis_types],
            **more,
            "final": {path: np.asarray(leaf).tolist() for path, leaf in tree_paths.flatten(gathered).items()},
        }
        print("result", json.dumps(result), flush=True)
