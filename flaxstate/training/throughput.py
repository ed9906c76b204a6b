"""What a step costs in FLOPs, and what the devices could do: model FLOPs utilization (MFU).

A step's model FLOPs (`model_flops`) are counted from the program the user
wrote, its jaxpr, before any backend rewrites it: every matrix product
(`dot_general`), convolution and fused attention kernel, 2 FLOPs a
multiply-add, each loop body times its iterations (`lax.scan`: K steps a
dispatch, microbatches, `nn.scan`'s layers) and each `shard_map` body times
its devices. Elementwise work, reductions and the optimizer's update are
left out, as MaxText's and PaLM's model FLOPs leave them out: for a
transformer the count is 6 x parameters x tokens plus attention's matrix
products. The same program traced for a CPU, a GPU or a TPU gives the same
count; records' `flops_per_step` and `mfu` use it.

XLA's count (`xla_flops_per_step`, kept beside it) is its cost analysis
of the compiled one-step update (`compiled.cost_analysis()["flops"]`):
matrix products plus elementwise work and the optimizer's update, of the
program after the backend rewrote it. On a GPU it undercounts, by a ratio
that changes with the batch (matrix products become library calls that the
analysis counts in part: RESULTS.md, issue 49), so MFU never uses it. It is read
from the one-step program whatever K: XLA counts a `lax.scan`'s body once,
not once per step. For the same reason a step of M microbatches is scaled
by the ratio of its count with the microbatches' loop written out to its
count as it runs (two lowerings, not compiled; `loop_factor`). The count is
of the program that one device runs; the global FLOPs of a step are that
times the devices (data-parallel, each runs the whole update on its part of
the batch; sharded, each runs its part).

MFU is achieved FLOP/s over the devices' peak. Peaks below are dense
bfloat16 matrix throughput per device, without sparsity, from each vendor's
data sheet; a device not listed (a CPU, say) has no MFU unless the loop is
given one (`TrainLoop(..., peak_flops_per_device=...)`), never a guess.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from typing import Any

import jax

from flaxstate import settings

DENSE_BF16_PEAKS: tuple[tuple[str, float], ...] = (
    ("H100 PCIe", 756e12),  # NVIDIA H100 PCIe data sheet, BF16 Tensor Core, dense
    ("H100", 989e12),  # H100 SXM5 (device kind "NVIDIA H100 80GB HBM3"), dense
    ("H200", 989e12),  # NVIDIA H200 data sheet: the H100 SXM's compute
    ("A100", 312e12),  # NVIDIA A100 data sheet (SXM and PCIe), dense
    ("TPU v4", 275e12),  # Google Cloud TPU v4 documentation
    ("TPU v5 lite", 197e12),  # TPU v5e
    ("TPU v5e", 197e12),
    ("TPU v5p", 459e12),
    ("TPU v5", 459e12),  # v5p reports its kind as "TPU v5"
    ("TPU v6 lite", 918e12),  # TPU v6e (Trillium)
    ("TPU v6e", 918e12),
)
"""(a substring of `jax.Device.device_kind`, dense bfloat16 FLOP/s of one device), the first match wins."""


def peak_flops(given_per_device: float | None, devices: Sequence[jax.Device]) -> float | None:
    """All the devices' peak FLOP/s: `given_per_device` (checked by the loop's options) or the known peak."""
    peak = given_per_device or peak_flops_per_device(devices)
    return None if peak is None else peak * len(devices)


def peak_flops_per_device(devices: Sequence[jax.Device]) -> float | None:
    """The devices' dense bfloat16 peak, one device's (`None`: unknown, or devices of different kinds)."""
    kinds = {device.device_kind for device in devices}
    if len(kinds) != 1:
        return None
    kind = kinds.pop()
    return next((peak for name, peak in DENSE_BF16_PEAKS if name in kind), None)


def flops_of(compiled: jax.stages.Compiled | jax.stages.Lowered) -> float | None:
    """XLA's FLOPs count of a compiled (or lowered) program (`None` where the backend gives none)."""
    analysis = compiled.cost_analysis()
    if isinstance(analysis, list | tuple):
        analysis = analysis[0] if analysis else None
    flops = analysis.get("flops") if analysis else None
    return float(flops) if flops is not None and flops >= 0 else None


def checked_flops(value: Any, name: str) -> float:
    """`value` as a float FLOPs count (a string of a number too, as YAML 1.1 reads 6e9).

    Raises:
        ValueError: not a positive finite number, naming `name` and the value.
    """
    number = value
    if isinstance(number, str):
        try:
            number = float(number)
        except ValueError:
            pass
    if not settings.is_real(number) or not math.isfinite(number) or number <= 0:
        if hasattr(number, "dtype") and getattr(number, "shape", None) == () and not settings.is_real(number):
            return checked_flops(float(number), name)  # a JAX scalar (numpy's are numbers.Real)
        raise ValueError(
            f"{name} must be a positive FLOPs count of one global training step (e.g. 6 * n_params * tokens), "
            f"got {value!r}."
        )
    return float(number)


