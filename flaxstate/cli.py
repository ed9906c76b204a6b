"""The `flaxstate` command line: inspect a run's checkpoints and plot its metrics.

flaxstate ls DIR                  a table of the checkpoints (best marked per writer)
flaxstate show DIR [--step N]     the state tree: paths, shapes, dtypes, bytes, logical axes; metadata
flaxstate plot DIR -o FILE.png    train and eval metric curves from the event files
flaxstate goodput DIR [--json]    where the run's time went, per session and in total (its goodput ledger)
flaxstate audit DIR [--json]      each resume's verdict: replayed bit for bit, or the first step that differs
                                  and why (exit 0: every replay bit for bit, 1: one differs, 2: an error,
                                  3: none differs but a replay was not verified: records without fingerprints)
flaxstate diff A B [--step-a N] [--step-b N]
                                  what differs between two checkpoints: metadata, environment, tree, values
                                  (exit 0: nothing, 1: something, 2: an error)
flaxstate export DIR OUT [--step N] [--dtype bfloat16] [--ema] [--map FILE.json]
                                  the params as safetensors files (`model.safetensors`, or shards and their index),
                                  named and laid out by a `WeightMap`'s table (`WeightMap.to_json`)
flaxstate launch [--processes N] [--max-restarts R] [--grace S] [--min-processes K] -- CMD ...
                                  N processes of CMD on this machine, all started again after a failure
                                  (`flaxstate.launch`)

DIR is a local path, or a gs:// or s3:// URL.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from flaxstate import extras, launch, plotting
from flaxstate.checkpoint.catalog import (
    TOP_CHANGED,
    describe_state,
    diff_checkpoints,
    holds_local_tier,
    list_checkpoints,
    newest_writer,
)
from flaxstate.checkpoint.damage import is_damage
from flaxstate.checkpoint.damage import summary as damage_summary
from flaxstate.checkpoint.errors import CheckpointError
from flaxstate.checkpoint.safetensors import WeightMap, export_safetensors
from flaxstate.locations import is_url, run_directory
from flaxstate.records import format_bytes
from flaxstate.run_record import audit, goodput, ledger

AUDIT_UNVERIFIED = 3
"""`flaxstate audit`'s exit status when no replay differs but one was not verified (records without fingerprints)."""


class UsageError(Exception):
    """Bad input on the command line: one line on stderr, exit status 2."""


def _table(rows: Sequence[Sequence[str]]) -> str:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join(
        "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip() for row in rows
    )


def _time(timestamp: float | None) -> str:
    if timestamp is None:
        return "-"
    return datetime.datetime.fromtimestamp(timestamp).strftime("%Y-%m-%d %H:%M:%S")


def command_ls(args: argparse.Namespace) -> None:
    infos = list_checkpoints(args.dir)
    names = sorted({f"{group}/{name}" for info in infos for group, values in info.metrics.items() for name in values})
    damaged = any(info.damaged for info in infos)
    rows = [["writer", "step", "time", *names, "bytes", "best", *(["damaged"] if damaged else [])]]
    for info in infos:
        values = [
            f"{info.metrics[g][n]:.4g}" if info.metrics.get(g, {}).get(n) is not None else "-"
            for g, n in (name.split("/", 1) for name in names)
        ]
        note = [info.damaged or ""] if damaged else []
        rows.append(
            [
                info.writer,
                str(info.step),
                _time(info.time),
                *values,
                format_bytes(info.bytes),
                "*" if info.best else "",
                *note,
            ]
        )
    print(_table(rows))
    peaks = _memory_peaks(args.dir)
    if peaks:
        print(f"memory at its peak over the run: {peaks}")


def _memory_peaks(run_dir: Path) -> str:
    """The run's memory peaks from its goodput ledger ("" where it keeps none)."""
    try:
        total = goodput.report(ledger.run_events(run_dir))["total"]
    except (FileNotFoundError, OSError):
        return ""
    sizes = {"host": total.get("host_memory_peak"), "devices": total.get("device_memory_peak")}
    return ", ".join(f"{name} {format_bytes(size)}" for name, size in sizes.items() if size is not None)


