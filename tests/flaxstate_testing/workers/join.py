"""Joins its manager's processes with `jax.distributed.initialize(**config["initialize"])` and says so; the process
whose id under its manager is `config["late"]` starts its join `config["delay"]` seconds after all the others have
started theirs.

Each process but the late one leaves a file in `config["ready"]` (a folder) just before it joins; the late one,
its imports done as theirs are, waits for them all, then for `delay`. Counted from its own start instead, the
delay was spent while the others still imported JAX on a loaded machine, and they waited less than it.
"""

import json
import os
import sys
import time
from pathlib import Path

config = json.loads(sys.argv[1])
own_id = int(os.environ.get("SLURM_PROCID") or os.environ.get("OMPI_COMM_WORLD_RANK") or 0)
count = int(os.environ.get("SLURM_NTASKS") or os.environ.get("OMPI_COMM_WORLD_SIZE") or 1)

import jax  # noqa: E402

import flaxstate  # noqa: E402, F401  (checks and watches the join)

if "late" in config:
    ready = Path(config["ready"])
    ready.mkdir(parents=True, exist_ok=True)
    if own_id == config["late"]:
        deadline = time.monotonic() + 120
        while len(list(ready.iterdir())) < count - 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(config["delay"])
    else:
        (ready / str(own_id)).touch()
jax.distributed.initialize(**config.get("initialize", {}))
print(f"joined {jax.process_index()} of {jax.process_count()}", flush=True)
