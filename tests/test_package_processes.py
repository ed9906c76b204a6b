"""The package's public names: all of them importable, the checkpoint ones (orbax, tensorstore) at their first use.

Tier 2 (tests/README.md): tests that start, kill or signal processes of their own, or run servers or commands. The
others of package are in test_package.py.
"""

import subprocess
import sys

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