def _axes(axes: tuple[str | None, ...] | None) -> str:
    """A leaf's logical axes as `(embed, mlp)` (`None` for an unnamed dimension), `-` for a leaf without names."""
    return "-" if axes is None else "(" + ", ".join(str(name) for name in axes) + ")"


def command_show(args: argparse.Namespace) -> None:
    step, leaves, meta = describe_state(args.dir, args.step)
    rows = [["path", "shape", "dtype", "bytes", "logical axes"]]
    rows += [
        [leaf.path, str(list(leaf.shape)), leaf.dtype, format_bytes(leaf.bytes), _axes(leaf.axes)] for leaf in leaves
    ]
    n_params = sum(math.prod(leaf.shape) for leaf in leaves if leaf.path.startswith("target/"))
    param_bytes = sum(leaf.bytes for leaf in leaves if leaf.path.startswith("target/"))
    print(f"checkpoint {newest_writer(args.dir) / str(step)} (format {meta['format_version']})")
    print(_table(rows))
    print(
        f"parameters: {n_params:,} ({format_bytes(param_bytes)}); "
        f"state: {format_bytes(sum(leaf.bytes for leaf in leaves))}"
    )
    print("metrics: " + json.dumps(meta.get("metrics", {})))
    print("metadata: " + json.dumps(meta.get("metadata"), indent=2, sort_keys=True))
    print("environment: " + json.dumps(meta.get("environment"), indent=2, sort_keys=True))


def command_diff(args: argparse.Namespace) -> int:
    diff = diff_checkpoints(args.a, args.b, args.step_a, args.step_b)
    print(f"A: {diff.a}\nB: {diff.b}")
    sections = [
        ("metadata", diff.metadata),
        ("environment", diff.environment),
        ("arrays only in A", diff.only_a),
        ("arrays only in B", diff.only_b),
        ("arrays whose shape or dtype differ", diff.mismatched),
    ]
    for title, lines in sections:
        if lines:
            print(f"{title}:")
            print("\n".join(f"  {line}" for line in lines))
    if diff.changed:
        shown = diff.changed[:TOP_CHANGED]
        print(f"arrays whose values differ: {len(diff.changed)} of {diff.n_compared} (|a - b| / |a|, largest first):")
        rows = [[f"  {path}", f"{change:.3g}"] for path, change in shown]
        print(_table(rows))
        if len(diff.changed) > len(shown):
            print(f"  ... and {len(diff.changed) - len(shown)} more")
    print("they differ" if diff.differ else f"the same ({diff.n_compared} arrays, metadata and environment)")
    return 1 if diff.differ else 0


def command_plot(args: argparse.Namespace) -> None:
    try:
        matplotlib = extras.require("matplotlib", "plot", "flaxstate plot")
        matplotlib.use("Agg")  # a file, not a window
        scalars = plotting.read_scalars(args.dir)
        figure = plotting.curves(scalars, f"flaxstate run {args.dir}")
    except (ImportError, FileNotFoundError, ValueError) as error:
        raise UsageError(str(error).replace("flaxstate.plot", "flaxstate plot")) from error
    figure.savefig(args.output, dpi=100)
    print(f"wrote {args.output} ({', '.join(sorted(scalars))})")


def _ledger_events(run_dir: Path) -> tuple[Path, list[dict]]:
    """The run's ledger (where it is) and its events.

    Raises:
        UsageError: the directory keeps no ledger.
    """
    path = run_dir / (ledger.SESSIONS if is_url(run_dir) else ledger.FILENAME)
    try:
        return path, ledger.run_events(run_dir)
    except FileNotFoundError:
        if holds_local_tier(run_dir):
            raise UsageError(
                f"{run_dir} is a local tier's directory (CheckpointFileWriter(fs.LocalTier(...))): `flaxstate ls` "
                "lists its steps; the goodput ledger is kept by the run's persistent writer: give its directory."
            ) from None
        raise UsageError(
            f"{path} does not exist: a run's CheckpointFileWriter(output_dir) keeps its goodput ledger there "
            "(unless made with ledger=False); give the run's directory."
        ) from None


