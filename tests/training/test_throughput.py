"""FLOPs, examples a second and MFU in records: the model's count against a hand count, XLA's beside it; MFU only
where a peak is known."""

import dataclasses
import io
import types

import flax.linen as nn
import jax
import numpy as np
import optax
import pytest
from flaxstate_testing import lm, loops, toy

import flaxstate as fs
from flaxstate.training import throughput


class Wide(nn.Module):
    """An MLP 4-512-512-1: its first layer is a small share of its parameters."""

    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Dense(512)(x))
        x = nn.relu(nn.Dense(512)(x))
        return nn.Dense(1)(x)[:, 0]


def first_record(per_dispatch=1, **options):
    loop = loops.make_loop(
        toy.batches(20, 64), model=Wide(), optimizer=optax.sgd(1e-4), n_steps=20, every=10, per_dispatch=per_dispatch,
        **options,
    )  # fmt: skip
    record = loop.next_checkpoint()
    return record, sum(np.size(leaf) for leaf in jax.tree.leaves(record.state.params))


def test_the_flops_of_a_step_are_six_times_parameters_times_examples_for_an_mlp():
    record, n_params = first_record()
    hand_count = 6 * n_params * 64  # forward and backward matmuls, batch 64
    assert record.flops_per_step == pytest.approx(hand_count, rel=0.03)
    assert record.xla_flops_per_step == pytest.approx(hand_count, rel=0.03)  # XLA's, kept beside it
    # K steps a dispatch: the same FLOPs a step.
    assert first_record(per_dispatch=5)[0].flops_per_step == record.flops_per_step
    # M microbatches: the same examples a step, so the same FLOPs (XLA counted the microbatches' loop once: 1/M).
    for n_microbatches in (2, 4):
        micro, _ = first_record(n_microbatches=n_microbatches)
        assert micro.flops_per_step == pytest.approx(record.flops_per_step, rel=0.03), n_microbatches
    assert record.batch_size == 64
    assert record.examples_per_second == pytest.approx(record.steps_per_second * 64)


@pytest.mark.parametrize("options", [{}, {"scan_layers": True}, {"attention": "xla"}])
def test_the_lm_examples_model_count_is_six_times_its_matrices_times_tokens_plus_attention(options):
    config = lm.lm.Config(batch_size=4, seq_len=32, embed=64, heads=4, head_dim=16, mlp=128, layers=3, **options)
    one_step = dataclasses.replace(config, steps_per_checkpoint=1, steps_per_dispatch=1)
    record = lm.train_loop(one_step, n_steps=1).next_checkpoint()
    kernels = sum(
        np.size(leaf)
        for path, leaf in jax.tree_util.tree_leaves_with_path(record.state.params)
        if "kernel" in jax.tree_util.keystr(path)
    )  # the matrices: the embeddings are looked up (no product), norms and biases are elementwise
    tokens = config.batch_size * config.seq_len
    # Attention's two products (scores, weighted values) of 2 x B x T x T x heads x head_dim each, a layer, forward;
    # the backward pass has twice the forward's products.
    attention = 3 * 2 * 2 * config.batch_size * config.seq_len**2 * config.heads * config.head_dim * config.layers
    assert record.flops_per_step == pytest.approx(6 * kernels * tokens + attention, rel=0.03)


def test_a_hand_count_of_flops_is_taken_as_a_number_or_a_function_of_the_batch_shapes():
    given, _ = first_record(flops_per_step=1e9, peak_flops_per_device=2e12)
    assert given.flops_per_step == 1e9 and given.mfu == pytest.approx(1e9 * given.steps_per_second / 2e12)
    assert given.xla_flops_per_step is not None and given.xla_flops_per_step != 1e9  # XLA's stays its own
    seen = []

    def count(batch):
        seen.append(batch)
        (x,), (y,) = batch
        return 6 * 64 * x.shape[0]

    from_shapes, _ = first_record(flops_per_step=count)
    assert from_shapes.flops_per_step == 6 * 64 * 64
    assert len(seen) == 1 and isinstance(seen[0][0][0], jax.ShapeDtypeStruct) and seen[0][0][0].shape == (64, 4)
    assert first_record(flops_per_step="6e9")[0].flops_per_step == 6e9  # YAML 1.1 reads 6e9 as a string
    for bad in (0, -1.0, "many", float("nan"), True):
        with pytest.raises(ValueError, match="flops_per_step must be a positive FLOPs count"):
            first_record(flops_per_step=bad)
    with pytest.raises(ValueError, match=r"flops_per_step\(batch\) must be a positive FLOPs count.*got None"):
        first_record(flops_per_step=lambda batch: None)


def test_mfu_is_absent_on_a_cpu_and_follows_the_records_own_fields_with_a_given_peak():
    record, _ = first_record()
    assert record.peak_flops is None and record.mfu is None  # a CPU: no guess
    assert record.tflops_per_device == pytest.approx(record.flops_per_step * record.steps_per_second / 1e12)
    record, _ = first_record(peak_flops_per_device=2e12)
    assert record.peak_flops == 2e12 * record.n_devices
    assert record.mfu == pytest.approx(record.flops_per_step * record.steps_per_second / record.peak_flops)
    assert 0 < record.mfu < 1
    out = io.StringIO()
    fs.SummaryLogger(out)(record)
    assert f"{record.examples_per_second:,.0f} examples/s, MFU {record.mfu:.1%}" in out.getvalue()
    for bad in (0, "fast", float("inf"), True):
        with pytest.raises(ValueError, match="peak_flops_per_device must be a positive FLOP/s figure"):
            first_record(peak_flops_per_device=bad)
    from_yaml, _ = first_record(peak_flops_per_device="2e12")  # YAML 1.1 reads 2e12 as a string
    assert from_yaml.peak_flops == 2e12 * from_yaml.n_devices


def test_the_peaks_of_known_devices_and_none_for_others():
    def devices(*kinds):
        return [types.SimpleNamespace(device_kind=kind) for kind in kinds]

    assert throughput.peak_flops_per_device(devices("NVIDIA H100 80GB HBM3")) == 989e12
    assert throughput.peak_flops_per_device(devices("NVIDIA H100 PCIe")) == 756e12
    assert throughput.peak_flops_per_device(devices("NVIDIA H200")) == 989e12
    assert throughput.peak_flops_per_device(devices("TPU v5 lite", "TPU v5 lite")) == 197e12
    assert throughput.peak_flops_per_device(devices("cpu")) is None
    assert throughput.peak_flops_per_device(devices("NVIDIA H100 80GB HBM3", "NVIDIA A100-SXM4-80GB")) is None
