"""`fs.WeightMap`: HF's Llama/Qwen3 files (as `safetensors.numpy.save_file` writes them, HF's names and 2-D
shapes) into decoders whose attention kernels are 3-D, NNX and linen, and back out in HF's layout; every expected
array is rearranged by hand (`decoders.held`), apart from einops."""

import json

import jax
import ml_dtypes
import numpy as np
import optax
import pytest
import safetensors.numpy
from flaxstate_testing import decoders

import flaxstate as fs
from flaxstate import tree_paths


def hf_folder(path, tied, **kwargs):
    path.mkdir(parents=True, exist_ok=True)
    tensors = decoders.hf_tensors(tied, **kwargs)
    safetensors.numpy.save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    return tensors


def task(api, model, n_steps=3):
    return fs.TrainTask(
        apply=model.apply if api == "linen" else model,
        optimizer=optax.adam(1e-2),
        loss=decoders.cross_entropy,
        data=decoders.token_batches(n_steps),
    )


def fine_tune(tmp_path, api, tied, n_steps):
    """HF's files in `tmp_path / "hf"`, and a loop of the decoder of `api` that starts from them through the map."""
    tensors = hf_folder(tmp_path / "hf", tied)
    rules = decoders.weight_map(api, tied)
    model, init = decoders.init(api)
    reader = fs.SafetensorsReader(tmp_path / "hf", init, map=rules)
    loop = fs.TrainLoop(reader, task(api, model), 0, n_steps=n_steps, n_steps_per_checkpoint=n_steps, stdout=False)
    return tensors, rules, loop


def hf_of(api, params, tied):
    """HF's tensors from the params' flat tree, rearranged back by hand: the inverse of `decoders.held`."""
    layer = "layers/{}" if api == "nnx" else "layers_{}"
    e, d = decoders.EMBED, decoders.HEAD_DIM
    tensors = {"model.embed_tokens.weight": params["embed/embedding"], "model.norm.weight": params["norm/scale"]}
    if not tied:
        tensors["lm_head.weight"] = params["lm_head/kernel"].T
    for i in range(decoders.LAYERS):
        hf, at = f"model.layers.{i}", layer.format(i)
        for proj in ("q", "k", "v"):  # (e, n, d) -> (n * d, e)
            kernel = params[f"{at}/{proj}/kernel"]
            tensors[f"{hf}.self_attn.{proj}_proj.weight"] = kernel.transpose(1, 2, 0).reshape(-1, e)
        tensors[f"{hf}.self_attn.o_proj.weight"] = params[f"{at}/o/kernel"].transpose(2, 0, 1).reshape(e, -1)
        tensors[f"{hf}.self_attn.q_norm.weight"] = params[f"{at}/q_norm/scale"]
        tensors[f"{hf}.input_layernorm.weight"] = params[f"{at}/input_norm/scale"]
        tensors[f"{hf}.post_attention_layernorm.weight"] = params[f"{at}/post_norm/scale"]
        for proj in ("gate", "up", "down"):
            tensors[f"{hf}.mlp.{proj}_proj.weight"] = params[f"{at}/{proj}/kernel"].T
    assert all(value.shape[-1] in (e, d, decoders.HIDDEN) or value.ndim == 1 for value in tensors.values())
    return tensors


def flat(params):
    return {path: np.asarray(value) for path, value in tree_paths.flatten(params).items()}


@pytest.mark.parametrize("mesh", ["auto", "explicit"])
@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
@pytest.mark.parametrize("api", ["linen", "nnx"])
def test_hf_files_fill_3d_attention_kernels_and_a_tied_head_then_train(tmp_path, api, tied, mesh):
    tensors = hf_folder(tmp_path / "hf", tied)
    model, init = decoders.init(api)
    reader = fs.SafetensorsReader(tmp_path / "hf", init, map=fs.WeightMap(decoders.weight_map(api, tied)))
    if mesh == "explicit":
        placement = {"mesh": jax.make_mesh((1,), ("data",)), "axis_rules": (("batch", "data"),)}
        assert jax.sharding.AxisType.Explicit in placement["mesh"].axis_types
    else:
        placement = {
            "mesh": jax.sharding.Mesh(np.asarray(jax.devices()[:1]), ("data",)),
            "axis_rules": (("batch", "data"),),
        }
    loop = fs.TrainLoop(reader, task(api, model), jax.random.key(0), n_steps=3, stdout=False, **placement)
    params = flat(loop.state.params)
    expected = decoders.held(api, tensors, tied)
    assert sorted(params) == sorted(expected)
    for path, value in expected.items():
        np.testing.assert_array_equal(params[path], value, err_msg=path)
    embedding = tensors["model.embed_tokens.weight"].nbytes
    assert reader.bytes_read == sum(t.nbytes for t in tensors.values()) + (embedding if tied else 0)
    records = list(loop)
    assert records[-1].step == 3 and np.isfinite(records[-1].loss)


