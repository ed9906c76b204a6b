"""Writers: when they save (in the background, below the loop's priority), what they keep, how failures surface.

Tier 1 (tests/README.md): scenarios on the shared cluster's processes, joined by `jax.distributed`. The others of
writers are in test_writers.py and test_writers_processes.py.
"""

from flaxstate_testing import cluster
from flaxstate_testing.checkpoints import saved_steps


def test_a_run_writer_and_a_best_writer_save_the_same_steps_on_two_processes_under_load(tmp_path, cpu_burner):
    """Each writer of a process has its own orbax barriers: both save every step at once, 5 runs in a row."""
    for run in range(5):
        out = tmp_path / f"run-{run}"
        outputs = cluster.run("two_writers", {"out": str(out), "n_steps": 10}, n_processes=2, timeout=240)
        assert all("done" in output for output in outputs), outputs
        assert saved_steps(out) == list(range(1, 11))
        assert saved_steps(out / "lowest-eval-loss") == list(range(1, 11))
