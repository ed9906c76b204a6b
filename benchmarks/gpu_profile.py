"""Where the K-step loop's and the restore's time goes on a device: traces and host profiles, printed.

1. `jax.profiler.trace` of two rounds of 400 steps (a record between them) of
   flaxstate's loop and the hand-written jit loops of `loop_overhead.py` (small
   MLP), at K=1 and K=10, without Python's tracer: the devices' busy time, and
   their idle gaps by size. Then flaxstate's rounds again with Python's tracer:
   each of the largest gaps with the host's Python calls that span it.
2. cProfile of 3 restores, flaxstate's `CheckpointFileReader` and plain orbax
   (`checkpoint.py`'s state), the top calls by cumulative time.

    python benchmarks/gpu_profile.py [--out DIR] [--steps 400]

The traces (`perfetto_trace.json.gz`) stay under DIR for `ui.perfetto.dev`.
"""

from __future__ import annotations

import argparse
import cProfile
import gzip
import io
import json
import pstats
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))


def device_lanes(events: list[dict[str, Any]]) -> set[int]:
    """The trace's process ids of accelerator devices (the host's CPU client where there is none)."""
    names = {e["pid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"}
    devices = {pid for pid, name in names.items() if "/device:GPU" in name or "/device:TPU" in name}
    return devices or {pid for pid, name in names.items() if name == "/host:CPU"}


def busy_and_gaps(events: list[dict[str, Any]]) -> tuple[float, float, list[tuple[float, float]]]:
    """(span, busy, gaps) in microseconds: the devices' kernels merged into busy intervals, the idle between them."""
    lanes = device_lanes(events)
    spans = sorted(
        (e["ts"], e["ts"] + e.get("dur", 0))
        for e in events
        if e.get("ph") == "X" and e.get("pid") in lanes and not str(e.get("name", "")).startswith("$")
        and (len(lanes) > 1 or "Thunk" in e.get("name", "") or "fusion" in e.get("name", ""))
    )  # fmt: skip
    if not spans:
        return 0.0, 0.0, []
    merged = [list(spans[0])]
    for start, end in spans[1:]:
        if start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    busy = sum(end - start for start, end in merged)
    gaps = [(merged[i][1], merged[i + 1][0]) for i in range(len(merged) - 1)]
    return merged[-1][1] - merged[0][0], busy, gaps


def read_trace(directory: Path) -> list[dict[str, Any]]:
    (path,) = directory.rglob("perfetto_trace.json.gz")
    return json.load(gzip.open(path))["traceEvents"]


def summarize(name: str, events: list[dict[str, Any]], steps: int) -> None:
    span, busy, gaps = busy_and_gaps(events)
    if not span:
        print(f"{name}: no device events in the trace")
        return
    sizes = sorted((end - start for start, end in gaps), reverse=True)
    buckets = {"<10us": 0.0, "10-100us": 0.0, "0.1-1ms": 0.0, ">1ms": 0.0}
    for size in sizes:
        key = "<10us" if size < 10 else "10-100us" if size < 100 else "0.1-1ms" if size < 1000 else ">1ms"
        buckets[key] += size
    print(
        f"{name}: span {span / 1e3:.2f} ms for {steps} steps ({span / steps:.1f} us a step), devices busy "
        f"{busy / span:.1%}; idle by gap size (ms): "
        + ", ".join(f"{k} {v / 1e3:.2f}" for k, v in buckets.items())
        + f"; largest gaps (us): {', '.join(f'{s:.0f}' for s in sizes[:8])}"
    )


def spanning_calls(events: list[dict[str, Any]], gaps: int = 6) -> None:
    """The largest device gaps, each with the host's Python calls (`$...`) that cover most of it, innermost first."""
    _, _, all_gaps = busy_and_gaps(events)
    python = [e for e in events if e.get("ph") == "X" and str(e.get("name", "")).startswith("$")]
    for start, end in sorted(all_gaps, key=lambda g: g[0] - g[1])[:gaps]:
        size = end - start
        covering = [
            e for e in python
            if e["ts"] < end and e["ts"] + e.get("dur", 0) > start
            and min(end, e["ts"] + e["dur"]) - max(start, e["ts"]) > 0.3 * size
        ]  # fmt: skip
        covering.sort(key=lambda e: e["dur"])
        names = [f"{e['name'][1:]} ({e['dur']:.0f})" for e in covering[:7]]
        print(f"  gap {size:.0f} us: " + " < ".join(names))


def trace(run: Callable[[int], None], steps: int, directory: Path, python: bool) -> list[dict[str, Any]]:
    options = jax.profiler.ProfileOptions()
    options.python_tracer_level = 1 if python else 0
    run(steps)
    with jax.profiler.trace(str(directory), create_perfetto_trace=True, profiler_options=options):
        run(steps)
        run(steps)
    return read_trace(directory)


def loop_traces(out: Path, steps: int) -> None:
    from loop_overhead import MLP, flaxstate_runner, handwritten_jit_runner, make_data

    model, data = MLP(64), make_data(64, 64)
    runners = {}
    for k in (1, 10):
        runners[f"hand-written jit, K={k}"] = handwritten_jit_runner(model, data, k)
        runners[f"hand-written jit, K={k}, a record a round"] = handwritten_jit_runner(model, data, k, record=True)
        runners[f"flaxstate, K={k}"] = flaxstate_runner(model, data, k, steps)
    for name, run in runners.items():
        run(steps)
        start = time.perf_counter()
        run(steps)
        seconds = time.perf_counter() - start
        events = trace(run, steps, out / name.replace(" ", "_").replace(",", ""), python=False)
        print(f"[untraced round {seconds / steps * 1e6:.1f} us a step] ", end="")
        summarize(name, events, 2 * steps)
    for k in (1, 10):
        name = f"flaxstate, K={k}"
        events = trace(runners[name], steps, out / f"python_{k}", python=True)
        print(f"{name} with Python's tracer:")
        summarize("  ", events, 2 * steps)
        spanning_calls(events)


def restore_profile(out: Path) -> None:
    import checkpoint as bench
    import orbax.checkpoint as ocp

    import flaxstate as fs

    workdir = Path(tempfile.mkdtemp(dir=out))
    loop = bench.make_loop(1)
    record = loop.next_checkpoint()
    fs.CheckpointFileWriter(workdir / "restore")(fs.Checkpoint(**{**record.__dict__, "final": True}))
    plain = ocp.CheckpointManager(workdir / "plain")
    plain.save(1, args=ocp.args.StandardSave(record.state.state_dict()))
    plain.wait_until_finished()
    template = jax.device_put(loop.state)
    abstract = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), template.state_dict()
    )
    reader = fs.CheckpointFileReader(workdir / "restore")
    contenders = {
        "flaxstate": lambda: reader.restore(template),
        "orbax": lambda: plain.restore(1, args=ocp.args.StandardRestore(abstract)),
    }
    for name, restore in contenders.items():
        jax.block_until_ready(restore())
        times = []
        profile = cProfile.Profile()
        for _ in range(3):
            start = time.perf_counter()
            profile.enable()
            jax.block_until_ready(restore())
            profile.disable()
            times.append(time.perf_counter() - start)
        text = io.StringIO()
        pstats.Stats(profile, stream=text).sort_stats("cumtime").print_stats(32)
        print(f"--- {name}: {', '.join(f'{t * 1e3:.1f}' for t in times)} ms (profiled)")
        lines = [line for line in text.getvalue().splitlines() if "/" in line or "{" in line]
        print("\n".join(line.replace(str(Path(ocp.__file__).parent), "orbax") for line in lines[:34]))
        text = io.StringIO()
        pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(16)
        lines = [line for line in text.getvalue().splitlines() if "/" in line or "{" in line]
        print(f"--- {name}, by own time:")
        print("\n".join(line.replace(str(Path(ocp.__file__).parent), "orbax") for line in lines[:17]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(tempfile.gettempdir()) / "flaxstate-profile")
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--only", default="loop_traces,restore_profile")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    print(f"jax {jax.__version__}, {jax.devices()}")
    for check in args.only.split(","):
        print(f"\n## {check}", flush=True)
        try:
            globals()[check](args.out, args.steps) if check == "loop_traces" else globals()[check](args.out)
        except Exception as error:  # one check's failure leaves the others to run
            print(f"FAILED: {type(error).__name__}: {error}")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
