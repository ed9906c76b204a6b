"""Peer copies of the local tier: what `peers=1` costs a save, and what it saves a replaced host at its restart.

Two gloo processes on this machine (one CPU device each, each given a host of
its own), each holding about `--mib` MiB of the state: a sharded state of
2 x `--mib` MiB (half on each process: its parts need a copy), and a
replicated one of `--mib` MiB (data parallelism: each process's parts are the
other's, so `peers=1` copies nothing). Alternating rounds, medians, on
process 0:

1. save: milliseconds the local writer's call blocks the loop, and until the
   save is on disk (the call and `wait()`): the sharded state with `peers=0`
   and `peers=1` (and with `host_memory_budget=` `--budget-mib` MiB: the
   parts sent in slices), the replicated one with `peers=1`; the bytes each process
   sends its peer a save; the peak of the host memory that numpy allocates
   during a save (`tracemalloc`: the packed buffer, the received copy); and
   the local tier's bytes on disk;
2. restore of a replaced host (process 1's local directory deleted before each
   round): `CheckpointFileReader([local, persistent])`, where process 1's
   parts come back from process 0 (its peer copy, or its own step where the
   state is replicated; under the budget, in slices), against the persistent tier's restore
   (`CheckpointFileReader(persistent)`, on this machine's disk: a real
   persistent tier is a network filesystem or a bucket, slower).

    python benchmarks/peers.py [--rounds 5] [--mib 200] [--budget-mib 16]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path

WRITERS = ("sharded, peers=0", "sharded, peers=1", "sharded, peers=1, budget", "replicated, peers=1")
RESTORES = (
    "sharded: peer copy",
    "sharded: peer copy, budget",
    "sharded: persistent",
    "replicated: replica's step",
    "replicated: persistent",
)


def median_ms(values: list[float]) -> float:
    return statistics.median(values) * 1e3


def worker(args: argparse.Namespace) -> None:
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(f"127.0.0.1:{args.port}", 2, args.process_id)
    os.environ["FLAXSTATE_HOST"] = f"host-{args.process_id}"
    import jax.numpy as jnp
    import numpy as np
    from jax.experimental import multihost_utils
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    import flaxstate as fs

    root, me = Path(args.root), jax.process_index()
    mesh = Mesh(np.asarray(jax.devices()), ("devices",))
    n = args.mib * 2**20 // 4 // 4  # four float32 arrays of a process's MiB

    def make(layout: str, fill: float) -> fs.InferenceState:  # its step included
        spec = PartitionSpec("devices") if layout == "sharded" else PartitionSpec()
        size = 2 * n if layout == "sharded" else n
        params = {f"w{i}": jnp.full((size,), fill * i, jnp.float32) for i in range(4)}
        create = lambda: fs.InferenceState.create({"params": params})  # noqa: E731
        layouts = jax.tree.map(
            lambda leaf: NamedSharding(mesh, spec if leaf.ndim else PartitionSpec()), jax.eval_shape(create)
        )
        return jax.jit(create, out_shardings=layouts)()

    states = {layout: make(layout, 1.0) for layout in ("sharded", "replicated")}
    templates = {layout: make(layout, 0.0) for layout in ("sharded", "replicated")}

    def record(layout: str, step: int) -> fs.Checkpoint:
        return fs.Checkpoint(
            state=states[layout], grads=None, loss=0.0, n_completed_steps=1, elapsed_time=1.0,
            step=step, rng=jax.random.key(0), run_id="bench",
        )  # fmt: skip

    def local_dir(name: str) -> Path:
        return root / f"local-{WRITERS.index(name)}-{me}"

    budget = args.budget_mib * 2**20

    def peers_of(name: str) -> int:
        return int(name.split("peers=")[1][0])

    writers = {
        name: fs.CheckpointFileWriter(
            fs.LocalTier(local_dir(name), peers=peers_of(name), keep=2),
            host_memory_budget=budget if name.endswith("budget") else None,
        )
        for name in WRITERS
    }
    for name, writer in writers.items():  # the first record claims the directory (a survey, a collective): not timed
        writer(record(name.split(",")[0], 999))
        writer.wait()
    memory: dict[str, list[float]] = {name: [] for name in WRITERS}
    blocks: dict[str, list[float]] = {name: [] for name in WRITERS}
    ends: dict[str, list[float]] = {name: [] for name in WRITERS}
    for index in range(args.rounds):
        for name in WRITERS if index % 2 == 0 else WRITERS[::-1]:
            tracemalloc.start()
            start = time.perf_counter()
            writers[name](record(name.split(",")[0], 1000 + index))
            blocks[name].append(time.perf_counter() - start)
            writers[name].wait()
            ends[name].append(time.perf_counter() - start)
            memory[name].append(tracemalloc.get_traced_memory()[1] / 2**20)
            tracemalloc.stop()
    on_disk = {
        name: sum(f.stat().st_size for f in local_dir(name).rglob("*") if f.is_file()) / 2**20 for name in WRITERS
    }
    copied = {name: any((local_dir(name) / f"process-{me}" / "peers").rglob("arrays.bin")) for name in WRITERS}
    for writer in writers.values():
        writer.close()

    # A replaced host: process 1's local directory is gone before each restore.
    persistent = {layout: Path(args.persistent) / layout for layout in ("sharded", "replicated")}
    for layout, directory in persistent.items():
        with fs.CheckpointFileWriter(directory, ledger=False) as writer:
            writer(record(layout, 1))  # older than the local steps: the two-tier read takes the local one
    restores: dict[str, list[float]] = {name: [] for name in RESTORES}
    for index in range(args.rounds):
        for name in RESTORES if index % 2 == 0 else RESTORES[::-1]:
            layout = name.split(":")[0]
            local = local_dir(f"{layout}, peers=1" + (", budget" if name.endswith("budget") else ""))
            if me == 1:
                shutil.rmtree(local / "process-1", ignore_errors=True)
            multihost_utils.sync_global_devices("replaced")
            reader = fs.CheckpointFileReader(
                persistent[layout] if "persistent" in name else [local, persistent[layout]],
                host_memory_budget=budget if name.endswith("budget") else None,
            )
            start = time.perf_counter()
            restored = reader.restore(templates[layout])
            jax.block_until_ready(restored.params)
            restores[name].append(time.perf_counter() - start)
            assert float(multihost_utils.process_allgather(restored.params["w3"], tiled=True)[-1]) == 3.0
    if me == 0:
        print(
            json.dumps(
                {
                    "blocks": {name: median_ms(v) for name, v in blocks.items()},
                    "ends": {name: median_ms(v) for name, v in ends.items()},
                    "memory": {name: statistics.median(v) for name, v in memory.items()},
                    "disk": on_disk,
                    "sent": {name: 4 * n * 4 / 2**20 if copied[name] else 0 for name in WRITERS},
                    "restores": {name: median_ms(v) for name, v in restores.items()},
                }
            )
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--mib", type=int, default=200, help="the state's MiB")
    parser.add_argument("--budget-mib", type=int, default=16, help="the budgeted writer's and reader's MiB")
    parser.add_argument("--process-id", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--root", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--persistent", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.process_id is not None:
        worker(args)
        return
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    root = tempfile.mkdtemp(prefix="flaxstate-peers-", dir="/dev/shm" if Path("/dev/shm").is_dir() else None)
    persistent = tempfile.mkdtemp(prefix="flaxstate-peers-persistent-")  # on disk
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONUNBUFFERED": "1"}
    command = [sys.executable, __file__, "--rounds", str(args.rounds), "--mib", str(args.mib)]
    command += ["--budget-mib", str(args.budget_mib)]
    command += ["--port", str(port), "--root", root, "--persistent", persistent]
    try:
        workers = [
            subprocess.Popen([*command, "--process-id", str(i)], env=env, stdout=subprocess.PIPE, text=True)
            for i in range(2)
        ]
        outputs = [worker.communicate(timeout=1800)[0] for worker in workers]
        if any(worker.returncode for worker in workers):
            raise RuntimeError(f"a worker failed: {[worker.returncode for worker in workers]}")
    finally:
        shutil.rmtree(root, ignore_errors=True)
        shutil.rmtree(persistent, ignore_errors=True)
    found = json.loads(outputs[0].strip().splitlines()[-1])
    import jax

    print(
        f"jax {jax.__version__}, 2 gloo processes on this machine ({os.cpu_count()} CPUs), {args.mib} MiB of the "
        f"state on each process, local tiers in {Path(root).parent}, the persistent tier in "
        f"{Path(persistent).parent}, budget {args.budget_mib} MiB, {args.rounds} alternating rounds, medians on "
        "process 0\n"
    )
    print(
        "| state, local writer | ms the call blocks | ms to on disk | MiB sent to the peer | peak host MiB a save "
        "allocates | local tier on disk, MiB |\n|---|---:|---:|---:|---:|---:|"
    )
    for name in WRITERS:
        print(
            f"| {name} | {found['blocks'][name]:.1f} | {found['ends'][name]:.1f} | {found['sent'][name]:.0f} | "
            f"{found['memory'][name]:.0f} | {found['disk'][name]:.0f} |"
        )
    print("\n| restore of a replaced host (its local directory gone): from | ms |\n|---|---:|")
    for name, value in found["restores"].items():
        print(f"| {name} | {value:.1f} |")


if __name__ == "__main__":
    main()
