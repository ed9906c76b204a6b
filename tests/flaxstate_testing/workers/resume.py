"""Trains with checkpoints and resumes from the newest one; prints each record as it is saved.

For the preemption tests it can also slow its data down, send itself SIGTERM
right after a save was started, and time-limit its writer. With `sharded`,
the MLP's hidden units are sharded over a mesh of every process's devices
(with `explicit`, `jax.make_mesh`'s, whose axes are Explicit).
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
from pathlib import Path

from flaxstate_testing.workers.common import setup

config = setup()

import grain  # noqa: E402
import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
import redex  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402

import flaxstate as fs  # noqa: E402
from flaxstate_testing import toy  # noqa: E402

if config.get("nnx"):  # the module itself: its own dropout streams and a Variable of the user's own, carried
    from flax import nnx  # noqa: E402

    from flaxstate_testing import nnx_models  # noqa: E402

    module = nnx_models.MLP(nnx.Rngs(0), width=config.get("width") or 16, dropout=0.25, calls=True)
    model_init, model_apply = module, module
else:
    if config.get("width") is None:
        model = toy.BatchNormNet()
    else:
        sharded = toy.ExplicitShardedMLP if config.get("explicit") else toy.ShardedMLP
        model = (sharded if config.get("sharded") else toy.MLP)(width=config["width"])
    model_init, model_apply = model.init, model.apply
mesh = None
if config.get("sharded"):  # with `explicit`, jax.make_mesh's mesh: Explicit axes, the shardings in the arrays' types
    explicit = config.get("explicit")
    mesh = jax.make_mesh((jax.device_count(),), ("fsdp",)) if explicit else jax.sharding.Mesh(jax.devices(), ("fsdp",))
global_batches = toy.batches(64, config.get("global_batch", 8), seed=1)
x = np.concatenate([b[0] for b in global_batches])
y = np.concatenate([b[1] for b in global_batches])
per_host = config.get("global_batch", 8) // jax.process_count()
if config["data"] == "grain":
    examples = list(zip(x, y, strict=True))[jax.process_index() :: jax.process_count()]
    data = grain.MapDataset.source(examples).shuffle(seed=3).repeat().batch(per_host)
else:
    data = toy.shard(global_batches * 100, jax.process_index(), jax.process_count())
    poison = config.get("poison", {})  # inf inputs in these batches' parts of one process (or of every process)
    if poison.get("process", jax.process_index()) == jax.process_index():
        for index in poison.get("batches", []):
            data[index] = (np.full_like(data[index][0], np.inf), data[index][1])


class Positioned:
    """Data whose iterators save their position (`get_state`) and restore it, or (`forgetful`, a pipeline's bug)
    do not: a resume then starts from the beginning."""

    def __init__(self, batches, forgetful):
        self.batches, self.forgetful = batches, forgetful

    def __iter__(self):
        return _PositionedIterator(self)


class _PositionedIterator:
    def __init__(self, data):
        self.data, self.index = data, 0

    def __next__(self):
        self.index += 1
        return self.data.batches[self.index - 1]

    def get_state(self):
        return {"index": self.index}

    def set_state(self, state):
        if not self.data.forgetful:
            self.index = state["index"]


if config["data"] in ("positioned", "forgetful"):
    data = Positioned(data, forgetful=config["data"] == "forgetful")


class Slow:
    """The data, each batch `data_sleep` seconds late (so that a signal lands in training)."""

    def __init__(self, batches):
        self.batches = batches

    def __iter__(self):
        for batch in self.batches:
            time.sleep(config["data_sleep"])
            yield batch


if config.get("data_sleep"):
    if jax.process_index() == config.get("slow_process"):
        config["data_sleep"] *= 4  # its data wait stands out in the records, and the run stays short
    data = Slow(data)


def stuck_reader(batches, after, seconds=None):
    """Yields `after` batches, then blocks for `seconds` (forever: a reader stuck on a network file)."""
    for index, batch in enumerate(batches):
        if index == after:
            threading.Event().wait(seconds)
        yield batch


def debugged_reader(batches, after, seconds):
    """Yields `after` batches, then stops at a real pdb prompt that a person answers ("c") `seconds` later."""
    import pdb

    for index, batch in enumerate(batches):
        if index == after:
            read_end, write_end = os.pipe()
            typed = threading.Timer(seconds, os.write, (write_end, b"c\n"))
            typed.start()
            print("at the pdb prompt", flush=True)
            pdb.Pdb(stdin=os.fdopen(read_end), stdout=sys.stdout).set_trace()
        yield batch


if config.get("pdb_after") is not None:
    data = debugged_reader(data, config["pdb_after"], config["pdb_seconds"])
if config.get("block_after") is not None and jax.process_index() == config.get("block_process", 0):
    data = stuck_reader(data, config["block_after"], config.get("block_seconds"))
if config.get("interactive"):
    sys.ps1 = ">>> "  # as a REPL has it
if config.get("floor") is not None:
    fs.training.watchdog.FLOOR_SECONDS = config["floor"]

output_dir = config["output_dir"]
local_dir = config["local_dirs"][jax.process_index()] if config.get("local_dirs") else None
if local_dir is not None:
    shown = logging.getLogger("flaxstate")  # its info lines too: which tier restored
    shown.setLevel(logging.INFO)
    shown.addHandler(logging.StreamHandler(sys.stdout))
    shown.propagate = False
optimizer = optax.sgd(0.05, momentum=0.9) if config.get("optimizer") == "sgd" else optax.adam(config.get("lr", 1e-2))
loop = fs.TrainLoop(
    init=fs.CheckpointFileReader(
        [local_dir, output_dir] if local_dir else output_dir,
        target=model_init,
        host_memory_budget=config.get("budget"),
    )
    if config.get("resume", True)
    else model_init,
    task=fs.TrainTask(
        apply=model_apply, optimizer=optimizer, loss=toy.mse, data=data, ema_decay=config.get("ema_decay")
    ),
    rng=jax.random.key(0),
    n_steps=config["n_steps"],
    n_steps_per_checkpoint=config["every"],
    n_steps_per_dispatch=config.get("per_dispatch", 1),
    stdout=False,
    handle_preemption=config.get("handle_preemption", True),
    hang_timeout="auto" if config.get("hang_timeout_from_record") else config.get("hang_timeout", "auto"),
    mesh=mesh,
    axis_rules=toy.SHARDED_RULES if mesh is not None else None,
    rollback=fs.Rollback() if config.get("rollback") else None,
)
print("start", loop.step, flush=True)
now = [0.0]
save_steps = config.get("save_steps")  # saves only these steps (and the last): a clock that moves at them
seconds = 1.0 if save_steps else config.get("every_seconds")
every = {"continuous": fs.Continuous(), "auto": fs.AutoInterval()}.get(config.get("writer_every"))
writer = fs.CheckpointFileWriter(
    output_dir,
    keep=config.get("keep", 2),
    clock=(lambda: now[0]) if save_steps else time.monotonic,
    every=every if seconds is None else fs.EverySeconds(seconds),
)
logger = fs.SummaryLogger() if config.get("logger") else (lambda record: record)
if config.get("hosts"):  # one simulated host a process (FLAXSTATE_HOST, as a cluster whose host names repeat)
    os.environ["FLAXSTATE_HOST"] = config["hosts"][jax.process_index()]
local = (
    fs.CheckpointFileWriter(
        fs.LocalTier(local_dir, peers=config.get("peers", 0), keep=3), host_memory_budget=config.get("budget")
    )
    if local_dir
    else (lambda record: record)
)
process = redex.combinator.serial(logger, local, writer)
if config.get("slow_eval"):  # an evaluation of 40 batches, `slow_eval` seconds each, at the record of step 20
    # (after the writers with `eval_after_save`)

    def slow_eval_data():
        for index in range(10**6):
            time.sleep(config["slow_eval"])
            print("eval batch", index % 40, flush=True)
            yield toy.batches(1, 8, seed=2)[0]

    evaluate = fs.EvalLoop(
        fs.EvalTask(apply=model_apply, metrics={"mse": toy.mse}, data=slow_eval_data()), rng=0, n_steps=40
    )
    train_only = process

    def process(record):
        if config.get("eval_after_save"):  # the writers first: orbax's save is the process's last call into JAX
            record = train_only(record)
        if record.step == 20 or record.preempted:
            record = evaluate(record)
            for done, asked in record.evaluation_cut_short.values():
                print(f"evaluation of {record.step} cut short: {done} of {asked}", flush=True)
        return record if config.get("eval_after_save") else train_only(record)


for checkpoint in loop:
    if save_steps:
        now[0] = 100.0 * sum(step <= checkpoint.step for step in save_steps)
    if config.get("outside_sleep"):
        time.sleep(config["outside_sleep"])  # the caller's own time between records
    process(checkpoint)
    if config.get("wait_saved") and save_steps and checkpoint.step in save_steps:
        writer.wait()  # the persistent step is committed before a kill can land
    requested = ["requested"] if checkpoint.requested else []
    if checkpoint.rollbacks:
        print("rollbacks", len(checkpoint.rollbacks), "at", checkpoint.step, flush=True)
    print("record", checkpoint.step, "preempted" if checkpoint.preempted else "", *requested, flush=True)
    if config.get("hang_timeout_from_record"):  # a short timeout once compiled: a loaded host compiles slowly
        loop._watchdog.timeout = config["hang_timeout_from_record"]  # noqa: SLF001 - what hang_timeout= sets
    if checkpoint.step == config.get("sigterm_after_save"):
        os.kill(os.getpid(), signal.SIGTERM)  # the save runs in the background now
final = loop.state
flat = fs.tree_paths.flatten(final.state_dict())
if mesh is not None:  # the whole of each array, on every process
    flat = multihost_utils.process_allgather(flat, tiled=True)
if jax.process_index() == 0:
    is_key = {k: jax.dtypes.issubdtype(v.dtype, jax.dtypes.prng_key) for k, v in flat.items()}  # an NNX stream's
    flat = {k: np.asarray(jax.random.key_data(v) if is_key[k] else v) for k, v in flat.items()}
    np.savez(Path(config["out"]), **flat)
print("done", loop.step, flush=True)
