"""From a lost process to the first record again: a job that goes on with fewer processes against one restarted
at its old size, with and without the launcher's compilation cache.

Each round is one `flaxstate launch --processes 4` of a worker that trains an
MLP (`--layers` dense layers of `--width`, adam) on `fs.global_batches`, 32
examples a step, a record every 5 steps, `TrainLoop(max_device_batch=8)`, and
saves every 4th record (step 20, 40, ...) to one persistent folder. At the
record of step `--fail-at` process 3 fails (`os._exit(5)`, as a crash):

- "shrink": a health check has named process 3 in `FLAXSTATE_LOST_FILE`,
  so the launcher goes on at once with 2 processes (`--min-processes 2`),
  whose devices take the 32 examples in 2 microbatches;
- "old size": the failure is a one-off (a replacement host came at once), and
  the launcher starts all 4 again. A real replacement also waits for the
  host, which no machine here can show.

Each runs with the launcher's compilation cache (`--compilation-cache DIR`,
warmed by an earlier job of that size: a shrink's first time at a size
compiles as "none" does) and without (`none`). The four alternate round by
round; the table gives medians over `--rounds`: seconds from the failure (the
failing process's clock just before it exits) to the first record of the
next round, split into the launcher's part (the others stopped and the new
processes started), the processes' start (Python, JAX and flaxstate imported,
peers found, the checkpoint restored) and the first record (compiling and the
steps to it), and the steps lost (trained before the failure and again after
it). JAX caches programs that took `JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS`
to compile: this script sets it to 0, so that every program counts.

    python benchmarks/shrink.py [--rounds 3] [--fail-at 35] [--layers 12] [--width 512]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

WORKER = r"""
import json, os, sys, time
begun = time.time()
config = json.loads(sys.argv[1])
import jax
import flaxstate as fs  # registers the launcher's cluster with JAX
jax.distributed.initialize()
import flax.linen as nn, jax.numpy as jnp, numpy as np, optax


class Deep(nn.Module):
    @nn.compact
    def __call__(self, x):
        for _ in range(config["layers"]):
            x = nn.tanh(nn.Dense(config["width"])(x))
        return nn.Dense(1)(x)[:, 0]


rng = np.random.RandomState(0)
x = rng.randn(4096, 32).astype(np.float32)
y = np.sin(x.sum(axis=1)).astype(np.float32)
model = Deep()
data = fs.global_batches((x, y), batch_size=32, seed=0)
loss = lambda out, target: jnp.mean((out - target) ** 2)
loop = fs.TrainLoop(
    fs.CheckpointFileReader(config["dir"], target=model.init),
    fs.TrainTask(apply=model.apply, optimizer=optax.adam(1e-3), loss=loss, data=data),
    jax.random.key(0),
    n_steps=config["n_steps"],
    n_steps_per_checkpoint=5,
    stdout=False,
    max_device_batch=8,
)
index, restarts = jax.process_index(), os.environ["FLAXSTATE_RESTARTS"]
print("begun", restarts, begun, "restored", time.time(), loop.step, flush=True)
broken = index == 3 and restarts == "0"
with fs.CheckpointFileWriter(config["dir"], keep=2) as writer:
    for checkpoint in loop:
        if checkpoint.step % 20 == 0 or checkpoint.final:
            writer(checkpoint)
        if index == 0:
            print("record", restarts, time.time(), checkpoint.step, flush=True)
        if broken and checkpoint.step == config["fail_at"]:
            writer.wait()
            print("failed", time.time(), checkpoint.step, flush=True)
            os._exit(5)
"""

CONTENDERS = ("shrink, cache", "shrink, none", "old size, cache", "old size, none")


def one_round(contender: str, workdir: Path, args: argparse.Namespace) -> dict[str, float]:
    """Launches one job, fails process 3 at `--fail-at`, and returns the round's figures."""
    run = Path(tempfile.mkdtemp(dir=workdir))
    script = run / "worker.py"
    script.write_text(textwrap.dedent(WORKER))
    config = {"dir": str(run / "run"), "n_steps": args.fail_at + 10, "fail_at": args.fail_at}
    config.update(layers=args.layers, width=args.width)
    shrink, cached = contender.startswith("shrink"), contender.endswith("cache")
    env = dict(os.environ, JAX_PLATFORMS="cpu", JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0")
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    command = [sys.executable, "-m", "flaxstate", "launch", "--processes", "4", "--grace", str(args.grace)]
    command += ["--compilation-cache", str(workdir / "cache") if cached else "none"]
    if shrink:
        (run / "lost").write_text("3\n")
        env["FLAXSTATE_LOST_FILE"] = str(run / "lost")
        command += ["--min-processes", "2"]
    done = subprocess.run(
        [*command, "--", sys.executable, str(script), json.dumps(config)],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    lines = [line.split("] ", 1)[-1].split() for line in done.stdout.splitlines()]
    failed = next((line for line in lines if line[0] == "failed"), None)
    restarted = [line for line in lines if line[0] == "begun" and line[1] == "1"]
    records = [line for line in lines if line[0] == "record" and line[1] == "1"]
    expected = 2 if shrink else 4
    if done.returncode != 0 or failed is None or len(restarted) != expected or not records:
        raise RuntimeError(f"{contender}: exit {done.returncode}, {len(restarted)} restarted:\n{done.stdout[-4000:]}")
    failed_at, begun = float(failed[1]), min(float(line[2]) for line in restarted)
    restored = max(float(line[4]) for line in restarted)
    first = float(records[0][2])
    return {
        "total": first - failed_at,
        "launcher": begun - failed_at,
        "start": restored - begun,
        "first record": first - restored,
        "steps lost": int(failed[2]) - int(restarted[0][5]),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--fail-at", type=int, default=35)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--grace", type=float, default=3.0, help="the launcher's --grace (its default is 30)")
    args = parser.parse_args()
    import jax

    results: dict[str, list[dict[str, float]]] = {name: [] for name in CONTENDERS}
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        # Warm the cache for both sizes, as an earlier job at each would: the first round of each contender
        # with the cache then finds the programs of the size it restarts at.
        for warm in ("shrink, cache", "old size, cache"):
            one_round(warm, workdir, args)
        for _ in range(args.rounds):
            for name in CONTENDERS:
                results[name].append(one_round(name, workdir, args))
    print(
        f"jax {jax.__version__}, 4 CPU processes on gloo, {args.layers} x {args.width} MLP, failure at step "
        f"{args.fail_at}, medians of {args.rounds} alternating rounds\n"
    )
    columns = ("total", "launcher", "start", "first record", "steps lost")
    print("| restart | failure to first record (s) | launcher (s) | processes' start (s) | to first record (s) "
          "| steps lost |")  # fmt: skip
    print("|---|---:|---:|---:|---:|---:|")
    for name, rounds in results.items():
        medians = [statistics.median(each[column] for each in rounds) for column in columns]
        print(f"| {name} | " + " | ".join(f"{value:.2f}" for value in medians[:-1]) + f" | {medians[-1]:.0f} |")


if __name__ == "__main__":
    main()
