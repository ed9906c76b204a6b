"""Export to safetensors: what the `safetensors` package's own API reads back from a run, a record or a state."""

import json
import re
import types

import flax.linen as nn
import jax
import ml_dtypes
import numpy as np
import optax
import pytest
import safetensors.numpy
from flax import nnx
from flaxstate_testing import toy
from safetensors import safe_open

import flaxstate as fs
from flaxstate import tree_paths
from flaxstate.checkpoint.safetensors import INDEX, files
from flaxstate.checkpoint.safetensors import export as exporting
from flaxstate.checkpoint.stores import orbax_manager


class Wide(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.tanh(nn.Dense(32, name="up")(x))
        x = nn.LayerNorm(name="norm")(x)
        return nn.Dense(1, name="down")(x)[:, 0]


class NNXWide(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.up = nnx.Linear(4, 32, rngs=rngs)
        self.norm = nnx.BatchNorm(32, rngs=rngs)
        self.down = nnx.Linear(32, 1, rngs=rngs)

    def __call__(self, x):
        return self.down(self.norm(nnx.tanh(self.up(x))))[:, 0]


def trained(tmp_path, model, ema_decay=None, n_steps=6):
    """A run of `model` (linen or NNX) written to `tmp_path / "run"`: its records."""
    linen = isinstance(model, nn.Module)
    task = fs.TrainTask(
        apply=model.apply if linen else model,
        optimizer=optax.adam(1e-2),
        loss=toy.mse,
        data=toy.batches(n_steps, 8),
        ema_decay=ema_decay,
    )
    loop = fs.TrainLoop(
        model.init if linen else model, task, jax.random.key(0), n_steps=n_steps, n_steps_per_checkpoint=3, stdout=False
    )
    with fs.CheckpointFileWriter(tmp_path / "run", keep=2, metadata={"model": type(model).__name__}) as writer:
        records = [writer(record) or record for record in loop]
    return records


def params_of(tree):
    return {path: np.asarray(value) for path, value in tree_paths.flatten(tree).items()}


@pytest.mark.parametrize("api", ["linen", "nnx"])
def test_a_run_s_params_export_bit_for_bit_and_nothing_of_the_optimizer_is_read(tmp_path, api, monkeypatch):
    model = Wide() if api == "linen" else NNXWide(nnx.Rngs(0))
    records = trained(tmp_path, model)
    expected = params_of(records[-1].state.params)
    read = []
    original = orbax_manager.CheckpointStore.read_paths

    def spy(self, step, paths):
        read.append(paths)
        return original(self, step, paths)

    monkeypatch.setattr(orbax_manager.CheckpointStore, "read_paths", spy)
    monkeypatch.setattr(exporting, "READ_BYTES", 1)  # every tensor read, written and dropped alone
    out = fs.export_safetensors(tmp_path / "run", tmp_path / "hf")
    assert sorted(p.name for p in out.iterdir()) == ["model.safetensors"]
    loaded = safetensors.numpy.load_file(out / "model.safetensors")
    assert sorted(loaded) == sorted(expected)
    for name, value in expected.items():
        assert loaded[name].dtype == value.dtype
        np.testing.assert_array_equal(loaded[name], value, err_msg=name)
    assert read and all(path.startswith("target/") for paths in read for path in paths)  # never state/...
    assert sorted(paths for paths in read) == sorted([f"target/{name}"] for name in expected)
    with safe_open(out / "model.safetensors", framework="numpy") as f:
        metadata = f.metadata()
    assert metadata["format"] == "pt" and metadata["flaxstate_step"] == "6"
    assert json.loads(metadata["flaxstate_config"]) == {"model": type(model).__name__}
    # a record and a live state export the same tensors as the run directory
    for source in (records[-1], records[-1].state):
        again = safetensors.numpy.load_file(fs.export_safetensors(source, tmp_path / "again") / "model.safetensors")
        assert sorted(again) == sorted(loaded)
        for name in loaded:
            np.testing.assert_array_equal(again[name], loaded[name])


def test_hf_names_transposed_kernels_bfloat16_and_shards_with_their_index(tmp_path):
    records = trained(tmp_path, Wide())
    params = params_of(records[-1].state.params)
    rename = [(r"^up/", "model.layers.0.mlp.up_proj."), (r"^down/", "model.layers.0.mlp.down_proj."),
              (r"^norm/", "model.norm."), (r"\.kernel$", ".weight")]  # fmt: skip
    out = fs.export_safetensors(
        tmp_path / "run", tmp_path / "hf", rename=rename, transpose=r"kernel$", dtype="bfloat16", max_shard_bytes=200
    )
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(p.name for p in out.glob("*.safetensors"))
    assert len(shards) > 2 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    assert sorted(set(index["weight_map"].values())) == shards
    loaded = {}
    for shard in shards:
        in_shard = safetensors.numpy.load_file(out / shard)
        assert not set(in_shard) & set(loaded)  # each tensor once
        assert set(in_shard) == {name for name, file in index["weight_map"].items() if file == shard}
        big = sum(v.nbytes for v in in_shard.values())
        assert big <= 200 or len(in_shard) == 1  # a tensor larger than a shard goes alone
        loaded.update(in_shard)
    assert index["metadata"]["total_size"] == sum(v.nbytes for v in loaded.values())
    up = loaded["model.layers.0.mlp.up_proj.weight"]
    assert up.shape == (32, 4) and up.dtype == ml_dtypes.bfloat16  # HF's (out, in)
    np.testing.assert_array_equal(up, params["up/kernel"].T.astype(ml_dtypes.bfloat16))
    np.testing.assert_array_equal(loaded["model.norm.scale"], params["norm/scale"].astype(ml_dtypes.bfloat16))
    assert sorted(loaded) == sorted(
        ["model.layers.0.mlp.up_proj.weight", "model.layers.0.mlp.up_proj.bias", "model.norm.scale",
         "model.norm.bias", "model.layers.0.mlp.down_proj.weight", "model.layers.0.mlp.down_proj.bias"]
    )  # fmt: skip
    # exported again into one file: the earlier export's shards and index go, nothing else of the folder
    (out / "README.md").write_text("mine")
    fs.export_safetensors(tmp_path / "run", out)
    assert sorted(p.name for p in out.iterdir()) == ["README.md", "model.safetensors"]


def test_the_ema_exports_where_trained_with_one_and_an_error_names_its_absence(tmp_path):
    records = trained(tmp_path, Wide(), ema_decay=0.9)
    loaded = safetensors.numpy.load_file(
        fs.export_safetensors(tmp_path / "run", tmp_path / "ema", use_ema=True) / "model.safetensors"
    )
    ema = params_of(records[-1].state.ema)
    assert sorted(loaded) == sorted(ema)
    for name, value in ema.items():
        np.testing.assert_array_equal(loaded[name], value)
    assert not np.array_equal(loaded["up/kernel"], np.asarray(records[-1].state.params["up"]["kernel"]))
    plain = tmp_path / "plain"
    plain.mkdir()
    without = trained(plain, Wide())
    with pytest.raises(fs.CheckpointError, match="step 6 in .* holds no EMA.*ema_decay"):
        fs.export_safetensors(plain / "run", tmp_path / "none", use_ema=True)
    with pytest.raises(fs.CheckpointError, match="step 6 holds no EMA"):
        fs.export_safetensors(without[-1], tmp_path / "none", use_ema=True)
    assert not (tmp_path / "none").exists()


def test_bad_input_is_named_before_a_byte_is_written_and_an_earlier_export_stays(tmp_path):
    trained(tmp_path, Wide())
    out = fs.export_safetensors(tmp_path / "run", tmp_path / "hf")
    before = (out / "model.safetensors").read_bytes()
    with pytest.raises(ValueError, match=r"not 2-D: norm/bias \[32\], norm/scale \[32\]"):
        fs.export_safetensors(tmp_path / "run", out, transpose="norm")
    with pytest.raises(ValueError, match="rename maps both 'down/bias' and 'down/kernel' to 'down'"):
        fs.export_safetensors(tmp_path / "run", out, rename=[(r"/.*", "")])
    with pytest.raises(ValueError, match="list of \\(regex, replacement\\) pairs"):
        fs.export_safetensors(tmp_path / "run", out, rename={"up": "down"})
    with pytest.raises(ValueError, match="'int7' is not a dtype"):
        fs.export_safetensors(tmp_path / "run", out, dtype="int7")
    with pytest.raises(ValueError, match=r"safetensors has no dtype for down/bias complex64, down/kernel complex64"):
        fs.export_safetensors(tmp_path / "run", out, dtype="complex64")
    with pytest.raises(ValueError, match="max_shard_bytes must be a positive int, got 0"):
        fs.export_safetensors(tmp_path / "run", out, max_shard_bytes=0)
    with pytest.raises(fs.CheckpointError, match="no checkpoint at step 5; it has steps \\[3, 6\\]"):
        fs.export_safetensors(tmp_path / "run", out, step=5)
    with pytest.raises(TypeError, match="got int"):
        fs.export_safetensors(3, out)
    assert sorted(p.name for p in out.iterdir()) == ["model.safetensors"]
    assert (out / "model.safetensors").read_bytes() == before


class Square(nn.Module):
    """A model whose first kernel is square: a transposed one has the same shape, and must still be transposed."""

    @nn.compact
    def __call__(self, x):
        x = nn.tanh(nn.Dense(4, name="gate")(x))
        return nn.Dense(1, name="down")(x)[:, 0]


class NNXSquare(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.gate = nnx.Linear(4, 4, rngs=rngs)
        self.norm = nnx.BatchNorm(4, use_bias=False, use_scale=False, rngs=rngs)  # statistics, no params
        self.down = nnx.Linear(4, 1, rngs=rngs)

    def __call__(self, x):
        return self.down(self.norm(nnx.tanh(self.gate(x))))[:, 0]


HF_NAMES = [(r"^model\.layers\.0\.mlp\.gate_proj\.", "gate/"), (r"^model\.layers\.0\.mlp\.down_proj\.", "down/"),
            (r"/weight$", "/kernel")]  # fmt: skip


def hf_file(path, dtype=np.float32):
    """A file as transformers writes one: HF's names, (out, in) weights."""
    rng = np.random.default_rng(0)
    tensors = {
        "model.layers.0.mlp.gate_proj.weight": rng.normal(size=(4, 4)).astype(dtype),
        "model.layers.0.mlp.gate_proj.bias": rng.normal(size=(4,)).astype(dtype),
        "model.layers.0.mlp.down_proj.weight": rng.normal(size=(1, 4)).astype(dtype),
        "model.layers.0.mlp.down_proj.bias": rng.normal(size=(1,)).astype(dtype),
    }
    safetensors.numpy.save_file(tensors, str(path), metadata={"format": "pt"})
    return tensors


@pytest.mark.parametrize("api", ["linen", "nnx"])
def test_hf_style_files_start_a_run_renamed_and_transposed_with_a_fresh_optimizer_state(tmp_path, api):
    tensors = hf_file(tmp_path / "model.safetensors")
    model = Square() if api == "linen" else NNXSquare(nnx.Rngs(0))
    reader = fs.SafetensorsReader(
        tmp_path, model.init if api == "linen" else model, rename=HF_NAMES, transpose="kernel$"
    )
    task = fs.TrainTask(
        apply=model.apply if api == "linen" else model,
        optimizer=optax.adam(1e-2),
        loss=toy.mse,
        data=toy.batches(4, 8),
        ema_decay=0.5,
    )
    loop = fs.TrainLoop(reader, task, jax.random.key(0), n_steps=2, n_steps_per_checkpoint=2, stdout=False)
    state = loop.state
    assert int(state.step) == 0
    np.testing.assert_array_equal(state.params["gate"]["kernel"], tensors["model.layers.0.mlp.gate_proj.weight"].T)
    np.testing.assert_array_equal(state.params["down"]["kernel"], tensors["model.layers.0.mlp.down_proj.weight"].T)
    np.testing.assert_array_equal(state.params["gate"]["bias"], tensors["model.layers.0.mlp.gate_proj.bias"])
    np.testing.assert_array_equal(state.ema["gate"]["kernel"], state.params["gate"]["kernel"])  # the EMA starts there
    adam = state.param_states[0]
    assert all(not np.any(np.asarray(m)) for m in jax.tree.leaves(adam.mu))  # a fresh optimizer state
    assert reader.bytes_read == sum(t.nbytes for t in tensors.values())  # each tensor read once
    if api == "nnx":
        np.testing.assert_array_equal(state.flax_mutables["batch_stats"]["norm"]["var"], np.ones(4))  # the module's
    records = list(loop)
    assert records[-1].step == 2 and np.isfinite(records[-1].loss)


@pytest.mark.parametrize("api", ["linen", "nnx"])
def test_a_checkpoint_reader_of_a_fine_tune_starts_from_the_files_then_resumes_its_own_checkpoints(tmp_path, api):
    tensors = hf_file(tmp_path / "model.safetensors")
    model = Square() if api == "linen" else NNXSquare(nnx.Rngs(0))
    files = fs.SafetensorsReader(tmp_path, model.init if api == "linen" else model, rename=HF_NAMES,
                                 transpose="kernel$")  # fmt: skip
    reader = fs.CheckpointFileReader(tmp_path / "tuned", target=files)
    task = fs.TrainTask(
        apply=model.apply if api == "linen" else model, optimizer=optax.adam(1e-2), loss=toy.mse, data=toy.batches(4, 8)
    )

    def loop(n_steps):
        return fs.TrainLoop(reader, task, jax.random.key(0), n_steps=n_steps, n_steps_per_checkpoint=2, stdout=False)

    first = loop(2)
    assert int(first.state.step) == 0
    np.testing.assert_array_equal(
        first.state.params["gate"]["kernel"], tensors["model.layers.0.mlp.gate_proj.weight"].T
    )
    with fs.CheckpointFileWriter(tmp_path / "tuned") as writer:
        for record in first:
            writer(record)
    read = files.bytes_read
    assert read == sum(t.nbytes for t in tensors.values())
    again = loop(4)  # the fine-tune's own step 2, its optimizer's state with it; the files are not read again
    assert int(again.state.step) == 2 and files.bytes_read == read
    for path, value in params_of(record.state.params).items():
        np.testing.assert_array_equal(tree_paths.flatten(again.state.params)[path], value, err_msg=path)
    assert list(again)[-1].step == 4


def test_an_export_read_back_is_bit_for_bit_and_a_bfloat16_file_is_cast_and_said_once(tmp_path, caplog):
    records = trained(tmp_path, Wide())
    params = records[-1].state.params
    out = fs.export_safetensors(
        tmp_path / "run", tmp_path / "hf", rename=[(r"/", ".")], transpose="kernel$", max_shard_bytes=300
    )
    assert (out / "model.safetensors.index.json").is_file()
    reader = fs.SafetensorsReader(out, Wide().init, rename=[(r"\.", "/")], transpose="kernel$")
    back = reader.params(jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params))
    for path, value in params_of(params).items():
        np.testing.assert_array_equal(tree_paths.flatten(back)[path], value, err_msg=path)
    fs.export_safetensors(tmp_path / "run", tmp_path / "bf16", dtype="bfloat16")
    with caplog.at_level("WARNING", logger="flaxstate"):
        cast = fs.SafetensorsReader(tmp_path / "bf16" / "model.safetensors", None).params(
            jax.tree.map(np.asarray, params)
        )
    assert [r.getMessage() for r in caplog.records if "casts" in r.getMessage()] == [
        f"SafetensorsReader({str(tmp_path / 'bf16' / 'model.safetensors')!r}) casts BF16 -> float32, as the params are."
    ]
    up = np.asarray(params["up"]["kernel"])
    np.testing.assert_array_equal(cast["up"]["kernel"], up.astype(ml_dtypes.bfloat16).astype(np.float32))


def test_files_that_do_not_fit_are_one_error_naming_every_path_and_both_shapes(tmp_path):
    hf_file(tmp_path / "model.safetensors")
    template = {"gate": {"kernel": np.zeros((4, 4)), "bias": np.zeros(4)}, "down": {"kernel": np.zeros((4, 2))},
                "head": {"kernel": np.zeros((2, 2))}}  # fmt: skip
    reader = fs.SafetensorsReader(tmp_path / "model.safetensors", None, rename=HF_NAMES, transpose="kernel$")
    with pytest.raises(fs.StateMismatchError) as raised:
        reader.params(template)
    message = str(raised.value)
    assert "unexpected (in the files, not the params): model.layers.0.mlp.down_proj.bias (as down/bias)" in message
    assert "missing (the params', in no file): head/kernel [2, 2]" in message
    assert (
        "differ: down/kernel (expected [4, 2], found model.layers.0.mlp.down_proj.weight [1, 4] (transposed))"
        in message
    )
    assert reader.bytes_read == 0  # nothing read, nothing placed
    with pytest.raises(ValueError, match="neither a .safetensors file nor a folder"):
        fs.SafetensorsReader(tmp_path / "nothing", None)


def test_a_plan_of_a_reader_is_the_plan_of_its_target(tmp_path):
    hf_file(tmp_path / "model.safetensors")
    model = Square()
    task = fs.TrainTask(apply=model.apply, optimizer=optax.adam(1e-2), loss=toy.mse, data=toy.batches(2, 8))
    reader = fs.SafetensorsReader(tmp_path, model.init, rename=HF_NAMES, transpose="kernel$")
    planned, direct = fs.plan(reader, task, target="cpu:2"), fs.plan(model.init, task, target="cpu:2")
    assert planned.per_device == direct.per_device and planned.per_device["params"] > 0 and reader.bytes_read == 0


def test_a_file_in_a_bucket_is_read_by_byte_ranges_of_the_rows_each_part_covers(tmp_path, monkeypatch):
    # The bucket's reader on a local file (`locations.read_range` reads both): its parts equal safe_open's, and
    # each part asks for the bytes of its rows alone.
    from flaxstate import locations

    tensors = {"w": np.arange(30, dtype=np.float32).reshape(6, 5), "b": np.arange(4, dtype=ml_dtypes.bfloat16),
               "s": np.asarray(7, np.int32)}  # fmt: skip
    safetensors.numpy.save_file(tensors, str(tmp_path / "model.safetensors"))
    ranges = []
    read_range = locations.read_range
    monkeypatch.setattr(locations, "read_range", lambda path, a, b: ranges.append((a, b)) or read_range(path, a, b))
    in_bucket = files.InBucket(tmp_path / "model.safetensors")
    with safe_open(str(tmp_path / "model.safetensors"), "numpy") as local:
        assert sorted(in_bucket.keys()) == sorted(local.keys())
        for name in local.keys():
            assert in_bucket.get_slice(name).get_shape() == local.get_slice(name).get_shape()
            assert in_bucket.get_slice(name).get_dtype() == local.get_slice(name).get_dtype()
            np.testing.assert_array_equal(in_bucket.get_tensor(name), local.get_tensor(name))
        for index in [(slice(2, 4), slice(None)), (slice(0, 6), slice(1, 3)), (slice(5, 6),)]:
            ranges.clear()
            np.testing.assert_array_equal(in_bucket.get_slice("w")[index], local.get_slice("w")[index])
            ((start, end),) = ranges
            rows = index[0]
            assert end - start == (rows.stop - rows.start) * 5 * 4, index  # its rows' bytes, one request


def test_two_param_paths_that_join_to_one_name_are_refused_naming_both_before_a_file_is_written(tmp_path):
    params = {"enc/proj": {"kernel": np.ones((2, 2), np.float32)}, "enc": {"proj": {"kernel": np.zeros((2, 2))}}}
    joined = r"join to the path 'enc/proj/kernel': \['enc'\]\['proj'\]\['kernel'\] and \['enc/proj'\]\['kernel'\]"
    with pytest.raises(ValueError, match=joined):  # the state refuses them: every '/'-joined name is one leaf's
        fs.export_safetensors(fs.FlaxOptimTrainState.create(optax.sgd(0.1), {"params": params}), tmp_path / "out")
    with pytest.raises(ValueError, match=joined):
        fs.export_safetensors(types.SimpleNamespace(params=params, step=3), tmp_path / "out")
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())
    safetensors.numpy.save_file({"enc/proj/kernel": np.ones((2, 2), np.float32)}, str(tmp_path / "m.safetensors"))
    with pytest.raises(ValueError, match=joined):
        fs.SafetensorsReader(tmp_path / "m.safetensors", target=None).params(params)


def raw_safetensors(path, header, data=b"", length=None):
    """A file laid out as safetensors lays one out, with whatever header (and header length) it is given."""
    text = header if isinstance(header, bytes) else json.dumps(header).encode()
    path.write_bytes(len(text).to_bytes(8, "little") if length is None else length.to_bytes(8, "little"))
    with open(path, "ab") as file:
        file.write(text + data)
    return path


HOSTILE = {
    "overlapping offsets": (
        {"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
         "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}}, bytes(12), None, "overlaps the tensor before"),
    "offsets shorter than the shape": (
        {"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 8]}}, bytes(8), None, "cover 8 bytes; its shape"),
    "offsets past the end": (
        {"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}, bytes(8), None, "the file has"),
    "a header length of 2^60": ({"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}, bytes(4), 2**60,
                                "more than safetensors'"),
    "a header that is not JSON": (b"{not json", b"", None, "not UTF-8 JSON"),
    "an unknown dtype": ({"a": {"dtype": "F7", "shape": [1], "data_offsets": [0, 4]}}, bytes(4), None,
                         "the dtype 'F7'"),
    "a cut file": ({"a": {"dtype": "F32", "shape": [1000], "data_offsets": [0, 4000]}}, bytes(100), None,
                   "the file has"),
    "a header cut short": ({"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}, b"", 10**6, "a cut file"),
}  # fmt: skip


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_a_bucket_s_file_is_checked_as_safe_open_checks_one_and_refused_naming_it_and_the_fault(tmp_path, case):
    # `_InBucket` reads through `locations.read_range`, the same on a disk as in a bucket; safetensors' own reader
    # (`safe_open`) refuses each of these files too.
    header, data, length, fault = HOSTILE[case]
    path = raw_safetensors(tmp_path / "model.safetensors", header, data, length)
    with pytest.raises(Exception):  # noqa: B017  (safetensors_rust.SafetensorError)
        safe_open(str(path), "numpy")
    with pytest.raises(ValueError, match=rf"{path} is not a safetensors file that can be read: .*{re.escape(fault)}"):
        files.InBucket(path)
    with pytest.raises(ValueError, match=rf"{path} is not a safetensors file that can be read"):  # on a disk
        fs.SafetensorsReader(path, target=None).params({"a": np.zeros((1,), np.float32)})


def test_an_empty_object_is_refused_and_a_good_file_read_whole(tmp_path):
    (tmp_path / "empty.safetensors").write_bytes(b"")
    with pytest.raises(ValueError, match="holds 0 bytes"):
        files.InBucket(tmp_path / "empty.safetensors")
    tensors = {"a": np.arange(6, dtype=np.float32).reshape(2, 3), "z": np.zeros((0, 4), np.int8)}
    safetensors.numpy.save_file(tensors, str(tmp_path / "good.safetensors"), metadata={"format": "np"})
    np.testing.assert_array_equal(files.InBucket(tmp_path / "good.safetensors").get_tensor("a"), tensors["a"])


def test_an_index_is_followed_only_to_files_in_its_folder_and_a_tensor_in_two_files_is_refused(tmp_path):
    (tmp_path / "elsewhere").mkdir()
    safetensors.numpy.save_file({"w": np.ones((2,), np.float32)}, str(tmp_path / "elsewhere" / "model.safetensors"))
    folder = tmp_path / "model"
    folder.mkdir()
    target = {"w": np.zeros((2,), np.float32)}
    for entry in ["../elsewhere/model.safetensors", "/etc/passwd", "sub/model.safetensors", "..", "passwd"]:
        (folder / INDEX).write_text(json.dumps({"weight_map": {"w": entry}}))
        with pytest.raises(ValueError, match=rf"maps 'w' to {re.escape(repr(entry))}: only the name of a"):
            fs.SafetensorsReader(folder, target=None).params(target)
    for text, fault in [("{not json", "not a JSON object"), ('{"weight_map": ["w"]}', "its weight_map is list"),
                        ("[1]", "not a JSON object")]:  # fmt: skip
        (folder / INDEX).write_text(text)
        with pytest.raises(ValueError, match=rf"{re.escape(str(folder / INDEX))} is not .*{fault}"):
            fs.SafetensorsReader(folder, target=None)
    (folder / INDEX).unlink()
    safetensors.numpy.save_file({"w": np.ones((2,), np.float32)}, str(folder / "model.safetensors"))
    safetensors.numpy.save_file({"w": np.full((2,), 9, np.float32)}, str(folder / "model_old.safetensors"))
    with pytest.raises(ValueError, match="the tensor 'w' is in both .*model.safetensors and .*model_old.safetensors"):
        fs.SafetensorsReader(folder, target=None).params(target)
    (folder / INDEX).write_text(json.dumps({"weight_map": {"w": "model.safetensors"}}))
    np.testing.assert_array_equal(fs.SafetensorsReader(folder, target=None).params(target)["w"], np.ones(2))
    safetensors.numpy.save_file({"w": np.ones((2,), np.float32), "v": np.ones((1,), np.float32)},
                                str(folder / "model.safetensors"))  # fmt: skip
    safetensors.numpy.save_file({"v": np.ones((1,), np.float32)}, str(folder / "model-2.safetensors"))
    (folder / INDEX).write_text(json.dumps({"weight_map": {"w": "model.safetensors", "v": "model-2.safetensors"}}))
    with pytest.raises(ValueError, match="'v' is in both|holds the tensor 'v', which .* gives to model-2"):
        fs.SafetensorsReader(folder, target=None).params({**target, "v": np.zeros((1,), np.float32)})
