"""How long a preempted run takes from SIGTERM to exit: flaxstate against a hand-written handler.

Each round starts fresh worker processes that train an MLP with adam (about
12 MiB of state) with a checkpoint every 100 steps, sends SIGTERM once they
have trained a while, and times the signal to the exit of the last process
(the checkpoint of the stopped step on disk, checked afterwards). flaxstate's
worker is the README's `for c in loop: writer(c)`; the hand-written one is the
minimal correct loop a user writes: a jitted step, a SIGTERM flag (one
process) or `reached_preemption_sync_point` every step (several processes),
then a synchronous orbax save of the state and `sys.exit(0)`. Two processes
are joined over gloo on this machine's CPUs, SIGTERM sent to process 1 only.
Rounds alternate between the two; the table gives medians.

    python benchmarks/preemption.py [--rounds 5] [--processes 1,2]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

WORKER = r"""
import json, signal, sys
config = json.loads(sys.argv[1])
import jax
if config["n_processes"] > 1:
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(f"127.0.0.1:{config['port']}", num_processes=config["n_processes"],
                               process_id=config["process_id"], initialization_timeout=60)
import flax.linen as nn, jax.numpy as jnp, numpy as np, optax

class MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Dense(1024)(x))
        return nn.Dense(10)(nn.relu(nn.Dense(1024)(x)))

def loss_fn(logits, labels):
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

rng = np.random.RandomState(jax.process_index())
batch = (rng.randn(16, 256).astype(np.float32), rng.randint(0, 10, 16).astype(np.int32))
model, optimizer, n_steps, directory = MLP(), optax.adam(1e-4), 10**7, config["dir"]

if config["mode"] == "flaxstate":
    import itertools
    import flaxstate as fs
    task = fs.TrainTask(apply=model.apply, optimizer=optimizer, loss=loss_fn, data=itertools.repeat(batch))
    loop = fs.TrainLoop(model.init, task, jax.random.key(0), n_steps=n_steps, n_steps_per_checkpoint=100,
                        stdout=False)
    writer = fs.CheckpointFileWriter(directory)
    for checkpoint in loop:
        writer(checkpoint)
        if checkpoint.step == 200:
            print("ready", flush=True)
        if checkpoint.preempted:
            print("stopped", checkpoint.step, flush=True)
else:
    import orbax.checkpoint as ocp
    from jax.experimental import multihost_utils
    from jax.sharding import NamedSharding, PartitionSpec
    mesh = jax.sharding.Mesh(np.asarray(jax.devices()), ("data",))
    replicated, split = NamedSharding(mesh, PartitionSpec()), NamedSharding(mesh, PartitionSpec("data"))
    params = jax.jit(model.init, out_shardings=replicated)(jax.random.key(0), batch[0][:1])
    state = (params, jax.jit(optimizer.init, out_shardings=replicated)(params))

    @jax.jit
    def update(state, x, y):
        params, opt_state = state
        grads = jax.grad(lambda p: loss_fn(model.apply(p, x), y))(params)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    preempted = [False]
    if jax.process_count() == 1:
        signal.signal(signal.SIGTERM, lambda *_: preempted.__setitem__(0, True))
    manager = ocp.CheckpointManager(directory, options=ocp.CheckpointManagerOptions(max_to_keep=1))
    for step in range(1, n_steps + 1):
        x = jax.make_array_from_process_local_data(split, batch[0])
        y = jax.make_array_from_process_local_data(split, batch[1])
        state = update(state, x, y)
        stop = preempted[0] if jax.process_count() == 1 else multihost_utils.reached_preemption_sync_point(step)
        if stop or step % 100 == 0:
            manager.save(step, args=ocp.args.StandardSave(state), force=stop)
            manager.wait_until_finished()
        if step == 200:
            print("ready", flush=True)
        if stop:
            print("stopped", step, flush=True)
            manager.close()
            sys.exit(0)
"""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def one_round(mode: str, n_processes: int) -> float:
    """Starts the workers, sends SIGTERM to the last, and returns the seconds to the last exit."""
    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(tmp) / "run"
        port = free_port()
        env = dict(os.environ, JAX_PLATFORMS="cpu")
        workers = []
        for index in range(n_processes):
            config = {"mode": mode, "dir": str(directory), "n_processes": n_processes, "process_id": index}
            workers.append(
                subprocess.Popen(
                    [sys.executable, "-c", WORKER, json.dumps(dict(config, port=port))],
                    env=env,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    text=True,
                    start_new_session=True,
                )
            )
        outputs: list[list[str]] = [[] for _ in workers]
        ready = [threading.Event() for _ in workers]

        def read(index: int) -> None:
            for line in workers[index].stdout:
                outputs[index].append(line)
                if line.startswith("ready"):
                    ready[index].set()

        readers = [threading.Thread(target=read, args=(index,), daemon=True) for index in range(n_processes)]
        for reader in readers:
            reader.start()
        try:
            for event in ready:
                if not event.wait(300):
                    raise RuntimeError(f"{mode}: no worker got ready:\n{''.join(sum(outputs, []))[-3000:]}")
            workers[-1].send_signal(signal.SIGTERM)
            signalled = time.perf_counter()
            for worker in workers:
                worker.wait(timeout=120)
            seconds = time.perf_counter() - signalled
        finally:
            for worker in workers:
                if worker.poll() is None:
                    os.killpg(worker.pid, signal.SIGKILL)
        for reader in readers:
            reader.join(10)
        text = "".join(sum(outputs, []))
        codes = [worker.returncode for worker in workers]
        stopped = {line.split()[1] for lines in outputs for line in lines if line.startswith("stopped")}
        saved = sorted(int(path.name) for path in directory.iterdir() if path.name.isdigit())
        if codes != [0] * n_processes or len(stopped) != 1 or saved[-1] != int(stopped.pop()):
            raise RuntimeError(f"{mode}: exits {codes}, stopped {stopped}, saved {saved}:\n{text[-3000:]}")
        return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--processes", default="1,2")
    args = parser.parse_args()
    import jax

    print(f"jax {jax.__version__}, {args.rounds} alternating rounds, CPU workers\n")
    print("| processes | SIGTERM to the last exit: flaxstate (s) | hand-written (s) | ratio |")
    print("|---:|---:|---:|---:|")
    for n_processes in [int(n) for n in args.processes.split(",")]:
        times: dict[str, list[float]] = {"flaxstate": [], "hand": []}
        for _ in range(args.rounds):
            for mode in times:
                times[mode].append(one_round(mode, n_processes))
        ours, theirs = statistics.median(times["flaxstate"]), statistics.median(times["hand"])
        print(f"| {n_processes} | {ours:.2f} | {theirs:.2f} | {ours / theirs:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
