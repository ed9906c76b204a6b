"""Sharded training over 2 gloo processes (one CPU device each): the LM example's model, FSDP and tensor-parallel.

Tier 1 (tests/README.md): scenarios on the shared cluster's processes, joined by `jax.distributed`. The others of
sharded_loop are in test_sharded_loop_processes.py.

One worker run trains every layout in turn (`flaxstate_testing/workers/sharded.py`), so the processes join
once; the one-device runs they are compared with train here, in the test's own process. kill -9 and SIGTERM
(preemption) runs start their own workers, and resume to end bit for bit as a straight FSDP run.
"""

import dataclasses
import functools
import json
import re
import shutil
from pathlib import Path

import flax.linen as nn
import jax
import numpy as np
import pytest
from flaxstate_testing import cluster
from flaxstate_testing.lm import lm, train_loop

import flaxstate as fs
from flaxstate import tree_paths
from flaxstate.checkpoint.catalog import list_checkpoints

MODEL = {
    "batch_size": 8,
    "seq_len": 16,
    "embed": 32,
    "heads": 2,
    "head_dim": 8,
    "mlp": 64,
    "layers": 1,
    "steps_per_checkpoint": 2,
    "steps_per_dispatch": 2,
}
N = 6
LONG = 24
"""The preempted run's length: long enough, with slow data, to still be training when both processes agree to stop."""
FSDP, TENSOR = "data=1,fsdp=2,model=1", "data=1,fsdp=1,model=2"
EMA_DECAY = 0.9


def train_on_one_device(directory, n_steps, ema_decay=None):
    """The data-parallel loop on this process's one device, on the full batch (resumes from `directory`)."""
    config = lm.Config(**MODEL)
    init = fs.CheckpointFileReader(directory, target=lm.Transformer(config).init)
    with fs.CheckpointFileWriter(directory, keep=10) as writer:
        for record in train_loop(config, init=init, n_steps=n_steps, ema_decay=ema_decay):
            writer(record)


def params(directory, step=None):
    checkpoint = fs.CheckpointFileReader(directory, step=step).read(None)
    return checkpoint.step, tree_paths.flatten(checkpoint.state["target"])


ATOL = 3e-5
"""The absolute tolerance between layouts (`assert_close` says why)."""


def assert_close(a, b, rtol=1e-5):
    """Equal up to the order of reductions: 1e-5 relative, or 3e-5 absolute.

    AdamW divides each gradient by its own running scale, so an element whose gradient is near zero moves by up
    to a learning rate (3e-3) a step whatever its gradient's low bits: reduction order shows there as an absolute
    difference, not a relative one (seen: up to 3.3e-6 after 6 steps, on the 32 weights of one hidden unit; on
    an AMD EPYC machine, 1.03e-5 on one weight of 2048, tensor-parallel against one device, the same before and
    after the change that met it). Training on other batches moves every element by about the learning rate,
    100 times the tolerance.
    """
    assert a[0] == b[0]
    assert a[1].keys() == b[1].keys()
    for path in a[1]:
        np.testing.assert_allclose(a[1][path], b[1][path], rtol=rtol, atol=ATOL, err_msg=path)


def results(output):
    """The worker's `result {json}` lines, one a phase."""
    return [json.loads(line.removeprefix("result ")) for line in output.splitlines() if line.startswith("result ")]


