"""Runs a benchmark under an XLA preset, as `flaxstate launch --xla-preset` would set it, or a variant of one.

    python benchmarks/with_preset.py hopper benchmarks/loop_overhead.py --models small   # the preset
    python benchmarks/with_preset.py hopper:no-capture ...  # while loops not captured (XLA's own command buffers)
    python benchmarks/with_preset.py hopper:off ...         # command buffers off (MaxText's H100 configurations)
    python benchmarks/with_preset.py none ...               # XLA's defaults (no XLA_FLAGS at all)

The user's own `XLA_FLAGS` still win flag by flag. The script then replaces this process (`os.execv`), so the
flags are in place before JAX starts its backend.
"""

from __future__ import annotations

import os
import sys

from flaxstate import xla_settings


def main() -> None:
    if len(sys.argv) < 3:
        raise SystemExit(__doc__)
    name, _, variant = sys.argv[1].partition(":")
    if variant not in ("", "no-capture", "off"):
        raise SystemExit(f"the variant after ':' is no-capture or off, got {variant!r}")
    if name == "none":
        os.environ.pop("XLA_FLAGS", None)
    os.environ.update(xla_settings.environment(name, os.environ, capture=variant == ""))
    if variant == "off":
        os.environ["XLA_FLAGS"] = xla_settings.compose(
            ("--xla_gpu_enable_command_buffer=",), os.environ.get("XLA_FLAGS", "")
        )
    print(f"XLA preset {sys.argv[1]}: XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}", flush=True)
    os.execv(sys.executable, [sys.executable, *sys.argv[2:]])


if __name__ == "__main__":
    main()
