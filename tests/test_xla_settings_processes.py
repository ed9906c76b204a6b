"""XLA presets: composed with the user's flags, chosen by the GPU generation, applied before JAX's backend starts

Tier 2 (tests/README.md): tests that start, kill or signal processes of their own, or run servers or commands. The
others of xla_settings are in test_xla_settings.py.
(in a fresh process and through `flaxstate launch`), refused after, and kept with every checkpoint's environment.
"""

import json
import subprocess
import sys
import textwrap

from flaxstate_testing import processes

from flaxstate import xla_settings
from flaxstate.run_record import environment


def test_every_preset_s_flags_are_known_to_this_jaxlib_and_kept_in_the_checkpoint_s_environment(tmp_path):
    """XLA aborts at the backend's start on a flag it does not know: a fresh process that applies the Hopper preset
    (whose flags hold every other preset's) and trains one step shows that this jaxlib knows them all."""
    every = {xla_settings.flag_name(flag) for each in xla_settings.PRESETS.values() for flag in each.flags}
    assert every == {xla_settings.flag_name(flag) for flag in xla_settings.PRESETS["hopper"].flags}
    script = textwrap.dedent(
        """
        import json
        import flaxstate as fs
        fs.use_xla_preset("hopper")
        import jax, jax.numpy as jnp
        from flaxstate.run_record import environment
        print(float(jax.jit(lambda x: jnp.sin(x).sum())(jnp.ones(3))))
        print(json.dumps(environment.describe()["xla"]))
        """
    )
    env = {**processes.worker_env(), "XLA_FLAGS": "--xla_gpu_enable_triton_gemm=true"}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    xla = json.loads(done.stdout.splitlines()[-1])
    assert xla["preset"] == "hopper" and every <= xla["flags"].keys()
    assert xla["flags"]["--xla_gpu_enable_triton_gemm"] == "true"  # the user's own
    assert xla["variables"] == {"CUDA_DEVICE_MAX_CONNECTIONS": "1"}
    assert xla["jax"]["jax_enable_x64"] is False and "jax_default_matmul_precision" in xla["jax"]
    # This process applied none: its environment says so, and a change between two checkpoints is named.
    here = environment.describe()["xla"]
    assert here["preset"] is None
    lines = environment.changes({"xla": here}, {"xla": xla})
    assert "xla/preset: '(absent)' -> 'hopper'" in lines
    assert "xla/flags/--xla_gpu_enable_triton_gemm: '(absent)' -> 'true'" in lines


def test_a_preset_whose_while_loop_capture_fails_here_goes_on_without_it_in_one_line(monkeypatch):
    """The Hopper preset captures while loops in CUDA graphs; a child process tries it first. Here (no GPU) the
    flag is harmless and the probe passes; with a value XLA cannot parse beside it (as a capture that fails), the
    probe fails and the preset is applied without the capture, the user's flags and the rest of the preset kept."""
    assert xla_settings.CAPTURE_WHILE in xla_settings.PRESETS["hopper"].flags
    base = processes.worker_env()
    assert xla_settings.capture_fails("hopper", base) is None
    assert xla_settings.capture_fails("none", base) is None  # nothing to try: no child process
    mine = {**base, "XLA_FLAGS": "--xla_gpu_enable_command_buffer=FUSION"}
    assert xla_settings.capture_fails("hopper", mine) is None  # the user's own command buffers win: not tried
    broken = {**base, "XLA_FLAGS": "--xla_gpu_graph_min_graph_size=not-a-number"}
    why = xla_settings.capture_fails("hopper", broken)
    assert why, "a probe whose backend cannot start must fail"
    without = xla_settings.environment("hopper", broken, capture=False)
    flags = xla_settings.parse(without["XLA_FLAGS"])
    assert "--xla_gpu_enable_command_buffer" not in flags and flags["--xla_gpu_graph_min_graph_size"] == "not-a-number"
    assert flags["--xla_gpu_enable_latency_hiding_scheduler"] == "true"
    line = xla_settings.fallback_line("hopper", why)
    assert "\n" not in line and xla_settings.CAPTURE_WHILE in line and why in line
