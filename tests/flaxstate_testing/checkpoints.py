"""What checkpoint tests share: a toy run's records and state, and what they read of a directory without flaxstate."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import jax
import numpy as np
import optax

import flaxstate as fs
from flaxstate.checkpoint.stores.packed import ARRAYS, stored_meta
from flaxstate.run_record import audit, ledger
from flaxstate_testing import toy


def assert_equal_files(got: Path, want: Path, **close: float) -> None:
    """Two `.npz` files of final parameters hold the same arrays: bit for bit, or within `close`'s `rtol`/`atol`."""
    with np.load(got) as got_arrays, np.load(want) as want_arrays:
        assert got_arrays.keys() == want_arrays.keys()
        for key in want_arrays:
            if close:
                np.testing.assert_allclose(got_arrays[key], want_arrays[key], err_msg=key, **close)
            else:
                np.testing.assert_array_equal(got_arrays[key], want_arrays[key], err_msg=key)


def data_fingerprints(run_dir: Path) -> dict[int, str]:
    """Each record's fingerprint of the global examples trained since the one before, by step (the newest
    session's where several logged a step)."""
    return {
        event["step"]: event["data_fp"]
        for event in ledger.read_events(Path(run_dir) / ledger.FILENAME)
        if event["event"] == "record"
    }


def saved_steps(directory: Path) -> list[int]:
    """The steps saved in `directory` (its numeric subdirectories), in order."""
    return sorted(int(path.name) for path in Path(directory).iterdir() if path.name.isdigit())


def patch_async_save(monkeypatch: Any, before_write: Any) -> None:
    """Runs `before_write()` in each orbax array write (in the save's thread), then writes."""
    import orbax.checkpoint as ocp

    original = ocp.PyTreeCheckpointHandler.async_save

    async def patched(self: Any, directory: Any, *args: Any, **kwargs: Any) -> Any:
        before_write()
        return await original(self, directory, *args, **kwargs)

    monkeypatch.setattr(ocp.PyTreeCheckpointHandler, "async_save", patched)


MODEL = toy.BatchNormNet()
TX = optax.adam(1e-2)


def records(
    n_steps: int = 6, every: int = 2, model: Any = MODEL, data: Any = None, record_memory: str = "host"
) -> list[fs.Checkpoint]:
    """The records of a toy run of `n_steps`, one every `every`."""
    data = toy.batches(n_steps, 8) if data is None else data
    task = fs.TrainTask(apply=model.apply, optimizer=TX, loss=toy.mse, data=data)
    loop = fs.TrainLoop(
        model.init,
        task,
        jax.random.key(0),
        n_steps=n_steps,
        n_steps_per_checkpoint=every,
        stdout=False,
        record_memory=record_memory,
    )
    return list(loop)


def summary(record: fs.Checkpoint, loss: float) -> fs.Summary:
    """`record` with eval metrics `loss` and `acc = -loss`."""
    return fs.Summary.of(record, {"eval": {"loss": loss, "acc": -loss}})


def fresh_state(model: Any = MODEL) -> fs.FlaxOptimTrainState:
    """A new training state of `model`."""
    return fs.FlaxOptimTrainState.create(TX, model.init(jax.random.key(3), np.ones((8, 4), np.float32)))


def assert_trees_equal(a: Any, b: Any) -> None:
    """Asserts two trees' leaves equal, bit for bit."""
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def damage_arrays(step_dir: Path, how: str) -> None:
    """Damages a step's first array file of its model item: `"truncate"` it to half, or delete it."""
    files = sorted(p for p in (step_dir / "model").rglob("*") if p.is_file() and p.parent.name == "d")
    assert files, list((step_dir / "model").rglob("*"))
    if how == "truncate":
        with open(files[0], "r+b") as handle:
            handle.truncate(os.path.getsize(files[0]) // 2)
    else:
        files[0].unlink()


def read_beside_a_rotating_writer(directory: str, keep: int, reads: int, each: Any = None) -> list[int]:
    """Restores `reads` times beside a writer process that saves steps 1, 2, ... a tenth of a second of training
    apart; returns the steps.

    Each restored array must hold its step's value (the worker fills them so):
    a reader never mixes two steps. `each(step)` runs after each read. With
    `keep=1` a step lives from its save's end to the next one's: saving as
    fast as it could (no training between saves), the writer rotated faster
    than a reader could read on a machine running a second test run beside
    it, and every read for 30 s found its step deleted (2 of 6 runs under load).
    """
    from flaxstate_testing import processes

    writer = processes.Watched(
        processes.start(
            "checkpoint_faults",
            {"mode": "rotating_writer", "dir": directory, "keep": keep, "n_steps": 100_000, "pause": 0.1},
        )
    )
    params = {f"w{i}": np.zeros((256, 256), np.float32) for i in range(4)}
    template = fs.FlaxOptimTrainState.create(optax.sgd(0.1), {"params": params})
    steps = []
    try:
        writer.wait_for("SAVED 3", 120)
        for _ in range(reads):
            restored = fs.CheckpointFileReader(directory).restore(template)
            step = int(restored.step)
            assert all(np.all(np.asarray(leaf) == step) for leaf in jax.tree.leaves(restored.params)), step
            steps.append(step)
            if each is not None:
                each(step)
    finally:
        processes.kill(writer.process)
    return steps


def assert_same(final: dict, expected: dict) -> None:
    """Two runs' final states (state-dict path -> array) are equal, bit for bit."""
    assert final.keys() == expected.keys()
    for key, value in expected.items():
        np.testing.assert_array_equal(final[key], value, err_msg=key)


def restored_local_step(output: str) -> int:
    """The local step a two-tier restart's primary says it restored."""
    found = re.search(r"restored step (\d+) from the local tier", output)
    assert found, output[-3000:]
    return int(found.group(1))


def local_steps(local_dir: Path, process: int) -> list[int]:
    """The whole steps in a process's own part of a local tier."""
    part = local_dir / f"process-{process}"
    return sorted(int(p.name) for p in part.iterdir() if p.name.isdigit())


def read_packed(step_dir: Path) -> tuple[dict, np.ndarray]:
    """A local step's meta as stored and its `arrays.bin`'s bytes."""
    return stored_meta(step_dir), np.fromfile(step_dir / ARRAYS, dtype=np.uint8)


def resume_verdicts(run_dir: str | Path) -> list[dict[str, Any]]:
    """Each resume's verdict in a run directory's goodput ledger (`flaxstate audit --json`'s `resumes`)."""
    return [resume.to_json() for resume in audit.resumes(ledger.run_events(run_dir))]
