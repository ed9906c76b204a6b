"""Every private API of a dependency that flaxstate uses resolves on this stack, and does what flaxstate needs.

Tier 2 (tests/README.md): tests that start, kill or signal processes of their own, or run servers or commands. The
others of private_apis are in test_private_apis.py.

A dependency that moves one fails here by name, not as a silent fallback in a user's run.
"""

import subprocess
import sys

import jax

from flaxstate import private_apis


def test_jax_says_its_backend_is_up_and_lists_its_options_by_name():
    jax.devices()
    assert private_apis.backends_initialized() is True
    fresh = "from flaxstate import private_apis; print(private_apis.backends_initialized())"
    done = subprocess.run([sys.executable, "-c", fresh], capture_output=True, text=True, timeout=120)
    assert done.stdout.split() == ["False"], done.stderr[-2000:]  # imported, nothing run on a device
    values = private_apis.jax_config_values()
    assert values["jax_enable_x64"] is jax.config.jax_enable_x64 and "jax_default_matmul_precision" in values