def command_audit(args: argparse.Namespace) -> int:
    path, events = _ledger_events(args.dir)
    if not any(event.get("event") == "session" for event in events):
        raise UsageError(f"{path} holds no session: the run wrote no record yet.")
    found = audit.resumes(events)
    if args.json:
        print(json.dumps({"resumes": [resume.to_json() for resume in found]}, indent=2))
    elif not found:
        print("no resume: the run was never resumed")
    else:
        for resume in found:
            print(f"session {resume.session}: {resume.line()}")
    if any(resume.differs for resume in found):
        return 1
    return AUDIT_UNVERIFIED if not all(resume.verified for resume in found) else 0


def command_goodput(args: argparse.Namespace) -> None:
    path, events = _ledger_events(args.dir)
    summary = goodput.report(events)
    if not summary["sessions"]:
        raise UsageError(f"{path} holds no session: the run wrote no record yet.")
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        print(goodput.format_report(summary))


def _run_dir(value: str) -> Path:
    """A run directory argument: a local or mounted path, or a bucket's URL (checked: see `run_directory`)."""
    try:
        return run_directory(value, "flaxstate")
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def build_parser() -> argparse.ArgumentParser:
    """Returns the parser of the `flaxstate` command."""
    parser = argparse.ArgumentParser(prog="flaxstate", description="Inspect flaxstate runs and checkpoints.")
    commands = parser.add_subparsers(dest="command")
    ls = commands.add_parser("ls", help="a table of the checkpoints: step, time, metrics, bytes")
    ls.add_argument("dir", type=_run_dir)
    ls.set_defaults(run=command_ls)
    show = commands.add_parser("show", help="the state tree of a checkpoint and its metadata")
    show.add_argument("dir", type=_run_dir)
    show.add_argument("--step", type=int, default=None)
    show.set_defaults(run=command_show)
    plot = commands.add_parser("plot", help="metric curves from the run's TensorBoard event files")
    plot.add_argument("dir", type=_run_dir)
    plot.add_argument("-o", "--output", required=True, help="the PNG file to write")
    plot.set_defaults(run=command_plot)
    diff = commands.add_parser("diff", help="what differs between two checkpoints (exit 0 same, 1 different)")
    diff.add_argument("a", type=_run_dir, help="a run directory (its newest checkpoint, or --step-a)")
    diff.add_argument("b", type=_run_dir, help="another (or the same, with --step-b)")
    diff.add_argument("--step-a", type=int, default=None)
    diff.add_argument("--step-b", type=int, default=None)
    diff.set_defaults(run=command_diff)
    time_spent = commands.add_parser("goodput", help="where the run's time went: its goodput ledger, added up")
    time_spent.add_argument("dir", type=_run_dir)
    time_spent.add_argument("--json", action="store_true", help="one JSON object: sessions and total")
    time_spent.set_defaults(run=command_goodput)
    audited = commands.add_parser(
        "audit", help="each resume's verdict (exit 0 bit for bit, 1 a replay differs, 3 a replay not verified)"
    )
    audited.add_argument("dir", type=_run_dir)
    audited.add_argument("--json", action="store_true", help='one JSON object: {"resumes": [...]}')
    audited.set_defaults(run=command_audit)
    export = commands.add_parser(
        "export", help="the params of a checkpoint as safetensors files (an HF-style folder vLLM and transformers load)"
    )
    export.add_argument("dir", type=_run_dir)
    export.add_argument("out", help="the folder to write")
    export.add_argument("--step", type=int, default=None, help="default: the newest intact step")
    export.add_argument("--dtype", default=None, help="the dtype to store, e.g. bfloat16 (default: the params')")
    export.add_argument("--ema", action="store_true", help="the EMA of the params (TrainTask(ema_decay=...))")
    export.add_argument("--max-shard-bytes", type=int, default=5 * 2**30, help="the most bytes a file (default 5 GiB)")
    export.add_argument(
        "--map",
        default=None,
        help='a JSON file of one object {"tree path pattern": "file name pattern" | ["file name pattern", "layout"]}: '
        "fs.WeightMap's table (default: the tree paths as names, as held)",
    )
    export.set_defaults(run=command_export)
    starter = commands.add_parser(
        "launch", help="N processes of a command on this machine, all started again after a failure"
    )
    starter.add_argument("--processes", type=int, default=None, help="default: one a local GPU, else 1")
    starter.add_argument("--max-restarts", type=int, default=3)
    starter.add_argument("--grace", type=float, default=30.0, help="seconds from SIGTERM to SIGKILL (default 30)")
    starter.add_argument(
        "--min-processes",
        type=int,
        default=None,
        help="go on with fewer processes, not fewer than this, after processes are lost (default: never fewer)",
    )
    starter.add_argument(
        "--compilation-cache",
        default="",
        help="the processes' JAX compilation caches, one folder a process count (default "
        "~/.cache/flaxstate/compilation; 'none': none; a JAX_COMPILATION_CACHE_DIR of your own wins)",
    )
    starter.add_argument(
        "--xla-preset",
        default="auto",
        help="XLA's flags for the GPU generation: hopper, blackwell, ampere, none, or auto (this machine's GPU's; "
        "none without a GPU; your own XLA_FLAGS win flag by flag)",
    )
    starter.add_argument(
        "program", metavar="command", nargs=argparse.REMAINDER, help="-- then the command of each process"
    )
    starter.set_defaults(run=command_launch)
    return parser


