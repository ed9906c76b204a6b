"""Peer copies of the local tier: what `peers=1` costs a save, and what it saves a replaced host at its restart.

Two gloo processes on this machine (one CPU device each, each given a host of
its own), a replicated state of about `--mib` MiB (so each process's parts are
the whole state). Alternating rounds, medians, on process 0:

1. save: milliseconds the local writer's call blocks the loop, and until the
   save is on disk (the call and `wait()`), with `peers=0` and `peers=1`; the
   bytes each process sends its peer a save; the peak of the host memory
   that numpy allocates during a save (`tracemalloc`: the packed buffer, the
   received copy); and the local tier's bytes on disk;
2. restore of a replaced host (process 1's local directory deleted before each
   round): `CheckpointFileReader([local, persistent])` with peer copies,
   where process 1's parts come back from process 0, against the persistent
   tier's restore (`CheckpointFileReader(persistent)`, on this machine's
   disk: a real persistent tier is a network filesystem or a bucket, slower).

    python benchmarks/peers.py [--rounds 5] [--mib 200]
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

    root = Path(args.root)
    replicated = NamedSharding(Mesh(np.asarray(jax.devices()), ("devices",)), PartitionSpec())
    n = args.mib * 2**20 // 4 // 4  # four float32 arrays

    def make(fill: float) -> fs.InferenceState:  # replicated on both processes, its step included
        params = {f"w{i}": jnp.full((n,), fill * i, jnp.float32) for i in range(4)}
        return jax.jit(lambda: fs.InferenceState.create({"params": params}), out_shardings=replicated)()

    state, template = make(1.0), make(0.0)

    def record(step: int, run_id: str = "bench") -> fs.Checkpoint:
        return fs.Checkpoint(
            state=state, grads=None, loss=0.0, n_completed_steps=1, elapsed_time=1.0,
            step=step, rng=jax.random.key(0), run_id=run_id,
        )  # fmt: skip

    me = jax.process_index()
    writers = {
        peers: fs.CheckpointFileWriter(root / f"local-{peers}-{me}", keep=2, per_process=True, peers=peers)
        for peers in (0, 1)
    }
    for writer in writers.values():  # the first record claims the directory (a survey, a collective): not timed
        writer(record(999))
        writer.wait()
    memory: dict[int, list[float]] = {0: [], 1: []}
    blocks: dict[int, list[float]] = {0: [], 1: []}
    ends: dict[int, list[float]] = {0: [], 1: []}
    for index in range(args.rounds):
        for peers in (0, 1) if index % 2 == 0 else (1, 0):
            tracemalloc.start()
            start = time.perf_counter()
            writers[peers](record(1000 + index))
            blocks[peers].append(time.perf_counter() - start)
            writers[peers].wait()
            ends[peers].append(time.perf_counter() - start)
            memory[peers].append(tracemalloc.get_traced_memory()[1] / 2**20)
            tracemalloc.stop()
    on_disk = {
        peers: sum(f.stat().st_size for f in (root / f"local-{peers}-{me}").rglob("*") if f.is_file()) / 2**20
        for peers in (0, 1)
    }
    for writer in writers.values():
        writer.close()

    # A replaced host: process 1's local directory is gone before each restore.
    local, persistent = root / f"local-1-{me}", Path(args.persistent)
    with fs.CheckpointFileWriter(persistent, ledger=False) as writer:
        writer(record(1))  # older than the local steps: the two-tier read takes the local one
    restores: dict[str, list[float]] = {"peer copy": [], "persistent": []}
    for index in range(args.rounds):
        for name in ("peer copy", "persistent") if index % 2 == 0 else ("persistent", "peer copy"):
            if me == 1:
                shutil.rmtree(local / "process-1", ignore_errors=True)
            multihost_utils.sync_global_devices("replaced")
            reader = fs.CheckpointFileReader([local, persistent] if name == "peer copy" else persistent)
            start = time.perf_counter()
            restored = reader.restore(template)
            jax.block_until_ready(restored.params)
            restores[name].append(time.perf_counter() - start)
            assert float(restored.params["w3"][0]) == 3.0
    if me == 0:
        print(
            json.dumps(
                {
                    "blocks": {p: median_ms(v) for p, v in blocks.items()},
                    "ends": {p: median_ms(v) for p, v in ends.items()},
                    "memory": {p: statistics.median(v) for p, v in memory.items()},
                    "disk": on_disk,
                    "sent": 4 * n * 4 / 2**20,
                    "restores": {name: median_ms(v) for name, v in restores.items()},
                }
            )
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--mib", type=int, default=200, help="the state's MiB")
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
        f"jax {jax.__version__}, 2 gloo processes on this machine ({os.cpu_count()} CPUs), a replicated state of "
        f"{args.mib} MiB (each process's parts: the whole state), local tiers in {Path(root).parent}, the "
        f"persistent tier in {Path(persistent).parent}, "
        f"{args.rounds} alternating rounds, medians on process 0\n"
    )
    print(
        "| local writer | ms the call blocks | ms to on disk | MiB sent to the peer | peak host MiB a save allocates "
        "| local tier on disk, MiB |\n|---|---:|---:|---:|---:|---:|"
    )
    for peers in ("0", "1"):
        sent = found["sent"] if peers == "1" else 0
        print(
            f"| peers={peers} | {found['blocks'][peers]:.1f} | {found['ends'][peers]:.1f} | {sent:.0f} | "
            f"{found['memory'][peers]:.0f} | {found['disk'][peers]:.0f} |"
        )
    print("\n| restore of a replaced host (its local directory gone) | ms |\n|---|---:|")
    for name, value in found["restores"].items():
        what = "local tier, its parts from the peer's copy" if name == "peer copy" else "persistent tier (disk)"
        print(f"| {what} | {value:.1f} |")


if __name__ == "__main__":
    main()
