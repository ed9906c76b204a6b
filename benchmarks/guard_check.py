"""The loop between records under JAX's transfer guard at "disallow": any implicit device-to-host read raises.

python benchmarks/guard_check.py
"""

import itertools
import sys
from pathlib import Path

import jax
import optax

sys.path.insert(0, str(Path(__file__).parent))
from loop_overhead import MLP, loss_fn, make_data  # noqa: E402

import flaxstate as fs  # noqa: E402

data = make_data(64, 64)
for k in (1, 10):
    task = fs.TrainTask(apply=MLP(64).apply, optimizer=optax.adam(1e-3), loss=loss_fn, data=itertools.cycle(data))
    loop = fs.TrainLoop(
        MLP(64).init, task, 0, n_steps=10**9, n_steps_per_checkpoint=200, n_steps_per_dispatch=k, stdout=False
    )
    loop.next_checkpoint()  # compiled
    try:
        with jax.transfer_guard_device_to_host("disallow"):
            for _ in range(3):
                loop.next_checkpoint()
        print(f"K={k}: 3 records of 200 steps under transfer_guard_device_to_host('disallow'): no implicit transfer")
    except Exception as error:
        print(f"K={k}: an implicit transfer: {type(error).__name__}: {str(error)[:400]}")
        import traceback

        traceback.print_exc(limit=-6)