def command_export(args: argparse.Namespace) -> None:
    try:
        weight_map = None if args.map is None else WeightMap.from_json(args.map)
        out = export_safetensors(
            args.dir,
            args.out,
            map=weight_map,
            dtype=args.dtype,
            use_ema=args.ema,
            max_shard_bytes=args.max_shard_bytes,
            step=args.step,
        )
    except ValueError as error:
        raise UsageError(str(error)) from None
    files = sorted(entry.name for entry in out.iterdir() if entry.name.startswith("model"))
    print(f"exported {args.dir} to {out}: {', '.join(files)}")


def command_launch(args: argparse.Namespace) -> int:
    command = args.program[1:] if args.program[:1] == ["--"] else args.program
    try:
        cache = None if args.compilation_cache == "none" else args.compilation_cache
        return launch.launch(
            command,
            args.processes,
            args.max_restarts,
            args.grace,
            min_processes=args.min_processes,
            compilation_cache=cache,
            xla_preset=args.xla_preset,
        )
    except ValueError as error:
        raise UsageError(str(error)) from None


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the command line.

    Args:
        argv: the arguments (`sys.argv[1:]` by default).

    Returns:
        the exit status: 0, or 2 for bad input (one line on stderr); `diff`: 1 when the checkpoints differ;
        `audit`: 1 when a resume's replay differs, 3 when none differs but a replay was not verified (records
        without state fingerprints to compare).
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    try:
        status = args.run(args)
    except BrokenPipeError:  # the reader of stdout went away (`flaxstate ls DIR | head`): not an error
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error when Python flushes
        return 0
    except (CheckpointError, UsageError) as error:
        print(f"flaxstate {args.command}: {str(error).splitlines()[0]}", file=sys.stderr)
        return 2
    except Exception as error:
        if not is_damage(error):
            raise
        print(f"flaxstate {args.command}: a damaged checkpoint: {damage_summary(error)}", file=sys.stderr)
        return 2
    return int(status or 0)


if __name__ == "__main__":
    sys.exit(main())
