"""The package's public names: all of them importable, the checkpoint ones (orbax, tensorstore) at their first use."""

import subprocess
import sys

import pytest

import flaxstate

FRESH = r"""
import sys
import flaxstate as fs
loaded = sorted(name for name in sys.modules if name.startswith(("orbax", "tensorstore", "flaxstate.checkpoint")))
assert not loaded, f"import flaxstate imported {loaded[:5]}"
assert fs.TrainLoop.__module__ == "flaxstate.training.loop"
from flaxstate import CheckpointFileWriter, plan  # a from-import resolves a deferred name too
assert CheckpointFileWriter is fs.CheckpointFileWriter and "orbax.checkpoint" in sys.modules
assert plan.__module__ == "flaxstate.planning" and fs.checkpoint.budget.HostMemoryBudget is fs.HostMemoryBudget
print("ok")
"""


def test_import_flaxstate_leaves_orbax_until_a_checkpoint_name_is_used():
    done = subprocess.run([sys.executable, "-c", FRESH], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]


def test_every_public_name_resolves_and_is_listed():
    for name in flaxstate.__all__:
        assert getattr(flaxstate, name) is not None, name
    assert set(flaxstate.__all__) <= set(dir(flaxstate))
    namespace: dict = {}
    exec("from flaxstate import *", namespace)
    assert set(flaxstate.__all__) <= set(namespace)


def test_an_unknown_name_is_an_attribute_error_naming_it():
    with pytest.raises(AttributeError, match="'CheckpointFileWritter'"):
        flaxstate.CheckpointFileWritter  # noqa: B018
