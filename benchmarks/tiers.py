"""Two checkpoint tiers: a save and a restore of the local tier (tmpfs) against the persistent one (disk).

One process, the small MLP widened to a state of about 200 MB (params and
adam moments). Alternating rounds, medians:

1. save: milliseconds the writer's call blocks the loop, and milliseconds
   until the save is on disk (the call and `wait()`): a local writer
   (`fs.LocalTier`) in /dev/shm against the persistent writer on disk;
2. restore, what a failure waits for: `CheckpointFileReader([local,
   persistent])` (the local step is newer) and `CheckpointFileReader(persistent)`
   against plain orbax's `CheckpointManager.restore` of the same persistent
   files into the same abstract target;
3. the same three restores from outside: each in a fresh process, timing
   the restore call alone (a restart's restore runs once, in a new process).

    python benchmarks/tiers.py [--rounds 5] [--width 4100]
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import jax
import orbax.checkpoint as ocp
from contenders import make_loop

import flaxstate as fs

LOCAL_ROOT = Path("/dev/shm")


def median_ms(values: list[float]) -> float:
    return statistics.median(values) * 1e3


def saves(rounds: int, record: fs.Checkpoint, local: Path, persistent: Path) -> dict[str, tuple[float, float]]:
    """Median ms a save blocks, and ms to its end, of each tier's writer."""
    writers = {
        "local (tmpfs)": fs.CheckpointFileWriter(fs.LocalTier(local, keep=2)),
        "persistent (disk)": fs.CheckpointFileWriter(persistent, keep=2, ledger=False),
    }
    blocks: dict[str, list[float]] = {name: [] for name in writers}
    ends: dict[str, list[float]] = {name: [] for name in writers}
    names = list(writers)
    for index in range(rounds):
        for name in names if index % 2 == 0 else names[::-1]:
            writer = writers[name]
            step_record = fs.Checkpoint(**{**record.__dict__, "step": 1000 + index})
            start = time.perf_counter()
            writer(step_record)
            blocks[name].append(time.perf_counter() - start)
            writer.wait()
            ends[name].append(time.perf_counter() - start)
    for writer in writers.values():
        writer.close()
    return {name: (median_ms(blocks[name]), median_ms(ends[name])) for name in writers}


RESTORE = """
import json, sys, time
sys.path.insert(0, {benchmarks!r})
import jax, orbax.checkpoint as ocp, flaxstate as fs
from contenders import make_loop
name, local, persistent, width = {name!r}, {local!r}, {persistent!r}, {width}
loop = make_loop(1, width=width)
state = jax.device_put(loop.state)  # on the device: a record's host copy has no sharding
abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state.state_dict())
if name == "orbax":
    manager = ocp.CheckpointManager(persistent)
    start = time.perf_counter()
    jax.block_until_ready(manager.restore(manager.latest_step(), args=ocp.args.StandardRestore(abstract)))
else:
    reader = fs.CheckpointFileReader([local, persistent] if name == "local" else persistent)
    start = time.perf_counter()
    jax.block_until_ready(reader.restore(state))
print(json.dumps(time.perf_counter() - start))
"""


def restores(
    rounds: int, width: int, state: fs.FlaxOptimTrainState, local: Path, persistent: Path, plain: Path
) -> dict[str, tuple[float, float]]:
    """Median ms of each restore: in this process, and each in a fresh process."""
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state.state_dict())
    manager = ocp.CheckpointManager(plain)
    readers = {
        "local": fs.CheckpointFileReader([local, persistent]),
        "persistent": fs.CheckpointFileReader(persistent),
    }
    contenders = {
        **{name: (lambda reader=reader: reader.restore(state)) for name, reader in readers.items()},
        "orbax": lambda: manager.restore(manager.latest_step(), args=ocp.args.StandardRestore(abstract)),
    }
    inside: dict[str, list[float]] = {name: [] for name in contenders}
    outside: dict[str, list[float]] = {name: [] for name in contenders}
    names = list(contenders)
    for index in range(rounds):
        for name in names[index % 3 :] + names[: index % 3]:
            start = time.perf_counter()
            jax.block_until_ready(contenders[name]())
            inside[name].append(time.perf_counter() - start)
    for index in range(rounds):
        for name in names[index % 3 :] + names[: index % 3]:
            directory = plain if name == "orbax" else persistent
            code = RESTORE.format(
                benchmarks=str(Path(__file__).parent),
                name=name,
                local=str(local),
                persistent=str(directory),
                width=width,
            )
            result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
            if result.returncode:
                raise RuntimeError(result.stderr[-3000:])
            outside[name].append(json.loads(result.stdout.strip().splitlines()[-1]))
    return {name: (median_ms(inside[name]), median_ms(outside[name])) for name in contenders}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--width", type=int, default=4100, help="hidden width: 4100 makes a state of 205 MiB")
    args = parser.parse_args()
    disk = Path(tempfile.mkdtemp(prefix="flaxstate-tiers-"))
    local = Path(tempfile.mkdtemp(prefix="flaxstate-tiers-", dir=LOCAL_ROOT))
    try:
        loop = make_loop(1, width=args.width)
        record = loop.next_checkpoint()
        n_bytes = sum(leaf.nbytes for leaf in jax.tree.leaves(record.state))
        print(
            f"jax {jax.__version__}, orbax {ocp.__version__}, {jax.devices()[0].device_kind}, state "
            f"{n_bytes / 2**20:.0f} MiB, {args.rounds} alternating rounds; local tier in {LOCAL_ROOT}, persistent "
            f"in {disk.parent}"
        )
        saved = saves(args.rounds, record, local / "save", disk / "save")
        # The restores' files: a persistent step 1, a newer local step 2, and plain orbax's step 1.
        first = fs.Checkpoint(**{**record.__dict__, "step": 1, "final": True})
        fs.CheckpointFileWriter(disk / "restore", ledger=False)(first)
        fs.CheckpointFileWriter(fs.LocalTier(local / "restore"))(fs.Checkpoint(**{**first.__dict__, "step": 2}))
        plain = ocp.CheckpointManager(disk / "plain")
        plain.save(1, args=ocp.args.StandardSave(record.state.state_dict()))
        plain.wait_until_finished()
        restored = restores(
            args.rounds, args.width, jax.device_put(loop.state), local / "restore", disk / "restore", disk / "plain"
        )
    finally:
        shutil.rmtree(disk, ignore_errors=True)
        shutil.rmtree(local, ignore_errors=True)
    print("\n| save | ms the call blocks | ms to on disk |\n|---|---:|---:|")
    for name, (block, end) in saved.items():
        print(f"| {name} | {block:.1f} | {end:.1f} |")
    orbax_inside, orbax_outside = restored["orbax"]
    print(
        "\n| restore | ms in this process | against plain orbax | ms in a fresh process | against plain orbax |"
        "\n|---|---:|---:|---:|---:|"
    )
    labels = {
        "local": "CheckpointFileReader([local, persistent]): the local step",
        "persistent": "CheckpointFileReader(persistent)",
        "orbax": "plain orbax CheckpointManager.restore, same files",
    }
    for name, (inside, outside) in restored.items():
        print(
            f"| {labels[name]} | {inside:.1f} | {inside / orbax_inside:.2f}x | {outside:.1f} | "
            f"{outside / orbax_outside:.2f}x |"
        )


if __name__ == "__main__":
    main()
