"""Checkpoints in a bucket: save and restore of a ~200 MiB state to an emulator (gs:// or s3://), against a local
disk and against the plain library on the same bucket.

One process, the small MLP widened to a state of about 200 MiB (params and
adam moments). The emulator (fake-gcs-server for gs://, moto's server for
s3://, in memory, on 127.0.0.1) is started here and stopped at the end.
Alternating rounds, medians:

1. save: milliseconds the writer's call blocks the loop, and milliseconds
   until the save is complete (the call and `wait()`; in the bucket, its
   `commit_success.txt` written): flaxstate's writer to the bucket, the same
   writer to a local directory, and the plain library to the bucket: orbax's
   `CheckpointManager.save` on gs://, and on s3:// (which orbax does not
   write) JAX's own `array_serialization.run_serialization` of the state's
   arrays through tensorstore's s3 driver, a synchronous call;
2. restore: `CheckpointFileReader(<bucket>)`, the reader of the local
   directory, and the plain library's restore of its own save into the same
   abstract target.

An emulator models none of a real bucket's latency, throughput, consistency
or rate limits: these figures are the client side's costs (orbax,
tensorstore's drivers, gcsfs, s3fs) and flaxstate's own on top of them.

    python benchmarks/object_storage.py [--scheme gs|s3] [--rounds 5] [--width 4100]
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
from typing import Any

import jax

sys.path.insert(0, str(Path(__file__).parents[1] / "tests"))
from flaxstate_testing import buckets  # noqa: E402  (the tests' emulator)


def median_ms(values: list[float]) -> float:
    return statistics.median(values) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--width", type=int, default=4100, help="hidden width: 4100 makes a state of 205 MiB")
    parser.add_argument("--scheme", default="gs", choices=("gs", "s3"))
    args = parser.parse_args()
    disk = Path(tempfile.mkdtemp(prefix="flaxstate-buckets-"))
    emulator = buckets.fake_gcs() if args.scheme == "gs" else buckets.moto_s3()
    with emulator as server:  # its variables set before tensorstore's drivers read them
        url = server.create_bucket("bench")
        import orbax.checkpoint as ocp
        from contenders import make_loop

        import flaxstate as fs

        try:
            loop = make_loop(1, width=args.width)
            record = loop.next_checkpoint()
            n_bytes = sum(leaf.nbytes for leaf in jax.tree.leaves(record.state))
            print(
                f"jax {jax.__version__}, orbax {ocp.__version__}, {jax.devices()[0].device_kind}, state "
                f"{n_bytes / 2**20:.0f} MiB, {args.rounds} alternating rounds; {type(server).__name__} (in memory) on "
                f"127.0.0.1, local directory in {disk.parent}; {os.cpu_count()} CPUs"
            )
            plain: Any = PlainOrbax(url) if args.scheme == "gs" else PlainSerialization(url)
            bucket_name = f"flaxstate, {args.scheme}://"
            writers = {
                bucket_name: fs.CheckpointFileWriter(f"{url}/save", keep=2, ledger=False),
                "flaxstate, local disk": fs.CheckpointFileWriter(disk / "save", keep=2, ledger=False),
            }
            save_calls = {
                **{
                    name: (lambda step, writer=writer: writer(fs.Checkpoint(**{**record.__dict__, "step": step})))
                    for name, writer in writers.items()
                },
                plain.name: lambda step: plain.save(step, record.state.state_dict()),
            }
            waits = {**{name: writer.wait for name, writer in writers.items()}, plain.name: plain.wait}
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
                bucket_name: fs.CheckpointFileReader(f"{url}/save"),
                "flaxstate, local disk": fs.CheckpointFileReader(disk / "save"),
            }
            restore_calls = {
                **{name: (lambda reader=reader: reader.restore(state)) for name, reader in readers.items()},
                plain.name: lambda: plain.restore(abstract),
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
    bucket, local, plain_medians = (medians[name] for name in names)
    print(
        f"\nflaxstate in the bucket against its local disk: the call blocks {bucket[0] / local[0]:.2f}x, complete "
        f"{bucket[1] / local[1]:.2f}x, restore {bucket[2] / local[2]:.2f}x; against {names[2]}: "
        f"complete {bucket[1] / plain_medians[1]:.2f}x, restore {bucket[2] / plain_medians[2]:.2f}x"
    )


class PlainOrbax:
    """Plain orbax on a gs:// bucket: `CheckpointManager` save (asynchronous) and restore."""

    name = "plain orbax, gs://"

    def __init__(self, url: str) -> None:
        import orbax.checkpoint as ocp
        from etils import epath

        self._ocp = ocp
        self._manager = ocp.CheckpointManager(
            epath.Path(f"{url}/plain"), options=ocp.CheckpointManagerOptions(max_to_keep=2)
        )

    def save(self, step: int, state_dict: Any) -> None:
        self._manager.save(step, args=self._ocp.args.StandardSave(state_dict))

    def wait(self) -> None:
        self._manager.wait_until_finished()

    def restore(self, abstract: Any) -> Any:
        return self._manager.restore(self._manager.latest_step(), args=self._ocp.args.StandardRestore(abstract))

    def close(self) -> None:
        self._manager.close()


class PlainSerialization:
    """JAX's own array serialization on an s3:// bucket: each array a zarr3 array through tensorstore's s3 driver."""

    name = "plain jax array_serialization, s3://"

    def __init__(self, url: str) -> None:
        self._url = f"{url}/plain"
        self._step = 0

    def _specs(self, abstract: Any) -> list[dict[str, Any]]:
        from flaxstate.checkpoint.stores.s3 import kvstore

        count = len(jax.tree.leaves(abstract))
        return [{"driver": "zarr3", "kvstore": kvstore(f"{self._url}/{self._step}/{n}")} for n in range(count)]

    def save(self, step: int, state_dict: Any) -> None:
        from jax.experimental.array_serialization import serialization

        self._step = step
        arrays = [jax.numpy.asarray(leaf) for leaf in jax.tree.leaves(state_dict)]
        serialization.run_serialization(arrays, self._specs(arrays))

    def wait(self) -> None:
        pass  # the save is synchronous

    def restore(self, abstract: Any) -> Any:
        from jax.experimental.array_serialization import serialization

        leaves, tree = jax.tree.flatten(abstract)
        shardings = [leaf.sharding for leaf in leaves]
        arrays = serialization.run_deserialization(shardings, self._specs(leaves), [leaf.shape for leaf in leaves])
        return jax.tree.unflatten(tree, arrays)

    def close(self) -> None:
        pass


if __name__ == "__main__":
    main()
