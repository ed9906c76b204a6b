"""Builds sharded TrainLoops from bad input over a mesh of 2 devices; prints each error that they raise.

Run in one process with 2 CPU devices: every error comes before anything is
compiled, so no collective ever runs (those deadlock on these machines). Run
as 2 processes of one device each, it builds the cases that only the
processes' split of the data can raise.
Prints `case NAME: TYPE: MESSAGE` a case, on one line, then `done`.
"""

from __future__ import annotations

import dataclasses
import logging

from flaxstate_testing.workers.common import setup

config = setup()

import jax  # noqa: E402

import flaxstate as fs  # noqa: E402
from flaxstate_testing.lm import data, lm  # noqa: E402

small = lm.Config(batch_size=8, seq_len=8, embed=32, heads=2, head_dim=8, mlp=64, layers=1)


class Compiles(logging.Handler):
    """Counts the compiles of the state's init (`create`) and of the update (`flat_steps`)."""

    count = 0

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        Compiles.count += message.startswith(("Compiling create", "Compiling flat_steps"))


jax.config.update("jax_log_compiles", True)
logging.getLogger("jax").addHandler(Compiles())


def build(config, mesh: str, rules=lm.RULES, n_microbatches: int = 1) -> None:
    model = lm.Transformer(config)
    task = fs.TrainTask(apply=model.apply, optimizer=lm.optimizer(config), loss=lm.loss, data=data(config))
    fs.TrainLoop(
        model.init, task, rng=0, stdout=False, mesh=lm.make_mesh(mesh), axis_rules=rules, n_microbatches=n_microbatches
    )


across_processes = {  # 2 processes of one device each: only what the processes' split of the data changes
    "tensor-parallel data split as data-parallel": lambda: build(small, "model=2"),  # data(config): half each
}
cases = (
    across_processes
    if config["n_processes"] > 1
    else {
        "odd dimension": lambda: build(dataclasses.replace(small, embed=33), "fsdp=2"),
        "odd heads": lambda: build(dataclasses.replace(small, heads=3), "model=2"),
        "odd batch": lambda: build(dataclasses.replace(small, batch_size=7), "fsdp=2"),
        "odd microbatches": lambda: build(small, "fsdp=2", n_microbatches=3),
        "unknown mesh axis": lambda: build(small, "fsdp=2", (*lm.RULES, ("mlp", "tensor"))),
    }
)
for name, case in cases.items():
    try:
        case()
        print(f"case {name}: no error", flush=True)
    except Exception as error:  # noqa: BLE001 - printed for the test to read
        print(f"case {name}: {type(error).__name__}: {' '.join(str(error).split())}", flush=True)
print(f"compiled {Compiles.count}", flush=True)
print("done", flush=True)