@pytest.mark.parametrize("api", ["linen", "nnx"])
def test_import_train_and_export_with_one_map_gives_hf_s_2d_tensors_equal_to_the_trained_params(tmp_path, api):
    tensors, rules, loop = fine_tune(tmp_path, api, tied=False, n_steps=3)
    init = decoders.init(api)[1]
    with fs.CheckpointFileWriter(tmp_path / "run") as writer:
        record = [writer(record) or record for record in loop][-1]
    trained = flat(record.state.params)
    q = next(path for path in trained if path.endswith("q/kernel"))
    assert not np.array_equal(trained[q], decoders.held(api, tensors, False)[q])  # trained away from the files
    expected = hf_of(api, trained, tied=False)
    assert {name: value.shape for name, value in expected.items()} == {n: v.shape for n, v in tensors.items()}

    out = fs.export_safetensors(tmp_path / "run", tmp_path / "out", map=fs.WeightMap(rules), max_shard_bytes=4096)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert sorted(index["weight_map"]) == sorted(tensors) and len(set(index["weight_map"].values())) > 1
    written = {}
    for file in sorted(set(index["weight_map"].values())):
        written |= safetensors.numpy.load_file(out / file)
    assert sorted(written) == sorted(tensors)
    for name, value in expected.items():
        np.testing.assert_array_equal(written[name], value, err_msg=name)

    fs.export_safetensors(record, tmp_path / "bf16", map=rules, dtype="bfloat16")  # the record: the same params
    bf16 = safetensors.numpy.load_file(tmp_path / "bf16" / "model.safetensors")
    for name, value in expected.items():
        assert bf16[name].dtype == ml_dtypes.bfloat16 and bf16[name].shape == value.shape
        np.testing.assert_array_equal(bf16[name], value.astype(ml_dtypes.bfloat16), err_msg=name)

    again = fs.SafetensorsReader(out, init, map=rules).params(decoders.template(api))  # and back in, bit for bit
    for path, value in flat(again).items():
        np.testing.assert_array_equal(value, trained[path], err_msg=path)


@pytest.mark.parametrize("api", ["linen", "nnx"])
def test_tied_params_are_written_once_and_refused_naming_both_paths_once_they_differ(tmp_path, api):
    tensors, rules, loop = fine_tune(tmp_path, api, tied=True, n_steps=2)
    out = fs.export_safetensors(loop.state, tmp_path / "out", map=rules)  # as read: the head is the embedding
    written = safetensors.numpy.load_file(out / "model.safetensors")
    assert sorted(written) == sorted(tensors) and "lm_head.weight" not in written
    for name, value in tensors.items():
        np.testing.assert_array_equal(written[name], value, err_msg=name)

    trained = list(loop)[-1]  # two steps part the head from the embedding
    with pytest.raises(ValueError, match="embed/embedding and lm_head/kernel are tied") as raised:
        fs.export_safetensors(trained, tmp_path / "out", map=rules)
    assert "model.embed_tokens.weight" in str(raised.value)
    assert safetensors.numpy.load_file(out / "model.safetensors").keys() == written.keys()  # the earlier export stays
    assert sorted(entry.name for entry in (tmp_path / "out").iterdir()) == ["model.safetensors"]


