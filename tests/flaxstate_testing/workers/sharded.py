"""Trains the LM example's model sharded over a mesh of the processes' devices, phase after phase.

Each phase (`config["phases"]`) is one run: `mesh` ('data=1,fsdp=2,model=1'),
`dir` (resumed from when it holds checkpoints), `steps`; with `copy_from`,
process 0 first copies that directory to `dir`. With `stall_at`, the data
sleeps before that batch (so that a kill lands mid-run); with `local`, a local tier
there too (`copy_local_from` is copied with `copy_from`), and with
`persistent_steps` the persistent writer saves only those steps; with `data_sleep`,
before every batch (so that a SIGTERM lands in training); with `inference`, the
last checkpoint is restored into a sharded `InferenceState` too; with
`evaluate`, the final record is evaluated by a sharded `EvalLoop` on that many
of the example's batches. Process 0 prints one `result {json}` line a phase:
the bytes of the final state that each process's devices hold, against the
whole state's, which leaves were left whole, and the evaluation's metrics with
whether the parameters it saw inside its compiled step were sharded; with
`record_memory="device"`, whether each record's state fingerprint (its K-step
dispatch's) equals one computed apart from its state.
"""

from __future__ import annotations

import json
import logging
import shutil
import sys
import time

from flaxstate_testing.workers.common import setup

config = setup()

import jax  # noqa: E402
import numpy as np  # noqa: E402
import redex  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402

import flaxstate as fs  # noqa: E402
from flaxstate import tree_paths  # noqa: E402
from flaxstate.run_record import fingerprints  # noqa: E402
from flaxstate_testing.lm import lm, train_loop  # noqa: E402

shown = logging.getLogger("flaxstate")  # its info lines too: which tier restored
shown.setLevel(logging.INFO)
shown.addHandler(logging.StreamHandler(sys.stdout))
shown.propagate = False
model_config = lm.Config(**config["model"])
model = lm.Transformer(model_config)
tokens = lm.text()


def local_bytes(leaf: jax.Array | np.ndarray) -> int:
    """The bytes of a leaf that this process's devices hold (a numpy leaf: a host copy of a replicated one)."""
    if isinstance(leaf, np.ndarray):
        return leaf.nbytes
    return sum(shard.data.nbytes for shard in leaf.addressable_shards)


def layout_report(state) -> dict:
    leaves = tree_paths.flatten(state)
    whole = {path: leaf for path, leaf in leaves.items() if local_bytes(leaf) == leaf.nbytes}
    return {
        "local_bytes": sum(local_bytes(leaf) for leaf in leaves.values()),
        "total_bytes": sum(leaf.nbytes for leaf in leaves.values()),
        "whole": {path: int(leaf.nbytes) for path, leaf in whole.items()},
    }


class Late:
    """The example's global batches (this process's part of each), each `data_sleep` seconds late; the batch of
    step `stall_at` after a long sleep. It keeps `iter_from`: a resume still starts at its global step."""

    def __init__(self, batches: fs.GlobalBatches, stall_at: int | None, data_sleep: float) -> None:
        self.batches, self.stall_at, self.data_sleep = batches, stall_at, data_sleep

    def iter_from(self, step: int):
        for index, batch in enumerate(self.batches.iter_from(step), start=step):
            if index == self.stall_at:
                print("stalled", flush=True)
                time.sleep(120)
            time.sleep(self.data_sleep)
            yield batch

    def __iter__(self):
        return self.iter_from(0)


def batches(mesh, stall_at: int | None, data_sleep: float) -> fs.GlobalBatches | Late:
    """This process's part of the example's batches, late or stalled as the phase asks."""
    dataset = lm.batches(tokens, model_config, mesh)
    return Late(dataset, stall_at, data_sleep) if stall_at is not None or data_sleep else dataset


