"""Breaks checkpoints as users do: Ctrl-C inside restores, a writer rotating beside readers, a full disk.

Modes (config["mode"]):
- `restore_interrupts`: restores a checkpoint of about 100 MB again and again;
  prints `START i`, then after the attempt `RESTORED i`, `INTERRUPTED i` or
  `FAULT i ...` (any other exception). The test sends one SIGINT per
  attempt, then creates `sent-<i>` in the directory; the worker reports only
  once that file exists (absorbing a signal that lands after its restore).
- `rotating_writer`: saves steps 1, 2, ... with `keep`, each array filled
  with its step, `pause` seconds of training between one save's end and the
  next (0: as fast as it can), until `n_steps`; prints `SAVED n`.
- `full_disk`: trains 6 steps with a writer; from step 4 on, files may not
  grow past 2,000 bytes (RLIMIT_FSIZE), so array writes fail inside tensorstore.
"""

from __future__ import annotations

import faulthandler
import os
import resource
import signal
import sys
import time

from flaxstate_testing.workers.common import setup

config = setup()

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import flaxstate as fs  # noqa: E402
from flaxstate.locations import as_path  # noqa: E402
from flaxstate_testing import toy  # noqa: E402

directory = as_path(config["dir"])  # a bucket's URL stays one


def filled_state(value: float, n_arrays: int, shape: tuple[int, ...]) -> fs.FlaxOptimTrainState:
    params = {f"w{i}": np.full(shape, value, np.float32) for i in range(n_arrays)}
    return fs.FlaxOptimTrainState.create(optax.sgd(0.1), {"params": params}).replace_step(int(value))


def record(state: fs.FlaxOptimTrainState, step: int) -> fs.Checkpoint:
    return fs.Checkpoint(
        state=jax.device_get(state),
        grads=None,
        loss=0.0,
        n_completed_steps=1,
        elapsed_time=1.0,
        step=step,
        run_id="faults",
    )


def restore_interrupts() -> None:
    armed = False

    def interrupt(signum: int, frame: object) -> None:  # Python's own Ctrl-C, while a restore runs
        if armed:
            raise KeyboardInterrupt

    signal.signal(signal.SIGINT, interrupt)
    state = filled_state(7.0, 16, (1500, 1000))  # 96 MB
    if not directory.exists():
        with fs.CheckpointFileWriter(directory) as writer:
            writer(record(state, 7))
    template = jax.eval_shape(lambda: state)
    sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    template = fs.sharded_like(template, jax.tree.map(lambda _: sharding, template))
    reader = fs.CheckpointFileReader(directory)
    seconds = []
    for _ in range(3):  # the shortest: the first, cold, took 0.3 s where later ones were quicker, and all
        start = time.perf_counter()  # 12 signals of one CI run landed after their restore
        reader.restore(template)
        seconds.append(time.perf_counter() - start)
    print(f"RESTORE SECONDS {min(seconds):.3f}", flush=True)
    for attempt in range(config["attempts"]):
        print(f"START {attempt}", flush=True)
        try:  # armed only inside the try: the test sends one signal an attempt, and one that lands outside
            armed = True  # the restore and its check is not the restore's to handle
            restored = reader.restore(template)
            assert all(float(np.asarray(leaf).max()) == 7.0 for leaf in jax.tree.leaves(restored.params))
            armed = False
            outcome = "RESTORED"
        except KeyboardInterrupt:
            armed = False
            outcome = "INTERRUPTED"
        except Exception as error:  # noqa: BLE001 - what the test looks for
            armed = False
            outcome = f"FAULT {type(error).__name__}: {str(error)[:200]}"
        while not (directory / f"sent-{attempt}").exists():
            time.sleep(0.01)
        print(f"{outcome.split()[0]} {attempt} {outcome}", flush=True)
    restored = reader.restore(template)
    print(f"DONE {int(restored.step)}", flush=True)
    # It exits now. Once (under xdist beside another test, 2 cores) it did not within 60 s after every attempt
    # was interrupted, and not again in 5 runs (3 with a CPU burner): should it hang again, its threads say where.
    faulthandler.dump_traceback_later(45, exit=True)


def rotating_writer() -> None:
    writer = fs.CheckpointFileWriter(directory, keep=config["keep"])
    for step in range(1, config["n_steps"] + 1):
        writer(record(filled_state(float(step), 4, (256, 256)), step))
        writer.wait()
        print(f"SAVED {step}", flush=True)
        time.sleep(config.get("pause", 0.0))
    writer.close()


def full_disk() -> None:
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG instead
    model = toy.MLP(width=256)
    task = fs.TrainTask(apply=model.apply, optimizer=optax.adam(1e-2), loss=toy.mse, data=toy.batches(6, 8))
    loop = fs.TrainLoop(model.init, task, jax.random.key(0), n_steps=6, n_steps_per_checkpoint=2, stdout=False)
    writer = fs.CheckpointFileWriter(directory, keep=1)
    for checkpoint in loop:
        if checkpoint.step == 4:
            resource.setrlimit(resource.RLIMIT_FSIZE, (2000, resource.RLIM_INFINITY))
        try:
            writer(checkpoint)
            writer.wait()
        except fs.CheckpointSaveError as error:
            print(f"SAVE FAILED {checkpoint.step}: {error}", flush=True)
    print(f"LEFT {sorted(name for name in os.listdir(directory) if name != 'goodput.jsonl')}", flush=True)


{"restore_interrupts": restore_interrupts, "rotating_writer": rotating_writer, "full_disk": full_disk}[config["mode"]]()
sys.exit(0)
