"""XLA's settings as part of the run: a preset per GPU generation, composed with the user's own flags.

MaxText, AXLearn and NVIDIA's JAX-Toolbox ship a set of XLA flags per GPU
generation; XLA's defaults leave the latency-hiding scheduler off, collectives
uncombined and unpipelined. A preset is such a set: `hopper` (H100, H200),
`blackwell` (B200, GB200), `ampere` (A100), and `none`. `auto` picks the
preset of this machine's first GPU from `nvidia-smi`'s compute capability
(9.x Hopper, 10.x and 12.x Blackwell, 8.x Ampere) where the machine has
several GPUs, and `none` where it has one or none: a preset's flags tune the
collectives between GPUs, and on one H200 the Hopper preset made a small
model's loop 1.4 times slower than XLA's defaults (`benchmarks/RESULTS.md`,
issue 83). CPU and TPU runs get no preset unless one is named.

XLA reads `XLA_FLAGS` once, when JAX starts its backend, so a preset is
applied before that: `flaxstate launch --xla-preset NAME|auto|none` for its
processes (`auto` by default), or `fs.use_xla_preset(name)` at the top of a
single-process script, which refuses with a `RuntimeError` once the backend is
up. The user's own `XLA_FLAGS` win flag by flag (a preset never overrides a
flag the user set), as do environment variables the user set
(`CUDA_DEVICE_MAX_CONNECTIONS`).

`in_force()` is what the run's environment keeps with every checkpoint
(`flaxstate.run_record.environment`): the preset's name, every XLA flag in
force, the environment variables a preset may set, and JAX's options that
change the programs (`jax_optimization_level`, `jax_default_matmul_precision`,
...); `flaxstate show` prints them and `flaxstate diff` names a change.

The flags are those of MaxText's A3 (H100) configurations and JAX-Toolbox's
GPU performance guide (combine thresholds, pipelined collectives, while-loop
double buffering, Triton GEMM off); the Hopper preset adds `while` loops to
what XLA's command buffers capture (`CAPTURE_WHILE`), so that the K-step
loop's scan runs as one CUDA graph. Capture can fail on a machine (a driver,
a kernel that cannot be captured): before a preset with it is applied, a
child process runs a captured `lax.scan` (`capture_fails`), and where it
fails the preset goes on without it, in one line that says so. Every preset's flags are
known to the jaxlib versions flaxstate supports (tested: XLA aborts on an
unknown flag). Their speed on a GPU is measured in `benchmarks/RESULTS.md`
where a GPU was lent.
"""

from __future__ import annotations

import dataclasses
import os
import shlex
import shutil
import subprocess
import sys
import warnings
from collections.abc import Mapping, MutableMapping
from typing import Any

from flaxstate import private_apis

PRESET_VARIABLE = "FLAXSTATE_XLA_PRESET"
"""The preset applied to this process (set by `flaxstate launch` and `use_xla_preset`), for its environment."""
VARIABLES = ("CUDA_DEVICE_MAX_CONNECTIONS", "XLA_PYTHON_CLIENT_MEM_FRACTION", "NCCL_NVLS_ENABLE")
"""The environment variables that change a GPU run's programs or memory, kept with its environment."""
JAX_OPTIONS = (
    "jax_optimization_level",
    "jax_memory_fitting_level",
    "jax_default_matmul_precision",
    "jax_enable_x64",
    "jax_threefry_partitionable",
)
"""JAX's options that change the programs a run compiles, kept with its environment where this JAX has them."""


@dataclasses.dataclass(frozen=True)
class XlaPreset:
    """XLA flags and environment variables for one GPU generation.

    Attributes:
        name: the preset's name (`PRESETS`' key).
        flags: XLA flags, each `--name=value`.
        env: environment variables (a user's own value wins).
        summary: what it is for, in one line.
    """

    name: str
    flags: tuple[str, ...] = ()
    env: Mapping[str, str] = dataclasses.field(default_factory=dict)
    summary: str = ""


_COLLECTIVES = (
    "--xla_gpu_enable_latency_hiding_scheduler=true",
    "--xla_gpu_enable_triton_gemm=false",
    "--xla_gpu_all_reduce_combine_threshold_bytes=134217728",
    "--xla_gpu_all_gather_combine_threshold_bytes=134217728",
    "--xla_gpu_reduce_scatter_combine_threshold_bytes=67108864",
    "--xla_gpu_enable_pipelined_all_gather=true",
    "--xla_gpu_enable_pipelined_reduce_scatter=true",
    "--xla_gpu_enable_pipelined_all_reduce=true",
    "--xla_gpu_enable_while_loop_double_buffering=true",
)