@functools.cache
def straight_runs(base: Path) -> tuple[Path, list]:
    """One device to N (then on to N + 2); then over 2 processes: FSDP and tensor-parallel to N, each
    resumed (from the one-device and the tensor-parallel checkpoints) as FSDP to N + 2; FSDP straight to LONG.
    Once a session (`base`, its temporary folder), for the tests here and `test_sharded_loop_processes.py`'s."""
    root = base / "sharded"
    root.mkdir()
    tiers, tiers_local = root / "tiers", root / "tiers-local"
    train_on_one_device(root / "one", N)
    shutil.copytree(root / "one", root / "one-on")
    train_on_one_device(root / "one-on", N + 2)
    train_on_one_device(root / "one-ema", N, ema_decay=EMA_DECAY)
    phases = [
        {
            "mesh": FSDP,
            "dir": str(root / "fsdp"),
            "steps": N,
            "record_memory": "device",
            "inference": True,
            "evaluate": 2,
        },
        {"mesh": TENSOR, "dir": str(root / "tensor"), "steps": N, "evaluate": 2},
        {"mesh": FSDP, "dir": str(root / "one-to-fsdp"), "steps": N + 2, "copy_from": str(root / "one")},
        {"mesh": FSDP, "dir": str(root / "tensor-to-fsdp"), "steps": N + 2, "copy_from": str(root / "tensor")},
        {"mesh": FSDP, "dir": str(root / "fsdp-long"), "steps": LONG},
        {"mesh": FSDP, "dir": str(root / "fsdp-ema"), "steps": N, "ema_decay": EMA_DECAY},
        # Two tiers: the persistent one saves step 2 only, the local one every record (steps 2 and 4);
        # tensor-parallel restarts from a copy, then FSDP restarts from the original.
        {"mesh": FSDP, "dir": str(tiers), "local": str(tiers_local), "steps": N - 2, "persistent_steps": [2]},
        {
            "mesh": TENSOR,
            "dir": str(root / "tiers-tensor"),
            "local": str(root / "tiers-tensor-local"),
            "copy_from": str(tiers),
            "copy_local_from": str(tiers_local),
            "steps": N,
        },
        {"mesh": FSDP, "dir": str(tiers), "local": str(tiers_local), "steps": N},
    ]
    output = cluster.run("sharded", {"model": MODEL, "phases": phases}, n_processes=2, timeout=240)[0]
    (root / "output.txt").write_text(output)
    return root, results(output)[:5]  # the EMA's and the tiers' phases are compared through their checkpoints


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """`straight_runs`: the session's runs to compare with."""
    return straight_runs(tmp_path_factory.getbasetemp())


def test_fsdp_and_tensor_parallel_end_equal_to_one_device(runs):
    root, _ = runs
    one = params(root / "one")
    assert one[0] == N
    assert_close(params(root / "fsdp"), one)
    assert_close(params(root / "tensor"), one)
    # And at every record on the way, from the first step on (the same global batches, the same updates).
    for step in range(2, N + 1, 2):
        assert_close(params(root / "fsdp", step), params(root / "one", step))


def test_fsdp_over_two_devices_holds_about_half_of_the_state_on_each(runs):
    root, (fsdp, tensor, *_) = runs
    ratio = fsdp["local_bytes"] / fsdp["total_bytes"]
    print(f"FSDP=2: {ratio:.3f} of the state a device; left whole: {fsdp['whole']}")
    assert ratio <= 0.6
    # What is left whole: the step, adam's count and the MLP biases (axis 'mlp', over 'model' of size 1).
    assert all(path.endswith(("step", "count", "Dense_0/bias")) for path in fsdp["whole"]), fsdp["whole"]
    assert sum(fsdp["whole"].values()) < 0.01 * fsdp["total_bytes"]
    # Tensor-parallel shards mlp, heads and vocab over 'model': less than FSDP, still well under one copy.
    assert tensor["local_bytes"] / tensor["total_bytes"] < 0.8
    # Saved from the shards, each process its own: one copy of the state on disk, not two. (Measured 1.35x the
    # one-device checkpoint: orbax's per-process files and sharding metadata, ~100 kB, on a 0.3 MB state.)
    stored = {name: {c.step: c.bytes for c in list_checkpoints(root / name)}[N] for name in ("fsdp", "one")}
    assert stored["fsdp"] < 1.5 * stored["one"], stored


def test_a_sharded_record_s_fingerprint_from_its_k_step_dispatch_is_the_global_state_s(runs):
    # The record's dispatch (K=2) computes it over the FSDP-sharded state, across both processes; the same
    # fingerprint computed apart from the record's device state, after it, agrees at every record.
    _, (fsdp, *_) = runs
    assert fsdp["fingerprints_agree"] == [[step, True] for step in range(2, N + 1, 2)], fsdp["fingerprints_agree"]


def test_sharded_checkpoints_restore_into_other_meshes(runs):
    root, (_, _, one_to_fsdp, tensor_to_fsdp, _) = runs
    assert one_to_fsdp["step"] == tensor_to_fsdp["step"] == N + 2
    # One device -> FSDP 2, and tensor-parallel 2 -> FSDP 2, go on as the one-device run went on.
    assert_close(params(root / "one-to-fsdp"), params(root / "one-on"))
    assert_close(params(root / "tensor-to-fsdp"), params(root / "one-on"))
    # FSDP 2 -> one device: restored into this process's one device by a template with its sharding.
    on_one_device = fs.CheckpointFileReader(root / "fsdp").restore(inference_template())
    for leaf in jax.tree.leaves(on_one_device.params):
        assert leaf.sharding.device_set == {jax.devices()[0]}


