"""What a step costs in FLOPs, and what the devices could do: model FLOPs utilization (MFU).

The FLOPs of a step are XLA's own count (`compiled.cost_analysis()["flops"]`)
of the one-step update the loop runs: forward and backward matmuls (about
6 x parameters x examples for an MLP), plus attention, elementwise work and
the optimizer's update, which a hand count of 6PB leaves out. They are read
from the one-step program whatever K: XLA counts a `lax.scan`'s body once,
not once per step. For the same reason a step of M microbatches is scaled
by the ratio of its count with the microbatches' loop written out to its
count as it runs (two lowerings, not compiled; `loop_factor`). The count is of the program that one device runs; the
global FLOPs of a step are that times the devices (data-parallel, each runs
the whole update on its part of the batch; sharded, each runs its part).

MFU is achieved FLOP/s over the devices' peak. Peaks below are dense
bfloat16 matrix throughput per device, without sparsity, from each vendor's
data sheet; a device not listed (a CPU, say) has no MFU unless the loop is
given one (`TrainLoop(..., peak_flops_per_device=...)`), never a guess.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax

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


def loop_factor(rolled: jax.stages.Lowered, unrolled: jax.stages.Lowered) -> float:
    """How many times the FLOPs of `unrolled` (a loop written out) are those of `rolled` (1 where either is unknown).

    XLA's cost analysis counts a loop's body once: the factor scales a
    compiled program's count up to every iteration's.
    """
    counts = flops_of(rolled), flops_of(unrolled)
    return counts[1] / counts[0] if counts[0] and counts[1] else 1.0
