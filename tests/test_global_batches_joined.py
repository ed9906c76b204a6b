"""global_batches: the global batch at step s is fixed whatever the process count, and a resume does not draw.

Tier 1 (tests/README.md): scenarios on the shared cluster's processes, joined by `jax.distributed`. The others of
global_batches are in test_global_batches.py and test_global_batches_processes.py.
"""

import shutil

import numpy as np
import pytest
from flaxstate_testing import cluster

from flaxstate.run_record import audit, ledger


def served(output, start, local):
    """The source indices that a worker read, by global step (after the first batch the loop looked at)."""
    reads = [int(line.split()[1]) for line in output.splitlines() if line.startswith("read ")][local:]
    return {start + index: reads[index * local : (index + 1) * local] for index in range(len(reads) // local)}


def run(tmp_path, name, n_processes, n_steps, resume=False, run_dir=None, fsdp=False, per_dispatch=1):
    out = tmp_path / f"{name}.npz"
    config = {"output_dir": str(run_dir or tmp_path / name), "out": str(out), "n_steps": n_steps, "resume": resume}
    config.update(fsdp=fsdp, per_dispatch=per_dispatch)
    outputs = cluster.run("global_data", config, n_processes=n_processes, timeout=240)
    start = int(outputs[0].split("start ")[1].split()[0])
    by_process = [served(output, start, 8 // n_processes) for output in outputs]
    steps = {step: sum((part[step] for part in by_process), []) for step in by_process[0]}
    return out, steps, outputs


def assert_close_files(path, reference):
    with np.load(path) as got, np.load(reference) as want:
        assert got.keys() == want.keys()
        for key in want:
            np.testing.assert_allclose(got[key], want[key], rtol=1e-5, atol=1e-6, err_msg=key)


@pytest.fixture(scope="module")
def straight_run(tmp_path_factory):
    """20 steps in one process: the final parameters' file and each step's global examples."""
    straight, straight_steps, _ = run(tmp_path_factory.mktemp("straight"), "straight", 1, 20)
    return straight, straight_steps


@pytest.mark.parametrize(("first", "then", "fsdp"), [(2, 1, False), (1, 2, False), (2, 1, True)])
def test_a_run_resumed_on_another_process_count_trains_the_examples_of_a_straight_run(
    tmp_path, straight_run, first, then, fsdp
):
    straight, straight_steps = straight_run
    run_dir = tmp_path / "moved"
    _, early, outputs = run(tmp_path, "first", first, 10, run_dir=run_dir, fsdp=fsdp)  # FSDP over 2, then 1 device
    resumed, late, later_outputs = run(tmp_path, "then", then, 20, resume=True, run_dir=run_dir)
    assert all("start 10" in output for output in later_outputs)
    assert {**early, **late} == straight_steps  # every step's global examples, whatever the processes
    assert sorted(early) == list(range(10)) and sorted(late) == list(range(10, 20))
    assert_close_files(resumed, straight)
    # The environment stored with the checkpoint names the change of devices and processes on resume.
    assert "the resumed run's environment differs" in later_outputs[0]
    assert f"devices: {first} -> {then}" in later_outputs[0] and f"processes: {first} -> {then}" in later_outputs[0]
    if 2 in (first, then):
        two = outputs if first == 2 else later_outputs
        assert all("batch_size 7 does not divide among the 2 processes" in output for output in two)


def test_a_replay_on_another_process_count_is_audited_by_the_global_batches_indices(tmp_path):
    # Two processes train to step 20; their save of step 20 is lost (removed), so one process resumes from step 15
    # and trains 16-20 again: the same global examples (the indices match), and the same state where the reduction
    # over one process's batch gives the bits of two processes' (else the audit says the state alone differs).
    # Five steps a dispatch: each record's state fingerprint comes from its dispatch (each device's replica under
    # two processes), the restored state's from a call of its own on one; they agree, or the restore would differ.
    run_dir = tmp_path / "moved"
    run(tmp_path, "first", 2, 20, run_dir=run_dir, per_dispatch=5)
    shutil.rmtree(run_dir / "20")
    _, _, outputs = run(tmp_path, "then", 1, 20, resume=True, run_dir=run_dir, per_dispatch=5)
    assert "start 15" in outputs[0]
    (resume,) = audit.resumes(ledger.run_events(run_dir))
    assert resume.replayed == (16, 20) and resume.verdict in ("bit-exact", "state differs"), resume
    if resume.verdict == "state differs":
        assert "the batches are the same and the state differs" in resume.line()
        assert resume.line() in outputs[0]  # said at runtime, in one line