def test_a_training_checkpoint_restores_into_a_sharded_inference_state(runs):
    _, (fsdp, *_) = runs
    inference = fsdp["inference"]
    assert inference["mismatched"] == []
    assert inference["local_bytes"] / inference["total_bytes"] <= 0.6


def test_a_sharded_eval_loop_keeps_the_parameters_sharded_and_evaluates_as_one_device(runs):
    root, (fsdp, tensor, *_) = runs
    config = lm.Config(**MODEL)
    model = lm.Transformer(config)
    state = fs.CheckpointFileReader(root / "one").restore(inference_template())
    dataset = lm.batches(lm.text(), config)
    task = fs.EvalTask(apply=model.apply, metrics={"loss": lm.loss}, data=[dataset.batch(i) for i in range(2)])
    record = fs.Checkpoint(state=state, grads=None, loss=0.0, n_completed_steps=N, elapsed_time=0.0, step=N)
    one = fs.EvalLoop(task, jax.random.key(1), n_steps=2)(record).metrics["eval"]["loss"]
    # FSDP evaluates the record's device copy, tensor-parallel its host copy; neither gathers the embedding.
    for evaluation in (fsdp["evaluation"], tensor["evaluation"]):
        np.testing.assert_allclose(evaluation["metrics"]["loss"], one, rtol=1e-5)
        assert evaluation["replicated_inside"] == [False]


def test_an_fsdp_run_restarts_from_its_local_tier_bit_for_bit_and_another_mesh_from_the_persistent_one(runs):
    root, _ = runs
    output = (root / "output.txt").read_text()
    # Each process saved only its own half of the sharded arrays.
    for process in range(2):
        meta = json.loads((root / "tiers-local" / f"process-{process}" / "4" / "meta.json").read_text())
        assert meta["process_index"] == process and meta["processes"] == 2
        parts = meta["arrays"]["target/Embed_0/embedding"]["parts"]
        assert len(parts) == 1 and parts[0]["index"] != [
            [0, size] for size in meta["arrays"]["target/Embed_0/embedding"]["shape"]
        ]
    # Tensor-parallel: the local parts are not the ones its devices need, so step 2 of the persistent tier.
    assert re.search(r"restoring from the persistent tier .*tiers-tensor: .*another mesh", output), output[-4000:]
    assert_close(params(root / "tiers-tensor"), params(root / "fsdp"))
    # FSDP again: step 4 from the local tier, then on to N, bit for bit as the straight FSDP run.
    assert re.search(r"restored step 4 from the local tier .*tiers-local", output), output[-4000:]
    assert_bit_equal_checkpoints(root / "tiers", root / "fsdp", N)


def inference_template():
    """The LM's `InferenceState`, abstract: a one-device restore template."""
    model = lm.Transformer(lm.Config(**MODEL))
    sample = np.zeros((1, MODEL["seq_len"]), np.int32)
    return jax.eval_shape(lambda: fs.InferenceState.create(model.init(jax.random.key(0), sample)))


def assert_bit_equal_checkpoints(directory, reference, step):
    got, want = fs.CheckpointFileReader(directory).read(None), fs.CheckpointFileReader(reference).read(None)
    assert got.step == want.step == step
    assert got.data_position == want.data_position
    for a, b in zip(jax.tree.leaves(got.state), jax.tree.leaves(want.state), strict=True):
        np.testing.assert_array_equal(a, b)


def test_an_ema_trained_with_fsdp_over_two_processes_equals_one_devices(runs):
    root, _ = runs
    config = lm.Config(**MODEL)
    variables = lm.Transformer(config).init(jax.random.key(0), np.zeros((1, config.seq_len), np.int32))
    template = fs.InferenceState.create(variables)
    sharded, one = (
        fs.CheckpointFileReader(root / name).restore(template, use_ema=True) for name in ("fsdp-ema", "one-ema")
    )
    raw = fs.CheckpointFileReader(root / "one-ema").restore(template)
    for path, leaf in tree_paths.flatten(one.params).items():
        np.testing.assert_allclose(tree_paths.flatten(sharded.params)[path], leaf, rtol=1e-5, atol=ATOL, err_msg=path)
    assert any(
        not np.array_equal(a, b) for a, b in zip(jax.tree.leaves(one.params), jax.tree.leaves(raw.params), strict=True)
    )  # the EMA, not the parameters