def test_what_a_map_does_not_fit_is_one_error_naming_each_path_the_file_s_name_and_both_shapes(tmp_path):
    tensors = decoders.hf_tensors(tied=False)
    tensors["model.layers.0.self_attn.rotary_emb.inv_freq"] = np.ones(2, np.float32)  # older Llama files hold it
    tensors["model.layers.1.self_attn.k_proj.weight"] = np.ones((3 * decoders.HEAD_DIM, decoders.EMBED), np.float32)
    safetensors.numpy.save_file(tensors, str(tmp_path / "model.safetensors"))
    rules = decoders.weight_map("nnx", tied=False)
    del rules["norm/scale"]
    rules["layers/{i}/q_norm/scale"] = ("model.layers.{i}.self_attn.q_norm.weight", "(h d) e -> e h d")
    reader = fs.SafetensorsReader(tmp_path, None, map=fs.WeightMap(rules))
    with pytest.raises(fs.StateMismatchError) as raised:
        reader.params(decoders.template("nnx"))
    message = str(raised.value)
    assert f"no rule of the map covers (the params'): norm/scale [{decoders.EMBED}]" in message
    assert (
        "unexpected (in the files, read by no rule): model.layers.0.self_attn.rotary_emb.inv_freq, model.norm.weight"
        in message
    )
    assert (
        "the layout does not fit: layers/0/q_norm/scale [4] from model.layers.0.self_attn.q_norm.weight [4]" in message
    )
    assert (
        "differ: layers/1/k/kernel (expected [16, 2, 4], which '(h d) e -> e h d' stores as [8, 16]; found "
        "model.layers.1.self_attn.k_proj.weight [12, 16])" in message
    )
    assert "skip=" in message and reader.bytes_read == 0  # nothing read, nothing placed

    fixed = decoders.hf_tensors(tied=False)
    tensors["model.layers.1.self_attn.k_proj.weight"] = fixed["model.layers.1.self_attn.k_proj.weight"]
    del tensors["model.norm.weight"]
    safetensors.numpy.save_file(tensors, str(tmp_path / "model.safetensors"))
    skipping = fs.WeightMap(
        decoders.weight_map("nnx", tied=False), skip="model.layers.{i}.self_attn.rotary_emb.inv_freq"
    )
    with pytest.raises(fs.StateMismatchError) as raised:
        fs.SafetensorsReader(tmp_path, None, map=skipping).params(decoders.template("nnx"))
    message = str(raised.value)  # the skipped tensor is not "unexpected"
    assert "missing (the map's names, in no file): norm/scale [16] (as model.norm.weight)." in message
    assert "unexpected" not in message
    tensors["model.norm.weight"] = fixed["model.norm.weight"]
    safetensors.numpy.save_file(tensors, str(tmp_path / "model.safetensors"))
    rules = decoders.weight_map("nnx", tied=False)
    del rules["norm/scale"]
    rules["{name}/scale"] = "model.{name}.weight"  # a placeholder for a whole segment
    skipping = fs.WeightMap(rules, skip=["model.layers.{i}.self_attn.rotary_emb.inv_freq"])
    params = flat(fs.SafetensorsReader(tmp_path, None, map=skipping).params(decoders.template("nnx")))
    for path, value in decoders.held("nnx", tensors, tied=False).items():
        np.testing.assert_array_equal(params[path], value, err_msg=path)


