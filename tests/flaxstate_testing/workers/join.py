"""Joins its manager's processes with `jax.distributed.initialize(**config["initialize"])` and says so; the process
whose id under its manager is `config["late"]` starts its join `config["delay"]` seconds after the others."""

import json
import os
import sys
import time

config = json.loads(sys.argv[1])
own_id = int(os.environ.get("SLURM_PROCID") or os.environ.get("OMPI_COMM_WORLD_RANK") or 0)
if own_id == config.get("late"):
    time.sleep(config["delay"])

import jax  # noqa: E402

import flaxstate  # noqa: E402, F401  (checks and watches the join)

jax.distributed.initialize(**config.get("initialize", {}))
print(f"joined {jax.process_index()} of {jax.process_count()}", flush=True)
