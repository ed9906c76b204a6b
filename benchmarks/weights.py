"""Export to and import from safetensors: flaxstate against the `safetensors` package's own numpy API.

A 1 GiB state of params (`--mib`: eight square float32 kernels, with adam's two
moments beside them in the run directory, which the export never reads) is
saved once by `CheckpointFileWriter`. Each measurement then runs in a fresh
process (a subprocess of this script), its peak resident set reset just
before the operation, so a figure is what the operation added at its peak:

- export: `fs.export_safetensors(run_dir, out)` (reads the params from the
  checkpoint, `READ_BYTES` of tensors at a time), the same with `max_shard_bytes` of
  `--shard-mib`, `fs.export_safetensors(state, out)` of the params in host
  memory, against `safetensors.numpy.save_file` of those arrays (read from
  the checkpoint before the clock starts, as a user who holds them would);
- import: `fs.SafetensorsReader(out, target).params(template, shardings)`,
  each array placed on the device, against `safetensors.numpy.load_file`
  then `jax.device_put`. On a CPU the device is host memory: an import's
  figure includes the imported params themselves (1x the state).

Rounds alternate the contenders (each first in turn); the table gives the
medians, in seconds and in MiB (and as a multiple of the params' bytes).

    python benchmarks/weights.py [--rounds 3] [--mib 1024] [--shard-mib 256]
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from host_memory import in_fresh_process

MiB = 2**20
EXPORTS = ("flaxstate (run dir)", "flaxstate (run dir, shards)", "flaxstate (state)", "save_file")
IMPORTS = ("SafetensorsReader", "load_file")


TENSORS = 8
"""The params' square float32 kernels: a shard of `--shard-mib` 256 holds two of a 1 GiB state's."""


def _width(mib: int) -> int:
    return int((mib * MiB / 4 / TENSORS) ** 0.5)


def _params(mib: int) -> dict[str, Any]:
    import numpy as np

    rng = np.random.default_rng(0)
    return {f"Dense_{i}": {"kernel": rng.standard_normal((_width(mib),) * 2, np.float32)} for i in range(TENSORS)}


def prepare(directory: str, mib: int) -> None:
    """The run directory (a state of params and adam's moments, saved once) and the files the imports read."""
    import optax
    import safetensors.numpy

    import flaxstate as fs

    params = _params(mib)
    state = fs.FlaxOptimTrainState.create(optax.adam(1e-3), {"params": params})
    record = fs.Checkpoint(state=state, grads=None, loss=0.0, n_completed_steps=1, elapsed_time=0.0, step=1)
    with fs.CheckpointFileWriter(Path(directory) / "run") as writer:
        writer(record)
    flat = {f"{layer}/kernel": value["kernel"] for layer, value in params.items()}
    safetensors.numpy.save_file(flat, str(Path(directory) / "model.safetensors"))


def measure(operation: str, contender: str, directory: str, mib: int, shard_mib: int) -> dict[str, Any]:
    """One operation in this (fresh) process: its seconds, and the peak bytes it added."""
    import jax
    import numpy as np
    import safetensors.numpy

    import flaxstate as fs
    from flaxstate.training.memory import host_peak_since_reset, host_resident, reset_host_peak

    run_dir, out = Path(directory) / "run", Path(directory) / "out"
    files = Path(directory) / "model.safetensors"
    held: Any = None
    if contender in ("flaxstate (state)", "save_file"):  # the arrays in host memory first, off the clock
        checkpoint = fs.CheckpointFileReader(run_dir).read(None)
        held = jax.tree.map(np.asarray, checkpoint.state["target"])
        del checkpoint
    template: Any = None
    if operation == "import":
        shape = jax.ShapeDtypeStruct((_width(mib),) * 2, np.float32)
        template = {f"Dense_{i}": {"kernel": shape} for i in range(TENSORS)}
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    before = host_resident()
    reset_host_peak()
    start = time.perf_counter()
    if contender == "flaxstate (run dir)":
        fs.export_safetensors(run_dir, out)
    elif contender == "flaxstate (run dir, shards)":
        fs.export_safetensors(run_dir, out, max_shard_bytes=shard_mib * MiB)
    elif contender == "flaxstate (state)":
        fs.export_safetensors(fs.InferenceState.create({"params": held}), out)
    elif contender == "save_file":
        out.mkdir()
        flat = {f"{layer}/kernel": value["kernel"] for layer, value in held.items()}
        safetensors.numpy.save_file(flat, str(out / "model.safetensors"))
    elif contender == "SafetensorsReader":
        placed = fs.SafetensorsReader(files, None).params(template, device)
        jax.block_until_ready(jax.tree.leaves(placed))
    else:
        loaded = safetensors.numpy.load_file(str(files))
        placed = jax.device_put(loaded, device)
        jax.block_until_ready(jax.tree.leaves(placed))
    seconds = time.perf_counter() - start
    peak = host_peak_since_reset()
    assert before is not None and peak is not None, "/proc is needed (Linux)"
    return {"seconds": seconds, "added": peak - before}


def run(operation: str, contender: str, directory: str, mib: int, shard_mib: int) -> dict[str, Any]:
    """`measure` in a fresh process."""
    return in_fresh_process("weights", "measure", operation, contender, directory, mib, shard_mib, timeout=900)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--mib", type=int, default=1024, help="the params' MiB (eight square float32 kernels)")
    parser.add_argument("--shard-mib", type=int, default=256, help="max_shard_bytes of the sharded export, in MiB")
    args = parser.parse_args()
    figures: dict[tuple[str, str], list[dict[str, Any]]] = {}
    with tempfile.TemporaryDirectory(dir=".") as directory:  # on this disk, not a memory-backed /tmp
        in_fresh_process("weights", "prepare", directory, args.mib, timeout=900)
        for index in range(args.rounds):
            for operation, contenders in (("export", EXPORTS), ("import", IMPORTS)):
                shift = index % len(contenders)
                for contender in contenders[shift:] + contenders[:shift]:  # each first in turn
                    figure = run(operation, contender, directory, args.mib, args.shard_mib)
                    figures.setdefault((operation, contender), []).append(figure)
                    shutil.rmtree(Path(directory) / "out", ignore_errors=True)
    params_bytes = _width(args.mib) ** 2 * 4 * TENSORS
    print(
        f"params: {params_bytes / MiB:.0f} MiB in {TENSORS} float32 kernels (adam's moments beside them in the run "
        f"directory); shards of {args.shard_mib} MiB; medians of {args.rounds} rounds, a fresh process each"
    )
    print(f"{'operation':<8} {'contender':<28} {'seconds':>8} {'peak added (MiB)':>17} {'x params':>9}")
    for (operation, contender), runs in figures.items():
        seconds = statistics.median(figure["seconds"] for figure in runs)
        added = statistics.median(figure["added"] for figure in runs)
        print(f"{operation:<8} {contender:<28} {seconds:>8.2f} {added / MiB:>17.0f} {added / params_bytes:>9.2f}")


if __name__ == "__main__":
    main()