def test_a_bad_table_is_refused_at_the_door_naming_the_rule_and_the_fix(tmp_path):
    with pytest.raises(ValueError, match=r"placeholders \['i'\] on the tree's side and \[\] on the file's"):
        fs.WeightMap({"layers/{i}/kernel": "model.weight"})
    with pytest.raises(ValueError, match=r"names \['d', 'e', 'h'\] on the file's side and \['e', 'h'\] on the tree's"):
        fs.WeightMap({"q": ("q", "(h d) e -> e h")})
    with pytest.raises(ValueError, match="not an einops pattern 'file axes -> tree axes'"):
        fs.WeightMap({"q": ("q", "o i")})
    with pytest.raises(ValueError, match="the rule of 'q' is 3"):
        fs.WeightMap({"q": 3})
    with pytest.raises(ValueError, match=r"names a placeholder twice"):
        fs.WeightMap({"{a}/{a}": "{a}.{a}"})
    with pytest.raises(ValueError, match="covered by two rules, '{a}/kernel' and 'up/{b}'"):
        fs.WeightMap({"{a}/kernel": "{a}.weight", "up/{b}": "up.{b}"}).entry("up/kernel")
    hf_folder(tmp_path / "hf", tied=True)
    with pytest.raises(ValueError, match="takes map= or rename=/transpose=, not both"):
        fs.SafetensorsReader(tmp_path / "hf", None, map={"a": "b"}, transpose="kernel$")
    state = fs.InferenceState.create({"params": {"up": {"kernel": np.ones((2, 3), np.float32)}}})
    with pytest.raises(ValueError, match="takes map= or rename=/transpose=, not both"):
        fs.export_safetensors(state, tmp_path / "out", map={"a": "b"}, rename=[("a", "b")])
    with pytest.raises(fs.StateMismatchError, match=r"no rule of the map covers up/kernel \[2, 3\]"):
        fs.export_safetensors(state, tmp_path / "out", map={"down/kernel": "down.weight"})
    with pytest.raises(
        fs.StateMismatchError, match=r"up/kernel \[2, 3\] -> up.weight: the layout '\(h d\) e -> e h d'"
    ):
        fs.export_safetensors(state, tmp_path / "out", map={"up/kernel": ("up.weight", "(h d) e -> e h d")})
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("api", ["linen", "nnx"])
def test_a_dry_run_lists_every_param_beside_its_tensor_and_both_shapes_reading_nothing(api):
    tied = fs.WeightMap(decoders.weight_map(api, tied=True))
    template = decoders.template(api)
    pairs = {pair.path: pair for pair in tied.pairs(template)}
    tensors = decoders.hf_tensors(tied=True)
    assert sorted(pairs) == sorted(decoders.held(api, tensors, tied=True))
    for pair in pairs.values():  # each file shape is HF's, each tree shape the model's
        assert (
            pair.file_shape == tensors[pair.name].shape and pair.shape == tree_paths.flatten(template)[pair.path].shape
        )
    layer = "layers/0" if api == "nnx" else "layers_0"
    assert str(pairs[f"{layer}/q/kernel"]) == (
        f"{layer}/q/kernel [16, 4, 4] <-> model.layers.0.self_attn.q_proj.weight [16, 16]  ((h d) e -> e h d)"
    )
    assert pairs["lm_head/kernel"].name == pairs["embed/embedding"].name == "model.embed_tokens.weight"  # tied
    rules = decoders.weight_map(api, tied=True)
    rules[f"{layer.replace('0', '{i}')}/o/kernel"] = ("model.layers.{i}.self_attn.o_proj.weight", "o i -> i o")
    del rules["norm/scale"]
    with pytest.raises(fs.StateMismatchError) as raised:
        fs.WeightMap(rules).pairs(template)
    assert "no rule covers norm/scale [16]" in str(raised.value)
    assert f"{layer}/o/kernel [4, 4, 16] -> model.layers.0.self_attn.o_proj.weight: 'o i -> i o'" in str(raised.value)


def test_a_part_cut_in_heads_or_embed_reads_its_block_of_the_file_and_one_cut_in_head_dim_reads_none():
    from flaxstate.checkpoint.safetensors.weight_map import Layout

    e, h, d = 6, 4, 3
    tree = np.arange(e * h * d, dtype=np.float32).reshape(e, h, d)
    stored = {  # each layout's file array, by hand
        "(h d) e -> e h d": tree.transpose(1, 2, 0).reshape(h * d, e),
        "e (h d) -> e h d": tree.reshape(e, h * d),
        "o i -> i o": tree[:, :, 0].T,
    }
    cuts = [  # a part's index into the tree, and whether it is one block of the file
        ((slice(0, 3),), True),
        ((slice(3, 6), slice(None)), True),
        ((slice(None), slice(2, 4)), True),
        ((slice(1, 2), slice(1, 3)), True),
        ((slice(None), slice(1, 2), slice(0, 2)), True),
        ((slice(None), slice(None), slice(0, 1)), False),
        ((slice(None), slice(1, 3), slice(0, 2)), False),
    ]
    for pattern, file in stored.items():
        layout = Layout(pattern)
        held = tree[:, :, 0] if pattern == "o i -> i o" else tree
        for cut, block in cuts:
            cut = cut[: held.ndim]
            within = layout.file_index(cut, held.shape)
            assert (within is not None) == (block or held.ndim == 2), (pattern, cut)
            if within is not None:
                np.testing.assert_array_equal(layout.to_tree(file[within], held[cut].shape), held[cut])
        np.testing.assert_array_equal(layout.to_file(held), file)
