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

With `--layout 3d` the kernels are attention projections held
`(embed, heads, head_dim)` and stored as HF's 2-D `(heads * head_dim, embed)`:
flaxstate's export and import take a `WeightMap` whose layout is
`(h d) e -> e h d`, against `save_file` and `load_file` with the same
rearrangement written by hand in numpy (on the clock).

Rounds alternate the contenders (each first in turn); the table gives the
medians, in seconds and in MiB (and as a multiple of the params' bytes).

    python benchmarks/weights.py [--rounds 3] [--mib 1024] [--shard-mib 256] [--layout 3d]
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
from host_memory import in_fresh_process

MiB = 2**20
EXPORTS = ("flaxstate (run dir)", "flaxstate (run dir, shards)", "flaxstate (state)", "save_file")
IMPORTS = ("SafetensorsReader", "load_file")


TENSORS = 8
"""The params' square float32 kernels: a shard of `--shard-mib` 256 holds two of a 1 GiB state's."""
HEADS = 16
"""`--layout 3d`: each kernel's heads (its `(width, HEADS, width // HEADS)`)."""
MAP = {"Dense_{i}/kernel": ("model.layers.{i}.self_attn.q_proj.weight", "(h d) e -> e h d")}
"""`--layout 3d`: the files' names and layout."""


def _shape(mib: int, layout: str) -> tuple[int, ...]:
    width = _width(mib) // HEADS * HEADS
    return (width, width) if layout == "2d" else (width, HEADS, width // HEADS)


def _to_file(kernel: Any) -> Any:
    """A 3-D kernel as HF stores it, by hand: `(embed, heads, head_dim)` to `(heads * head_dim, embed)`.

    Made row-major here: `safetensors.numpy.save_file` writes a view's underlying memory as it lies (0.8.x), so
    a transposed view given to it is stored scrambled, with the right shape and no error.
    """
    import numpy as np

    return np.ascontiguousarray(kernel.transpose(1, 2, 0)).reshape(-1, kernel.shape[0])


def _file_name(layer: str, layout: str) -> str:
    return f"{layer}/kernel" if layout == "2d" else f"model.layers.{layer.split('_')[1]}.self_attn.q_proj.weight"


def _width(mib: int) -> int:
    return int((mib * MiB / 4 / TENSORS) ** 0.5)


def _params(mib: int, layout: str) -> dict[str, Any]:
    import numpy as np

    rng = np.random.default_rng(0)
    return {f"Dense_{i}": {"kernel": rng.standard_normal(_shape(mib, layout), np.float32)} for i in range(TENSORS)}


def prepare(directory: str, mib: int, layout: str) -> None:
    """The run directory (a state of params and adam's moments, saved once) and the files the imports read."""
    import optax
    import safetensors.numpy

    import flaxstate as fs

    params = _params(mib, layout)
    state = fs.FlaxOptimTrainState.create(optax.adam(1e-3), {"params": params})
    record = fs.Checkpoint(state=state, grads=None, loss=0.0, n_completed_steps=1, elapsed_time=0.0, step=1)
    with fs.CheckpointFileWriter(Path(directory) / "run") as writer:
        writer(record)
    by_hand = (lambda kernel: kernel) if layout == "2d" else _to_file
    flat = {_file_name(layer, layout): by_hand(value["kernel"]) for layer, value in params.items()}
    del params, state, record
    safetensors.numpy.save_file(flat, str(Path(directory) / "model.safetensors"))


def measure(operation: str, contender: str, directory: str, mib: int, shard_mib: int, layout: str) -> dict[str, Any]:
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
    shape = _shape(mib, layout)
    if operation == "import":
        template = {f"Dense_{i}": {"kernel": jax.ShapeDtypeStruct(shape, np.float32)} for i in range(TENSORS)}
    mapped = {} if layout == "2d" else {"map": fs.WeightMap(MAP)}
    to_file = (lambda kernel: kernel) if layout == "2d" else _to_file
    to_tree = (
        (lambda tensor: tensor)
        if layout == "2d"
        else lambda t: t.reshape(shape[1], shape[2], shape[0]).transpose(2, 0, 1)
    )
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    before = host_resident()
    reset_host_peak()
    start = time.perf_counter()
    if contender == "flaxstate (run dir)":
        fs.export_safetensors(run_dir, out, **mapped)
    elif contender == "flaxstate (run dir, shards)":
        fs.export_safetensors(run_dir, out, max_shard_bytes=shard_mib * MiB, **mapped)
    elif contender == "flaxstate (state)":
        fs.export_safetensors(fs.InferenceState.create({"params": held}), out, **mapped)
    elif contender == "save_file":
        out.mkdir()
        flat = {_file_name(layer, layout): to_file(value["kernel"]) for layer, value in held.items()}
        safetensors.numpy.save_file(flat, str(out / "model.safetensors"))
    elif contender == "SafetensorsReader":
        placed = fs.SafetensorsReader(files, None, **mapped).params(template, device)
        jax.block_until_ready(jax.tree.leaves(placed))
    else:
        loaded = safetensors.numpy.load_file(str(files))
        held_names = {_file_name(f"Dense_{i}", layout): f"Dense_{i}" for i in range(TENSORS)}
        placed = jax.device_put({held_names[n]: {"kernel": to_tree(t)} for n, t in loaded.items()}, device)
        jax.block_until_ready(jax.tree.leaves(placed))
    seconds = time.perf_counter() - start
    peak = host_peak_since_reset()
    assert before is not None and peak is not None, "/proc is needed (Linux)"
    first = np.random.default_rng(0).standard_normal(shape, np.float32)  # `_params`' first kernel, off the clock
    if operation == "import":  # each contender placed the params as held
        np.testing.assert_array_equal(np.asarray(placed["Dense_0"]["kernel"]), first)
    else:  # and wrote the files as HF holds them
        written = safetensors.numpy.load_file(str(sorted(out.glob("model*.safetensors"))[0]))
        np.testing.assert_array_equal(written[_file_name("Dense_0", layout)], to_file(first))
    return {"seconds": seconds, "added": peak - before}


def run(operation: str, contender: str, directory: str, mib: int, shard_mib: int, layout: str) -> dict[str, Any]:
    """`measure` in a fresh process."""
    return in_fresh_process("weights", "measure", operation, contender, directory, mib, shard_mib, layout, timeout=900)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--mib", type=int, default=1024, help="the params' MiB (eight square float32 kernels)")
    parser.add_argument("--shard-mib", type=int, default=256, help="max_shard_bytes of the sharded export, in MiB")
    parser.add_argument(
        "--layout", choices=("2d", "3d"), default="2d", help="3d: attention kernels stored as HF's 2-D, through a map"
    )
    args = parser.parse_args()
    figures: dict[tuple[str, str], list[dict[str, Any]]] = {}
    with tempfile.TemporaryDirectory(dir=".") as directory:  # on this disk, not a memory-backed /tmp
        in_fresh_process("weights", "prepare", directory, args.mib, args.layout, timeout=900)
        for index in range(args.rounds):
            for operation, contenders in (("export", EXPORTS), ("import", IMPORTS)):
                shift = index % len(contenders)
                for contender in contenders[shift:] + contenders[:shift]:  # each first in turn
                    figure = run(operation, contender, directory, args.mib, args.shard_mib, args.layout)
                    figures.setdefault((operation, contender), []).append(figure)
                    shutil.rmtree(Path(directory) / "out", ignore_errors=True)
    shape = _shape(args.mib, args.layout)
    params_bytes = int(np.prod(shape)) * 4 * TENSORS
    print(
        f"params: {params_bytes / MiB:.0f} MiB in {TENSORS} float32 kernels of {list(shape)} (adam's moments beside "
        f"them in the run directory); layout {args.layout}; shards of {args.shard_mib} MiB; medians of "
        f"{args.rounds} rounds, a fresh process each"
    )
    print(f"{'operation':<8} {'contender':<28} {'seconds':>8} {'peak added (MiB)':>17} {'x params':>9}")
    for (operation, contender), runs in figures.items():
        seconds = statistics.median(figure["seconds"] for figure in runs)
        added = statistics.median(figure["added"] for figure in runs)
        print(f"{operation:<8} {contender:<28} {seconds:>8.2f} {added / MiB:>17.0f} {added / params_bytes:>9.2f}")


if __name__ == "__main__":
    main()
