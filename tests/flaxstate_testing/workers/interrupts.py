"""Trains once undisturbed, then again under real SIGINTs sent at many moments; saves both results.

The SIGINTs come from inside the data generator (once, and twice in a row),
from inside the making of a record, and from a timer thread at random moments
(in a dispatch, in the data, between records). The interrupted run catches
each `KeyboardInterrupt` and iterates the loop again, as a notebook user
would; the test compares its records and parameters with the undisturbed run.
"""

from __future__ import annotations

import json
import os
import random
import signal
import threading
import time
import traceback
from pathlib import Path

from flaxstate_testing.workers.common import setup

config = setup()
# As in a script run from a terminal: a shell that starts a process in the background leaves SIGINT ignored,
# and Python then keeps it ignored (the loop leaves an ignored SIGINT alone).
signal.signal(signal.SIGINT, signal.default_int_handler)

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import flaxstate as fs  # noqa: E402
from flaxstate.training import multihost  # noqa: E402
from flaxstate_testing import toy  # noqa: E402

model = toy.BatchNormNet()
BATCHES = toy.batches(config["n_steps"], 8, seed=1)


def interrupt() -> None:
    os.kill(os.getpid(), signal.SIGINT)


class Data:
    """A re-iterable of the batches whose generator sends SIGINTs to its own process at given batches (once)."""

    def __init__(self, signals_at: dict[int, int]) -> None:
        self.signals_at = dict(signals_at)
        self.passes = 0

    def __iter__(self):
        self.passes += 1
        for index, batch in enumerate(BATCHES):
            for _ in range(self.signals_at.pop(index, 0)):
                interrupt()
            time.sleep(config.get("data_sleep", 0.0))
            yield batch


def make_loop(data: Data) -> fs.TrainLoop:
    return fs.TrainLoop(
        init=model.init,
        task=fs.TrainTask(apply=model.apply, optimizer=optax.adam(1e-2), loss=toy.mse, data=data),
        rng=jax.random.key(0),
        n_steps=config["n_steps"],
        n_steps_per_checkpoint=config["every"],
        n_steps_per_dispatch=config["per_dispatch"],
        stdout=False,
    )


def flat(state) -> dict[str, np.ndarray]:
    return {k: np.asarray(v) for k, v in fs.tree_paths.flatten(state.state_dict()).items()}


reference = make_loop(Data({}))
reference_records = list(reference)
reference_steps = [record.step for record in reference_records]
segment_seconds = float(np.median([record.elapsed_time for record in reference_records]))
np.savez(Path(config["out"]) / "reference.npz", **flat(reference.state))

# A SIGINT inside the making of the records at these steps (the record is kept for the next call).
record_signal_steps = set(config.get("record_signal_steps", []))
gather_position = multihost.gather_position


def gather_position_interrupted(local, batch_size):
    if int(local["n_batches"]) in record_signal_steps:
        record_signal_steps.discard(int(local["n_batches"]))
        interrupt()
    return gather_position(local, batch_size)


multihost.gather_position = gather_position_interrupted

random.seed(config.get("seed", 0))
timer: threading.Timer | None = None


def settle(pending: threading.Timer | None) -> None:
    """Waits until the timer's SIGINT was sent and has landed; one landing here is dropped (between records)."""
    while pending is not None:
        try:
            pending.join()
            time.sleep(0.02)
            return
        except KeyboardInterrupt:
            pass


def arm() -> threading.Timer | None:
    if not config.get("random_signals", True):
        return None
    armed = threading.Timer(random.uniform(0, 1.5 * segment_seconds), interrupt)
    armed.start()
    return armed


data = Data({int(k): v for k, v in config.get("data_signals", {}).items()})
loop = make_loop(data)
steps: list[int] = []
landed: list[str] = []
"""Where each KeyboardInterrupt was raised: the innermost flaxstate function, or between records."""
while True:
    try:
        try:
            timer = arm()
            for record in loop:
                steps.append(record.step)
                settle(timer)
                timer = arm()
            break
        finally:
            settle(timer)
    except KeyboardInterrupt as error:
        frames = traceback.extract_tb(error.__traceback__)
        ours = [f.name for f in frames if "flaxstate/" in f.filename and not f.filename.endswith("interrupts.py")]
        landed.append(ours[-1] if ours else "between records")
np.savez(Path(config["out"]) / "interrupted.npz", **flat(loop.state))
summary = {"reference_steps": reference_steps, "steps": steps, "landed": landed, "passes": data.passes}
(Path(config["out"]) / "summary.json").write_text(json.dumps(summary))
print("done", json.dumps(summary), flush=True)