CAPTURE_WHILE = "--xla_gpu_enable_command_buffer=+WHILE,+CONDITIONAL"
"""XLA's command buffers (CUDA graphs) with `while` loops and conditionals captured beside XLA's defaults: the K-step
loop's `lax.scan` runs as one graph, not a graph an iteration launched by the host."""

PRESETS: dict[str, XlaPreset] = {
    "hopper": XlaPreset(
        "hopper",
        (*_COLLECTIVES, CAPTURE_WHILE),
        {"CUDA_DEVICE_MAX_CONNECTIONS": "1"},
        "H100, H200: the latency-hiding scheduler, combined and pipelined collectives, while loops in CUDA graphs",
    ),
    "blackwell": XlaPreset(
        "blackwell",
        _COLLECTIVES,
        {},
        "B200, GB200: the latency-hiding scheduler, combined and pipelined collectives",
    ),
    "ampere": XlaPreset(
        "ampere",
        _COLLECTIVES,
        {"CUDA_DEVICE_MAX_CONNECTIONS": "1"},
        "A100: the latency-hiding scheduler, combined and pipelined collectives",
    ),
    "none": XlaPreset("none", (), {}, "XLA's own defaults"),
}
"""The presets by name (`auto` chooses one of them)."""

_GENERATIONS = {8: "ampere", 9: "hopper", 10: "blackwell", 12: "blackwell"}
"""A GPU's major compute capability -> its preset."""