def run(phase: dict) -> dict:
    local_dir = phase.get("local")
    if phase.get("copy_from"):
        if jax.process_index() == 0:
            shutil.copytree(phase["copy_from"], phase["dir"])
            if local_dir is not None:
                shutil.copytree(phase["copy_local_from"], local_dir)
        multihost_utils.sync_global_devices("copied")
    mesh = lm.make_mesh(phase["mesh"])
    loop = train_loop(
        model_config,
        init=fs.CheckpointFileReader([local_dir, phase["dir"]] if local_dir else phase["dir"], target=model.init),
        batches=batches(mesh, phase.get("stall_at"), phase.get("data_sleep", 0.0)),
        mesh=mesh,
        n_steps=phase["steps"],
        record_memory=phase.get("record_memory", "host"),
        ema_decay=phase.get("ema_decay"),
    )
    writer = fs.CheckpointFileWriter(phase["dir"], keep=10)
    local = fs.CheckpointFileWriter(fs.LocalTier(local_dir, keep=3)) if local_dir else (lambda record: record)
    saves = phase.get("persistent_steps")  # the persistent tier saves only these (not the final record either)
    process = redex.combinator.serial(
        local, lambda record: writer(record) if saves is None or record.step in saves else record
    )
    record = None
    agree = []  # with the state on the devices, whether a record's fingerprint equals one computed apart
    for record in loop:
        if phase.get("record_memory") == "device":
            apart = fingerprints.text(fingerprints.of_state(jax.tree.leaves(record.state)))
            agree.append([record.step, record.state_fingerprint == apart])
        process(record)
        print("record", record.step, "preempted" if record.preempted else "", flush=True)
    writer.close()
    if local_dir:
        local.close()
    result = {"step": loop.step, "fingerprints_agree": agree, **layout_report(record.state)}
    if phase.get("inference"):
        abstract = jax.eval_shape(lambda: fs.InferenceState.create(model.init(jax.random.key(0), *record_inputs())))
        template = fs.sharded_like(abstract, fs.logical_shardings(abstract, mesh, lm.RULES))
        restored = fs.CheckpointFileReader(phase["dir"]).restore(template)
        mismatched = [
            path
            for path, leaf in tree_paths.flatten(restored.params).items()
            if not all(
                np.array_equal(a.data, b.data)
                for a, b in zip(
                    leaf.addressable_shards,
                    tree_paths.flatten(record.state.params)[path].addressable_shards,
                    strict=True,
                )
            )
        ]
        result["inference"] = {**layout_report(restored.params), "mismatched": mismatched}
    if phase.get("evaluate"):
        result["evaluation"] = evaluate(record, mesh, phase["evaluate"])
    return result


def evaluate(record: fs.Checkpoint, mesh, n_batches: int) -> dict:
    """The record's loss on the first batches (this process's part of each), evaluated sharded over the mesh."""
    dataset = lm.batches(tokens, model_config, mesh)
    inside = []

    def apply(variables, *inputs):
        embedding = variables["params"]["Embed_0"]["embedding"]
        jax.debug.inspect_array_sharding(embedding, callback=lambda s: inside.append(s.is_fully_replicated))
        return model.apply(variables, *inputs)

    task = fs.EvalTask(apply=apply, metrics={"loss": lm.loss}, data=[dataset.batch(i) for i in range(n_batches)])
    evaluated = fs.EvalLoop(task, jax.random.key(1), n_steps=n_batches, mesh=mesh, axis_rules=lm.RULES)(record)
    return {"metrics": evaluated.metrics["eval"], "replicated_inside": inside}


def record_inputs() -> tuple[np.ndarray]:
    return (np.zeros((1, model_config.seq_len), np.int32),)


for phase in config["phases"]:
    started = time.perf_counter()
    result = run(phase)
    if jax.process_index() == 0:
        print("result " + json.dumps(result), flush=True)
        print(f"phase took {time.perf_counter() - started:.1f} s", flush=True)
print("done", flush=True)