def hf_name(path):
    """A tree path's name in the LM example's HF-style export (`lm.HF_MAP`)."""
    return lm.HF_MAP.entry(path).name


def hf_layout(path, value):
    """A param as the LM example's export holds it, rearranged by hand: HF's 2-D `(heads * head_dim, embed)`
    attention projections (`o`: `(embed, heads * head_dim)`), the other 2-D kernels `(out, in)`."""
    if re.search(r"DenseGeneral_[012]/kernel$", path):  # (embed, heads, head_dim)
        return value.transpose(1, 2, 0).reshape(-1, value.shape[0])
    if path.endswith("DenseGeneral_3/kernel"):  # (heads, head_dim, embed)
        return value.transpose(2, 0, 1).reshape(value.shape[2], -1)
    return value.T if re.search(r"Dense_\d+/kernel$", path) else value


def tree_layout(path, tensor, held):
    """The inverse of `hf_layout`, to the shape the params hold (`held`)."""
    if re.search(r"DenseGeneral_[012]/kernel$", path):
        return tensor.reshape(held[1], held[2], held[0]).transpose(2, 0, 1)
    if path.endswith("DenseGeneral_3/kernel"):
        return tensor.reshape(held[2], held[0], held[1]).transpose(1, 2, 0)
    return tensor.T if re.search(r"Dense_\d+/kernel$", path) else tensor


def exported(directory, out):
    """The run directory's newest step exported with the LM example's map, as its tensors by name."""
    import safetensors.numpy

    fs.export_safetensors(directory, out, map=lm.HF_MAP)
    return safetensors.numpy.load_file(out / "model.safetensors")


def test_a_two_process_fsdp_run_exports_as_its_checkpoint_holds_and_as_one_device_s_run(runs, tmp_path):
    root, _ = runs
    sharded, one = exported(root / "fsdp", tmp_path / "fsdp"), exported(root / "one", tmp_path / "one")
    step, stored = params(root / "fsdp")
    assert sorted(sharded) == sorted(one) == sorted(hf_name(path) for path in stored)
    assert {"model.layers.0.mlp.up_proj.weight", "lm_head.weight", "model.embed_tokens.weight"} <= set(sharded)
    for path, value in stored.items():  # bit for bit what the two processes saved, in HF's layouts
        np.testing.assert_array_equal(sharded[hf_name(path)], hf_layout(path, value), err_msg=path)
    assert sharded["lm_head.weight"].shape == (256, MODEL["embed"])  # (vocab, embed): out, in
    q = sharded["model.layers.0.self_attn.q_proj.weight"]
    assert q.shape == (MODEL["heads"] * MODEL["head_dim"], MODEL["embed"]), q.shape  # HF's, 2-D
    assert_close((step, sharded), (N, one))


def test_the_lm_example_fine_tunes_from_an_export_of_its_own_run_then_resumes_its_own_checkpoints(
    runs, tmp_path, capsys
):
    root, _ = runs
    files = tmp_path / "export"
    export = exported(root / "fsdp", files)
    config = lm.Config(**{**MODEL, "steps_per_checkpoint": 1, "steps_per_dispatch": 1}, eval_batches=1, steps=1,
                       output_dir=str(tmp_path / "tuned"), init_from=str(files))  # fmt: skip
    lm.main(config)
    assert "training starts from SafetensorsReader(" in capsys.readouterr().out
    first = params(tmp_path / "tuned")
    assert first[0] == 1
    # One AdamW step from the files' params moves each by at most the learning rate (and its weight decay); a
    # fresh start is further than that from them (the export is N steps from the same seed's init).
    fresh = lm.Transformer(config).init(jax.random.key(0), np.zeros((1, config.seq_len), np.int32))
    fresh = tree_paths.flatten(nn.meta.unbox(fresh))
    for path, value in first[1].items():
        start = tree_layout(path, export[hf_name(path)], value.shape)
        bound = config.learning_rate * (1 + 1e-4 * np.abs(start).max()) * 1.001
        assert np.abs(value - start).max() <= bound, path
    assert max(np.abs(fresh["params/" + path] - value).max() for path, value in first[1].items()) > 2 * bound
    # Run again, longer: it resumes its own step 1 (the files are not read again) and goes on to step 3.
    lm.main(dataclasses.replace(config, steps=3))
    assert "training starts from" not in capsys.readouterr().out
    assert [c.step for c in list_checkpoints(tmp_path / "tuned")][-1] == 3
