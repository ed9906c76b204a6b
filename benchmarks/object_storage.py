"""Checkpoints in a bucket: save and restore of a ~200 MiB state to fake-gcs-server, against a local disk and
against plain orbax on the same bucket.

One process, the small MLP widened to a state of about 200 MiB (params and
adam moments). The emulator (fake-gcs-server, in memory, on 127.0.0.1) is
started here and stopped at the end. Alternating rounds, medians:

1. save: milliseconds the writer's call blocks the loop, and milliseconds
   until the save is complete (the call and `wait()`; in the bucket, its
   `commit_success.txt` written): flaxstate's writer to `gs://`, the same
   writer to a local directory, and plain orbax's `CheckpointManager.save`
   to `gs://`;
2. restore: `CheckpointFileReader(gs://...)`, the reader of the local
   directory, and plain orbax's `CheckpointManager.restore` of its own
   `gs://` step into the same abstract target.

An emulator models none of a real bucket's latency, throughput, consistency
or rate limits: these figures are the client side's costs (orbax,
tensorstore's gcs driver, gcsfs) and flaxstate's own on top of them.

    python benchmarks/object_storage.py [--rounds 5] [--width 4100]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[1] / "tests"))
from flaxstate_testing import buckets  # noqa: E402  (the tests' emulator)


def median_ms(values: list[float]) -> float:
    return statistics.median(values) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--width", type=int, default=4100, help="hidden width: 4100 makes a state of 205 MiB")
    args = parser.parse_args()
    disk = Path(tempfile.mkdtemp(prefix="flaxstate-buckets-"))
    with buckets.fake_gcs() as server:  # its variables set before tensorstore's gcs driver reads them
        url = server.create_bucket("bench")
        import jax
        import orbax.checkpoint as ocp
        from contenders import make_loop
        from etils import epath

        import flaxstate as fs

        try:
            loop = make_loop(1, width=args.width)
            record = loop.next_checkpoint()
            n_bytes = sum(leaf.nbytes for leaf in jax.tree.leaves(record.state))
            print(
                f"jax {jax.__version__}, orbax {ocp.__version__}, {jax.devices()[0].device_kind}, state "
                f"{n_bytes / 2**20:.0f} MiB, {args.rounds} alternating rounds; fake-gcs-server (in memory) on "
                f"127.0.0.1, local directory in {disk.parent}; {os.cpu_count()} CPUs"
            )
            plain = ocp.CheckpointManager(
                epath.Path(f"{url}/plain"), options=ocp.CheckpointManagerOptions(max_to_keep=2)
            )
            writers = {
                "flaxstate, gs://": fs.CheckpointFileWriter(f"{url}/save", keep=2, ledger=False),
                "flaxstate, local disk": fs.CheckpointFileWriter(disk / "save", keep=2, ledger=False),
            }
            save_calls = {
                **{
                    name: (lambda step, writer=writer: writer(fs.Checkpoint(**{**record.__dict__, "step": step})))
                    for name, writer in writers.items()
                },
                "plain orbax, gs://": lambda step: plain.save(
                    step, args=ocp.args.StandardSave(record.state.state_dict())
                ),
            }
            waits = {
                **{name: writer.wait for name, writer in writers.items()},
                "plain orbax, gs://": plain.wait_until_finished,
            }
            blocks: dict[str, list[float]] = {name: [] for name in save_calls}
            ends: dict[str, list[float]] = {name: [] for name in save_calls}
            names = list(save_calls)
            for index in range(args.rounds):
                for name in names[index % 3 :] + names[: index % 3]:
                    start = time.perf_counter()
                    save_calls[name](1000 + index)
                    blocks[name].append(time.perf_counter() - start)
                    waits[name]()
                    ends[name].append(time.perf_counter() - start)

            state = jax.device_put(loop.state)
            abstract = jax.tree.map(
                lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state.state_dict()
            )
            readers = {
                "flaxstate, gs://": fs.CheckpointFileReader(f"{url}/save"),
                "flaxstate, local disk": fs.CheckpointFileReader(disk / "save"),
            }
            restore_calls = {
                **{name: (lambda reader=reader: reader.restore(state)) for name, reader in readers.items()},
                "plain orbax, gs://": lambda: plain.restore(
                    plain.latest_step(), args=ocp.args.StandardRestore(abstract)
                ),
            }
            restores: dict[str, list[float]] = {name: [] for name in restore_calls}
            for index in range(args.rounds):
                for name in names[index % 3 :] + names[: index % 3]:
                    start = time.perf_counter()
                    jax.block_until_ready(restore_calls[name]())
                    restores[name].append(time.perf_counter() - start)
            for writer in writers.values():
                writer.close()
            plain.close()
        finally:
            shutil.rmtree(disk, ignore_errors=True)

    medians = {name: (median_ms(blocks[name]), median_ms(ends[name]), median_ms(restores[name])) for name in names}
    print("\n| save to | ms the call blocks | ms to complete (committed) | restore, ms |\n|---|---:|---:|---:|")
    for name, (block, end, restore) in medians.items():
        print(f"| {name} | {block:.1f} | {end:.1f} | {restore:.1f} |")
    bucket, local, orbax = (medians[name] for name in names)
    print(
        f"\nflaxstate in the bucket against its local disk: the call blocks {bucket[0] / local[0]:.2f}x, complete "
        f"{bucket[1] / local[1]:.2f}x, restore {bucket[2] / local[2]:.2f}x; against plain orbax on the bucket: "
        f"complete {bucket[1] / orbax[1]:.2f}x, restore {bucket[2] / orbax[2]:.2f}x"
    )


if __name__ == "__main__":
    main()
