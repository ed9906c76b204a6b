"""Resume bit for bit after kill -9 on a GPU: with the programs from the compilation cache, compiled afresh with
the autotune results kept, and compiled afresh without them.

Every run goes through `flaxstate launch` (one process, its XLA preset, its compilation cache and autotune file),
training the LM example's transformer with checkpoints (K steps a dispatch, a record and a save every
`--every` steps). A straight run to `--steps` gives the reference: its params' and optimizer state's SHA-256.
A second run, given the straight run's autotune results (its launcher loads them: its cache holds no programs),
kills itself with SIGKILL after its record at `--kill-at` (its save perhaps still under way); copies of its
checkpoints then resume three times to `--steps`, each from a launcher of its own:

- `cache`: the killed run's compilation cache, its programs and its autotune file: nothing compiled;
- `autotune file`: a fresh cache holding only the killed run's autotune file: compiled again, kernels loaded;
- `nothing kept`: a fresh cache: compiled and autotuned again.

Where loading the results pins the kernels, the first two end where the straight run ends unless a kernel is
not deterministic (`XLA_FLAGS=--xla_gpu_deterministic_ops=true` for XLA's deterministic ones); the third may
differ by autotuning alone.

Each resumed run's end is compared with the straight run's, and its session says where its programs came from
(`Session.programs`). The table says what happened, equal or not.

    python benchmarks/gpu_resume.py [--steps 200] [--kill-at 100] [--every 20] [--size small|gpu] [--out DIR]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve()
SIZES = {
    # Seconds on this CPU: the control flow of the GPU run, small.
    "small": dict(
        batch_size=4, seq_len=32, embed=32, heads=2, head_dim=16, mlp=64, layers=2, vocab=256, attention="xla"
    ),
    # GEMMs large enough to be autotuned, cuDNN's attention, the layers under nn.scan, in bfloat16.
    "gpu": dict(
        batch_size=16,
        seq_len=256,
        embed=512,
        heads=8,
        head_dim=64,
        mlp=2048,
        layers=4,
        vocab=8192,
        attention="cudnn",
        dtype="bfloat16",
        scan_layers=True,
    ),
}


def train(args: argparse.Namespace) -> None:
    """One process of a launched run: trains to `--steps` from `--dir`'s newest checkpoint, or kills itself."""
    import importlib.util

    import jax
    import numpy as np

    import flaxstate as fs

    spec = importlib.util.spec_from_file_location("lm_example", HERE.parents[1] / "examples" / "lm.py")
    lm = importlib.util.module_from_spec(spec)
    sys.modules["lm_example"] = lm
    spec.loader.exec_module(lm)
    config = lm.Config(
        steps=args.steps,
        output_dir=args.dir,
        steps_per_checkpoint=args.every,
        steps_per_dispatch=10,
        **SIZES[args.size],
    )
    mesh = lm.make_mesh("fsdp=1")
    model = lm.Transformer(config)
    train_tokens, _ = lm.split(lm.text())
    loop = fs.TrainLoop(
        init=fs.CheckpointFileReader(config.output_dir, target=model.init),
        task=fs.TrainTask(
            apply=model.apply,
            optimizer=lm.optimizer(config),
            loss=lm.loss,
            data=lm.batches(train_tokens, config, mesh),
        ),
        rng=jax.random.key(config.seed),
        n_steps=config.steps,
        n_steps_per_checkpoint=config.steps_per_checkpoint,
        n_steps_per_dispatch=config.steps_per_dispatch,
        mesh=mesh,
        axis_rules=lm.RULES,
        stdout=False,
    )
    writer = fs.CheckpointFileWriter(config.output_dir, keep=3)
    checkpoint = None
    for checkpoint in loop:
        writer(checkpoint)
        if args.kill_at is not None and checkpoint.step >= args.kill_at:
            print(json.dumps({"killed_at": checkpoint.step}), flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
    assert checkpoint is not None
    digest = hashlib.sha256()
    for leaf in jax.tree.leaves((checkpoint.state.params, checkpoint.state.param_states)):
        digest.update(np.ascontiguousarray(np.asarray(leaf)).tobytes())
    session = checkpoint.session
    print(
        json.dumps(
            {
                "step": checkpoint.step,
                "sha256": digest.hexdigest(),
                "loss": float(checkpoint.loss),
                "programs": session.programs if session else None,
                "restored_step": session.restored_step if session else None,
                "device": jax.devices()[0].device_kind,
                "xla_flags": os.environ.get("XLA_FLAGS", ""),
            }
        ),
        flush=True,
    )


def launch(args: argparse.Namespace, directory: Path, cache: Path, kill_at: int | None = None) -> dict:
    """A launched run of `train` (one process, no restart): its last JSON line, and its seconds."""
    command = [sys.executable, "-m", "flaxstate", "launch", "--processes", "1", "--max-restarts", "0"]
    command += ["--compilation-cache", str(cache), "--xla-preset", args.xla_preset, "--", sys.executable, str(HERE)]
    command += ["train", "--dir", str(directory), "--steps", str(args.steps), "--every", str(args.every)]
    command += ["--size", args.size] + (["--kill-at", str(kill_at)] if kill_at is not None else [])
    env = {key: value for key, value in os.environ.items() if key != "JAX_COMPILATION_CACHE_DIR"}  # the launcher's
    started = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, timeout=args.timeout, env=env)
    seconds = time.perf_counter() - started
    lines = [line.split("] ", 1)[-1] for line in done.stdout.splitlines()]
    found = [json.loads(line) for line in lines if line.startswith("{")]
    if not found:
        raise SystemExit(f"no result from {' '.join(command)} (exit {done.returncode}):\n{done.stdout[-3000:]}\n"
                         f"{done.stderr[-3000:]}")  # fmt: skip
    launcher = [line for line in done.stdout.splitlines() if line.startswith("flaxstate launch:")]
    return {**found[-1], "seconds": seconds, "exit": done.returncode, "launcher": launcher}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="mode")
    child = sub.add_parser("train")
    child.add_argument("--dir", required=True)
    child.add_argument("--kill-at", type=int, default=None)
    for each in (parser, child):
        each.add_argument("--steps", type=int, default=200)
        each.add_argument("--every", type=int, default=20)
        each.add_argument("--size", choices=tuple(SIZES), default="gpu" if shutil.which("nvidia-smi") else "small")
    parser.add_argument("--kill-at", type=int, default=100)
    parser.add_argument("--xla-preset", default="auto")
    parser.add_argument("--timeout", type=float, default=300)
    parser.add_argument("--out", type=Path, default=None, help="the runs' folders (default: a temporary one)")
    args = parser.parse_args()
    if args.mode == "train":
        return train(args)
    root = args.out or Path(tempfile.mkdtemp(prefix="flaxstate-gpu-resume-"))
    straight = launch(args, root / "straight", root / "cache-straight")
    said = " ".join(straight["launcher"])
    print(f"straight to step {straight['step']}: {straight['sha256'][:16]} ({straight['seconds']:.1f} s, programs "
          f"{straight['programs']}); XLA_FLAGS {straight['xla_flags']!r}; {said}", flush=True)  # fmt: skip
    # The killed run compiles with the straight run's autotune results: the same kernels, where loading them pins
    # them, so that a difference left is the kernels' own (or the resume's).
    pinned = root / "cache-straight" / "processes-1" / "autotune" / "process-0.textproto"
    if pinned.exists():
        (root / "cache-killed" / "processes-1" / "autotune").mkdir(parents=True)
        shutil.copy(pinned, root / "cache-killed" / "processes-1" / "autotune" / pinned.name)
    killed = launch(args, root / "killed", root / "cache-killed", kill_at=args.kill_at)
    print(f"killed by SIGKILL after its record at step {killed.get('killed_at')} (exit {killed['exit']}, "
          f"{killed['seconds']:.1f} s)", flush=True)  # fmt: skip
    autotune = root / "cache-killed" / "processes-1" / "autotune" / "process-0.textproto"
    head = autotune.read_text().splitlines()[:3] if autotune.exists() else []
    print(f"its autotune file: {autotune.stat().st_size if autotune.exists() else 'none'} bytes {head}", flush=True)
    rows = []
    for name in ("cache", "autotune file", "nothing kept"):
        directory = root / f"resumed-{name.replace(' ', '-')}"
        shutil.copytree(root / "killed", directory)
        if name == "cache":
            cache = root / "cache-killed"
        else:
            cache = root / f"cache-{name.replace(' ', '-')}"
            if name == "autotune file" and autotune.exists():
                (cache / "processes-1" / "autotune").mkdir(parents=True)
                shutil.copy(autotune, cache / "processes-1" / "autotune" / autotune.name)
        resumed = launch(args, directory, cache)
        rows.append((name, resumed))
        print(f"resumed ({name}) from step {resumed['restored_step']}: {resumed['sha256'][:16]}", flush=True)
    print("\n| resumed after kill -9 | from step | programs | to step | equal to the straight run | seconds |")
    print("|---|---:|---|---:|---|---:|")
    for name, resumed in rows:
        equal = resumed["sha256"] == straight["sha256"] and resumed["step"] == straight["step"]
        print(f"| {name} | {resumed['restored_step']} | {resumed['programs']} | {resumed['step']} | "
              f"{'yes, bit for bit' if equal else 'NO'} | {resumed['seconds']:.1f} |")  # fmt: skip
    print(f"\nthe straight run: step {straight['step']}, loss {straight['loss']:.4f}, {straight['device']}")


if __name__ == "__main__":
    main()