def detect() -> str:
    """The preset of this machine's first GPU (`nvidia-smi`'s compute capability) where it has several GPUs;
    `"none"` with one GPU or none."""
    if shutil.which("nvidia-smi") is None:
        return "none"
    try:
        listed = subprocess.run(
            ["nvidia-smi", "--query-gpu=compute_cap", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=30,
        )
        gpus = listed.stdout.split() if listed.returncode == 0 else []
        major = int(gpus[0].split(".")[0]) if len(gpus) > 1 else None
    except (OSError, subprocess.TimeoutExpired, ValueError, IndexError):
        return "none"
    return _GENERATIONS.get(major, "none") if major is not None else "none"


def preset(name: str) -> XlaPreset:
    """The preset named `name` (`"auto"`: `detect()`'s).

    Raises:
        ValueError: an unknown name, naming the presets.
    """
    chosen = detect() if name == "auto" else name
    if chosen not in PRESETS:
        raise ValueError(f"no XLA preset {name!r}: choose one of {', '.join(['auto', *PRESETS])}.")
    return PRESETS[chosen]


def flag_name(flag: str) -> str:
    """A flag's name: `--xla_gpu_enable_triton_gemm` of `--xla_gpu_enable_triton_gemm=false`."""
    return flag.split("=", 1)[0]


def parse(flags: str) -> dict[str, str | None]:
    """`XLA_FLAGS` as `{name: value}` (`None` for a flag without a value), in order, the last of a name winning."""
    parsed: dict[str, str | None] = {}
    for flag in shlex.split(flags):
        name, _, value = flag.partition("=")
        parsed[name] = value if "=" in flag else None
    return parsed


def compose(preset_flags: tuple[str, ...], user_flags: str) -> str:
    """`XLA_FLAGS` of a preset's flags and the user's: every user flag kept, a preset's flag only where the user
    set no flag of its name."""
    user = parse(user_flags)
    kept = [flag for flag in preset_flags if flag_name(flag) not in user]
    return " ".join([*kept, *([user_flags.strip()] if user_flags.strip() else [])])


def environment(name: str, environ: Mapping[str, str], capture: bool = True) -> dict[str, str]:
    """The variables to set for a process of preset `name` beside `environ` (its `XLA_FLAGS` composed, the
    preset's variables that `environ` lacks, and `FLAXSTATE_XLA_PRESET`); without `capture`, the preset's
    `CAPTURE_WHILE` left out (XLA's own command buffers).

    Raises:
        ValueError: an unknown name.
    """
    chosen = preset(name)
    update = {PRESET_VARIABLE: chosen.name}
    flags = chosen.flags if capture else tuple(flag for flag in chosen.flags if flag != CAPTURE_WHILE)
    if flags:
        update["XLA_FLAGS"] = compose(flags, environ.get("XLA_FLAGS", ""))
    update.update({key: value for key, value in chosen.env.items() if key not in environ})
    return update


_PROBE = """
import numpy as np, jax, jax.numpy as jnp
x = np.linspace(-1.0, 1.0, 64, dtype=np.float32).reshape(8, 8)
got = jax.jit(lambda c: jax.lax.scan(lambda c, _: (jnp.tanh(c @ x), None), c, None, length=6)[0])(x)
want = x
for _ in range(6):
    want = np.tanh(want @ x)
assert np.allclose(np.asarray(got), want, atol=1e-2), "a captured while loop computed other values"
"""
"""A `lax.scan` (XLA's `while`) compiled and run, its result checked against numpy's."""


def capture_fails(name: str, environ: Mapping[str, str], timeout: float = 180.0) -> str | None:
    """Why preset `name`'s `CAPTURE_WHILE` fails on this machine, from a child process that runs a `lax.scan` under
    the preset (`None`: it works, or the preset does not capture, or the user set XLA's command buffers).

    Capture errors are real (a wedged run with captured collectives, `STREAM_CAPTURE_INVALIDATED`): a child
    process finds them before the run does, at the cost of one backend start.
    """
    composed = {**environ, **environment(name, environ)}
    if parse(composed.get("XLA_FLAGS", "")).get(flag_name(CAPTURE_WHILE)) != CAPTURE_WHILE.split("=", 1)[1]:
        return None
    try:
        done = subprocess.run(
            [sys.executable, "-c", _PROBE], env=composed, capture_output=True, text=True, timeout=timeout
        )
    except subprocess.TimeoutExpired:
        return f"a captured while loop did not finish in {timeout:.0f} s"
    if done.returncode == 0:
        return None
    lines = [line.strip() for line in done.stderr.splitlines() if line.strip()]
    return lines[-1][:300] if lines else f"exit status {done.returncode}"


def fallback_line(name: str, why: str) -> str:
    """The one line that says a preset runs without `CAPTURE_WHILE`, and why."""
    return (
        f"XLA preset {name!r}: XLA could not run a while loop captured in a CUDA graph here ({why}); the K-step loop "
        f"runs without {CAPTURE_WHILE} (XLA's own command buffers)."
    )


def apply(name: str, environ: MutableMapping[str, str], capture: bool = True) -> XlaPreset:
    """Sets preset `name` into `environ` (see `environment`); returns the preset."""
    environ.update(environment(name, environ, capture))
    return preset(environ[PRESET_VARIABLE])


def use_xla_preset(name: str = "auto") -> XlaPreset:
    """Applies an XLA preset to this process: call it before anything starts JAX's backend.

    The user's own `XLA_FLAGS` and variables win flag by flag. Under
    `flaxstate launch`, whose `--xla-preset` already applied one, a call
    changes nothing where it names the same preset. A preset that captures
    while loops in CUDA graphs (`CAPTURE_WHILE`) is tried first in a child
    process; where that fails, it is applied without, with a warning.

    Args:
        name: `"hopper"`, `"blackwell"`, `"ampere"`, `"none"`, or `"auto"` (this machine's GPUs' where it has
            several; `"none"` with one GPU or none).

    Returns:
        the preset applied.

    Raises:
        ValueError: an unknown name, naming the presets; another preset than the one this process applied
            already (a cell run again with another name), naming both.
        RuntimeError: JAX's backend is already up (XLA has read its flags): the call must come first.
    """
    chosen = preset(name)
    applied = os.environ.get(PRESET_VARIABLE)
    if applied == chosen.name or (name == "auto" and applied is not None):  # applied already (by the launcher, which
        return preset(applied)  # tried the capture, or by an earlier call)
    if applied is not None:
        raise ValueError(
            f"use_xla_preset({name!r}): the preset {applied!r} is applied in this process already, its flags in "
            f"XLA_FLAGS; a second preset would not take them out. Restart the process (or the notebook's kernel) "
            f"and call use_xla_preset({chosen.name!r}) once, or launch with `flaxstate launch --xla-preset "
            f"{chosen.name}`."
        )
    if private_apis.backends_initialized():
        raise RuntimeError(
            f"use_xla_preset({name!r}) after JAX started its backend: XLA has read its flags already. Call it "
            "before anything runs on a device (jax.devices(), a jit, flaxstate's loop), at the top of the script, "
            "or launch with `flaxstate launch --xla-preset " + chosen.name + "`."
        )
    why = capture_fails(chosen.name, os.environ)
    if why is not None:
        warnings.warn(fallback_line(chosen.name, why), stacklevel=2)
    return apply(chosen.name, os.environ, capture=why is None)


def in_force() -> dict[str, Any]:
    """The XLA and JAX settings of this process, as its environment keeps them: the preset's name (`None`: none
    applied), every XLA flag (`{name: value}`), the variables of `VARIABLES` that are set, and `JAX_OPTIONS`."""
    options: dict[str, Any] = {}
    config = private_apis.jax_config_values()
    for option in JAX_OPTIONS:
        if option in config:
            value = config[option]
            options[option] = value if isinstance(value, bool | int | float | str) or value is None else str(value)
    return {
        "preset": os.environ.get(PRESET_VARIABLE),
        "flags": parse(os.environ.get("XLA_FLAGS", "")),
        "variables": {key: os.environ[key] for key in VARIABLES if key in os.environ},
        "jax": options,
    }
