"""`fs.plan`: the loop's own update compiled for a target's devices, from shapes only, never run.

Tier 2 (tests/README.md): tests that start, kill or signal processes of their own, or run servers or commands. The
others of planning are in test_planning.py.

TPU targets compile through libtpu on this CPU machine (the test extra
installs `jax[tpu]`); "cpu:N" compiles for N host devices of a client of
their own, and "local" for this process's device.
"""

import os
import signal
import subprocess
import sys


def test_without_libtpu_a_tpu_target_names_the_extra():
    script = (
        "import sys; sys.modules['libtpu'] = None\n"
        "import flaxstate as fs\n"
        "try:\n    fs.planning.target_devices('v5e:2x2')\nexcept ValueError as error:\n    print(error)\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert "pip install 'flaxstate[plan]'" in done.stdout, done.stdout + done.stderr


def test_a_plan_beside_another_process_that_holds_libtpu_compiles_or_names_the_lock_and_the_fix(tmp_path):
    """Any JAX process that loaded libtpu holds its lockfile for life; a plan never calls the topology unknown."""
    env = {key: value for key, value in os.environ.items() if key != "ALLOW_MULTIPLE_LIBTPU_LOAD"}
    env["JAX_PLATFORMS"] = "cpu"
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD_LIBTPU], stdout=subprocess.PIPE, text=True, env=env, start_new_session=True
    )
    try:
        assert holder.stdout.readline().strip() == "holding"
        plan = [sys.executable, "-c", "import flaxstate as fs; print(len(fs.planning.target_devices('v5e:2x2')))"]
        done = subprocess.run(plan, capture_output=True, text=True, timeout=120, env=env)
        assert done.stdout.strip() == "4", done.stdout + done.stderr  # fs.plan lets its compile-only client load it
        kept = subprocess.run(
            plan, capture_output=True, text=True, timeout=120, env={**env, "ALLOW_MULTIPLE_LIBTPU_LOAD": "0"}
        )  # a value the user set is kept: then the lock is named, not the topology
        assert "another process holds libtpu" in kept.stderr and "ALLOW_MULTIPLE_LIBTPU_LOAD=1" in kept.stderr
        assert "does not know the TPU topology" not in kept.stderr, kept.stderr
    finally:
        os.killpg(holder.pid, signal.SIGKILL)
        holder.wait()


HOLD_LIBTPU = """
import time
from jax.experimental import topologies
topologies.get_topology_desc(platform="tpu", topology_name="v5e:2x2")
print("holding", flush=True)
time.sleep(300)
"""