def loop_factor(rolled: jax.stages.Lowered, unrolled: jax.stages.Lowered) -> float:
    """How many times the FLOPs of `unrolled` (a loop written out) are those of `rolled` (1 where either is unknown).

    XLA's cost analysis counts a loop's body once: the factor scales a
    compiled program's count up to every iteration's.
    """
    counts = flops_of(rolled), flops_of(unrolled)
    return counts[1] / counts[0] if counts[0] and counts[1] else 1.0


FUSED_ATTENTION = "dot_product_attention_"
"""The name that cuDNN's fused attention primitives (`jax.nn.dot_product_attention` on a GPU) begin with."""


def model_flops(jaxpr: Any) -> float:
    """The model FLOPs of a traced program: its matrix products, convolutions and fused attention, every iteration.

    Args:
        jaxpr: a `jax.make_jaxpr` result, or `jax.jit(f).trace(...).jaxpr`
            (a closed jaxpr or a jaxpr).

    Returns:
        2 FLOPs a multiply-add of every `dot_general` and
        `conv_general_dilated`, and of the matrix products inside a fused
        attention kernel (counted as the unfused attention's, the causal
        mask's zeros included, so a model counts alike on every backend);
        a `lax.scan`'s body times its length, a `shard_map`'s or `pmap`'s
        body times its devices, the larger branch of a `lax.cond`, a
        `while_loop`'s body once (its trip count is not known when traced).

    Example:
        >>> import jax.numpy as jnp
        >>> model_flops(jax.make_jaxpr(jnp.matmul)(jnp.ones((4, 8)), jnp.ones((8, 16))))
        1024.0
    """
    return math.fsum(_equation_flops(equation) for equation in _equations(jaxpr))


def _equations(jaxpr: Any) -> Iterator[Any]:
    yield from getattr(jaxpr, "jaxpr", jaxpr).eqns


def _inner_jaxprs(params: dict[str, Any]) -> Iterator[Any]:
    for value in params.values():
        for item in value if isinstance(value, tuple | list) else (value,):
            if hasattr(item, "eqns") or hasattr(getattr(item, "jaxpr", None), "eqns"):
                yield item


def _equation_flops(equation: Any) -> float:
    name, params = equation.primitive.name, equation.params
    shapes = [tuple(getattr(var.aval, "shape", ())) for var in equation.invars]
    if name == "dot_general":
        (lhs_contract, rhs_contract), (_, rhs_batch) = params["dimension_numbers"]
        rhs_free = [size for axis, size in enumerate(shapes[1]) if axis not in (*rhs_contract, *rhs_batch)]
        return 2.0 * math.prod(shapes[0]) * math.prod(rhs_free)
    if name == "conv_general_dilated":
        out_shape = tuple(equation.outvars[0].aval.shape)
        rhs_spec = params["dimension_numbers"].rhs_spec  # (out features, in features, spatial...)
        return 2.0 * math.prod(out_shape) * math.prod(shapes[1]) / shapes[1][rhs_spec[0]]
    if name.startswith(FUSED_ATTENTION):
        return _fused_attention_flops(name, params, shapes)
    inner = [model_flops(jaxpr) for jaxpr in _inner_jaxprs(params)]
    if not inner:
        return 0.0
    if name == "cond":
        return max(inner)
    return _repeats(name, params) * math.fsum(inner)


def _repeats(name: str, params: dict[str, Any]) -> int:
    """How many times an equation runs its inner program: a scan's length, a shard_map's or pmap's devices."""
    if name == "scan":
        return int(params["length"])
    if name == "xla_pmap":
        return int(params["axis_size"])
    if name == "shard_map":
        mesh = params["mesh"]
        manual = params.get("newly_manual_axes", params.get("manual_axes"))
        if manual is None:
            manual = set(mesh.axis_names) - set(params.get("auto", ()))
        return math.prod(mesh.shape[axis] for axis in manual)
    return 1


def _fused_attention_flops(name: str, params: dict[str, Any], shapes: list[tuple[int, ...]]) -> float:
    """cuDNN's attention as its unfused matrix products: 2 forward (QK, PV), 4 backward (dV, dP, dQ, dK)."""
    query, key = shapes[0], shapes[1]
    key_length = key[1] if params.get("layout", 0) == 0 else key[2]  # BTNH (0) or BNTH (1)
    one_product = 2.0 * math.prod(query) * key_length
    return (4 if "_bwd" in name else 2) * one_product
