"""Exact resume: a run stopped anywhere (even by kill -9) ends bit for bit as an uninterrupted one."""

import signal
import time

import numpy as np
import pytest
from flaxstate_testing import processes


def run(tmp_path, name, **config):
    out = tmp_path / f"{name}.npz"
    config = {"output_dir": str(tmp_path / name), "out": str(out), "every": 5, **config}
    outputs = processes.run("resume.py", config, timeout=180)
    return dict(np.load(out)), outputs[0]


def assert_same(a, b):
    assert a.keys() == b.keys()
    for key in a:
        np.testing.assert_array_equal(a[key], b[key], err_msg=key)


@pytest.mark.parametrize("data", ["list", "grain"])
def test_stop_and_resume_equals_an_uninterrupted_run(tmp_path, data):
    reference, _ = run(tmp_path, "reference", data=data, n_steps=20)
    first, output = run(tmp_path, "resumed", data=data, n_steps=10)
    assert "start 0" in output
    resumed, output = run(tmp_path, "resumed", data=data, n_steps=20)
    assert "start 10" in output
    assert_same(resumed, reference)
    assert not np.array_equal(first["target/Dense_0/kernel"], reference["target/Dense_0/kernel"])


def test_resume_with_steps_per_dispatch(tmp_path):
    reference, _ = run(tmp_path, "reference", data="grain", n_steps=20, per_dispatch=5)
    run(tmp_path, "resumed", data="grain", n_steps=10, per_dispatch=5)
    resumed, _ = run(tmp_path, "resumed", data="grain", n_steps=20, per_dispatch=5)
    assert_same(resumed, reference)


def run_and_kill(tmp_path, name, after_record, delay, **config):
    """Starts a run, waits for a record line, then kills it with SIGKILL after `delay` seconds."""
    config = {"output_dir": str(tmp_path / name), "out": str(tmp_path / f"{name}.npz"), **config}
    process = processes.start("resume.py", config)
    lines = []
    deadline = time.monotonic() + 120
    try:
        for line in process.stdout:
            lines.append(line)
            if line.strip() == f"record {after_record}":
                time.sleep(delay)
                process.send_signal(signal.SIGKILL)
                break
            assert time.monotonic() < deadline, "".join(lines)
    finally:
        processes.kill(process)
        process.wait(timeout=30)
    assert process.returncode == -signal.SIGKILL, "".join(lines) + process.stdout.read()


# Kill points: right after a save started (its bytes still being written), a little later, and
# well into the training steps after it. A wide model makes each save take a while.
@pytest.mark.parametrize("delay", [0.0, 0.05, 0.3])
def test_kill_9_then_resume_equals_an_uninterrupted_run(tmp_path, delay):
    # 100 steps: the run goes on well past every kill point, so the kill always lands mid-run.
    config = {"data": "grain", "n_steps": 100, "every": 10, "width": 200_000, "keep": 2}
    reference, _ = run(tmp_path, "reference", resume=False, **config)
    run_and_kill(tmp_path, "killed", after_record=20, delay=delay, **config)
    entries = sorted(p.name for p in (tmp_path / "killed").iterdir())
    print("after kill -9:", entries)
    steps = sorted(int(name) for name in entries if name.isdigit())
    assert steps and 10 <= steps[-1] < 100, steps
    resumed, output = run(tmp_path, "killed", **config)
    start = int(output.split("start ")[1].split()[0])
    assert start == steps[-1], output
    assert_same(resumed, reference)
